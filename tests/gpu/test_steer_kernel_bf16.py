"""The compiled steering kernel on CUDA against the float32 reference on the same inputs.

Both compute in float32 from the same (possibly bfloat16) inputs and differ only in the
order of summation, so in bfloat16 they may differ by the final rounding: about one bf16
ulp (2^-7 relative) of the output. `fired` must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.steer import steer, steer_reference, steer_triton
from tests.unit.engine.kernels.test_steer import random_case, run, run_readback, with_readback

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,H", [(1, 64), (37, 100), (300, 1536), (64, 4096)])
def test_kernel_matches_reference(dtype, T, H):
    case = random_case(T, H, R=17, dtype=dtype, device="cuda", seed=T)
    ref, ref_fired = run(steer_reference, case)
    out, fired = run(steer_triton, case)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    assert torch.equal(fired, ref_fired)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_with_a_residual_add_matches_reference(dtype):
    """The residual add folded into the op rounds h + add to h's dtype as PyTorch does."""
    case = random_case(37, 1536, R=17, dtype=dtype, device="cuda", seed=5)
    case["add"] = torch.randn(37, 1536, device="cuda").to(dtype)
    ref, ref_fired = run(steer_reference, case)
    out, fired = run(steer_triton, case)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    assert torch.equal(fired, ref_fired)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_with_readouts_and_a_latch_carry_matches_reference(dtype):
    """Read-out scores are float32 dot products of the (possibly bf16) residual with float32
    probes: they differ from the reference by summation order only."""
    case = with_readback(random_case(300, 1536, R=17, dtype=dtype, device="cuda", seed=6))
    case = {k: v.cuda() if v is not None else None for k, v in case.items()}
    ref, ref_fired, ref_scores = run_readback(steer_reference, case)
    out, fired, scores = run_readback(steer_triton, case)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    assert torch.equal(fired, ref_fired)
    read = case["read_rows"][case["read_rows"] >= 0].long()
    torch.testing.assert_close(scores[read, :5], ref_scores[read, :5], atol=1e-3, rtol=1e-4)
    assert scores[:, 5:].isnan().all() and not scores[read, :5].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H", [1024, 4096])  # 4096: the norm over four H tiles
def test_kernel_with_the_next_norm_matches_the_norm_kernel(dtype, H):
    """The fused next norm is the RMSNorm kernel's, bit for bit, on the op's own output: it
    reduces in the same tile shape and order."""
    from services.engine.kernels.norm_rope import rms_norm_triton

    case = random_case(128, H, R=17, dtype=dtype, device="cuda", seed=H)
    case["add"] = torch.randn(128, H, device="cuda").to(dtype)
    w = (torch.rand(H, device="cuda") + 0.5).to(dtype)
    out, normed = steer_triton(**case, norm_weight=w, eps=1e-6)
    # With the norm the op reads H in one tile: its probe sums may round differently.
    torch.testing.assert_close(out, steer_triton(**case), **TOLERANCE[dtype])
    torch.testing.assert_close(normed, rms_norm_triton(out, w, 1e-6), rtol=0, atol=0)


def test_dispatcher_uses_kernel_on_cuda(monkeypatch):
    from services.engine.kernels import steer as steer_module

    case = random_case(16, 256, device="cuda")
    ref, _ = run(steer_reference, case)
    monkeypatch.setattr(steer_module, "steer_reference", None)  # a match proves the kernel ran
    torch.testing.assert_close(run(steer, case)[0], ref, atol=1e-5, rtol=1e-5)


def test_empty_batch():
    case = random_case(0, 64, device="cuda")
    assert run(steer_triton, case)[0].shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H", [100, 4096])
def test_kernel_with_captures_matches_reference(dtype, H):
    """The pristine residual (after the folded add) is captured exactly: the same rounding
    of the same sum; the output captured at the next slot is the op's output itself."""
    from tests.unit.engine.kernels.test_steer import with_capture

    case = with_capture(random_case(40, H, R=17, dtype=dtype, device="cuda", seed=H))
    case = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    case["add"] = torch.randn(40, H, device="cuda").to(dtype)
    want_buf, got_buf = case["capture_out"].clone(), case["capture_out"].clone()
    want = steer_reference(**{**case, "capture_out": want_buf}, capture_next=4)
    got = steer_triton(**{**case, "capture_out": got_buf}, capture_next=4)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    rows = case["capture_rows"][case["capture_rows"] >= 0].long()
    assert torch.equal(got_buf[rows, 3], want_buf[rows, 3])  # h + add: one rounding, exact
    captured = (case["capture_rows"] >= 0).nonzero().flatten()
    assert torch.equal(got_buf[case["capture_rows"][captured].long(), 4], got[captured])
    untouched = torch.ones(got_buf.shape[:2], dtype=torch.bool, device="cuda")
    untouched[rows, 3] = untouched[rows, 4] = False
    assert got_buf[untouched].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_capture_kernel_copies_rows_bit_for_bit(dtype):
    from services.engine.kernels.capture import capture, capture_reference

    h = torch.randn(50, 4096, device="cuda").to(dtype)
    rows = torch.full((50,), -1, dtype=torch.int32, device="cuda")
    rows[::4] = torch.randperm(13, device="cuda").to(torch.int32)
    want = torch.full((13, 6, 4096), float("nan"), device="cuda", dtype=dtype)
    got = want.clone()
    capture_reference(h, rows, want, 5)
    capture(h, rows, got, 5)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
