"""The sampler on CUDA (run on the device: `make gpu-test`): building the metadata and
sampling queue device work only (no device→host sync until `to_host`), and the tokens and
logprobs are the CPU path's: greedy rows exactly, seeded rows given the same noise."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.sampler import SampledBatch, SamplingMetadata, sample
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

V = 32_000


def _params() -> list[SamplingParams]:
    """Greedy, plain, temperature, top-k, top-p, both, min-p, seeded and logprob rows."""
    return [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=20, seed=2, logprob_token_ids=[3, 17]),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.9, seed=4, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5),
        SamplingParams(temperature=0.0),
    ]


def _generators(params: list[SamplingParams], device: str) -> list[torch.Generator | None]:
    return [
        None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed)
        for p in params
    ]


def _sample_without_sync(logits: torch.Tensor, params: list[SamplingParams]) -> SampledBatch:
    default = torch.Generator(device="cuda").manual_seed(0)
    gens = _generators(params, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = SamplingMetadata.build(params, gens, logits.device, default)
        return sample(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _seeded_noise(params: list[SamplingParams], i: int) -> torch.Tensor:
    """The Exp(1) noise row i's own CUDA generator gives on its first step, on the host."""
    g = _generators(params, "cuda")[i]
    return torch.empty(V, device="cuda").exponential_(generator=g).cpu()


def _reference_token(logits: torch.Tensor, p: SamplingParams, noise: torch.Tensor) -> int:
    """Row-wise CPU reference: temperature, top-k, top-p, softmax, min-p, argmax(p / E)."""
    x = logits / p.temperature
    if p.top_k:
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.clone()
        x[order[drop]] = float("-inf")
    probs = x.softmax(-1)
    if p.min_p:
        probs = probs * (probs >= p.min_p * probs.max())
    return int((probs / noise).argmax())


def test_sample_makes_no_host_sync_and_matches_cpu():
    params = _params()
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(0)) * 4
    batch = _sample_without_sync(logits.cuda(), params)
    pinned = torch.empty(batch.packed().numel(), dtype=torch.float64, pin_memory=True)
    out = batch.to_host(pinned)
    for i, p in enumerate(params):
        if p.greedy:
            assert out.token_ids[i] == int(logits[i].argmax())
        elif p.seed is not None:
            ref = _reference_token(logits[i], p, _seeded_noise(params, i))
            assert out.token_ids[i] == ref, f"row {i}"
    lp = torch.log_softmax(logits, -1)
    top = lp.topk(5, -1).indices
    assert set(out.logprobs[0]) == set(top[0].tolist())
    assert set(out.logprobs[3]) == {out.token_ids[3], 3, 17}
    assert set(out.logprobs[5]) == set(top[5, :2].tolist()) | {out.token_ids[5]}
    for i in (1, 2, 4, 6, 7):
        assert out.logprobs[i] is None
    for i in (0, 3, 5):
        for t, v in out.logprobs[i].items():
            assert math.isclose(v, float(lp[i, t]), abs_tol=1e-4)


def test_seeded_rows_ignore_batch_neighbours_on_cuda():
    params = _params()
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)).cuda() * 4
    alone = {}
    for i, p in enumerate(params):
        if p.seed is not None:
            alone[i] = sample(logits, SamplingMetadata.build([p], _generators([p], "cuda"), "cuda"))
    batch = _sample_without_sync(logits.repeat(len(params), 1), params)
    together = batch.to_host().token_ids
    for i, single in alone.items():
        assert together[i] == single.to_host().token_ids[0], f"row {i}"


def test_all_greedy_large_batch_without_sync():
    logits = torch.randn(256, 152_064, device="cuda")
    params = [SamplingParams(temperature=0.0)] * 256
    batch = _sample_without_sync(logits, params)
    assert batch.to_host().token_ids == logits.argmax(-1).tolist()
