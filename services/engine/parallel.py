"""Where this process sits in a tensor- and pipeline-parallel model replica.

The model code takes a `ParallelContext` instead of reading global state, so one process
can own a shard of each Linear (TP) and a slice of the layer stack (PP). Collectives go
through `torch.distributed` only when the group really has more than one rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    """Ranks and sizes of this process in its replica; the default is a single process."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup when tp_size > 1
    # Small CUDA all-reduces of the TP group through symmetric memory (None: NCCL's)
    symmetric: SymmetricAllReduce | None = None
    # The all-reduce fused with the add and norm after it (`kernels/all_reduce_norm.py`;
    # EngineConfig.fused_all_reduce_norm), None: kept apart
    fused_norm: Any = None
    # The first and last stages' pair group the sampled tokens travel in, with pipeline
    # microbatches (`recent_tokens.py`; None: the default group, in turn with the stages)
    token_group: Any = None

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"bad parallel ranks: {self}")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """The layers this pipeline stage owns: contiguous, earlier stages take the remainder."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    @property
    def rank(self) -> int:
        """This process's rank in its replica: stages in order, TP ranks within a stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def send_to_next_stage(self, h: torch.Tensor) -> None:
        """Hand this stage's residual stream `[T, H]` to the same TP rank of the next stage."""
        dist.send(h.contiguous(), dst=self.rank + self.tp_size)

    def recv_from_prev_stage(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        h = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(h, src=self.rank - self.tp_size)
        return h

    def send_to_first_stage(self, token_ids: torch.Tensor) -> Any:
        """Last stage: hand a step's sampled token ids `[N]` (int64) to the same TP rank of
        the first stage, which embeds them in the step that feeds them back. With pipeline
        microbatches that step comes later, so the send is left under way (gloo's would
        hold the host until the receive): its work is returned, to be waited on."""
        if self.token_group is None:
            dist.send(token_ids.contiguous(), dst=self.tp_rank)
            return None
        return dist.isend(token_ids.contiguous(), dst=self.tp_rank, group=self.token_group)

    def recv_from_last_stage(self, n: int, device: torch.device) -> torch.Tensor:
        ids = torch.empty(n, dtype=torch.int64, device=device)
        dist.recv(ids, src=(self.pp_size - 1) * self.tp_size + self.tp_rank, group=self.token_group)
        return ids

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the TP group (in place, or a new tensor: use the result)."""
        if self.tp_size == 1:
            return x
        if self.symmetric is not None and self.symmetric.fits(x):
            return self.symmetric(x)
        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_reduce_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(Σx + residual), Σx + residual), Σ over the TP group: one fused kernel where
        `fused_norm` takes the call, else the all-reduce, then `norm`'s fused add + norm."""
        fused = self.fused_norm
        if fused is not None and fused.fits(x):
            return fused(x, residual, norm.weight, norm.eps)
        return norm(self.all_reduce(x), residual)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


class SymmetricAllReduce:
    """One-shot all-reduce of small CUDA tensors through PyTorch's symmetric memory: each
    rank copies its part into a buffer every peer maps, then every rank reads all of them
    and sums, in one kernel. A decode step's all-reduces are a few KiB to a few MiB, where
    NCCL's ring costs about twice as much (`benchmarks/tp_collectives.py`: 7 against 16 µs
    for a [1, 4096] bf16 all-reduce on two H200s inside a CUDA graph); larger ones go to
    NCCL. The kernel syncs the ranks before it reads and after, so one buffer serves
    every call in turn. Graph-capturable."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and x.is_contiguous() and nbytes <= self.max_bytes and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", self.group_name)


def symmetric_all_reduce(group: Any, device: torch.device) -> SymmetricAllReduce | None:
    """A `SymmetricAllReduce` for the TP `group` on CUDA, or None where this PyTorch or its
    GPUs cannot map each other's memory (then NCCL does every all-reduce; logged).
    `COXSWAIN_SYMMETRIC_ALL_REDUCE=0` turns it off; `..._MAX_BYTES` sizes its buffer."""
    if os.environ.get("COXSWAIN_SYMMETRIC_ALL_REDUCE", "1") == "0":
        return None
    max_bytes = int(os.environ.get("COXSWAIN_SYMMETRIC_ALL_REDUCE_MAX_BYTES", 4 << 20))
    fast: SymmetricAllReduce | None = None
    try:
        fast = SymmetricAllReduce(group, device, max_bytes)
        probe = torch.ones(8, dtype=torch.float32, device=device)
        if not torch.equal(fast(probe), probe * dist.get_world_size(group)):
            raise RuntimeError("a probe all-reduce gave a wrong sum")
    except Exception as exc:  # an older PyTorch, no peer access between the GPUs
        log.warning("symmetric-memory all-reduce unavailable (%s): NCCL does all of them", exc)
        fast = None
    # Every rank of the group must take the same path, or their all-reduces never meet.
    return fast if on_every_rank(fast is not None, group, device) else None


def on_every_rank(ok: bool, group: Any, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of `group`: how ranks agree on a collective's path
    (one that takes another path alone would wait for its peers forever)."""
    flag = torch.tensor([ok], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


SINGLE_PROCESS = ParallelContext()
