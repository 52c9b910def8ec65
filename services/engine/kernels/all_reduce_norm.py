"""A tensor-parallel all-reduce fused with the residual add and the RMSNorm after it.

Under tensor parallelism each layer ends its attention and its MLP with an all-reduce of a
`[T, H]` partial sum, then adds the residual stream and normalises it: two kernels each
time, 64 a decode step on the Llama-3-8B shape, where a TP=2 step at batch 1 spends about
0.8 ms in small kernels (`benchmarks/README.md`). Here one kernel does both, one-shot over
symmetric memory (every rank's buffer mapped into every other's address space), pushing
rather than pulling:

1. each program writes its rows of this rank's partial into slot `rank` of every rank's
   buffer (stores over NVLink, which need no round trip), in the half of the buffer this
   call's number picks;
2. it sets its flag in every peer's signal pad to the call's number (a release at system
   scope: the rows land first), and waits until every peer's flag in its own pad holds it
   (an acquire);
3. it sums its rows over the slots of its own buffer, now local, in rank order on every
   rank (so every rank holds the same bits), rounds the sum to the activation dtype as the
   all-reduce would, adds the residual (rounded as `x + r` is), and normalises exactly as
   `norm_rope.rms_norm_reference` does.

One wait a call, not two: the flags count calls (each program keeps its count on the
device, so graph replays count too) and are never reset, and calls alternate between the
buffer's two halves. A rank writing a half at call n + 2 has seen every peer's flag for
call n + 1, so each peer's kernel of call n, the last to read that half, has ended. Every
launch runs `PROGRAMS` programs whatever the row count, so the same program of every rank
handles the same rows in every call.

The first version met each peer twice a call, pulling the rows over NVLink between the
two meetings, and measured no faster than the one-shot all-reduce and the norm kept apart
(`benchmarks/README.md`, 2026-11-27).

`EngineConfig.fused_all_reduce_norm` turns it on; left None, it is on for two TP ranks
(measured faster there on two H200s, and no faster at four).
`all_reduce_add_norm_reference` is what it computes from every rank's partial.
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

PROGRAMS = 64  # programs per launch, always (rows loop over them); each owns WORLD flag slots


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
    def _signal_and_wait(sig_ptrs, pid, rank, call, WORLD: tl.constexpr):
        """Set this program's flag in every peer's pad to `call` (release, system scope:
        this program's earlier stores land first), then wait until each peer's flag in this
        rank's pad holds `call` too (acquire). A peer's flag is `call - 1` until it gets
        here: it cannot run further ahead than `call + 1` without this rank's flag."""
        tl.debug_barrier()  # every thread of the program has stored before the signal
        for p in tl.static_range(WORLD):
            if p != rank:
                slot = tl.load(sig_ptrs + p).to(tl.pointer_type(tl.int32)) + pid * WORLD + rank
                tl.atomic_xchg(slot, call, sem="release", scope="sys")
        mine = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32))
        for p in tl.static_range(WORLD):
            if p != rank:
                slot = mine + pid * WORLD + p
                while tl.atomic_add(slot, 0, sem="acquire", scope="sys") == call - 1:
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
        calls_ptr,  # int32 [PROGRAMS]: the calls each program has made (this rank's)
        slot_elems,  # elements of one rank's slot in one half of a buffer
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
        call = tl.load(calls_ptr + pid) + 1
        half = (call % 2).to(tl.int64) * WORLD * slot_elems
        # Offsets fit in 32 bits within a slot: a call's rows fit it (`FusedAllReduceNorm.fits`).
        for row in range(pid, T, nprog):
            x = tl.load(x_ptr + row * stride_x + cols, mask=m)
            for r in tl.static_range(WORLD):
                buf = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype)) + half
                tl.store(buf + rank * slot_elems + row * H + cols, x, mask=m)
        if SYNC:
            _signal_and_wait(sig_ptrs, pid, rank, call, WORLD)
        mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)) + half
        for row in range(pid, T, nprog):
            acc = tl.zeros([BLOCK_H], tl.float32)
            for r in tl.static_range(WORLD):  # rank order on every rank: the same bits
                acc += tl.load(
                    mine + r * slot_elems + row * H + cols, mask=m, other=0.0, volatile=True
                ).to(tl.float32)
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
        tl.store(calls_ptr + pid, call)


