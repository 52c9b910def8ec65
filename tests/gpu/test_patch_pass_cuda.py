"""The layered patching pass on CUDA: the same grid as one patched request per cell.

In float32 the two paths agree to float32 rounding. In bfloat16 neither is exact, so the
pass's error against the float32 grid must be no worse than the requests path's own bf16
error (same checkpoint, same GPU) plus a small slack, as in `test_oracle_bf16.py`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.engine import EngineConfig, LLMEngine
from services.engine.sweep import Sweep, SweepSpec
from tests.conftest import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N = 23
ERROR_SLACK = 1.25
SITES = ["pre_attn", "post_attn", "post_block"]


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(4)
    clean = [rng.randrange(8, 500) for _ in range(N)]
    corrupt = list(clean)
    for p in range(5, 9):  # a "subject" redrawn a fifth of the way in
        corrupt[p] = rng.randrange(8, 500)
    return clean, corrupt


def _grid(path, dtype: str, executor: str, alpha: float = 1.0):
    clean, corrupt = _prompts()
    config = dict(enforce_eager=True, gpu_memory_utilization=0.2)  # sweeps are all prefill
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype=dtype, **config))
    spec = SweepSpec(
        corrupt_prompt=corrupt,
        clean_prompt=clean,
        answer_token=17,
        foil_token=42,
        metric="logit_diff",
        sites=SITES,
        alpha=alpha,
    )
    res = Sweep(engine, spec, executor=executor).run()  # type: ignore[arg-type]
    assert res.executor == executor and not res.void
    return res


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_pass_equals_patched_requests(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, layers=3)
    for alpha in (1.0, 0.5):
        by_pass = _grid(path, "float32", "patch_pass", alpha)
        by_requests = _grid(path, "float32", "requests", alpha)
        scale = max(1.0, float(np.abs(by_requests.grid).max()))
        np.testing.assert_allclose(by_pass.grid, by_requests.grid, atol=2e-5 * scale, rtol=0)
        assert np.abs(by_pass.grid - by_pass.corrupt).max() > 0.1  # the patches move it


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_pass_is_as_close_to_float32_as_patched_requests(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, layers=3)
    want = _grid(path, "float32", "requests").grid
    ours = np.abs(_grid(path, "bfloat16", "patch_pass").grid - want)
    theirs = np.abs(_grid(path, "bfloat16", "requests").grid - want)
    print(
        f"[{arch}] bf16 grid error vs float32: pass mean {ours.mean():.4f} max {ours.max():.4f}"
        f"; requests mean {theirs.mean():.4f} max {theirs.max():.4f}"
    )
    assert ours.mean() <= ERROR_SLACK * theirs.mean() + 0.01
