"""`host_empty` / `host_zeros`: large host tensors on huge-page-advised mappings behave as
tensors from the allocator do."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from services.engine.host_memory import (
    HUGE_BYTES,
    host_empty,
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
