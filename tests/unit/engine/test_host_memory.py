"""`host_empty` / `host_zeros`: large host tensors on huge-page-advised mappings behave as
tensors from the allocator do."""

from __future__ import annotations

import gc
import mmap
import pickle

import pytest
import torch

from services.engine.host_memory import (
    HUGE_BYTES,
    host_empty,
    host_rows,
    host_zeros,
    transparent_huge_pages,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, HUGE_BYTES // 4096 + 3])  # below and above the threshold
def test_host_tensors_hold_what_is_written(dtype, rows):
    shape = (rows, 2048)
    zeros = host_zeros(shape, dtype)
    assert zeros.shape == shape and zeros.dtype == dtype and zeros.is_contiguous()
    assert not zeros.any()
    src = torch.randn(shape).to(dtype)
    out = host_empty(shape, dtype).copy_(src)
    assert torch.equal(out, src)
    assert torch.equal(pickle.loads(pickle.dumps(out)), src)
    assert torch.equal(torch.from_numpy(out.float().numpy()), src.float())


def test_a_view_keeps_its_mapping_alive():
    big = host_empty((HUGE_BYTES // 4 + 1,), torch.float32).fill_(2.0)
    tail = big[-8:]
    del big
    gc.collect()
    assert torch.equal(tail, torch.full((8,), 2.0))
    tail.add_(1.0)  # still writable memory of its own
    assert tail.sum().item() == 24.0


def test_host_tensors_are_independent():
    a, b = (host_zeros((HUGE_BYTES // 4,), torch.float32) for _ in range(2))
    a.fill_(1.0)
    assert not b.any() and a.data_ptr() != b.data_ptr()


def test_the_huge_page_mode_is_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_pages(setting) == "madvise"
    setting.write_text("[never]")
    assert transparent_huge_pages(setting) == "never"
    assert transparent_huge_pages(tmp_path / "absent") == "unknown"
    setting.write_text("garbled")
    assert transparent_huge_pages(setting) == "unknown"


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise on this platform")
def test_a_tensor_under_the_default_size_on_a_mapping_of_its_own_gives_rows_without_copies():
    """A request's capture buffer under `HUGE_BYTES` (a bfloat16 request of a small model)
    asks for a mapping from a smaller size, so its result is sliced off it, not copied."""
    shape = (3, 5, 64)  # [keys, rows, H]
    t = host_empty(shape, torch.bfloat16, min_mapped_bytes=1024)
    t.copy_(torch.randn(shape).to(torch.bfloat16))
    rows = host_rows(t, 4)
    for j, r in enumerate(rows):
        assert torch.equal(r, t[j, :4]) and r.is_contiguous()
        assert r.data_ptr() == t[j].data_ptr()  # a slice of the mapping, no copy
    assert torch.equal(pickle.loads(pickle.dumps(rows[1])), t[1, :4])  # its rows alone
    small = host_empty(shape, torch.bfloat16)  # the allocator's: copied out
    assert host_rows(small, 4)[1].data_ptr() != small[1].data_ptr()
