"""Low-rank adapters in each target Linear's SVD basis, applied per request in the step batch.

An adapter changes a target Linear `W` (`[out, in]`, `y = x Wᵀ`) to
`W + U·diag(δ)·Vᵀ`, where `U [out, r]` and `V [in, r]` are W's top-r singular vectors
(frozen, computed from W itself, so trainer and engine agree without ever sending them) and
`δ [r]` is what training learns. A GRPO policy has a kept part δS and a quarantine part: its
"trained" variant uses both, its "deploy" variant `δS` alone (quarantine ablated). The
quarantine is an SVD-basis vector δS_q (trained: `δS + δS_q`), a LoRA `B_q A_q`
(`A_q [k, in]`, `B_q [out, k]`; trained: `W + U·diag(δS)·Vᵀ + B_q A_q`), or both (they add).

`AdapterBank` holds, per target module, the basis and a table of δ rows — row 0 is zero
(no adapter), then two rows (trained, deploy) per loaded adapter — and each step tells every
adapted Linear which row each token uses. So requests with different adapters, the ablated
variant, or none share one batch, at the cost of one `[T, in]·[in, r]` and one
`[T, r]·[r, out]` matmul per target module. LoRA quarantines live side by side in one
`[capacity·k_max, in]` / `[out, capacity·k_max]` pair per module (slot s in columns
`[s·k_max, (s+1)·k_max)`, zero-padded; `k_max` is the largest LoRA rank loaded so far, and the
buffers only grow): a step with a token on a LoRA adapter's trained row adds
`(where(mask, x A_allᵀ, 0)) B_allᵀ`, the `[T, capacity·k_max]` mask built once per step from
the token rows, and a step without one does no LoRA work at all. Weight sync sends only the
δ vectors (and a LoRA's two factors); loading a new version changes the requests' cache salt,
so prefix-cache blocks computed under the old weights are never reused.
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import InvalidRequestError, NotFoundError

Variant = Literal["trained", "deploy"]
VARIANTS: tuple[Variant, ...] = ("trained", "deploy")
DEFAULT_TARGETS = ("*.o_proj", "*.down_proj")
STATE_PARTS = ("kept", "quarantine", "lora_a", "lora_b")

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
    lora_rank: int = 0  # its LoRA quarantine's rank k (0: none)

    @property
    def slot(self) -> int:
        """Its block of columns in the modules' LoRA buffers."""
        return (self.rows["trained"] - 1) // 2


