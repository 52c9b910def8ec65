"""Low-rank adapters in each target Linear's SVD basis: `W + U·diag(δS + δS_q)·Vᵀ`.

For a target weight `W [out, in]` with top-r singular triplets `U [out, r]`, `S [r]`,
`V [in, r]` (frozen), the adapter learns two r-vectors: `δS` (kept) and `δS_q` (quarantine,
ablated at deploy). The add is done in the factored form

    y = x Wᵀ + ((x V) ⊙ δS + (x V) ⊙ δS_q) Uᵀ

so no dense `δW` is ever built, and a forward with both vectors at zero adds an exact `+0.0`:
logits are bit-identical to the base model. Instead of `δS_q` the quarantine can be a separate
LoRA (`B_q A_q`, `B_q` zero-initialised) for comparison.

The basis is computed once per weight in float64 on the weight's device (`svd_basis`): every
process, trainer or engine, holding W on the same kind of device gets the same basis, signs
included; across kinds the bases agree to float64 rounding, far below the serving dtype's. It
is cached by a hash of W's bytes.

Per-forward controls live on the `AdapterSet` and act on every adapted Linear at once:
`gates()` splices the rollout gate of the gate identity into the kept path, `mask_rollouts()`
and `mask_tokens()` detach the kept path on flagged rollouts or tokens (Arm B; with
`absorb`, route2, whose LoRA quarantine learns from every token), `capture()` records
adapter-space activations `x V`, `deploy()` ablates the quarantine and `disabled()` gives
the base model (the KL reference) without a copy.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from services.common.errors import InvalidRequestError
from services.engine.adapters import svd_basis
from services.engine.model.layers import ColumnParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)

QuarantineKind = Literal["svd", "lora"]
GateKind = Literal["scale", "shift"]
MaskMode = Literal["route", "erase", "absorb"]
MaskStop = Literal["parameter", "activation"]

KEPT = "delta_s"
QUARANTINE = "delta_s_q"
LORA_A = "lora_a_q"
LORA_B = "lora_b_q"


@dataclass(frozen=True)
class AdapterConfig:
    """Which Linears get adapters and how the adapters start.

    `targets` are fnmatch patterns over module names (`layers.0.self_attn.o_proj`; fused
    projections are `qkv_proj` and `gate_up_proj`). `kept_init`/`quarantine_init` fill δS/δS_q
    at start (both 0: bit-identical to the base; a nonzero `kept_init` gives the `scale` gate
    something to divide by). With `quarantine="lora"`, `quarantine_init` is the std of `B_q`'s
    start (0: zero-init) and `A_q` starts Kaiming-uniform from `seed`.
    """

    targets: tuple[str, ...] = ("*.o_proj", "*.down_proj")
    rank: int = 8
    quarantine: QuarantineKind = "svd"
    lora_rank: int = 4
    kept_init: float = 0.0
    quarantine_init: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.targets:
            raise InvalidRequestError("adapter targets must name at least one pattern")
        if self.rank < 1 or self.lora_rank < 1:
            raise InvalidRequestError("adapter rank and lora_rank must be >= 1")
        if self.quarantine not in ("svd", "lora"):
            raise InvalidRequestError(
                f"quarantine must be 'svd' or 'lora', got {self.quarantine!r}"
            )


@dataclass(frozen=True)
class SVDBasis:
    """Top-r singular triplets of one weight, float64 on the CPU: `W ≈ U diag(S) Vᵀ`."""

    u: torch.Tensor  # [out, r]
    s: torch.Tensor  # [r]
    v: torch.Tensor  # [in, r]
    weight_hash: str


def weight_hash(weight: torch.Tensor) -> str:
    """sha256 over a weight's dtype, shape and raw bytes (device-independent)."""
    w = weight.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{w.dtype}:{tuple(w.shape)}:".encode())
    h.update(w.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SVDBasisCache:
    """SVD bases keyed by (weight hash, rank), in memory and optionally on disk.

    The disk copy (`<dir>/<hash>-r<rank>.safetensors`) lets the trainer and every engine
    replica share one computation and, more importantly, one basis.
    """

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[tuple[str, int], SVDBasis] = {}

    def get(self, weight: torch.Tensor, rank: int) -> SVDBasis:
        out_f, in_f = weight.shape
        if rank > min(out_f, in_f):
            raise InvalidRequestError(
                f"adapter rank {rank} exceeds min(out, in) = {min(out_f, in_f)} of a "
                f"{out_f}x{in_f} weight"
            )
        key = (weight_hash(weight), rank)
        if key in self._memory:
            return self._memory[key]
        path = self.directory / f"{key[0]}-r{rank}.safetensors" if self.directory else None
        if path is not None and path.is_file():
            t = load_file(str(path))
            basis = SVDBasis(t["u"], t["s"], t["v"], key[0])
        else:
            # The engine's function: trainer and engine replicas get bit-identical bases.
            u, s, v = svd_basis(weight, rank)
            basis = SVDBasis(u, s, v, key[0])
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                save_file({"u": basis.u, "s": basis.s, "v": basis.v}, str(tmp))
                tmp.replace(path)  # atomic: a concurrent reader never sees half a file
        self._memory[key] = basis
        return basis


def _check_mask_mode(mode: str) -> None:
    if mode not in ("route", "erase", "absorb"):
        raise InvalidRequestError(f"mask mode must be 'route', 'erase' or 'absorb', got {mode!r}")


@dataclass
class _ForwardControls:
    """Per-forward switches shared by every adapter of one `AdapterSet` (set via its
    context managers, never directly)."""

    disabled: bool = False
    ablate_quarantine: bool = False
    gate_kind: GateKind = "scale"
    gates: dict[str, torch.Tensor] | None = None  # module -> [B, 1, r]
    rollout_mask: torch.Tensor | None = None  # [B] or [B, T] bool: flagged rollouts or tokens
    mask_mode: MaskMode = "route"
    mask_stop: MaskStop = "parameter"
    captured: dict[str, torch.Tensor] | None = None  # module -> [N, r] x V, detached
    # Per-token Arm B: module -> unit [r] direction; a token whose x V has cosine > tau
    # with it is flagged at that module. `token_flags` records each module's [B, T] flags.
    token_directions: dict[str, torch.Tensor] | None = None
    token_tau: float = 0.0
    token_batch: int = 0
    token_flags: dict[str, torch.Tensor] | None = None


def lora_rank_for(weight: torch.Tensor, rank: int) -> int:
    """The LoRA quarantine's rank on `weight`: `rank`, capped at min(out, in), the most a
    product B·A of that shape can have."""
    return min(rank, *weight.shape)


class SVDAdaptedLinear(nn.Module):
    """A frozen engine Linear plus its kept and quarantine adapters (see module docstring)."""

    def __init__(
        self,
        name: str,
        base: nn.Module,
        basis: SVDBasis,
        config: AdapterConfig,
        controls: _ForwardControls,
    ):
        super().__init__()
        self.name = name
        self.base = base
        self.weight_hash = basis.weight_hash
        w = base.weight
        dd = {"device": w.device, "dtype": w.dtype}
        r = basis.s.numel()
        self.register_buffer("u", basis.u.to(**dd), persistent=False)  # [out, r]
        self.register_buffer("v_t", basis.v.T.contiguous().to(**dd), persistent=False)  # [r, in]
        self.register_buffer("s", basis.s.to(**dd), persistent=False)  # [r]
        self.delta_s = nn.Parameter(torch.full((r,), config.kept_init, **dd))
        self.quarantine = config.quarantine
        if config.quarantine == "svd":
            self.delta_s_q = nn.Parameter(torch.full((r,), config.quarantine_init, **dd))
            self.lora_a_q = self.lora_b_q = None
        else:
            self.delta_s_q = None
            g = torch.Generator().manual_seed(config.seed + int(basis.weight_hash[:8], 16))
            # A LoRA wider than the weight's smaller side adds nothing B·A could express (and
            # an engine refuses it): capped there (`attach_adapters` says so once).
            lr = lora_rank_for(w, config.lora_rank)
            a = torch.empty(lr, w.shape[1], dtype=torch.float64)
            bound = (3.0 / w.shape[1]) ** 0.5  # Kaiming-uniform (a=sqrt(5)) as in PEFT's LoRA
            a.uniform_(-bound, bound, generator=g)
            b = torch.randn(w.shape[0], lr, dtype=torch.float64, generator=g)
            self.lora_a_q = nn.Parameter(a.to(**dd))  # [lr, in]
            self.lora_b_q = nn.Parameter((b * config.quarantine_init).to(**dd))  # [out, lr]
        self._controls = controls

    @property
    def rank(self) -> int:
        return self.delta_s.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        y = self.base(x)
        c = self._controls
        if c.disabled:
            return y
        z = F.linear(x, self.v_t)  # [N, r] adapter-space activations x V
        if c.captured is not None:
            c.captured[self.name] = z.detach()
        gate = c.gates.get(self.name) if c.gates is not None else None
        mask = c.rollout_mask  # [B] (a rollout's every token) or, below, [B, T]
        if c.token_directions is not None:
            v = c.token_directions[self.name].to(z)
            mask = (F.cosine_similarity(z.detach(), v[None], dim=-1) > c.token_tau).view(
                c.token_batch, -1
            )
            if c.token_flags is not None:
                c.token_flags[self.name] = mask
        rollouts = gate.shape[0] if gate is not None else mask.shape[0] if mask is not None else 0
        zb = z.view(rollouts, -1, self.rank) if rollouts else z  # [B, T, r] or [N, r]
        flagged = mask.view(rollouts, -1, 1) if mask is not None else None  # [B, 1|T, 1]
        by_param = c.mask_stop == "parameter"
        kept_s = self.delta_s
        if flagged is not None and by_param:
            kept_s = torch.where(flagged, kept_s.detach(), kept_s)  # [B, 1, r]
        if gate is None:
            kept = zb * kept_s
        elif c.gate_kind == "scale":  # c = 1:  c.grad[b] = δS ⊙ g_b
            kept = zb * gate * kept_s
        else:  # "shift", c = 0:  c.grad[b] = g_b exactly
            kept = zb * (kept_s + gate)
        if flagged is not None and not by_param:
            kept = torch.where(flagged, kept.detach(), kept)
        coef = kept
        if self.delta_s_q is not None and not c.ablate_quarantine:
            quar_s = self.delta_s_q
            if flagged is not None and by_param:
                quar_s = self._quarantine_view(quar_s, flagged, c.mask_mode)
            quar = zb * quar_s
            if flagged is not None and not by_param:
                quar = self._quarantine_view(quar, flagged, c.mask_mode)
            coef = kept + quar
        y = y + F.linear(coef.reshape(z.shape), self.u)
        if self.lora_a_q is not None and not c.ablate_quarantine:
            lora = F.linear(F.linear(x, self.lora_a_q), self.lora_b_q)
            if flagged is not None:
                lora = lora.view(rollouts, -1, lora.shape[-1])
                if by_param:  # the same values with the LoRA's parameters cut off the graph
                    frozen = F.linear(F.linear(x, self.lora_a_q.detach()), self.lora_b_q.detach())
                    lora = self._quarantine_view(lora, flagged, c.mask_mode, frozen.view_as(lora))
                else:
                    lora = self._quarantine_view(lora, flagged, c.mask_mode)
                lora = lora.reshape(-1, lora.shape[-1])
            y = y + lora
        return y

    @staticmethod
    def _quarantine_view(
        t: torch.Tensor, flagged: torch.Tensor, mode: MaskMode, frozen: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The quarantine side of a mask: only flagged rollouts train it (route), none
        (erase), or every one (absorb: route2's quarantine, always in the forward)."""
        if mode == "absorb":
            return t
        frozen = t.detach() if frozen is None else frozen
        return torch.where(flagged, t, frozen) if mode == "route" else frozen


@dataclass(frozen=True)
class AdapterNorms:
    """Frobenius norms of the weight updates over every adapted Linear (squares summed over
    modules): the kept part, the quarantine, and their sum as the trained forward adds it.
    A routed run whose parts grow apart while their sum does not is drifting."""

    kept: float  # ‖δS‖: ‖U diag(δS) Vᵀ‖, U and V orthonormal
    quarantine: float  # ‖δS_q‖, or a LoRA's ‖B_q A_q‖
    total: float  # ‖δS + δS_q‖, or ‖U diag(δS) Vᵀ + B_q A_q‖


def _product_norm_sq(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """‖left · rightᵀ‖_F² from the factors (`[out, k]`, `[in, k]`), without the `[out, in]`
    product: tr(R Lᵀ L Rᵀ) = Σ (LᵀL) ⊙ (RᵀR), two `[k, k]` Grams, in float64."""
    left, right = left.detach().double(), right.detach().double()
    return ((left.T @ left) * (right.T @ right)).sum().clamp(min=0)


@dataclass
class AdapterSet:
    """Every adapter attached to one model, with the per-forward controls they share."""

    modules: dict[str, SVDAdaptedLinear]
    config: AdapterConfig
    _controls: _ForwardControls = field(repr=False)

    # -- parameters and weight sync ---------------------------------------------------------

    def kept_parameters(self) -> list[nn.Parameter]:
        return [m.delta_s for m in self.modules.values()]

    def quarantine_parameters(self) -> list[nn.Parameter]:
        out: list[nn.Parameter] = []
        for m in self.modules.values():
            out += [p for p in (m.delta_s_q, m.lora_a_q, m.lora_b_q) if p is not None]
        return out

    @torch.no_grad()
    def norms(self) -> AdapterNorms:
        """The updates' sizes (`AdapterNorms`). A LoRA quarantine lies outside the kept
        basis, so its sum with the kept part is normed from the stacked factors
        `[U diag(δS), B_q] · [V, A_qᵀ]ᵀ`, never a dense `[out, in]` matrix."""
        mods = list(self.modules.values())
        kept = torch.cat([m.delta_s.reshape(-1) for m in mods])
        if self.config.quarantine == "svd":
            q = torch.cat([m.delta_s_q.reshape(-1) for m in mods])
            return AdapterNorms(float(kept.norm()), float(q.norm()), float((kept + q).norm()))
        quarantine = sum(_product_norm_sq(m.lora_b_q, m.lora_a_q.T) for m in mods)
        total = sum(
            _product_norm_sq(
                torch.cat([m.u * m.delta_s, m.lora_b_q], dim=1),  # [out, r + lr]
                torch.cat([m.v_t.T, m.lora_a_q.T], dim=1),  # [in, r + lr]
            )
            for m in mods
        )
        return AdapterNorms(float(kept.norm()), float(quarantine) ** 0.5, float(total) ** 0.5)

    def adapter_state(self, include_quarantine: bool = True) -> dict[str, torch.Tensor]:
        """The δ tensors (what weight sync sends to engines), `"<module>.<param>"` -> tensor,
        detached CPU copies. `include_quarantine=False` is the deployed adapter."""
        state: dict[str, torch.Tensor] = {}
        for name, m in self.modules.items():
            params = {KEPT: m.delta_s}
            if include_quarantine:
                params |= {QUARANTINE: m.delta_s_q, LORA_A: m.lora_a_q, LORA_B: m.lora_b_q}
            for leaf, p in params.items():
                if p is not None:
                    state[f"{name}.{leaf}"] = p.detach().to("cpu").clone()
        return state

    def load_adapter_state(
        self, state: Mapping[str, torch.Tensor], require_quarantine: bool = True
    ) -> None:
        """Copy δ tensors in. Every key must name one of our adapters with the right shape, and
        every kept δS must be present (plus the quarantine when `require_quarantine`)."""
        expected = {k: v.shape for k, v in self.adapter_state().items()}
        unknown = sorted(set(state) - set(expected))
        if unknown:
            raise InvalidRequestError(f"adapter state has unknown tensors, e.g. {unknown[:3]}")
        needed = {k for k in expected if require_quarantine or k.endswith("." + KEPT)}
        missing = sorted(needed - set(state))
        if missing:
            raise InvalidRequestError(f"adapter state is missing tensors, e.g. {missing[:3]}")
        for key, value in state.items():
            if tuple(value.shape) != tuple(expected[key]):
                raise InvalidRequestError(
                    f"adapter state {key}: shape {tuple(value.shape)}, expected "
                    f"{tuple(expected[key])}"
                )
        with torch.no_grad():
            for key, value in state.items():
                name, leaf = key.rsplit(".", 1)
                getattr(self.modules[name], leaf).copy_(value)

    # -- per-forward controls --------------------------------------------------------------

    @contextmanager
    def deploy(self) -> Iterator[None]:
        """Forward as deployed: the quarantine ablated (δS_q treated as 0, LoRA removed)."""
        with self._set(ablate_quarantine=True):
            yield

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Forward as the base model (no adapter at all): the KL reference, without a copy."""
        with self._set(disabled=True):
            yield

    @contextmanager
    def gates(self, rollouts: int, kind: GateKind = "scale") -> Iterator[dict[str, torch.Tensor]]:
        """Splice a per-rollout gate `c [rollouts, 1, r]` into every kept path (Arm A).

        `scale`: c = 1 multiplies the kept coefficients, so after backward
        `c.grad[b] = δS ⊙ g_b` (g_b: rollout b's gradient w.r.t. δS, summed over its tokens).
        `shift`: c = 0 is added to δS, so `c.grad[b] = g_b` directly, on every axis.
        Either leaves the forward values unchanged. The batch must be `[rollouts, T]`.
        """
        if kind not in ("scale", "shift"):
            raise InvalidRequestError(f"gate kind must be 'scale' or 'shift', got {kind!r}")
        fill = 1.0 if kind == "scale" else 0.0
        gates = {
            name: torch.full(
                (rollouts, 1, m.rank), fill, dtype=m.delta_s.dtype, device=m.delta_s.device
            ).requires_grad_()
            for name, m in self.modules.items()
        }
        with self._set(gates=gates, gate_kind=kind):
            yield gates

    @contextmanager
    def mask_rollouts(
        self, flagged: torch.Tensor, mode: MaskMode = "route", stop: MaskStop = "parameter"
    ) -> Iterator[None]:
        """Arm B: flagged rollouts (`[B]` bool) send no gradient into the kept δS; with `route`
        their gradient trains the quarantine, with `erase` it trains nothing. Unflagged
        rollouts train only the kept δS. With `absorb` (route2) the quarantine trains on
        every rollout, flagged or not. `[B, T]` flags mask tokens instead of rollouts (route2
        per token with flags given in advance). The batch must be `[B, T]`.

        `stop="parameter"` applies `where(mask, δ.detach(), δ)` to the adapter vectors: the
        gradient still flows through every path into earlier layers, so kept and quarantine
        gradients are an exact partition of the unmasked gradient (Arm A with these flags).
        `stop="activation"` is the classic `where(mask, kept.detach(), kept)` on the kept
        path's output, which also cuts that path out of the gradient reaching earlier layers.
        Values are the same either way; only gradients change.
        """
        _check_mask_mode(mode)
        if stop not in ("parameter", "activation"):
            raise InvalidRequestError(
                f"mask stop must be 'parameter' or 'activation', got {stop!r}"
            )
        if flagged.dim() not in (1, 2) or flagged.dtype != torch.bool:
            raise InvalidRequestError("flagged must be a [B] or [B, T] bool tensor")
        with self._set(rollout_mask=flagged, mask_mode=mode, mask_stop=stop):
            yield

    @contextmanager
    def mask_tokens(
        self,
        directions: dict[str, torch.Tensor],
        batch_size: int,
        tau: float = 0.0,
        mode: MaskMode = "route",
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Arm B per token, the spec's form: at each adapter, a token whose `x V` has cosine
        > `tau` with that module's direction gets `where(flag, kept.detach(), kept)` (its
        gradient reaches the quarantine, `route`, or nothing, `erase`); other tokens train
        only the kept δS (or, `absorb`, the quarantine as well). Yields each module's `[B, T]`
        flags as the forward fills them in. The batch must be `[batch_size, T]`."""
        _check_mask_mode(mode)
        missing = set(self.modules) - set(directions)
        if missing:
            raise InvalidRequestError(f"no per-token direction for {sorted(missing)}")
        flags: dict[str, torch.Tensor] = {}
        with self._set(
            token_directions=directions,
            token_tau=tau,
            token_batch=batch_size,
            token_flags=flags,
            mask_mode=mode,
            mask_stop="activation",
        ):
            yield flags

    @contextmanager
    def capture(self) -> Iterator[dict[str, torch.Tensor]]:
        """Record each adapter's `x V` (`[N, r]`, detached, N = B*T tokens) during forwards."""
        captured: dict[str, torch.Tensor] = {}
        with self._set(captured=captured):
            yield captured

    @contextmanager
    def _set(self, **values) -> Iterator[None]:
        old = {k: getattr(self._controls, k) for k in values}
        for k, v in values.items():
            setattr(self._controls, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self._controls, k, v)


def attach_adapters(
    model: nn.Module, config: AdapterConfig, cache: SVDBasisCache | None = None
) -> AdapterSet:
    """Wrap every Linear of `model` matching `config.targets` in an `SVDAdaptedLinear`.

    Raises if a pattern matches nothing or matches something that is not a Linear: an adapter
    that silently attaches nowhere would train nothing.
    """
    cache = cache or SVDBasisCache()
    named = dict(model.named_modules())
    matched: dict[str, nn.Module] = {}
    for pattern in config.targets:
        hits = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise InvalidRequestError(f"adapter target {pattern!r} matches no module")
        for n in hits:
            mod = named[n]
            if isinstance(mod, SVDAdaptedLinear):
                raise InvalidRequestError(f"{n} already has an adapter")
            if not isinstance(mod, ColumnParallelLinear | RowParallelLinear):
                raise InvalidRequestError(
                    f"adapter target {pattern!r} matches {n} ({type(mod).__name__}), "
                    "which is not a Linear"
                )
            if mod.ctx.tp_size != 1:
                raise InvalidRequestError("adapters need unsharded Linears (tp_size 1)")
            matched[n] = mod
    if config.quarantine == "lora":
        capped = sorted(
            n
            for n, m in matched.items()
            if lora_rank_for(m.weight, config.lora_rank) < config.lora_rank
        )
        if capped:
            log.warning(
                "LoRA quarantine rank %d exceeds min(out, in) of %d module(s) (%s...): capped "
                "there, where a wider LoRA could express nothing more",
                config.lora_rank, len(capped), capped[0],
            )  # fmt: skip
    controls = _ForwardControls()
    modules: dict[str, SVDAdaptedLinear] = {}
    for n, mod in sorted(matched.items()):
        adapted = SVDAdaptedLinear(n, mod, cache.get(mod.weight, config.rank), config, controls)
        parent_name, _, leaf = n.rpartition(".")
        setattr(named[parent_name] if parent_name else model, leaf, adapted)
        modules[n] = adapted
    return AdapterSet(modules, config, controls)


def target_names(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Module names `attach_adapters` would wrap for `patterns` (for configs and engines)."""
    return sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        and any(fnmatch.fnmatchcase(n, p) for p in patterns)
    )
