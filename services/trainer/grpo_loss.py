"""GRPO loss math as pure tensor functions: advantages, clipped ratio, k3 KL, aggregation.

Shapes: `B` rollouts (groups of `n` consecutive rollouts share a prompt), `T` completion
positions, right-padded; `mask [B, T]` is True on real completion tokens. Masked positions
never reach an `exp`, so padding holding -inf or garbage log-probs leaves loss and
gradients finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.common.errors import InvalidRequestError

AdvantageScale = Literal["std", "none"]
Aggregation = Literal["token_mean", "seq_mean", "seq_sum_const"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "seq_sum_const")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: AdvantageScale = "std", eps: float = 1e-4
) -> torch.Tensor:
    """Per-rollout advantages `[B]` from rewards `[B]` in consecutive groups of `group_size`.

    `scale="std"` (GRPO): `(r − mean) / (std + eps)` with the group's sample (Bessel) std,
    as TRL computes it; a group whose rewards are all equal gets zero advantage.
    `scale="none"` (Dr.GRPO): `r − mean`, no per-group rescaling.
    """
    groups = _groups(rewards, group_size, scale)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.reshape(-1)
    std = groups.std(dim=1, keepdim=True)
    # Equal rewards carry no signal: exactly zero advantage, even with eps = 0.
    adv = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return adv.reshape(-1)


def subset_advantages(
    rewards: torch.Tensor,
    group_size: int,
    include: torch.Tensor,
    *,
    scale: AdvantageScale = "std",
    eps: float = 1e-4,
) -> torch.Tensor:
    """`group_advantages` as if only the `include`d rollouts `[B]` bool had been sampled:
    each group is centred (and scaled) over its included rollouts; the rest get zero. With
    every rollout included this is `group_advantages`, bit for bit."""
    if include.shape != rewards.shape:
        raise InvalidRequestError(
            f"include must match rewards {tuple(rewards.shape)}, got {tuple(include.shape)}"
        )
    if bool(include.all()):
        return group_advantages(rewards, group_size, scale=scale, eps=eps)
    r = _groups(rewards, group_size, scale)
    w = include.view(-1, group_size).to(r.dtype)
    n = w.sum(1, keepdim=True)
    mean = (r * w).sum(1, keepdim=True) / n.clamp(min=1)
    centred = (r - mean) * w
    if scale == "none":
        return centred.reshape(-1)
    var = (centred.pow(2)).sum(1, keepdim=True) / (n - 1).clamp(min=1)  # Bessel, as above
    std = var.sqrt()
    ok = (std > 0) & (n >= 2)
    adv = torch.where(ok, centred / (std + eps), torch.zeros_like(centred))
    return adv.reshape(-1)


def _groups(rewards: torch.Tensor, group_size: int, scale: AdvantageScale) -> torch.Tensor:
    """`rewards [B]` as `[G, group_size]`, once the arguments are checked."""
    if rewards.ndim != 1:
        raise InvalidRequestError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise InvalidRequestError(
            f"group_size {group_size} does not divide the {rewards.numel()} rewards"
        )
    if scale not in ("std", "none"):
        raise InvalidRequestError(f"unknown advantage scale {scale!r}; use 'std' or 'none'")
    if scale == "std" and group_size < 2:
        raise InvalidRequestError("scale='std' needs group_size >= 2 (a std of one sample)")
    return rewards.view(-1, group_size)


def completion_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """`[B, max_len]` bool mask, True on the first `lengths[b]` positions of row `b`."""
    if lengths.ndim != 1:
        raise InvalidRequestError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    if (lengths < 0).any() or (lengths > max_len).any():
        raise InvalidRequestError(f"lengths must lie in [0, {max_len}], got {lengths.tolist()}")
    return torch.arange(max_len, device=lengths.device) < lengths[:, None]


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token: `(loss [B, T], clipped [B, T] bool)`.

    `loss = −min(ρ·A, clip(ρ, 1 − eps_low, 1 + eps_high)·A)` with `ρ = exp(logp − old_logp)`
    and the rollout's advantage `A` (`[B]`) on each of its tokens; separate low/high bounds
    allow DAPO's clip-higher. `clipped` marks tokens where the clip took effect (no gradient);
    masked positions hold 0 in both.
    """
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise InvalidRequestError(
            f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}"
        )
    _check_shapes(logp, mask, old_logp=old_logp)
    if advantages.shape != logp.shape[:1]:
        raise InvalidRequestError(
            f"advantages must be [B]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}"
        )
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logp.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped) & mask
    return torch.where(mask, loss, torch.zeros_like(loss)), was_clipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref): `exp(ref − logp) − (ref − logp) − 1` (≥ 0).

    Unbiased for KL(π ‖ π_ref) on tokens sampled from π; 0 on masked positions.
    """
    _check_shapes(logp, mask, ref_logp=ref_logp)
    d = torch.where(mask, ref_logp - logp, torch.zeros_like(logp))
    return torch.exp(d) - d - 1.0


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation = "token_mean",
    *,
    const_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `[B, T]` over real tokens to a scalar.

    `token_mean`: Σ loss / Σ tokens over the batch (DAPO). `seq_mean`: mean over rollouts of
    each rollout's own token mean (original GRPO; short rollouts weigh more per token).
    `seq_sum_const`: Σ loss / (B · const_len) (Dr.GRPO): a constant denominator, typically the
    generation budget, so a rollout's per-token weight does not depend on its length.
    A rollout with no real tokens contributes nothing.
    """
    _check_shapes(per_token, mask)
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1)
    if mode == "seq_mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.mean()
    if mode == "seq_sum_const":
        if const_len is None or const_len < 1:
            raise InvalidRequestError(
                f"seq_sum_const needs a positive const_len (the generation budget), got {const_len}"
            )
        return masked.sum() / (per_token.shape[0] * const_len)
    raise InvalidRequestError(f"unknown aggregation {mode!r}; use one of {', '.join(AGGREGATIONS)}")


