"""Where this process sits in a tensor- and pipeline-parallel model replica.

The model code takes a `ParallelContext` instead of reading global state, so one process
can own a shard of each Linear (TP) and a slice of the layer stack (PP). Collectives go
through `torch.distributed` only when the group really has more than one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """Ranks and sizes of this process in its replica; the default is a single process."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup when tp_size > 1

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


SINGLE_PROCESS = ParallelContext()
