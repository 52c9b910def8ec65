"""Building blocks of Llama-family models, written tensor-parallel aware.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that cuts this rank's
shard out of the full Hugging Face tensor at load time, so no process ever has to hold
(or even see) another rank's slice in its parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import CheckpointError
from services.engine.kernels import gemv
from services.engine.kernels.norm_rope import rms_norm, rotary
from services.engine.kernels.skinny_gemm import skinny_linear, takes
from services.engine.kernels.tickets import Tickets
from services.engine.model.config import RopeConfig, llama3_inv_freq
from services.engine.parallel import ParallelContext


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    if param.shape != loaded.shape:
        raise CheckpointError(
            f"shape mismatch for {name or 'parameter'}: checkpoint {tuple(loaded.shape)}, "
            f"model expects {tuple(param.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    _check_shape(param, loaded)
    param.data.copy_(loaded)


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise CheckpointError(f"{what}={n} is not divisible by tensor-parallel size {parts}")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b) with W's output rows split across TP ranks; output stays sharded.

    `skinny`: decode-size batches (`kernels/skinny_gemm.py`'s `takes`) run that kernel
    instead of cuBLAS (`EngineConfig.skinny_gemm`), split over K where the model gives it
    `tickets` (`kernels/tickets.py`). `gemv` (set by the model, `EngineConfig.gemv`): a
    one-row input runs `kernels/gemv.py`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ctx: ParallelContext,
        skinny: bool = False,
    ):
        super().__init__()
        self.ctx = ctx
        self.skinny = skinny
        self.gemv = False
        self.tickets: Tickets | None = None  # the model's, for the split-K skinny kernel
        self.out_per_rank = _divide(out_features, ctx.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        shard = loaded.narrow(0, self.ctx.tp_rank * n, n) if self.ctx.tp_size > 1 else loaded
        _check_shape(param, shard)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny and takes(x):
            return skinny_linear(x, self.weight, self.bias, tickets=self.tickets)
        if self.gemv:
            return gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul.

    `output_sizes` are the full (unsharded) sizes of each part, in order; HF stores each
    part as its own tensor, loaded with `shard_id` = the part's index. Each rank's weight is
    the concatenation of its shard of every part.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        ctx: ParallelContext,
        skinny: bool = False,
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, ctx, skinny)
        self.part_sizes = [_divide(s, ctx.tp_size, "output features") for s in output_sizes]
        for param in self.parameters(recurse=False):
            param.num_parts = len(output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        idx = int(shard_id)
        size = self.part_sizes[idx]
        offset = sum(self.part_sizes[:idx])
        if loaded.shape[0] != self.output_sizes[idx]:
            raise CheckpointError(
                f"shape mismatch: part {idx} has {loaded.shape[0]} rows, "
                f"expected {self.output_sizes[idx]}"
            )
        shard = loaded.narrow(0, self.ctx.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, shard)
        dst.copy_(shard)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split across TP ranks; partial sums all-reduced.
    `skinny`, `gemv`: as `ColumnParallelLinear`'s."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ctx: ParallelContext,
        skinny: bool = False,
    ):
        super().__init__()
        self.ctx = ctx
        self.skinny = skinny
        self.gemv = False
        self.tickets: Tickets | None = None  # as ColumnParallelLinear's
        self.in_per_rank = _divide(in_features, ctx.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[1]
        shard = loaded.narrow(1, self.ctx.tp_rank * n, n) if self.ctx.tp_size > 1 else loaded
        _check_shape(param, shard)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce` False: this rank's partial sum, for a caller that reduces it itself (the
        fused all-reduce + norm, `ParallelContext.all_reduce_add_norm`; no bias then)."""
        if self.skinny and takes(x):
            y = skinny_linear(x, self.weight, tickets=self.tickets)
        elif self.gemv:
            y = gemv.linear(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        if not reduce:
            assert self.bias is None, "a partial sum takes its bias after the reduction"
            return y
        y = self.ctx.all_reduce(y)
        # Bias once, after the reduction, so it is not counted tp_size times.
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across TP ranks."""

    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.per_rank = -(-vocab_size // ctx.tp_size)
        self.start = ctx.tp_rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded[self.start : self.end]
        if param.shape[1] != loaded.shape[1]:
            _check_shape(param, loaded)
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mask, self.weight) * mask.unsqueeze(-1)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocab logits; each rank computes its vocab slice, then gathers."""

    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext):
        super().__init__(vocab_size, hidden, ctx)
        self.vocab_size = vocab_size
        self.gemv = False  # as ColumnParallelLinear's

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        y = gemv.linear(h, self.weight) if self.gemv else F.linear(h, self.weight)
        logits = self.ctx.all_gather_last_dim(y)
        return logits[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one fused kernel
        on CUDA (`kernels/norm_rope.py`; the same ops as PyTorch on CPU)."""
        return rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        inv_freq = 1.0 / (
            rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if rope.scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, rope.scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D]; one fused kernel on CUDA
        return rotary(q, k, self.cos, self.sin, positions)
