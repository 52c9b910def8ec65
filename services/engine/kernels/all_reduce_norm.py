"""A tensor-parallel all-reduce fused with the residual add and the RMSNorm after it.

Under tensor parallelism each layer ends its attention and its MLP with an all-reduce of a
`[T, H]` partial sum, then adds the residual stream and normalises it: two kernels each
time, 64 a decode step on the Llama-3-8B shape, where a TP=2 step at batch 1 spends about
0.8 ms in small kernels (`benchmarks/README.md`). Here one kernel does both, one-shot over
symmetric memory (every rank's buffer mapped into every other's address space):

1. each program copies its rows of this rank's partial into this rank's buffer;
2. it meets the same program of every other rank at a barrier (signal flags in each rank's
   signal pad: a peer's flag is set with a release at system scope and taken back with
   an acquire, so the flags end where they started);
3. it sums its rows over every rank's buffer (read over NVLink), rounds the sum to the
   activation dtype as the all-reduce would, adds the residual (rounded as `x + r` is),
   and normalises exactly as `norm_rope.rms_norm_reference` does;
4. a second barrier: no rank writes its buffer again while a peer may still read it.

`EngineConfig.fused_all_reduce_norm` turns it on (off by default: it has not yet run on
GPUs). `all_reduce_add_norm_reference` is what it computes from every rank's partial.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here runs without CUDA
    triton = None

from services.engine.kernels.norm_rope import rms_norm_reference
from services.engine.parallel import on_every_rank

log = logging.getLogger(__name__)

MAX_PROGRAMS = 64  # programs per launch (rows loop over them); each owns WORLD flag slots


def all_reduce_add_norm_reference(
    parts: list[torch.Tensor],  # every rank's [T, H] partial sum
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual): the sum of `parts` in float32, rounded to
    their dtype, then `rms_norm_reference` with the residual."""
    total = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return rms_norm_reference(total, weight, eps, residual)  # type: ignore[return-value]


if triton is not None:

    @triton.jit
    def _block_barrier(sig_ptrs, pid, rank, WORLD: tl.constexpr):
        """Meet program `pid` of every other rank: flag slot [pid, rank] of each peer's pad
        set 0 -> 1 (release, system scope: this program's earlier writes go first), then
        each peer's slot [pid, peer] of this rank's pad taken back 1 -> 0 (acquire)."""
        tl.debug_barrier()  # every thread of the program has written before the signal
        for p in tl.static_range(WORLD):
            if p != rank:
                slot = tl.load(sig_ptrs + p).to(tl.pointer_type(tl.int32)) + pid * WORLD + rank
                while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
                    pass
        mine = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32))
        for p in tl.static_range(WORLD):
            if p != rank:
                slot = mine + pid * WORLD + p
                while tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()  # ... and no thread reads before it

    @triton.jit
    def _all_reduce_add_norm_kernel(
        x_ptr,  # [T, H] this rank's partial (last dim contiguous)
        stride_x,
        res_ptr,  # [T, H] the residual stream
        stride_res,
        w_ptr,  # [H]
        out_ptr,  # [T, H] norm(sum + residual), contiguous
        total_ptr,  # [T, H] sum + residual, contiguous
        buf_ptrs,  # int64 [WORLD]: each rank's symmetric buffer, as mapped here
        sig_ptrs,  # int64 [WORLD]: each rank's signal pad, as mapped here
        rank,
        T,
        H,
        eps,
        WORLD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        SYNC: tl.constexpr,  # False only with WORLD 1 (the interpreter's parity test)
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        m = cols < H
        dtype = x_ptr.dtype.element_ty
        mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
        # Offsets fit in 32 bits: a call's rows fit the buffer (`FusedAllReduceNorm.fits`).
        for row in range(pid, T, nprog):
            x = tl.load(x_ptr + row * stride_x + cols, mask=m)
            tl.store(mine + row * H + cols, x, mask=m)
        if SYNC:
            _block_barrier(sig_ptrs, pid, rank, WORLD)
        for row in range(pid, T, nprog):
            acc = tl.zeros([BLOCK_H], tl.float32)
            for r in tl.static_range(WORLD):
                buf = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype))
                acc += tl.load(buf + row * H + cols, mask=m, other=0.0, volatile=True).to(
                    tl.float32
                )
            reduced = acc.to(dtype)  # what the all-reduce hands back
            res = tl.load(res_ptr + row * stride_res + cols, mask=m, other=0.0)
            total = (reduced.to(tl.float32) + res.to(tl.float32)).to(dtype)  # as x + r
            tl.store(total_ptr + row * H + cols, total, mask=m)
            t32 = tl.where(m, total.to(tl.float32), 0.0)
            var = tl.sum(t32 * t32, 0) / H
            normed = (t32 * tl.rsqrt(var + eps)).to(dtype)
            w = tl.load(w_ptr + cols, mask=m, other=0.0)
            y = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
            tl.store(out_ptr + row * H + cols, y, mask=m)
        if SYNC:
            _block_barrier(sig_ptrs, pid, rank, WORLD)


