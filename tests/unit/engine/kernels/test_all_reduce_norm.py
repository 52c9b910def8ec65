"""The fused all-reduce + add + RMSNorm kernel against its PyTorch reference, on CPU under
TRITON_INTERPRET=1 with one rank (the push into the buffer's half, the sum over ranks, the
add, the rounding and the norm, the call counts; the flags between ranks run only on two
GPUs: tests/gpu/test_parallel_nccl.py)."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.all_reduce_norm import (
    PROGRAMS,
    all_reduce_add_norm_reference,
    all_reduce_add_norm_triton,
)
from services.engine.kernels.norm_rope import rms_norm_reference
from services.engine.kernels.steer import INTERPRET
from tests.interpreted import assert_passes_interpreted

interpreted_only = pytest.mark.skipif(
    not INTERPRET, reason="run under TRITON_INTERPRET=1 by test_triton_under_interpreter"
)


def test_the_reference_is_the_all_reduce_then_the_fused_add_and_norm():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(5, 32, generator=g).to(torch.bfloat16) for _ in range(3)]
    residual = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    weight = torch.randn(32, generator=g)
    summed = (parts[0].float() + parts[1].float() + parts[2].float()).to(torch.bfloat16)
    want = rms_norm_reference(summed, weight, 1e-6, residual)
    got = all_reduce_add_norm_reference(parts, residual, weight, 1e-6)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "interpreted")


@interpreted_only
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (PROGRAMS + 6, 130)])
def test_interpreted_one_rank_matches_the_reference(rows, hidden):
    """One rank: the push into the buffer, the sum, the add and the norm; more rows than
    programs (each program loops over its rows); a hidden size the block does not fill; a
    strided partial and residual. Calls alternate between the buffer's halves, and every
    program counts each call."""
    g = torch.Generator().manual_seed(rows)
    slot_bytes = rows * hidden * 4 + 100  # a slot larger than the call's rows
    buffer = torch.zeros(2 * slot_bytes // 4)  # two halves of one rank's slot
    buf_ptrs = torch.tensor([buffer.data_ptr()], dtype=torch.int64)
    sig_ptrs = torch.zeros(1, dtype=torch.int64)  # unread with one rank
    calls = torch.zeros(PROGRAMS, dtype=torch.int32)
    for call in (1, 2, 3):
        x = torch.randn(rows, hidden + 7, generator=g)[:, :hidden]  # rows with a stride
        residual = torch.randn(rows, hidden + 3, generator=g)[:, :hidden]
        weight = torch.randn(hidden, generator=g)
        got = all_reduce_add_norm_triton(
            x, residual, weight, 1e-6, buf_ptrs, sig_ptrs, calls, slot_bytes, 0, 1
        )
        want = all_reduce_add_norm_reference([x], residual, weight, 1e-6)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        half = buffer[(call % 2) * (slot_bytes // 4) :][: rows * hidden]
        torch.testing.assert_close(half.view(rows, hidden), x, atol=0, rtol=0)  # what peers read
        assert calls.tolist() == [call] * PROGRAMS
