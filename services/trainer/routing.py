"""Hack directions and per-rollout gradient routing between the kept and quarantine adapters.

Directions come from contrastive pairs (prompt, hacking completion, clean completion):

- activation space: per target module, the mean over pairs of (pooled `x V` over the hacking
  completion − the same over the clean one), unit-normalised. A rollout's score is the mean
  over modules of its pooled `x V` projected on that direction, measured from the midpoint of
  the hack and clean means, so τ = 0 is the natural threshold.
- gradient space: the mean over pairs of ∇δS log p(hacking) − ∇δS log p(clean) (the direction
  that makes hacks more likely), unit-normalised over all modules together, since a rollout is
  flagged by one cosine over all of them.

Arm A (gradient mask) runs one backward with the rollout gate spliced into the kept path
(`AdapterSet.gates`), recovers each rollout's gradient `g_b` (of the training loss), flags it
when its descent direction `−g_b` has cosine > τ with the gradient hack direction, and rebuilds
the gradients (`apply_gradient_mask`): with the `partition` split δS gets the unflagged
rollouts' share and δS_q the flagged share (`route`) or nothing (`erase`); with `share`, δS_q
gets, per coordinate, the part of the step's total the flagged rollouts pushed for.
Under `partition` and plain AdamW, δS's first and second moments are those of a run in which
the flagged rollouts contributed nothing; `RoutedAdamW`'s shared second moment is the total's.

Arm B (activation mask) flags rollouts by activation score before the training forward and
runs that forward under `AdapterSet.mask_rollouts`.

Every per-rollout quantity is a `[B, ...]` tensor op; loops run over target modules only.
The gate identity assumes the loss is a sum of per-rollout terms (GRPO's is, given advantages
and a batch-level constant denominator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.common.errors import InvalidRequestError
from services.trainer.adapters import AdapterSet, GateKind
from services.trainer.model import TokenBatch, TrainableModel

RouteMode = Literal["route", "erase"]
# How Arm A splits a step's gradient: `partition` gives δS the unflagged rollouts' sum and
# δS_q the flagged ones'; `share` gives δS_q, per coordinate, the part of the step's total
# that the flagged rollouts pushed for, and δS the rest (see `apply_gradient_mask`).
RouteSplit = Literal["partition", "share"]


@dataclass
class HackDirection:
    """A hack direction in one adapter space: an `[r]` vector per target module.

    `offsets` (activation directions only): per module, the projection of the midpoint between
    the hack and clean means, subtracted from a rollout's projection when scoring.
    """

    kind: Literal["activation", "gradient"]
    vectors: dict[str, torch.Tensor]
    offsets: dict[str, float] | None = None


@dataclass
class RolloutGradients:
    """Per-rollout gradients w.r.t. each module's δS, from one backward through the gates.

    `routable[m]` marks the axes where `g_b` was recovered: every axis for the `shift` gate;
    for `scale`, those with |δS| > eps (elsewhere `c.grad = δS ⊙ g_b` carries no information,
    and those axes stay unrouted: δS keeps their full gradient).
    """

    per_rollout: dict[str, torch.Tensor]  # module -> [B, r]
    routable: dict[str, torch.Tensor]  # module -> [r] bool


@dataclass
class RoutingStats:
    """What one routing decision did, for logging (scores are diagnostics, e.g. gate AUROC)."""

    flagged: torch.Tensor  # [B] bool
    scores: torch.Tensor  # [B]: cosine (Arm A) or activation score (Arm B)
    leakage: float  # ‖routed gradient‖ / (‖kept‖ + ‖routed‖), over all modules


# -- hack directions ----------------------------------------------------------------------


def pooled_activations(
    captured: dict[str, torch.Tensor], token_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per module, the mean of `x V` over each row's masked tokens: `[B, r]`."""
    b, t = token_mask.shape
    w = token_mask.to(next(iter(captured.values())).dtype)
    denom = w.sum(-1, keepdim=True).clamp(min=1)
    return {name: (z.view(b, t, -1) * w[..., None]).sum(1) / denom for name, z in captured.items()}