def all_reduce_add_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buf_ptrs: torch.Tensor,
    sig_ptrs: torch.Tensor,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over `x` [T, H] (this rank's partial) and `residual`; `buf_ptrs` and
    `sig_ptrs` (int64 [world], on the device) address every rank's buffer and signal pad."""
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out)
    if t == 0:
        return out, total
    assert x.stride(1) == 1 and residual.stride(1) == 1
    _all_reduce_add_norm_kernel[(min(t, MAX_PROGRAMS),)](
        x, x.stride(0), residual, residual.stride(0), weight, out, total,
        buf_ptrs, sig_ptrs, rank, t, h, eps,
        WORLD=world, BLOCK_H=triton.next_power_of_2(h), SYNC=world > 1,
        num_warps=4 if h <= 2048 else 8,
    )  # fmt: skip
    return out, total


class FusedAllReduceNorm:
    """The fused kernel's symmetric buffer and signal pads for one TP group (CUDA, bf16 or
    any dtype the buffer is sized for); `fits` says whether a call can take it."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = handle.rank, handle.world_size
        if handle.signal_pad_size < MAX_PROGRAMS * self.world * 4:
            raise RuntimeError(
                f"signal pads of {handle.signal_pad_size} bytes hold fewer than "
                f"{MAX_PROGRAMS} programs' flags"
            )
        self.buf_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.sig_ptrs = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dim() == 2 and x.numel() * x.element_size() <= self.max_bytes

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_add_norm_triton(
            x, residual, weight, eps, self.buf_ptrs, self.sig_ptrs, self.rank, self.world
        )


def fused_all_reduce_norm(group: Any, device: torch.device) -> FusedAllReduceNorm | None:
    """A `FusedAllReduceNorm` for the TP `group`, or None where it cannot be made on every
    rank (then every rank keeps the all-reduce and the norm apart; logged). Checked once
    against `all_reduce_add_norm_reference` on a probe."""

    fused: FusedAllReduceNorm | None = None
    try:
        fused = FusedAllReduceNorm(group, device, 4 << 20)
    except Exception as exc:  # no symmetric memory, no peer access, small signal pads
        log.warning("fused all-reduce + norm unavailable (%s): kept apart", exc)
    # A probe launched by some ranks only would hang the others at its barrier.
    if not on_every_rank(fused is not None, group, device):
        return None
    assert fused is not None
    try:
        part = torch.full((3, 256), float(fused.rank + 1), device=device)
        residual, weight = torch.ones_like(part), torch.ones(256, device=device)
        got = fused(part, residual, weight, 1e-6)
        parts = [torch.full_like(part, float(r + 1)) for r in range(fused.world)]
        want = all_reduce_add_norm_reference(parts, residual, weight, 1e-6)
        ok = all(torch.allclose(g, w) for g, w in zip(got, want, strict=True))
        if not ok:
            log.warning("fused all-reduce + norm gave a wrong probe result: kept apart")
    except Exception as exc:  # the kernel failed to compile or launch
        log.warning("fused all-reduce + norm unavailable (%s): kept apart", exc)
        ok = False
    return fused if on_every_rank(ok, group, device) else None
