"""Sampler semantics on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.sampler import (
    PromptLogprobs,
    SamplingMetadata,
    sample,
    sample_to_host,
)
from services.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def _draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = LOGITS.repeat(n, 1)
    return torch.tensor(sample_to_host(logits, [params] * n, [None] * n, g).token_ids)


def _random_logits(n: int, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_of_raw_logits():
    logits = _random_logits(7)
    out = sample_to_host(logits, [SamplingParams(temperature=0.0)] * 7, [None] * 7)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 7


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = _random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    out = sample_to_host(logits, params, [None] * 6, torch.Generator().manual_seed(1))
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _random_logits(8)
    argmax = logits.argmax(-1).tolist()
    g = torch.Generator().manual_seed(0)
    for p in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=1, top_p=0.9),
    ):
        assert sample_to_host(logits, [p] * 8, [None] * 8, g).token_ids == argmax


def test_greedy_and_logprobs():
    p = SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[4])
    out = sample_to_host(LOGITS, [p], [None])
    lp = torch.log_softmax(LOGITS[0], -1)
    assert out.token_ids == [0]
    assert set(out.logprobs[0]) == {0, 1, 4}
    assert math.isclose(out.logprobs[0][4], float(lp[4]), abs_tol=1e-6)


def test_logprob_dicts_hold_exactly_what_each_row_asked():
    logits = _random_logits(5, v=30)
    lp = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),  # asks for nothing
        SamplingParams(temperature=1.0, logprobs=1, logprob_token_ids=[7, 29]),
        SamplingParams(temperature=1.0, logprob_token_ids=[2]),
        SamplingParams(temperature=0.7, logprobs=0),
    ]
    out = sample_to_host(logits, params, [None] * 5, torch.Generator().manual_seed(3))
    tok = out.token_ids
    top = lp.topk(3, -1).indices.tolist()
    expected_keys = [
        set(top[0][:3]) | {tok[0]},
        None,
        {top[2][0], tok[2], 7, 29},
        {tok[3], 2},
        {tok[4]},
    ]
    for i, keys in enumerate(expected_keys):
        if keys is None:
            assert out.logprobs[i] is None
            continue
        d = out.logprobs[i]
        assert set(d) == keys
        for t, v in d.items():
            assert math.isclose(v, float(lp[i, t]), abs_tol=1e-5)


def test_temperature_sampling_matches_distribution():
    counts = torch.bincount(_draw(SamplingParams(temperature=1.0)), minlength=5).float()
    expected = torch.softmax(LOGITS[0], -1) * counts.sum()
    assert torch.allclose(counts, expected, rtol=0.15, atol=20)


def test_low_temperature_sharpens_the_distribution():
    counts = torch.bincount(_draw(SamplingParams(temperature=0.5)), minlength=5).float()
    expected = torch.softmax(LOGITS[0] / 0.5, -1) * counts.sum()
    assert torch.allclose(counts, expected, rtol=0.15, atol=20)


def test_top_k_top_p_min_p_truncate():
    assert set(_draw(SamplingParams(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    # top_p: p = [.56, .21, .13, ...]: p=0.5 keeps only token 0; p=0.75 keeps {0, 1}.
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.5)).tolist()) == {0}
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.75)).tolist()) == {0, 1}
    # top-k renormalizes before top-p: k=3 gives p = [.63, .23, .14], mass before 2 is .86.
    assert set(_draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.9)).tolist()) == {0, 1, 2}
    assert set(_draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.8)).tolist()) == {0, 1}
    # min_p: keep tokens with p >= min_p * p_max, i.e. logit >= 2 + ln(min_p).
    assert set(_draw(SamplingParams(temperature=1.0, min_p=0.5)).tolist()) == {0}
    assert set(_draw(SamplingParams(temperature=1.0, min_p=0.3)).tolist()) == {0, 1}


def test_the_nucleus_is_the_smallest_set_whose_mass_reaches_top_p():
    # Two tokens of exactly 0.5 each: the first alone reaches top_p = 0.5, so the second,
    # whose mass before it is exactly 0.5, is dropped.
    logits = torch.tensor([[1.0, 1.0, -30.0]]).repeat(400, 1)
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 400
    out = sample_to_host(logits, params, [None] * 400, torch.Generator().manual_seed(0))
    assert len(set(out.token_ids)) == 1 and set(out.token_ids) <= {0, 1}


def test_truncation_applies_only_to_rows_that_ask():
    n = 2000
    params = [SamplingParams(temperature=1.0, top_k=1 + i % 2) for i in range(n // 2)]
    params += [SamplingParams(temperature=1.0)] * (n // 2)
    params[-1] = SamplingParams(temperature=1.0, top_p=0.5)
    out = sample_to_host(LOGITS.repeat(n, 1), params, [None] * n, torch.Generator())
    tok = torch.tensor(out.token_ids)
    assert set(tok[0 : n // 2 : 2].tolist()) == {0}
    assert set(tok[1 : n // 2 : 2].tolist()) == {0, 1}
    assert set(tok[n // 2 : -1].tolist()) == {0, 1, 2, 3, 4}
    assert tok[-1] == 0


def test_a_top_k_only_batch_keeps_each_rows_own_k():
    """Without top-p the sampler takes one `topk` of the batch's largest k; every row's own
    k-th largest must come from it, so a k=3 row next to k=1 rows still draws from 3 tokens."""
    n = 600
    params = [SamplingParams(temperature=1.0, top_k=1 if i % 2 else 3, seed=i) for i in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    meta = SamplingMetadata.build(params, gens, "cpu")
    assert meta.needs_top_k and not meta.needs_top_p  # the top-k-only path
    out = sample_to_host(LOGITS.repeat(n, 1), params, gens, torch.Generator())
    tok = torch.tensor(out.token_ids)
    assert set(tok[1::2].tolist()) == {0}
    assert set(tok[0::2].tolist()) == {0, 1, 2}


def test_metadata_turns_on_only_the_stages_the_batch_needs():
    plain = SamplingMetadata.build([SamplingParams(temperature=1.0)] * 3, [None] * 3, "cpu")
    assert not plain.all_greedy
    assert plain.temperature is None and plain.random_index is None
    assert not (plain.needs_top_k or plain.needs_top_p or plain.needs_min_p)
    assert plain.logprob_rows == []
    mixed = SamplingMetadata.build(
        [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=1.0, logprobs=2),
        ],
        [None] * 3,
        "cpu",
    )
    assert mixed.random_rows == [1, 2] and mixed.random_index.tolist() == [1, 2]
    assert mixed.needs_top_p and not mixed.needs_top_k and not mixed.needs_min_p
    assert mixed.truncate_index.tolist() == [0]  # only the top-p row sorts
    assert mixed.logprob_rows == [2] and mixed.max_logprobs == 2
    greedy = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, [None] * 2, "cpu")
    assert greedy.all_greedy


@pytest.mark.parametrize("truncate", [{}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_seeded_rows_ignore_batch_neighbours(truncate):
    p = SamplingParams(temperature=1.0, seed=5, **truncate)
    logits = _random_logits(1, v=20)

    def run(batch: int, row: int) -> list[int]:
        g = torch.Generator().manual_seed(5)
        # Neighbours mix greedy, plain, truncated and other seeded rows.
        params = [
            SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_k=2 * (i % 2), top_p=0.8)
            for i in range(batch)
        ]
        gens: list[torch.Generator | None] = [
            torch.Generator().manual_seed(i) if i % 4 == 3 else None for i in range(batch)
        ]
        params[row], gens[row] = p, g
        toks = []
        for _ in range(30):
            out = sample_to_host(logits.repeat(batch, 1), params, gens, torch.Generator())
            toks.append(out.token_ids[row])
        return toks

    alone = run(1, 0)
    assert alone == run(6, 3) == run(9, 8)
    assert len(set(alone)) > 1  # really sampled, not degenerate


def test_sampled_batch_stays_on_device_until_to_host():
    params = [SamplingParams(temperature=1.0, logprobs=2), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.build(params, [None, None], "cpu", torch.Generator())
    batch = sample(LOGITS.repeat(2, 1), meta)
    assert isinstance(batch.token_ids, torch.Tensor) and batch.token_ids.dtype == torch.int64
    assert batch.logprob_rows == [0]
    out = batch.to_host()
    assert out.token_ids == batch.token_ids.tolist()
    assert out.logprobs[1] is None and set(out.logprobs[0]) == {0, 1, out.token_ids[0]}
    assert batch.unpack(batch.packed().tolist()) == out


def test_prompt_logprobs_include_actual_token():
    out = PromptLogprobs(LOGITS.repeat(2, 1), [4, 0], k=1).to_dicts()
    lp = torch.log_softmax(LOGITS[0], -1)
    assert out[0] == {4: float(lp[4]), 0: float(lp[0])}
    assert out[1] == {0: float(lp[0])}
    assert PromptLogprobs(LOGITS, [2], k=0).to_dicts() == [{2: float(lp[2])}]
