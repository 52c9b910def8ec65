"""Low-rank adapters in each target Linear's SVD basis, applied per request in the step batch.

An adapter changes a target Linear `W` (`[out, in]`, `y = x Wᵀ`) to
`W + U·diag(δ)·Vᵀ`, where `U [out, r]` and `V [in, r]` are W's top-r singular vectors
(frozen, computed from W itself, so trainer and engine agree without ever sending them) and
`δ [r]` is what training learns. A GRPO policy has a kept part δS and a quarantine part
δS_q: its "trained" variant uses `δS + δS_q`, its "deploy" variant `δS` alone (quarantine
ablated).

`AdapterBank` holds, per target module, the basis and a table of δ rows — row 0 is zero
(no adapter), then two rows (trained, deploy) per loaded adapter — and each step tells every
adapted Linear which row each token uses. So requests with different adapters, the ablated
variant, or none share one batch, at the cost of one `[T, in]·[in, r]` and one
`[T, r]·[r, out]` matmul per target module. Weight sync sends only the δ vectors; loading a
new version changes the requests' cache salt, so prefix-cache blocks computed under the old
weights are never reused.
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from services.common.errors import InvalidRequestError, NotFoundError

Variant = Literal["trained", "deploy"]
VARIANTS: tuple[Variant, ...] = ("trained", "deploy")
DEFAULT_TARGETS = ("*.o_proj", "*.down_proj")

_basis_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_basis_lock = threading.Lock()


def svd_basis(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(U [out, r], S [r], V [in, r])`: W's top-`rank` singular triplets, float64 on CPU.

    Deterministic given W's bytes (float64 SVD on CPU; each pair's sign fixed so U's
    largest-magnitude entry is positive), and cached by a hash of them, so a trainer and an
    engine holding the same weights get bit-identical bases.
    """
    w = weight.detach().to("cpu")
    if not 1 <= rank <= min(w.shape):
        raise InvalidRequestError(f"adapter rank must be in [1, {min(w.shape)}], got {rank}")
    key = (hashlib.sha256(w.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(), rank)
    with _basis_lock:
        hit = _basis_cache.get(key)
    if hit is not None:
        return hit
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    u, s, v = u[:, :rank], s[:rank], vh[:rank].T
    flip = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True))).squeeze(0)
    flip[flip == 0] = 1.0
    basis = ((u * flip).contiguous(), s.contiguous(), (v * flip).contiguous())
    with _basis_lock:
        _basis_cache[key] = basis
    return basis


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


@dataclass
class LoadedAdapter:
    name: str
    version: int
    rows: dict[Variant, int]  # variant -> row in every module's δ table


class AdaptedLinear(nn.Module):
    """A target Linear plus the bank's per-token low-rank term (nothing when no token of
    the step uses an adapter)."""

    def __init__(self, base: nn.Module, bank: AdapterBank, name: str, rank: int):
        super().__init__()
        self.base, self.bank, self.name = base, bank, name
        u, _, v = svd_basis(base.weight, rank)
        dtype, device = base.weight.dtype, base.weight.device
        self.register_buffer("U", u.to(device, dtype), persistent=False)  # [out, r]
        self.register_buffer("V", v.to(device, dtype), persistent=False)  # [in, r]
        # [rows, r]: row 0 zero, then (trained, deploy) per loaded adapter
        self.register_buffer(
            "deltas", torch.zeros(1 + 2 * bank.capacity, rank, dtype=dtype, device=device),
            persistent=False,
        )  # fmt: skip

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.bank.step_rows
        if rows is None:
            return y
        d = self.deltas.index_select(0, rows)  # [T, r]
        return y + ((x @ self.V) * d) @ self.U.T


class AdapterBank:
    """The adapters an engine (or a model) serves, and which row each token of a step uses."""

    def __init__(
        self, capacity: int = 4, rank: int = 8, targets: tuple[str, ...] = DEFAULT_TARGETS
    ):
        if capacity < 1:
            raise InvalidRequestError("an adapter bank needs a capacity of at least 1")
        self.capacity, self.rank, self.targets = capacity, rank, tuple(targets)
        self.modules: dict[str, AdaptedLinear] = {}
        self.loaded: dict[str, LoadedAdapter] = {}
        self.step_rows: torch.Tensor | None = None  # [T] int64, set for the step's forward
        self._versions = 0

    def attach(self, model: nn.Module) -> None:
        """Wrap the model's target Linears (after its weights are loaded)."""
        for name, module in target_modules(model, self.targets).items():
            if getattr(getattr(module, "ctx", None), "tp_size", 1) > 1:
                raise InvalidRequestError(
                    "adapters need the full weight of each target Linear: tp_size must be 1"
                )
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            wrapped = AdaptedLinear(module, self, name, self.rank)
            setattr(parent, leaf, wrapped)
            self.modules[name] = wrapped

    def load(self, name: str, state: dict[str, dict[str, torch.Tensor]]) -> LoadedAdapter:
        """Install (or replace) adapter `name` from `{module: {"kept": δS, "quarantine": δS_q}}`
        (quarantine optional). Every target module must be given; returns the new version."""
        missing = sorted(set(self.modules) - set(state))
        unknown = sorted(set(state) - set(self.modules))
        if missing or unknown:
            raise InvalidRequestError(
                f"adapter {name!r}: state must cover exactly the target modules; "
                f"missing {missing[:3]}, unknown {unknown[:3]}"
            )
        deltas = {}
        for module, parts in state.items():
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
        entry = self.loaded.get(name)
        if entry is None:
            used = {r for a in self.loaded.values() for r in a.rows.values()}
            free = [i for i in range(1, 1 + 2 * self.capacity, 2) if i not in used]
            if not free:
                raise InvalidRequestError(
                    f"the adapter bank is full ({self.capacity} adapters): unload one first"
                )
            entry = LoadedAdapter(name, 0, {"trained": free[0], "deploy": free[0] + 1})
        for module, by_variant in deltas.items():
            table = self.modules[module].deltas
            for variant, row in entry.rows.items():
                table[row] = by_variant[variant].to(table.dtype)
        self._versions += 1
        entry.version = self._versions
        self.loaded[name] = entry
        return entry

    def unload(self, name: str) -> None:
        entry = self.loaded.pop(name, None)
        if entry is None:
            raise NotFoundError(f"no adapter named {name!r} is loaded")
        for m in self.modules.values():
            for row in entry.rows.values():
                m.deltas[row].zero_()

    def row(self, name: str, variant: Variant) -> tuple[int, int]:
        """(table row, version) of an adapter's variant; InvalidRequestError if not loaded."""
        entry = self.loaded.get(name)
        if entry is None:
            known = ", ".join(sorted(self.loaded)) or "(none)"
            raise InvalidRequestError(f"unknown adapter {name!r}; loaded: {known}")
        if variant not in VARIANTS:
            raise InvalidRequestError(f"adapter variant must be one of {VARIANTS}")
        return entry.rows[variant], entry.version
