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
    lowest,
    scatter_rows,
    scatter_rows_reference,
    scatter_rows_triton,
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


def _scatter_case(R: int, C: int, H: int, dtype=torch.float32):
    """A block of R rows, C columns, and two chunks: the first holds the first request's
    buffer (rows 0, 2, 3 its positions 0, 1, 2, asking every column), the second the
    second's (row 1 its position 2, asking columns 0 and C-1 as its keys 1 and 0); a fifth
    row is nobody's (-1). Addresses count from the first chunk."""
    g = torch.Generator().manual_seed(R * C * H)
    src = torch.randn(R, C, H, generator=g).to(torch.bfloat16)
    capacity = 4
    first = torch.full((C * capacity * H,), float("nan"), dtype=dtype)
    second = torch.full((3 * capacity * H + 7,), float("nan"), dtype=dtype)
    maps = torch.full((2, C), -1, dtype=torch.int64)
    maps[0] = torch.arange(C)
    maps[1, 0], maps[1, C - 1] = 1, 0
    return src, [first, second], _dest([first, second], capacity * H, H), maps


def _dest(chunks: list[torch.Tensor], stride: int, H: int) -> torch.Tensor:
    """`_scatter_case`'s rows' addresses in these chunks (from the lowest)."""
    origin = lowest(chunks).data_ptr()
    first, second = ((c.data_ptr() - origin) // c.itemsize for c in chunks)
    second += 7  # its buffer starts off a row's alignment: addresses are elements
    return torch.tensor(
        [[first, stride, 0], [second + 2 * H, stride, 1], [first + H, stride, 0]]
        + [[first + 2 * H, stride, 0], [-1, 0, 0]],
        dtype=torch.int64,
    )


def test_scattered_rows_land_at_their_requests_keys_and_positions():
    src, (first, second), dest, maps = _scatter_case(5, 3, 8)
    dest = dest[:5]
    scatter_rows_reference(src, [first, second], dest, maps)
    H, capacity = 8, 4
    first = first.view(3, capacity, H)  # [keys, capacity, H]
    for row, i in ((0, 0), (2, 1), (3, 2)):  # block row -> its row of the first buffer
        assert torch.equal(first[:, i], src[row].float())
    assert first[:, 3].isnan().all()  # a row nobody wrote
    second = second[7:].view(3, capacity, H)
    assert torch.equal(second[1, 2], src[1, 0].float())  # column 0 is its key 1
    assert torch.equal(second[0, 2], src[1, 2].float())  # column C-1 its key 0
    assert second[2].isnan().all() and second[:, [0, 1, 3]].isnan().all()


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("programs", [2, 64])  # each walking several items, or one each
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,C,H", [(5, 3, 40), (4, 2, 1500)])  # 1500: two H tiles
def test_triton_scatters_exactly_what_the_reference_scatters(R, C, H, dtype, programs):
    src, want, dest, maps = _scatter_case(R, C, H, dtype)
    got = [t.clone() for t in want]
    scatter_rows_reference(src, want, dest[:R], maps)
    scatter_rows_triton(src, got, _dest(got, 4 * H, H)[:R], maps, programs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(), w.nan_to_num())  # a copy: bit for bit
    scatter_rows(src, got, torch.full_like(dest[:R], -1), maps)  # no row here: no change
    assert all(torch.equal(g.isnan(), w.isnan()) for g, w in zip(got, want, strict=True))
