"""The patch kernel compiled on CUDA against its reference, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.patch import patch, patch_reference, patch_triton
from tests.unit.engine.kernels.test_patch import case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,P", [(1, 64, 1), (37, 100, 5), (300, 4096, 64)])
def test_triton_matches_reference(dtype, T, H, P):
    args = case(T=T, H=H, P=P, dtype=dtype, device="cuda", seed=T)
    got, want = patch_triton(*args), patch_reference(*args)
    _, rows, targets, alpha = args
    exact = rows[alpha == 1]
    assert torch.equal(got[exact], targets[alpha == 1])  # alpha 1: a bit-exact copy
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # FMA vs separate ops: one ulp
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_dispatch_uses_triton_on_cuda():
    args = case(device="cuda")
    assert torch.equal(patch(*args), patch_triton(*args))
