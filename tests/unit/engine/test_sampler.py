"""Sampler semantics on hand-made logits."""

from __future__ import annotations

import math

import torch

from services.engine.sampler import prompt_logprobs, sample
from services.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def _draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = LOGITS.repeat(n, 1)
    return torch.tensor(sample(logits, [params] * n, [None] * n, g).token_ids)


def test_greedy_and_logprobs():
    p = SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[4])
    out = sample(LOGITS, [p], [None])
    lp = torch.log_softmax(LOGITS[0], -1)
    assert out.token_ids == [0]
    assert set(out.logprobs[0]) == {0, 1, 4}
    assert math.isclose(out.logprobs[0][4], float(lp[4]), abs_tol=1e-6)


def test_temperature_sampling_matches_distribution():
    counts = torch.bincount(_draw(SamplingParams(temperature=1.0)), minlength=5).float()
    expected = torch.softmax(LOGITS[0], -1) * counts.sum()
    assert torch.allclose(counts, expected, rtol=0.15, atol=20)


def test_top_k_top_p_min_p_truncate():
    assert set(_draw(SamplingParams(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    # top_p: p = [.56, .21, .13, ...]: p=0.5 keeps only token 0; p=0.75 keeps {0, 1}.
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.5)).tolist()) == {0}
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.75)).tolist()) == {0, 1}
    # min_p: keep tokens with p >= min_p * p_max, i.e. logit >= 2 + ln(min_p).
    assert set(_draw(SamplingParams(temperature=1.0, min_p=0.5)).tolist()) == {0}
    assert set(_draw(SamplingParams(temperature=1.0, min_p=0.3)).tolist()) == {0, 1}


def test_seeded_rows_ignore_batch_neighbours():
    p = SamplingParams(temperature=1.0, seed=5)

    def run(batch: int, row: int) -> list[int]:
        g = torch.Generator().manual_seed(5)
        params = [SamplingParams(temperature=1.0)] * batch
        params[row] = p
        gens = [None] * batch
        gens[row] = g
        toks = []
        for _ in range(20):
            toks.append(
                sample(LOGITS.repeat(batch, 1), params, gens, torch.Generator()).token_ids[row]
            )
        return toks

    assert run(1, 0) == run(6, 3)


def test_prompt_logprobs_include_actual_token():
    out = prompt_logprobs(LOGITS.repeat(2, 1), [4, 0], k=1)
    lp = torch.log_softmax(LOGITS[0], -1)
    assert out[0] == {4: float(lp[4]), 0: float(lp[0])}
    assert out[1] == {0: float(lp[0])}
