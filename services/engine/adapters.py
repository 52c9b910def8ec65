"""Low-rank adapters in each target Linear's SVD basis, applied per request in the step batch.

An adapter changes a target Linear `W` (`[out, in]`, `y = x Wᵀ`) to
`W + U·diag(δ)·Vᵀ`, where `U [out, r]` and `V [in, r]` are W's top-r singular vectors
(frozen, computed from W itself, so trainer and engine agree without ever sending them) and
`δ [r]` is what training learns. A GRPO policy has a kept part δS and a quarantine part: its
"trained" variant uses both, its "deploy" variant `δS` alone (quarantine ablated). The
quarantine is an SVD-basis vector δS_q (trained: `δS + δS_q`), a LoRA `B_q A_q`
(`A_q [k, in]`, `B_q [out, k]`; trained: `W + U·diag(δS)·Vᵀ + B_q A_q`), or both (they add).

`AdapterBank` holds, per target module, one set of shared directions and a coefficient
table. The directions are the basis (`V`, `U`: r columns) and every slot's LoRA factors side
by side (`A_sᵀ`, `B_s`: k_max columns per slot, zero-padded). The table's row 0 is zero (no
adapter), then two rows (trained, deploy) per loaded adapter: δ in the basis columns, and on a
LoRA adapter's trained row 1 in its own slot's columns. Each step gives every token its row,
and one batched op per target Linear (`kernels/lowrank.py`: shrink by the directions, scale
by the token's row, expand) adds every token's own term. So requests with different adapters,
the ablated variant, or none share one batch (and one CUDA graph), and a step where no token
uses an adapter runs no adapter op at all. Weight sync sends only the δ vectors (and a LoRA's
two factors); loading a new version changes the signature of the positions computed under it
from then on, so prefix-cache blocks computed under the old weights are never reused.

Under tensor parallelism the basis is still the full W's: each rank gathers W from its
group once, at attach, and keeps the part of `U`, `V` (and of a LoRA's factors) that meets
its shard. A column-parallel Linear (`qkv_proj`, `gate_up_proj`: output rows split) keeps
all of V and its rows of U; a row-parallel one (`o_proj`, `down_proj`: input columns split)
its rows of V and all of U, so each rank's shrink `x_r V_r` is a partial sum, expanded
before the Linear's all-reduce adds the partials up. Under pipeline parallelism a stage
holds its own layers' modules and takes the other stages' entries of an adapter's state as
theirs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import re
import threading
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from services.common.errors import InvalidRequestError, NotFoundError
from services.engine.kernels.lowrank import lowrank_expand
from services.engine.model.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

log = logging.getLogger(__name__)

Variant = Literal["trained", "deploy"]
VARIANTS: tuple[Variant, ...] = ("trained", "deploy")
DEFAULT_TARGETS = ("*.o_proj", "*.down_proj")
STATE_PARTS = ("kept", "quarantine", "lora_a", "lora_b")

_basis_cache: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_basis_lock = threading.Lock()


def svd_basis(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(U [out, r], S [r], V [in, r])`: W's top-`rank` singular triplets, float64 on CPU.

    Computed in float64 on W's device from the eigendecomposition of the smaller Gram
    matrix (`W Wᵀ` or `Wᵀ W`): the top directions of a Llama-3-8B `down_proj` take a
    fraction of a second on a GPU, where a full SVD on the CPU took minutes. Deterministic
    given W's bytes and the kind of device (each pair's sign fixed so U's largest-magnitude
    entry is positive), and cached by a hash of them, so a trainer and an engine holding
    the same weights on the same kind of device get bit-identical bases.
    """
    if not 1 <= rank <= min(weight.shape):
        raise InvalidRequestError(f"adapter rank must be in [1, {min(weight.shape)}], got {rank}")
    cpu = weight.detach().to("cpu").contiguous()
    digest = hashlib.sha256(cpu.view(torch.uint8).numpy().tobytes()).hexdigest()
    key = (digest, rank, weight.device.type)
    with _basis_lock:
        hit = _basis_cache.get(key)
    if hit is not None:
        return hit
    w = weight.detach().double()
    wide = w.shape[0] <= w.shape[1]
    gram = w @ w.T if wide else w.T @ w  # [min, min]
    values, vectors = torch.linalg.eigh(gram)  # ascending
    s = values[-rank:].flip(0).clamp(min=0).sqrt()
    top = vectors[:, -rank:].flip(1)
    other = (w.T @ top if wide else w @ top) / s.clamp(min=torch.finfo(s.dtype).tiny)
    u, v = (top, other) if wide else (other, top)
    flip = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True))).squeeze(0)
    flip[flip == 0] = 1.0
    basis = tuple(t.contiguous().cpu() for t in (u * flip, s, v * flip))
    with _basis_lock:
        _basis_cache[key] = basis
    return basis  # type: ignore[return-value]


