"""The patch op: exact replacement at alpha 1, interpolation otherwise, the Triton kernel
against the reference (interpreted on CPU in a fresh process, as in test_steer.py)."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.patch import patch_reference, patch_triton
from tests.interpreted import INTERPRETED, assert_passes_interpreted


def case(T: int = 10, H: int = 48, P: int = 4, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g)
    rows = torch.randperm(T, generator=g)[:P]
    targets = torch.randn(P, H, generator=g)
    alpha = torch.tensor([1.0, 0.0, 0.25, 0.7][:P] + [1.0] * max(0, P - 4))
    return (
        h.to(device, dtype),
        rows.to(device),
        targets.to(device, dtype),
        alpha.to(device),
    )


def test_alpha_one_is_an_exact_copy_and_others_untouched():
    h, rows, targets, alpha = case(dtype=torch.bfloat16)
    out = patch_reference(h, rows, targets, torch.ones_like(alpha))
    assert torch.equal(out[rows], targets)
    keep = torch.ones(h.shape[0], dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(out[keep], h[keep])


def test_alpha_zero_is_a_no_op_and_alpha_interpolates():
    h, rows, targets, alpha = case()
    out = patch_reference(h, rows, targets, alpha)
    assert torch.equal(out[rows[1]], h[rows[1]])  # alpha 0
    want = 0.75 * h[rows[2]] + 0.25 * targets[2]
    torch.testing.assert_close(out[rows[2]], want)
    assert torch.equal(patch_reference(h, rows[:0], targets[:0], alpha[:0]), h)


@pytest.mark.skipif(INTERPRETED, reason="already interpreting: the kernel tests run here")
def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "triton and not under_interpreter")


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1 by the test above")
@pytest.mark.parametrize("H", [48, 100, 1500])
def test_triton_matches_reference(H):
    args = case(T=9, H=H, P=5, seed=H)
    torch.testing.assert_close(patch_triton(*args), patch_reference(*args), atol=0, rtol=0)