def all_reduce_add_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buf_ptrs: torch.Tensor,
    sig_ptrs: torch.Tensor,
    calls: torch.Tensor,
    slot_bytes: int,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over `x` [T, H] (this rank's partial) and `residual`; `buf_ptrs` and
    `sig_ptrs` (int64 [world], on the device) address every rank's buffer (two halves of
    `world` slots of `slot_bytes`) and signal pad; `calls` (int32 [PROGRAMS]) counts this
    rank's calls per program."""
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out)
    if t == 0:
        return out, total
    assert x.stride(1) == 1 and residual.stride(1) == 1
    assert t * h * x.element_size() <= slot_bytes
    _all_reduce_add_norm_kernel[(PROGRAMS,)](
        x, x.stride(0), residual, residual.stride(0), weight, out, total,
        buf_ptrs, sig_ptrs, calls, slot_bytes // x.element_size(), rank, t, h, eps,
        WORLD=world, BLOCK_H=triton.next_power_of_2(h), SYNC=world > 1,
        num_warps=4 if h <= 2048 else 8,
    )  # fmt: skip
    return out, total


class FusedAllReduceNorm:
    """The fused kernel's symmetric buffer, signal pads and call counts for one TP group
    (CUDA, any dtype); `fits` says whether a call can take it: a partial of at most
    `slot_bytes`."""

    def __init__(self, group: Any, device: torch.device, slot_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.slot_bytes = slot_bytes
        world = group.size()
        self.buffer = symm_mem.empty(2 * world * slot_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = handle.rank, handle.world_size
        if handle.signal_pad_size < PROGRAMS * self.world * 4:
            raise RuntimeError(
                f"signal pads of {handle.signal_pad_size} bytes hold fewer than "
                f"{PROGRAMS} programs' flags"
            )
        # The flags count calls from 0, in pads that start zeroed and only this uses.
        self.calls = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
        self.buf_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.sig_ptrs = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dim() == 2 and x.numel() * x.element_size() <= self.slot_bytes

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_add_norm_triton(
            x, residual, weight, eps, self.buf_ptrs, self.sig_ptrs, self.calls,
            self.slot_bytes, self.rank, self.world,
        )  # fmt: skip


def fused_all_reduce_norm(group: Any, device: torch.device) -> FusedAllReduceNorm | None:
    """A `FusedAllReduceNorm` for the TP `group`, or None where it cannot be made on every
    rank (then every rank keeps the all-reduce and the norm apart; logged). Checked once
    against `all_reduce_add_norm_reference` on a probe."""

    fused: FusedAllReduceNorm | None = None
    try:
        fused = FusedAllReduceNorm(group, device, 2 << 20)
    except Exception as exc:  # no symmetric memory, no peer access, small signal pads
        log.warning("fused all-reduce + norm unavailable (%s): kept apart", exc)
    # A probe launched by some ranks only would hang the others at its wait.
    if not on_every_rank(fused is not None, group, device):
        return None
    assert fused is not None
    try:
        ok = True
        for call in range(3):  # both halves of the buffer, and one of them again
            part = torch.full((3, 256), float(fused.rank + 1 + 10 * call), device=device)
            residual, weight = torch.ones_like(part), torch.ones(256, device=device)
            got = fused(part, residual, weight, 1e-6)
            parts = [torch.full_like(part, float(r + 1 + 10 * call)) for r in range(fused.world)]
            want = all_reduce_add_norm_reference(parts, residual, weight, 1e-6)
            ok = ok and all(torch.allclose(g, w) for g, w in zip(got, want, strict=True))
        if not ok:
            log.warning("fused all-reduce + norm gave a wrong probe result: kept apart")
    except Exception as exc:  # the kernel failed to compile or launch
        log.warning("fused all-reduce + norm unavailable (%s): kept apart", exc)
        ok = False
    return fused if on_every_rank(ok, group, device) else None