@torch.no_grad()
def capture_pooled(
    model: TrainableModel, adapters: AdapterSet, batch: TokenBatch
) -> dict[str, torch.Tensor]:
    """One no-grad forward; per module, `[B, r]` pooled `x V` over `batch.loss_mask`."""
    with adapters.capture() as captured:
        model(batch.input_ids, batch.attention_mask)
    return pooled_activations(captured, batch.loss_mask)


def activation_direction(
    model: TrainableModel, adapters: AdapterSet, hack: TokenBatch, clean: TokenBatch
) -> HackDirection:
    """Row p of `hack` and of `clean` form pair p (same prompt, hacking vs clean completion)."""
    _check_pairs(hack, clean)
    ph = capture_pooled(model, adapters, hack)
    pc = capture_pooled(model, adapters, clean)
    vectors: dict[str, torch.Tensor] = {}
    offsets: dict[str, float] = {}
    for name in ph:
        diff = (ph[name] - pc[name]).mean(0)
        v = diff / diff.norm().clamp(min=torch.finfo(diff.dtype).tiny)
        midpoint = (ph[name].mean(0) + pc[name].mean(0)) / 2
        vectors[name] = v
        offsets[name] = float(midpoint @ v)
    return HackDirection("activation", vectors, offsets)


def per_sequence_gradients(
    model: TrainableModel, adapters: AdapterSet, batch: TokenBatch
) -> dict[str, torch.Tensor]:
    """Per module, `[B, r]`: each row's ∇δS of its loss-masked log-likelihood, from one
    backward through `shift` gates (exact; parameter `.grad`s are left untouched)."""
    with adapters.gates(batch.batch_size, "shift") as gates:
        loglik = model.sequence_logprob(batch).sum()
        grads = torch.autograd.grad(loglik, list(gates.values()))
    return {name: g.squeeze(1) for name, g in zip(gates, grads, strict=True)}


def gradient_direction(
    model: TrainableModel, adapters: AdapterSet, hack: TokenBatch, clean: TokenBatch
) -> HackDirection:
    """Mean over pairs of ∇δS log p(hacking) − ∇δS log p(clean), unit norm over all modules."""
    _check_pairs(hack, clean)
    gh = per_sequence_gradients(model, adapters, hack)
    gc = per_sequence_gradients(model, adapters, clean)
    diffs = {name: (gh[name] - gc[name]).mean(0) for name in gh}
    return HackDirection("gradient", _unit_overall(diffs))


def random_direction(like: HackDirection, seed: int) -> HackDirection:
    """The placebo: a uniformly random direction of the same kind and shapes (same unit-norm
    convention; activation offsets are 0, i.e. scores are raw projections)."""
    g = torch.Generator().manual_seed(seed)
    raw = {
        name: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v)
        for name, v in like.vectors.items()
    }
    if like.kind == "gradient":
        return HackDirection("gradient", _unit_overall(raw))
    vectors = {name: v / v.norm() for name, v in raw.items()}
    return HackDirection("activation", vectors, dict.fromkeys(vectors, 0.0))


def _check_pairs(hack: TokenBatch, clean: TokenBatch) -> None:
    if hack.batch_size != clean.batch_size or hack.batch_size == 0:
        raise InvalidRequestError(
            f"contrastive pairs need as many hacking as clean rows (got {hack.batch_size} and "
            f"{clean.batch_size}, at least 1)"
        )


