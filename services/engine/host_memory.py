"""Large host tensors that fault in 2 MiB at a time.

A fresh tensor from the CPU allocator is a new anonymous mapping whose pages the kernel maps
and zeroes one 4 KiB page at a time, as each is first written. For the blocks per-token
capture writes every step this dominates the copy itself: writing an 84 MB float32 block
(32 tokens x 80 layers x 8,192 of the Llama-3-70B shape) from bfloat16 takes 33 ms into
fresh memory, 6.5 ms into memory advised for transparent huge pages and 3 ms into memory
already touched (one core of a CI host, `benchmarks/host_copy.py --threads 1`).

`host_empty` maps blocks of `HUGE_BYTES` or more anonymously and advises `MADV_HUGEPAGE`,
which takes effect where the kernel's THP setting is `madvise` (the usual default) or
`always`; under `never`, or on a platform without it, the mapping is an ordinary one and
nothing is lost but the advice.

The tensor owns its mapping (`torch.frombuffer` holds the buffer): it is unmapped when the
last tensor sharing the storage goes. Such tensors pickle, `.numpy()` and `.clone()` like
any other.
"""

from __future__ import annotations

import math
import mmap
import weakref
from pathlib import Path

import torch

HUGE_BYTES = 4 << 20  # below this, the allocator's own memory (often already touched)

_ADVISE = getattr(mmap, "MADV_HUGEPAGE", None)
# data_ptr -> the mapping of each live `host_empty` tensor on one (for `host_rows`)
_MAPPINGS: dict[int, mmap.mmap] = {}
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages(setting: Path = THP_SETTING) -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`: the word in
    brackets of `setting`), or `unknown` where it cannot be read. Under `never` the advice
    here is lost and fresh blocks fault in 4 KiB at a time."""
    try:
        text = setting.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def host_empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, min_mapped_bytes: int = HUGE_BYTES
) -> torch.Tensor:
    """An uninitialised CPU tensor; one of `min_mapped_bytes` or more on a huge-page-advised
    mapping of its own (which `host_rows` slices without copies)."""
    mapped = _mapped(shape, dtype, min_mapped_bytes)
    return torch.empty(shape, dtype=dtype) if mapped is None else mapped


def host_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """`host_empty`, zeroed (a fresh mapping reads as zeros already: no pass over it)."""
    mapped = _mapped(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if mapped is None else mapped


def _mapped(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, min_bytes: int = HUGE_BYTES
) -> torch.Tensor | None:
    numel = math.prod(shape)
    if numel * dtype.itemsize < min_bytes or _ADVISE is None:
        return None
    mapping = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(_ADVISE)
    t = torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
    _MAPPINGS[t.data_ptr()] = mapping
    weakref.finalize(t, _MAPPINGS.pop, t.data_ptr(), None)
    return t


def to_device_async(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for the device's queue: on CUDA copied up
    from pinned memory (PyTorch's host allocator keeps the block until the copy has run).
    `torch.tensor(values, device=cuda)` copies synchronously, so it waits for every step
    queued, and a copy from pageable memory may wait too."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host without waiting for the device's queue: on CUDA a copy into fresh
    pinned memory, queued behind the work before it, that the caller's event must cover
    before the host reads it; a CPU tensor as it is."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def host_rows(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`t[j, :n]` for each `j` of a `host_empty` tensor `t` of shape `[K, rows, ...]`, each
    on a storage of its own holding those rows alone: each is contiguous, and pickled (to
    another process) sends its own rows, where a view `t[j, :n]` would send all of `t`.
    No copy where `t` is on a mapping (its slices of it); a copy of the rows where `t` is
    smaller than `HUGE_BYTES`."""
    mapping = _MAPPINGS.get(t.data_ptr())
    if mapping is None or not t.is_contiguous() or t.numel() * t.element_size() != len(mapping):
        return [t[j, :n].clone() for j in range(len(t))]  # not a whole mapping: copies
    row = math.prod(t.shape[2:])
    stride = t.shape[1] * row * t.dtype.itemsize
    return [
        torch.frombuffer(mapping, dtype=t.dtype, count=n * row, offset=j * stride).view(
            n, *t.shape[2:]
        )
        for j in range(len(t))
    ]
