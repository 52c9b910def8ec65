"""A routed arm's flags: thresholds calibrated on the current policy, the noisy oracle, and
the flags' quality against the oracle labels.

A gate flags a rollout when its score (Arm A: a cosine with the gradient hack direction;
Arm B: a projection on the activation one) exceeds τ. A fixed τ is set against the base
model; the policy moves, its scores move with it, and a fixed τ ends up flagging nearly
every rollout (issue 28: 95–97% at AUROC ≈ 0.65). Calibration re-estimates τ from the
current policy, without a label (`GRPOConfig.gate_calibration`):

- `quantile`: τ flags the top q of the step's own scores (`quantile_threshold`);
- `midpoint`: τ is the midpoint of the hack pairs' mean scores, hacking and clean, scored
  under the current policy (`pair_scores`): the convention that sets Arm B's offset against
  the base model, re-read as the policy moves.

The noisy oracle (`flip_flags`) flips a share of the oracle's flags, to ask how good flags
must be for routing to beat its placebo. `flag_quality` (precision, recall) and `gate_auroc`
score a step's flags and scores against the oracle's hack labels; they read labels, so they
run outside the training scope, for the records only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.trainer.adapters import AdapterSet
from services.trainer.envs import Grade
from services.trainer.grpo_config import GRPOConfig
from services.trainer.grpo_loss import group_advantages
from services.trainer.model import TokenBatch, TrainableModel
from services.trainer.routing import (
    HackDirection,
    RolloutGradients,
    activation_scores,
    capture_pooled,
    gradient_scores,
    per_sequence_gradients,
)


@dataclass
class GateDecision:
    """One step's routing decision: per rollout, whether it was flagged and the gate's score
    (0 where flags were given in advance: random, or the oracle's)."""

    flags: torch.Tensor  # [B] bool
    scores: torch.Tensor  # [B]


def quantile_threshold(scores: torch.Tensor, q: float) -> float:
    """The τ at which `scores > τ` flags the top `q` of `scores`, to the nearest rollout:
    k = round(q·B) of them (fewer where scores tie at the boundary). τ is the midpoint of the
    k-th and (k+1)-th largest scores; just below the smallest when k = B, the largest when
    k = 0."""
    # In the scores' own dtype, so that τ compares with them as computed.
    s = scores.detach().flatten().sort(descending=True).values
    k = round(q * len(s))
    if k == 0:
        return float(s[0])
    if k >= len(s):
        return float(torch.nextafter(s[-1], torch.tensor(-math.inf, dtype=s.dtype)))
    return float((s[k - 1] + s[k]) / 2)


@torch.no_grad()
def _activation_pair_scores(
    model: TrainableModel, adapters: AdapterSet, direction: HackDirection, batch: TokenBatch
) -> torch.Tensor:
    return activation_scores(capture_pooled(model, adapters, batch), direction)


def pair_scores(
    model: TrainableModel,
    adapters: AdapterSet,
    direction: HackDirection,
    hack: TokenBatch,
    clean: TokenBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`([P], [P])`: the gate's scores of the hacking and of the clean pair completions under
    the current adapters. Activation gate: as a rollout is scored. Gradient gate: the cosine
    of ∇δS log p(completion) with the direction, i.e. a rollout's score had it been sampled
    with a positive advantage (its descent direction raises its likelihood)."""
    if direction.kind == "activation":
        score = _activation_pair_scores
        return score(model, adapters, direction, hack), score(model, adapters, direction, clean)
    out = []
    for batch in (hack, clean):
        grads = per_sequence_gradients(model, adapters, batch)  # module -> [P, r]
        every = {n: torch.ones_like(g[0], dtype=torch.bool) for n, g in grads.items()}
        # gradient_scores takes a loss gradient g_b and scores its descent direction −g_b
        loss_grads = RolloutGradients({n: -g for n, g in grads.items()}, every)
        out.append(gradient_scores(loss_grads, direction).detach())
    return out[0], out[1]


def pair_midpoint(hack: torch.Tensor, clean: torch.Tensor) -> float:
    """The midpoint of the hacking and the clean pairs' mean scores."""
    return float((hack.double().mean() + clean.double().mean()) / 2)


def flip_flags(flags: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """`flags` with floor(fraction·B + u) of them flipped (u uniform in [0, 1)), chosen
    uniformly: the expected flipped share is exactly `fraction`, and each step's is within
    1/B of it."""
    n = flags.numel()
    u = float(torch.rand(1, generator=generator))
    k = min(n, math.floor(fraction * n + u))
    flipped = flags.clone()
    picked = torch.randperm(n, generator=generator)[:k]
    flipped[picked] = ~flipped[picked]
    return flipped


def flag_quality(flags: list[bool], hacked: list[bool]) -> dict[str, float | None]:
    """A step's flags against the oracle's hack labels (read outside the training scope):
    precision, the share of flagged rollouts that hack (None when none is flagged), and
    recall, the share of hacking rollouts flagged (None when none hacks)."""
    hits = sum(f and h for f, h in zip(flags, hacked, strict=True))
    return {
        "flag_precision": hits / sum(flags) if any(flags) else None,
        "flag_recall": hits / sum(hacked) if any(hacked) else None,
    }


def auroc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability a positive scores above a negative (ties count half); None if one class."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def gate_auroc(grades: list[Grade], scores: torch.Tensor, config: GRPOConfig) -> float | None:
    """The gate's AUROC against the held-back hack labels (a diagnostic, read outside any
    training scope), over the rollouts it decides on: those with a nonzero advantage. A
    zero-advantage rollout has no gradient (Arm A scores it 0) and routing it is moot; in
    the all-hack groups of a hacking policy those would otherwise rank every hack below
    the failures and read as a worse-than-chance gate."""
    if config.arm == "none":
        return None
    rewards = torch.tensor([g.training_view().reward for g in grades])
    live = group_advantages(rewards, config.group_size, scale=config.advantage) != 0
    picked = [
        (s, g.eval_only.hacked)
        for s, g, ok in zip(scores.tolist(), grades, live.tolist(), strict=True)
        if ok
    ]
    return auroc([s for s, _ in picked], [h for _, h in picked])
