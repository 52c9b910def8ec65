"""The in-graph capture op: the reference's semantics, and the Triton kernel against it
(under TRITON_INTERPRET=1, in a fresh process, as `test_steer.py` runs its kernel)."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.capture import (
    capture,
    capture_reference,
    capture_slot,
    capture_triton,
)
from tests.interpreted import INTERPRETED, assert_passes_interpreted


def _case(T: int, H: int, slots: int = 6, dtype=torch.float32):
    g = torch.Generator().manual_seed(T * H)
    h = torch.randn(T, H, generator=g).to(dtype)
    rows = torch.full((T,), -1, dtype=torch.int32)
    rows[1::2] = torch.randperm(len(rows[1::2]), generator=g).to(torch.int32)
    out = torch.full((T, slots, H), float("nan"), dtype=dtype)
    return h, rows, out


def test_slots_follow_layers_then_sites():
    assert [capture_slot(L, s) for L in (0, 1) for s in ("pre_attn", "post_attn")] == [0, 1, 3, 4]
    assert capture_slot(2, "post_block") == 8


def test_capturing_tokens_write_their_row_at_the_slot_and_nothing_else():
    h, rows, out = _case(7, 16)
    capture_reference(h, rows, out, slot=2)
    tokens = (rows >= 0).nonzero().flatten()
    assert torch.equal(out[rows[tokens].long(), 2], h[tokens])
    written = torch.zeros(out.shape[:2], dtype=torch.bool)
    written[rows[tokens].long(), 2] = True
    assert out[~written].isnan().all()


@pytest.mark.skipif(INTERPRETED, reason="already interpreting: the kernel tests run here")
def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "triton and not under_interpreter")


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("T,H", [(9, 40), (5, 1500)])  # 1500: two H tiles
def test_triton_copies_exactly_what_the_reference_copies(T, H):
    h, rows, want = _case(T, H)
    got = want.clone()
    capture_reference(h, rows, want, slot=4)
    capture_triton(h, rows, got, slot=4)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())  # a copy: bit for bit
    capture(h, torch.full_like(rows, -1), got, slot=5)  # nobody captures: nothing changes
    assert torch.equal(got.isnan(), want.isnan())