def _unit_overall(vectors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    norm = torch.cat([v.reshape(-1) for v in vectors.values()]).norm()
    if norm == 0:
        raise InvalidRequestError("the hack direction is zero: hacking and clean pairs agree")
    return {name: v / norm for name, v in vectors.items()}


# -- Arm A: gradient mask -------------------------------------------------------------------


def rollout_gradients(
    adapters: AdapterSet,
    gates: dict[str, torch.Tensor],
    kind: GateKind = "scale",
    eps: float = 1e-8,
) -> RolloutGradients:
    """Recover `g_b` from the gates' `.grad` after the training loss's backward."""
    per_rollout: dict[str, torch.Tensor] = {}
    routable: dict[str, torch.Tensor] = {}
    for name, c in gates.items():
        if c.grad is None:
            raise InvalidRequestError(
                f"gate of {name} has no gradient: run backward inside adapters.gates()"
            )
        cg = c.grad.squeeze(1)  # [B, r]
        if kind == "shift":
            per_rollout[name] = cg
            routable[name] = torch.ones(cg.shape[1], dtype=torch.bool, device=cg.device)
        else:
            ds = adapters.modules[name].delta_s.detach()
            ok = ds.abs() > eps
            per_rollout[name] = _divide_where(cg, ds, ok)
            routable[name] = ok
    return RolloutGradients(per_rollout, routable)


def gradient_scores(grads: RolloutGradients, direction: HackDirection) -> torch.Tensor:
    """`[B]`: cosine between each rollout's descent direction `−g_b` and the gradient hack
    direction, over the routable axes of all modules (0 for a rollout with no gradient)."""
    if direction.kind != "gradient":
        raise InvalidRequestError("Arm A flags rollouts with a gradient-space hack direction")
    _check_modules(direction, grads.per_rollout)
    g = torch.cat(
        [grads.per_rollout[n] * grads.routable[n] for n in grads.per_rollout], dim=1
    )  # [B, R]
    v = torch.cat([direction.vectors[n].to(g) * grads.routable[n] for n in grads.per_rollout])
    dots = -(g @ v)
    norms = g.norm(dim=1) * v.norm()
    return torch.where(norms > 0, dots / norms.clamp(min=torch.finfo(g.dtype).tiny), 0)


def apply_gradient_mask(
    adapters: AdapterSet,
    grads: RolloutGradients,
    flagged: torch.Tensor,
    mode: RouteMode,
    split: RouteSplit = "partition",
) -> float:
    """Rebuild `.grad`s from per-rollout gradients; returns the leakage.

    On routable axes, with G = Σ_b g_b the step's total:
    - `partition`: δS.grad = Σ_{b unflagged} g_b, δS_q.grad = Σ_{b flagged} g_b. With
      GRPO's zero-sum advantages G is a small difference of large per-rollout terms, so
      the two sums can each be far larger than G and nearly opposite: under a shared
      second moment (`RoutedAdamW`) each part then steps farther than the total, and δS and
      δS_q drift apart while only their sum is trained.
    - `share`: per coordinate, δS_q.grad = ρ·G and δS.grad = (1 − ρ)·G, where ρ is the
      flagged rollouts' sum over G, clipped to [0, 1] (0 where they push against G). Each
      part has G's sign and at most its size, coordinate by coordinate, so neither part's
      gradient outgrows the total's second moment that scales its step, and with no flags
      δS_q gets nothing. The parts still move apart where flagged and unflagged rollouts
      disagree from step to step (that is what routing is for), but not by the zero-sum
      amplification.
    `erase` gives δS_q nothing either way. Unroutable axes keep δS's full gradient and give
    δS_q none. δS_q's own backprop gradient is replaced, not added to: δS and δS_q enter
    the forward as one sum, so their raw gradients are equal and keeping both would count
    every rollout twice.
    """
    if mode not in ("route", "erase"):
        raise InvalidRequestError(f"routing mode must be 'route' or 'erase', got {mode!r}")
    if split not in ("partition", "share"):
        raise InvalidRequestError(f"routing split must be 'partition' or 'share', got {split!r}")
    if mode == "route" and adapters.config.quarantine != "svd":
        raise InvalidRequestError(
            "Arm A 'route' moves δS-basis gradient into δS_q and needs quarantine='svd'; "
            "with a LoRA quarantine use 'erase' or Arm B"
        )
    keep = (~flagged).to(next(iter(grads.per_rollout.values())).dtype)[:, None]  # [B, 1]
    flag = flagged.to(keep.dtype)[:, None]
    names = list(adapters.modules)
    if split == "partition":
        parts = {
            n: ((grads.per_rollout[n] * keep).sum(0), (grads.per_rollout[n] * flag).sum(0))
            for n in names
        }
    else:  # share
        parts = {}
        for n in names:
            total = grads.per_rollout[n].sum(0)
            pushed = (grads.per_rollout[n] * flag).sum(0)
            share = _divide_where(pushed, total, total != 0)
            routed = share.clamp(0, 1) * total
            parts[n] = (total - routed, routed)
    kept_sq = routed_sq = 0.0
    for name, m in adapters.modules.items():
        ok = grads.routable[name]
        full = m.delta_s.grad if m.delta_s.grad is not None else torch.zeros_like(m.delta_s)
        kept = torch.where(ok, parts[name][0], full)
        routed = torch.where(ok, parts[name][1], 0)
        m.delta_s.grad = kept
        if m.delta_s_q is not None:
            m.delta_s_q.grad = routed if mode == "route" else None
        for p in (m.lora_a_q, m.lora_b_q):
            if p is not None:
                p.grad = None
        kept_sq += float(kept.pow(2).sum())
        routed_sq += float(routed.pow(2).sum())
    return _leakage(kept_sq, routed_sq)


def route_gradients(
    adapters: AdapterSet,
    gates: dict[str, torch.Tensor],
    direction: HackDirection,
    tau: float,
    mode: RouteMode = "route",
    kind: GateKind = "scale",
    eps: float = 1e-8,
    split: RouteSplit = "partition",
) -> RoutingStats:
    """Arm A after `loss.backward()` inside `adapters.gates(B, kind)`: flag, then reroute."""
    grads = rollout_gradients(adapters, gates, kind, eps)
    scores = gradient_scores(grads, direction)
    flagged = scores > tau
    leakage = apply_gradient_mask(adapters, grads, flagged, mode, split)
    return RoutingStats(flagged, scores, leakage)


# -- Arm B: activation mask -----------------------------------------------------------------


def activation_scores(pooled: dict[str, torch.Tensor], direction: HackDirection) -> torch.Tensor:
    """`[B]`: mean over modules of (pooled `x V` · v − offset)."""
    if direction.kind != "activation":
        raise InvalidRequestError("Arm B flags rollouts with an activation-space hack direction")
    _check_modules(direction, pooled)
    offsets = direction.offsets or {}
    per_module = [
        pooled[n] @ direction.vectors[n].to(pooled[n]) - offsets.get(n, 0.0) for n in pooled
    ]
    return torch.stack(per_module).mean(0)


def activation_flags(
    model: TrainableModel,
    adapters: AdapterSet,
    batch: TokenBatch,
    direction: HackDirection,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arm B's decision for a rollout batch: `(flagged [B] bool, scores [B])`, from one
    no-grad forward pooling each rollout's completion (`loss_mask`) activations."""
    scores = activation_scores(capture_pooled(model, adapters, batch), direction)
    return scores > tau, scores


def gradient_leakage(adapters: AdapterSet) -> float:
    """‖δS_q.grad‖ / (‖δS.grad‖ + ‖δS_q.grad‖) over all modules, after a backward (Arm B).

    For a LoRA quarantine, its parameters' gradient norm stands in for ‖δS_q.grad‖.
    """
    kept_sq = sum(
        float(p.grad.pow(2).sum()) for p in adapters.kept_parameters() if p.grad is not None
    )
    routed_sq = sum(
        float(p.grad.pow(2).sum()) for p in adapters.quarantine_parameters() if p.grad is not None
    )
    return _leakage(kept_sq, routed_sq)


def _divide_where(num: torch.Tensor, den: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """`num / den` where `ok`, else 0 (the masked entries never divide, so no inf or nan)."""
    return torch.where(ok, num / torch.where(ok, den, 1), 0)


def _leakage(kept_sq: float, routed_sq: float) -> float:
    kept, routed = kept_sq**0.5, routed_sq**0.5
    return routed / (kept + routed) if kept + routed > 0 else 0.0


def _check_modules(direction: HackDirection, per_module: dict[str, torch.Tensor]) -> None:
    if set(direction.vectors) != set(per_module):
        raise InvalidRequestError(
            "the hack direction was extracted for different adapter modules than these: "
            f"{sorted(set(direction.vectors) ^ set(per_module))[:3]}"
        )