@dataclass(frozen=True)
class GRPOLossConfig:
    """Knobs of the GRPO objective; the defaults are vanilla GRPO without a KL term."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    const_len: int | None = None  # required by seq_sum_const


@dataclass
class GRPOLossOutput:
    """The scalar to backpropagate and the per-token pieces routing and metrics need."""

    loss: torch.Tensor  # scalar
    per_token: torch.Tensor  # [B, T] policy loss + kl_coef · KL, 0 on padding
    policy_loss: torch.Tensor  # scalar, aggregated like `loss`
    kl: torch.Tensor  # scalar mean k3 over real tokens (0 when no reference is given)
    clip_fraction: torch.Tensor  # scalar share of real tokens the clip affected


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig = GRPOLossConfig(),  # frozen, so a shared default is safe
    *,
    ref_logp: torch.Tensor | None = None,
) -> GRPOLossOutput:
    """The GRPO objective over a batch of rollouts.

    `logp [B, T]`: the current policy's log-probs of the sampled tokens (with grad);
    `old_logp`: the sampling policy's (detached); `ref_logp`: the reference policy's, needed
    when `config.kl_coef > 0`.
    """
    policy, clipped = clipped_policy_loss(
        logp, old_logp, advantages, mask, eps_low=config.eps_low, eps_high=config.eps_high
    )
    per_token = policy
    n_tokens = mask.sum().clamp(min=1)
    kl_mean = logp.new_zeros(())
    if config.kl_coef:
        if ref_logp is None:
            raise InvalidRequestError("kl_coef > 0 needs ref_logp (the reference log-probs)")
        kl = k3_kl(logp, ref_logp, mask)
        per_token = per_token + config.kl_coef * kl
        kl_mean = kl.sum().detach() / n_tokens
    elif ref_logp is not None:
        kl_mean = k3_kl(logp, ref_logp, mask).sum().detach() / n_tokens
    mode, const_len = config.aggregation, config.const_len
    return GRPOLossOutput(
        loss=aggregate(per_token, mask, mode, const_len=const_len),
        per_token=per_token,
        policy_loss=aggregate(policy, mask, mode, const_len=const_len).detach(),
        kl=kl_mean,
        clip_fraction=clipped.sum() / n_tokens,
    )


def _check_shapes(x: torch.Tensor, mask: torch.Tensor, **others: torch.Tensor) -> None:
    if x.ndim != 2:
        raise InvalidRequestError(f"per-token tensors must be [B, T], got {tuple(x.shape)}")
    if mask.shape != x.shape or mask.dtype != torch.bool:
        raise InvalidRequestError(
            f"mask must be a bool tensor of shape {tuple(x.shape)}, got {mask.dtype} "
            f"{tuple(mask.shape)}"
        )
    for name, t in others.items():
        if t.shape != x.shape:
            raise InvalidRequestError(
                f"{name} must have shape {tuple(x.shape)}, got {tuple(t.shape)}"
            )