def target_modules(model: nn.Module, patterns: tuple[str, ...] | list[str]) -> dict[str, nn.Module]:
    """The Linear-like modules (with a 2-D `weight`) whose names match any pattern."""
    found = {
        name: m
        for name, m in model.named_modules()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
    }
    if not found:
        raise InvalidRequestError(f"no Linear module matches the adapter targets {list(patterns)}")
    return found


LAYER = re.compile(r"^(layers\.)(\d+)(\..+)$")


def tp_layout(base: nn.Module, rank: int | None = None) -> tuple[str | None, torch.Tensor | None]:
    """How `base`'s weight is split across its TP group, seen from `rank` (default: this
    process's): `("column", rows)` (output rows split; `rows`: the rank's rows of the full
    W, in its shard's order), `("row", cols)` (input columns split) or `(None, None)`."""
    ctx = getattr(base, "ctx", None)
    if ctx is None or ctx.tp_size == 1:
        return None, None
    rank = ctx.tp_rank if rank is None else rank
    out_rows, in_cols = base.weight.shape
    if isinstance(base, RowParallelLinear):
        return "row", torch.arange(rank * in_cols, (rank + 1) * in_cols)
    if not isinstance(base, ColumnParallelLinear):
        raise InvalidRequestError(f"cannot adapt a split {type(base).__name__}")
    merged = isinstance(base, MergedColumnParallelLinear)  # its parts' shards, side by side
    sizes = base.part_sizes if merged else [out_rows]
    fulls = base.output_sizes if merged else [out_rows * ctx.tp_size]
    starts = [sum(fulls[:i]) + rank * n for i, n in enumerate(sizes)]
    return "column", torch.cat([torch.arange(a, a + n) for a, n in zip(starts, sizes, strict=True)])


def full_weight(base: nn.Module, split: str | None) -> torch.Tensor:
    """`base`'s whole weight, gathered from its TP group when it is split (`tp_layout`; a
    collective: every rank of the group calls it for the same modules in the same order)."""
    w = base.weight.data
    if split is None:
        return w
    ctx = base.ctx
    shards = [torch.empty_like(w) for _ in range(ctx.tp_size)]
    dist.all_gather(shards, w.contiguous(), group=ctx.tp_group)
    dim = 0 if split == "column" else 1
    shape = list(w.shape)
    shape[dim] *= ctx.tp_size
    full = w.new_empty(shape)
    for rank, shard in enumerate(shards):
        full.index_copy_(dim, tp_layout(base, rank)[1].to(w.device), shard)
    return full


@dataclass
class LoadedAdapter:
    name: str
    version: int
    rows: dict[Variant, int]  # variant -> row in every module's coefficient table
    lora_rank: int = 0  # its LoRA quarantine's rank k (0: none)

    @property
    def slot(self) -> int:
        """Its block of LoRA columns in every module's tables."""
        return (self.rows["trained"] - 1) // 2