class AdaptedLinear(nn.Module):
    """A target Linear plus the bank's per-token low-rank term (nothing when no token of
    the step uses an adapter) and LoRA term (nothing when no token uses a LoRA quarantine)."""

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
        out_f, in_f = base.weight.shape
        # LoRA factors of every slot, k_max columns each (empty until a LoRA is loaded)
        self.register_buffer(
            "lora_a_all", torch.zeros(0, in_f, dtype=dtype, device=device), persistent=False
        )  # [capacity * k_max, in]
        self.register_buffer(
            "lora_b_all", torch.zeros(out_f, 0, dtype=dtype, device=device), persistent=False
        )  # [out, capacity * k_max]

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.bank.step_rows
        if rows is None:
            return y
        d = self.deltas.index_select(0, rows)  # [T, r]
        y = y + ((x @ self.V) * d) @ self.U.T
        mask = self.bank.step_lora_mask  # [T, capacity * k_max] bool
        if mask is not None:
            # `where`, not a product: a token off the LoRA rows gets an exact 0 even if
            # another slot's x A_allᵀ overflowed
            z = torch.where(mask, F.linear(x, self.lora_a_all), 0.0)
            y = y + F.linear(z, self.lora_b_all)
        return y

    def grow_lora(self, capacity: int, old: int, new: int) -> None:
        """Re-lay the LoRA buffers from `old` to `new` columns per slot (zero-padded)."""
        (out_f, _), in_f = self.lora_b_all.shape, self.lora_a_all.shape[1]
        a = self.lora_a_all.new_zeros(capacity, new, in_f)
        a[:, :old] = self.lora_a_all.view(capacity, old, in_f)
        b = self.lora_b_all.new_zeros(out_f, capacity, new)
        b[:, :, :old] = self.lora_b_all.view(out_f, capacity, old)
        self.lora_a_all = a.view(capacity * new, in_f)
        self.lora_b_all = b.view(out_f, capacity * new)

    def set_lora(self, slot: int, k_max: int, ab: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write one slot's LoRA factors (`A [k, in]`, `B [out, k]`), or zero it (None)."""
        block = slice(slot * k_max, (slot + 1) * k_max)
        self.lora_a_all[block].zero_()
        self.lora_b_all[:, block].zero_()
        if ab is not None:
            a, b = ab
            k = a.shape[0]
            self.lora_a_all[slot * k_max : slot * k_max + k] = a
            self.lora_b_all[:, slot * k_max : slot * k_max + k] = b


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
        self.device = torch.device("cpu")  # the adapted Linears' (set by attach)
        self.lora_rank = 0  # k_max: columns per slot in the modules' LoRA buffers
        # Per LoRA-buffer column, the trained row it serves (-1: none).
        self._lora_owner = torch.zeros(0, dtype=torch.long)  # [capacity * k_max]
        self.step_rows: torch.Tensor | None = None  # [T] int64, set for the step's forward
        self.step_lora_mask: torch.Tensor | None = None  # [T, capacity * k_max] bool
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
            self.device = wrapped.U.device
        self._lora_owner = self._lora_owner.to(self.device)

    def plan_step(self, runs: list[tuple[int, int]]) -> None:
        """Set the step's token rows from `(row, num_tokens)` per scheduled sequence, in batch
        order, and the LoRA mask when a token is on a LoRA adapter's trained row. A step no
        adapter request runs in gets no per-token rows at all."""
        self.end_step()
        used = {row for row, _ in runs}
        if not any(used):
            return
        rows = torch.tensor([row for row, _ in runs], dtype=torch.long)
        counts = torch.tensor([n for _, n in runs], dtype=torch.long)
        self.step_rows = rows.repeat_interleave(counts).to(self.device, non_blocking=True)
        if any(e.lora_rank and e.rows["trained"] in used for e in self.loaded.values()):
            self.step_lora_mask = self.step_rows[:, None] == self._lora_owner[None, :]

    def end_step(self) -> None:
        self.step_rows = self.step_lora_mask = None

    def load(self, name: str, state: dict[str, dict[str, torch.Tensor]]) -> LoadedAdapter:
        """Install (or replace) adapter `name` from `{module: {"kept": δS, "quarantine": δS_q,
        "lora_a": A_q, "lora_b": B_q}}` (quarantine optional; the LoRA, `A_q [k, in]` and
        `B_q [out, k]`, given for every module or none). Every target module must be given;
        returns the new version."""
        missing = sorted(set(self.modules) - set(state))
        unknown = sorted(set(state) - set(self.modules))
        if missing or unknown:
            raise InvalidRequestError(
                f"adapter {name!r}: state must cover exactly the target modules; "
                f"missing {missing[:3]}, unknown {unknown[:3]}"
            )
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
        if loras and len(loras) != len(state):
            raise InvalidRequestError(
                f"adapter {name!r}: a LoRA quarantine must be given for every target module "
                f"or none; {len(loras)} of {len(state)} have one"
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
            for m in self.modules.values():
                m.grow_lora(self.capacity, self.lora_rank, entry.lora_rank)
            self.lora_rank = entry.lora_rank
        for module, by_variant in deltas.items():
            target = self.modules[module]
            for variant, row in entry.rows.items():
                target.deltas[row] = by_variant[variant].to(target.deltas.dtype)
            target.set_lora(entry.slot, self.lora_rank, loras.get(module))
        self._versions += 1
        entry.version = self._versions
        self.loaded[name] = entry
        self._update_lora_owner()
        return entry

    def _lora_factors(
        self, name: str, module: str, parts: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One module's validated `(A [k, in], B [out, k])` in the module's dtype."""
        target = self.modules[module]
        out_f, in_f = target.lora_b_all.shape[0], target.lora_a_all.shape[1]
        if "lora_a" not in parts or "lora_b" not in parts:
            raise InvalidRequestError(f"adapter {name!r}: {module} needs both lora_a and lora_b")
        dtype = target.lora_a_all.dtype
        a = torch.as_tensor(parts["lora_a"]).detach().to(target.lora_a_all.device, dtype)
        b = torch.as_tensor(parts["lora_b"]).detach().to(target.lora_b_all.device, dtype)
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

    def _update_lora_owner(self) -> None:
        owner = torch.full((self.capacity, self.lora_rank), -1, dtype=torch.long)
        for e in self.loaded.values():
            owner[e.slot, : e.lora_rank] = e.rows["trained"]
        self._lora_owner = owner.flatten().to(self.device)

    def unload(self, name: str) -> None:
        entry = self.loaded.pop(name, None)
        if entry is None:
            raise NotFoundError(f"no adapter named {name!r} is loaded")
        for m in self.modules.values():
            for row in entry.rows.values():
                m.deltas[row].zero_()
            m.set_lora(entry.slot, self.lora_rank, None)
        self._update_lora_owner()

    def row(self, name: str, variant: Variant) -> tuple[int, int]:
        """(table row, version) of an adapter's variant; InvalidRequestError if not loaded."""
        entry = self.loaded.get(name)
        if entry is None:
            known = ", ".join(sorted(self.loaded)) or "(none)"
            raise InvalidRequestError(f"unknown adapter {name!r}; loaded: {known}")
        if variant not in VARIANTS:
            raise InvalidRequestError(f"adapter variant must be one of {VARIANTS}")
        return entry.rows[variant], entry.version