class AdaptedLinear(nn.Module):
    """A target Linear plus the bank's per-token low-rank term (`kernels/lowrank.py`),
    which runs only in steps where some token uses an adapter.

    Columns of `basis_in [in, R]` / `basis_out [out, R]`: the SVD basis (`V`, `U`, r
    columns), then each slot's LoRA factors (`A_sᵀ`, `B_s`, k_max columns per slot,
    zero-padded). `coef [rows, R]` is each adapter row's coefficients: its δ in the SVD
    columns, and 1 in its own slot's LoRA columns on a LoRA adapter's trained row.

    `basis_in` is stored transposed under the weight, `weight_cat = [W; basis_inᵀ]`
    (`[out + R, in]`), and the base Linear's weight is a view of its first rows: a plain
    step runs the base GEMM unchanged, an adapted step one GEMM for both `x Wᵀ` and the
    shrink `x basis_in`."""

    def __init__(self, base: nn.Module, bank: AdapterBank, name: str, rank: int, lora_rank: int):
        super().__init__()
        self.base, self.bank, self.name = base, bank, name
        self.rank = rank
        # Under TP: which rows of U (column-split) or of V (row-split) meet this shard.
        self.split, self.index = tp_layout(base)
        full = full_weight(base, self.split)
        self.full_shape: tuple[int, int] = tuple(full.shape)  # [out, in] of the whole W
        u, _, v = svd_basis(full, rank)
        del full
        if self.split == "column":
            u = u[self.index]
        elif self.split == "row":
            v = v[self.index]
        weight = base.weight.data
        dtype, device = weight.dtype, weight.device
        self.out_features = weight.shape[0]
        cols = rank + bank.capacity * lora_rank
        self.weight_cat = torch.cat([weight, weight.new_zeros(cols, weight.shape[1])])
        self.weight_cat[self.out_features : self.out_features + rank] = v.T.to(device, dtype)
        base.weight.data = self.weight_cat[: self.out_features]
        self.basis_out = torch.zeros(self.out_features, cols, dtype=dtype, device=device)
        self.basis_out[:, :rank] = u.to(device, dtype)
        self.coef = torch.zeros(1 + 2 * bank.capacity, cols, dtype=dtype, device=device)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def basis_in(self) -> torch.Tensor:  # [in, R], a view
        return self.weight_cat[self.out_features :].T

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce` False (a row-split module only): this rank's partial sum, which the
        caller all-reduces (`RowParallelLinear.forward`'s)."""
        rows = self.bank.step_rows
        if rows is None:
            return self.base(x) if reduce else self.base(x, reduce=False)
        y = lowrank_expand(F.linear(x, self.weight_cat), self.basis_out, self.coef, rows)
        bias = getattr(self.base, "bias", None)
        if not reduce:  # the expand is linear in each rank's part: the sum comes later
            assert self.split == "row" and bias is None, "only a row-split sum waits"
            return y
        if self.split == "row":  # each rank's part of x Wᵀ and of the shrink: add them up
            y = self.base.ctx.all_reduce(y)
        return y + bias if bias is not None else y

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA's whole factors (`A [k, in]`, `B [out, k]`)."""
        if self.split == "column":
            return a, b[self.index.to(b.device)]
        if self.split == "row":
            return a[:, self.index.to(a.device)], b
        return a, b

    def lora_columns(self, slot: int, k_max: int) -> slice:
        """Slot `slot`'s block of LoRA columns."""
        start = self.rank + slot * k_max
        return slice(start, start + k_max)

    def relayout(self, old: int, new: int) -> None:
        """Re-lay the LoRA columns from `old` to `new` per slot (zero-padded), in new
        buffers: the base weight moves with `weight_cat`."""
        capacity, r, out_f = self.bank.capacity, self.rank, self.out_features

        def grown(t: torch.Tensor) -> torch.Tensor:  # [n, r + capacity * old] -> new cols
            n = t.shape[0]
            g = t.new_zeros(n, r + capacity * new)
            g[:, :r] = t[:, :r]
            g[:, r:].view(n, capacity, new)[:, :, :old] = t[:, r:].view(n, capacity, old)
            return g

        self.basis_out, self.coef = grown(self.basis_out), grown(self.coef)
        basis_in = grown(self.basis_in.contiguous()).T  # [R', in]
        self.weight_cat = torch.cat([self.weight_cat[:out_f], basis_in])
        self.base.weight.data = self.weight_cat[:out_f]

    def set_lora(self, slot: int, k_max: int, ab: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write one slot's LoRA factors (`A [k, in]`, `B [out, k]`), or zero it (None)."""
        block = self.lora_columns(slot, k_max)
        rows = slice(self.out_features + block.start, self.out_features + block.stop)
        self.weight_cat[rows] = 0
        self.basis_out[:, block] = 0
        if ab is not None:
            a, b = ab
            k = a.shape[0]
            self.weight_cat[rows.start : rows.start + k] = a
            self.basis_out[:, block.start : block.start + k] = b


class AdapterBank:
    """The adapters an engine (or a model) serves, and which row each token of a step uses.

    Its tables sit at fixed addresses while CUDA graphs replay them: loading and unloading
    write in place. Only a LoRA of a rank above every slot's reserved columns
    (`lora_rank`, from `EngineConfig.adapter_lora_rank`) re-lays them (the target weights
    too: they share a buffer with the shrink directions), which bumps `layout_version` so
    the runner re-captures its decode graphs."""

    def __init__(
        self,
        capacity: int = 4,
        rank: int = 8,
        targets: tuple[str, ...] = DEFAULT_TARGETS,
        lora_rank: int = 0,
    ):
        if capacity < 1:
            raise InvalidRequestError("an adapter bank needs a capacity of at least 1")
        if lora_rank < 0:
            raise InvalidRequestError(f"adapter_lora_rank must be >= 0, got {lora_rank}")
        self.capacity, self.rank, self.targets = capacity, rank, tuple(targets)
        self.modules: dict[str, AdaptedLinear] = {}  # this process's, wrapped
        # Every target module of the whole model (every pipeline stage's) -> its whole
        # `(out, in)`: what an adapter's state must name, and a LoRA's factors' shapes.
        self.shapes: dict[str, tuple[int, int]] = {}
        self.loaded: dict[str, LoadedAdapter] = {}
        self.lora_rank = lora_rank  # k_max: LoRA columns per slot in every module
        self.layout_version = 0  # bumped when the LoRA columns are re-laid (new buffers)
        # [T] int32 each token's coefficient row, set by the runner around an adapted
        # forward (a view of its step batch); None: no token of the step uses an adapter.
        self.step_rows: torch.Tensor | None = None
        self._versions = 0

    def attach(self, model: nn.Module) -> None:
        """Wrap the model's target Linears (after its weights are loaded; under TP every
        rank of the group attaches at once: each gathers the whole weights). On a pipeline
        stage, the same modules of the other stages' layers are known by name, so an
        adapter's state names every layer of the model."""
        found = target_modules(model, self.targets)
        num_layers = getattr(getattr(model, "cfg", None), "num_layers", None)
        for name, module in found.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            wrapped = AdaptedLinear(module, self, name, self.rank, self.lora_rank)
            setattr(parent, leaf, wrapped)
            self.modules[name] = wrapped
            layer = LAYER.match(name)
            for i in range(num_layers) if layer and num_layers else ():
                same = f"{layer[1]}{i}{layer[3]}"  # this module in another stage's layer
                if any(fnmatch.fnmatchcase(same, p) for p in self.targets):
                    self.shapes[same] = wrapped.full_shape
            self.shapes[name] = wrapped.full_shape

    def load(self, name: str, state: dict[str, dict[str, torch.Tensor]]) -> LoadedAdapter:
        """Install (or replace) adapter `name` from `{module: {"kept": δS, "quarantine": δS_q,
        "lora_a": A_q, "lora_b": B_q}}` (quarantine optional; the LoRA, `A_q [k, in]` and
        `B_q [out, k]`, given for every module or none). Every target module must be given;
        returns the new version."""
        missing = sorted(set(self.shapes) - set(state))
        unknown = sorted(set(state) - set(self.shapes))
        if missing or unknown:
            raise InvalidRequestError(
                f"adapter {name!r}: state must cover exactly the target modules; "
                f"missing {missing[:3]}, unknown {unknown[:3]}"
            )
        # Every entry is checked, this stage's or not, so every stage accepts or refuses alike.
        deltas, loras = {}, {}
        for module, parts in state.items():
            bad = sorted(set(parts) - set(STATE_PARTS))
            if bad or "kept" not in parts:
                raise InvalidRequestError(
                    f"adapter {name!r}: {module} takes {list(STATE_PARTS)} (kept required), "
                    f"got {sorted(parts)}"
                )
            kept = torch.as_tensor(parts["kept"], dtype=torch.float64).flatten()
            quarantine = torch.as_tensor(
                parts.get("quarantine", torch.zeros_like(kept)), dtype=torch.float64
            ).flatten()
            if kept.numel() != self.rank or quarantine.numel() != self.rank:
                raise InvalidRequestError(
                    f"adapter {name!r}: {module} needs δ vectors of rank {self.rank}"
                )
            if not (torch.isfinite(kept).all() and torch.isfinite(quarantine).all()):
                raise InvalidRequestError(f"adapter {name!r}: {module} has NaN/Inf values")
            deltas[module] = {"trained": kept + quarantine, "deploy": kept}
            if "lora_a" in parts or "lora_b" in parts:
                loras[module] = self._lora_factors(name, module, parts)
        with_lora = sum("lora_a" in p or "lora_b" in p for p in state.values())
        if with_lora and with_lora != len(state):
            raise InvalidRequestError(
                f"adapter {name!r}: a LoRA quarantine must be given for every target module "
                f"or none; {with_lora} of {len(state)} have one"
            )
        ranks = {a.shape[0] for a, _ in loras.values()}
        if len(ranks) > 1:
            raise InvalidRequestError(
                f"adapter {name!r}: its LoRA factors must have one rank, got {sorted(ranks)}"
            )
        entry = self.loaded.get(name)
        if entry is None:
            used = {r for a in self.loaded.values() for r in a.rows.values()}
            free = [i for i in range(1, 1 + 2 * self.capacity, 2) if i not in used]
            if not free:
                raise InvalidRequestError(
                    f"the adapter bank is full ({self.capacity} adapters): unload one first"
                )
            entry = LoadedAdapter(name, 0, {"trained": free[0], "deploy": free[0] + 1})
        entry.lora_rank = ranks.pop() if ranks else 0
        if entry.lora_rank > self.lora_rank:
            log.warning(
                "a LoRA of rank %d exceeds the %d columns per adapter slot reserved at start: "
                "re-laying the adapter tables (the decode CUDA graphs are re-captured; set "
                "EngineConfig.adapter_lora_rank=%d to reserve them)",
                entry.lora_rank, self.lora_rank, entry.lora_rank,
            )  # fmt: skip
            for m in self.modules.values():
                m.relayout(self.lora_rank, entry.lora_rank)
            self.lora_rank = entry.lora_rank
            self.layout_version += 1
        for module, by_variant in deltas.items():
            target = self.modules.get(module)
            if target is None:  # another pipeline stage's
                continue
            lora = target.lora_columns(entry.slot, self.lora_rank)
            for variant, row in entry.rows.items():
                target.coef[row] = 0
                target.coef[row, : self.rank] = by_variant[variant].to(target.coef.dtype)
            if entry.lora_rank:  # the LoRA term belongs to the trained variant only
                target.coef[entry.rows["trained"], lora.start : lora.start + entry.lora_rank] = 1
            ab = loras.get(module)
            target.set_lora(entry.slot, self.lora_rank, target.shard_lora(*ab) if ab else None)
        self._versions += 1
        entry.version = self._versions
        self.loaded[name] = entry
        return entry

    def _lora_factors(
        self, name: str, module: str, parts: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One module's validated whole `(A [k, in], B [out, k])`, in the serving dtype."""
        out_f, in_f = self.shapes[module]
        some = next(iter(self.modules.values()))
        if "lora_a" not in parts or "lora_b" not in parts:
            raise InvalidRequestError(f"adapter {name!r}: {module} needs both lora_a and lora_b")
        dtype, device = some.basis_in.dtype, some.basis_in.device
        a = torch.as_tensor(parts["lora_a"]).detach().to(device, dtype)
        b = torch.as_tensor(parts["lora_b"]).detach().to(device, dtype)
        k = a.shape[0] if a.dim() == 2 else 0
        if not (
            a.dim() == 2 and b.dim() == 2 and a.shape[1] == in_f and b.shape == (out_f, k)
            and 1 <= k <= min(out_f, in_f)
        ):  # fmt: skip
            raise InvalidRequestError(
                f"adapter {name!r}: {module} needs lora_a [k, {in_f}] and lora_b [{out_f}, k] "
                f"with 1 <= k <= {min(out_f, in_f)}, got {list(a.shape)} and {list(b.shape)}"
            )
        # checked in the serving dtype: a value that overflows it would be Inf there
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidRequestError(
                f"adapter {name!r}: {module} has NaN/Inf values in its LoRA (as {dtype})"
            )
        return a, b

    def unload(self, name: str) -> None:
        entry = self.loaded.pop(name, None)
        if entry is None:
            raise NotFoundError(f"no adapter named {name!r} is loaded")
        for m in self.modules.values():
            for row in entry.rows.values():
                m.coef[row] = 0
            m.set_lora(entry.slot, self.lora_rank, None)

    def row(self, name: str, variant: Variant) -> tuple[int, int]:
        """(table row, version) of an adapter's variant; InvalidRequestError if not loaded."""
        entry = self.loaded.get(name)
        if entry is None:
            known = ", ".join(sorted(self.loaded)) or "(none)"
            raise InvalidRequestError(f"unknown adapter {name!r}; loaded: {known}")
        if variant not in VARIANTS:
            raise InvalidRequestError(f"adapter variant must be one of {VARIANTS}")
        return entry.rows[variant], entry.version
