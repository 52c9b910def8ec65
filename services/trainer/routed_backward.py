"""The routed backward: one GRPO step's gradient, split between the kept part and the
quarantine by the configured arm (`GRPOConfig.arm`):

- `none`: vanilla GRPO (the kept δS learns everything);
- `erase` / `route` (Arm A): per-rollout gradients from one backward through gates;
  rollouts whose gradient points along the hack direction (cos > τ) lose their share
  (`erase`) or hand it to the quarantine δS_q (`route`);
- `activation` (Arm B): rollouts whose pooled adapter-space activations project on the
  activation hack direction above τ train only the quarantine (or, per token, the spec's
  `where(cos(x·V, v) > τ, kept.detach(), kept)` at each adapter);
- `placebo`: `route` with a random direction of the same shape;
- `kept-ablated` (design b): flags as Arm A's, but the kept δS takes its update in a
  forward with the quarantine ablated (as deployed), from the unflagged rollouts only, so
  it is trained to stand alone; the quarantine takes the flagged rollouts' gradient in the
  forward with it present;
- `route-dropout` (design c): `route`; the caller drops the quarantine from some steps'
  forward;
- `route2` (design a, the seed's reviewed design): a LoRA quarantine in its own basis,
  always in the forward and absorbing gradient from every rollout, and the kept part
  detach-routed, `where(flag, kept.detach(), kept)`, on rollouts or tokens Arm B's gate
  flags (`_route2_backward`);
- `expand-route-ablate` (design d): route2's backward, with a wider LoRA quarantine and
  label-free coherence steps after training (`coherence.py`).

Every routed arm takes flags given in advance (`oracle_flags`, `random_flags`) in place of
its own decision. The gate's threshold τ is fixed, or calibrated on the current policy
(`gates.py`). This module sees only `TrainingRollout`s and rewards: no label.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from services.trainer.adapters import AdapterSet
from services.trainer.gates import pair_midpoint, pair_scores, quantile_threshold
from services.trainer.grpo_config import GRPOConfig
from services.trainer.grpo_loss import GRPOLossConfig, grpo_loss, subset_advantages
from services.trainer.model import TokenBatch, TrainableModel
from services.trainer.probe import HackProbe
from services.trainer.rollouts import TrainingRollout
from services.trainer.routing import (
    HackDirection,
    RouteMode,
    activation_scores,
    apply_gradient_mask,
    capture_pooled,
    gradient_leakage,
    gradient_scores,
    rollout_gradients,
)


def completion_logprobs(
    model: TrainableModel, batch: TokenBatch, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, width]` per-token logprobs of each completion (right-aligned at its start) and
    the mask of real completion tokens."""
    tlp = model.token_logprobs(batch)  # [B, T], aligned with the inputs
    start = (batch.attention_mask.sum(1) - batch.loss_mask.sum(1)).long()  # prompt lengths
    lengths = batch.loss_mask.sum(1).long()
    pos = start[:, None] + torch.arange(width, device=tlp.device)
    mask = torch.arange(width, device=tlp.device)[None] < lengths[:, None]
    picked = tlp.gather(1, pos.clamp(max=tlp.shape[1] - 1))
    return torch.where(mask, picked, torch.zeros_like(picked)), mask


class RoutedBackward:
    """One run's routed backward over its adapters, by its arm. Holds the gate's current
    threshold `tau` (the config's, moved by calibration; a checkpoint saves it).
    `direction`: the hack direction (None for vanilla); `pairs`: the hack pairs' (hacking,
    clean) batches it came from, which the midpoint calibration re-scores; `probe`: the
    residual hack probe, for Arm B in residual space."""

    def __init__(
        self,
        cfg: GRPOConfig,
        model: TrainableModel,
        adapters: AdapterSet,
        loss_config: GRPOLossConfig,
        direction: HackDirection | None,
        pairs: tuple[TokenBatch, TokenBatch] | None,
        probe: HackProbe | None,
    ):
        self.cfg, self.model, self.adapters = cfg, model, adapters
        self.loss_config = loss_config
        self.direction, self.pairs, self.probe = direction, pairs, probe
        self.tau = cfg.tau
        # route2 per token: the share of the last step's real tokens flagged (else None)
        self.token_flag_rate: float | None = None

    def backward(
        self,
        step: int,
        batch: TokenBatch,
        rolled: list[TrainingRollout],
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        adv: torch.Tensor,
        ref: torch.Tensor | None,
        placebo: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, float]:
        """Step `step`'s backward, leaving each adapter parameter's `.grad` as the arm routes
        it. `placebo`: flags fixed in advance (random or the oracle's) in place of the arm's
        own decision. Returns the loss's output (for metrics), the `[B]` flags, the gate's
        scores and the leakage."""
        cfg, adapters = self.cfg, self.adapters
        # The dropout is the caller's; expand-route-ablate routes as route2 (its extra rank
        # and coherence steps are the adapters' and the loop's).
        arm = {"route-dropout": "route", "expand-route-ablate": "route2"}.get(cfg.arm, cfg.arm)
        width = old_logp.shape[1]
        B = batch.batch_size
        scores = torch.zeros(B)
        flagged = torch.zeros(B, dtype=torch.bool)
        leakage = 0.0

        def loss_of() -> Any:
            logp, mask = completion_logprobs(self.model, batch, width)
            return grpo_loss(logp, old_logp, adv, mask, self.loss_config, ref_logp=ref)

        def decide() -> tuple[torch.Tensor, torch.Tensor]:
            if placebo is not None:
                return placebo, scores
            own = self._gate_scores(batch, rolled, loss_of)
            return own > self._threshold(own, step), own

        if arm == "activation" and cfg.activation_granularity == "token":
            assert self.direction is not None
            with adapters.mask_tokens(self.direction.vectors, B, self.tau) as token_flags:
                out = loss_of()
                out.loss.backward()
            leakage = gradient_leakage(adapters)
            # Per rollout: the share of its completion tokens flagged, over modules.
            share = torch.stack(list(token_flags.values())).float().mean(0)  # [B, T]
            real = batch.loss_mask.to(share)
            scores = ((share * real).sum(1) / real.sum(1).clamp(min=1)).cpu()
            flagged = scores > 0.5
        elif arm == "route2":
            out, flagged, scores = self._route2_backward(batch, placebo, decide, loss_of)
            leakage = gradient_leakage(adapters)
        elif arm == "kept-ablated":
            flagged, scores = decide()
            out, leakage = self._kept_ablated_backward(batch, old_logp, rewards, adv, flagged, ref)
        elif cfg.route_split == "recentre" and arm != "none":
            flagged, scores = decide()
            out, leakage = self._recentred_backward(batch, old_logp, rewards, adv, flagged, ref)
        elif arm in ("erase", "route", "placebo"):
            assert self.direction is not None
            mode: RouteMode = "erase" if arm == "erase" else "route"
            with adapters.gates(B, kind=cfg.gate) as gates:
                out = loss_of()
                out.loss.backward()
                grads = rollout_gradients(adapters, gates, cfg.gate)
                if placebo is None:
                    scores = gradient_scores(grads, self.direction).detach()
                    flagged = scores > self._threshold(scores, step)
                else:
                    flagged = placebo
                leakage = apply_gradient_mask(adapters, grads, flagged, mode, cfg.route_split)
        elif arm == "activation":
            flagged, scores = decide()
            with adapters.mask_rollouts(flagged, mode="route"):
                out = loss_of()
                out.loss.backward()
            leakage = gradient_leakage(adapters)
        else:
            out = loss_of()
            out.loss.backward()
            for p in adapters.quarantine_parameters():  # vanilla: the kept δS learns it all
                p.grad = None
        return out, flagged, scores, leakage

    def _route2_backward(
        self,
        batch: TokenBatch,
        placebo: torch.Tensor | None,
        decide: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        loss_of: Callable[[], Any],
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Design (a), arm `route2`, as the seed specifies it: one forward with the LoRA
        quarantine present (it is on every training step) and, at each adapter, the kept
        part's output detached where flagged, `where(flag, kept.detach(), kept)`. The kept δS
        learns only from unflagged rollouts (tokens); the quarantine absorbs gradient from
        every one, flagged or not. Where the seed is silent: the stop is on the kept path's
        output (the seed's form, so the kept path also carries no gradient back to earlier
        adapters from a flagged token), and per token the flags are Arm B's per-token
        cosines, or (`random_flags`) `[B, T]` coin flips given in advance.

        Per rollout the flags are Arm B's decision or the ones given (`[B]`). Per token, a
        rollout's score is the share of its real tokens (prompt and completion) flagged,
        over modules, and it counts as flagged above one half (for the flag quality);
        `token_flag_rate` keeps the step's share of flagged tokens, the rate a per-token
        placebo matches. Returns the loss's output, the `[B]` flags and the scores."""
        cfg, adapters = self.cfg, self.adapters
        B, device = batch.batch_size, batch.input_ids.device
        real = batch.attention_mask.bool()  # [B, T]
        if cfg.activation_granularity == "rollout":
            flagged, scores = decide()
            with adapters.mask_rollouts(flagged.to(device), mode="absorb", stop="activation"):
                out = loss_of()
                out.loss.backward()
            self.token_flag_rate = None
            return out, flagged, scores
        if placebo is not None:
            with adapters.mask_rollouts(placebo.to(device), mode="absorb", stop="activation"):
                out = loss_of()
                out.loss.backward()
            share = placebo.to(device).float()  # [B, T]
        else:
            assert self.direction is not None
            vectors = self.direction.vectors
            with adapters.mask_tokens(vectors, B, self.tau, mode="absorb") as token_flags:
                out = loss_of()
                out.loss.backward()
            share = torch.stack(list(token_flags.values())).float().mean(0)  # [B, T]
        share = torch.where(real, share, 0)
        scores = (share.sum(1) / real.sum(1).clamp(min=1)).cpu()
        self.token_flag_rate = float(share.sum() / real.sum().clamp(min=1))
        return out, scores > 0.5, scores

    def _probe_scores(self, rolled: list[TrainingRollout]) -> torch.Tensor:
        """`[B]` Arm B by the residual hack probe: each rollout's mean read-out while it was
        sampled, minus the probe's offset."""
        assert self.probe is not None
        return torch.tensor([self.probe.score(r.readouts or []) for r in rolled])

    def _gate_scores(
        self, batch: TokenBatch, rolled: list[TrainingRollout], loss_of: Callable[[], Any]
    ) -> torch.Tensor:
        """`[B]` the arm's own gate scores for a batch, before any update: Arm B from one
        no-grad forward, Arm A (and its random-direction placebo) from each rollout's
        gradient, recovered through the gates by one backward whose gradients are dropped."""
        assert self.direction is not None
        if self.cfg.activation_gate:
            if self.cfg.activation_space == "residual":
                return self._probe_scores(rolled)
            pooled = capture_pooled(self.model, self.adapters, batch)
            return activation_scores(pooled, self.direction)
        with self.adapters.gates(batch.batch_size, kind=self.cfg.gate) as gates:
            loss_of().loss.backward()
            grads = rollout_gradients(self.adapters, gates, self.cfg.gate)
        for p in self.adapters.kept_parameters() + self.adapters.quarantine_parameters():
            p.grad = None  # the scoring backward's: no update takes them
        return gradient_scores(grads, self.direction).detach()

    def _threshold(self, scores: torch.Tensor, step: int) -> float:
        """The τ the gate flags step `step`'s `scores` at: fixed, the last midpoint, or
        (`gate_calibration: quantile`) re-estimated from these scores every
        `calibrate_every` steps."""
        cfg = self.cfg
        if cfg.gate_calibration == "quantile" and step % cfg.calibrate_every == 0:
            assert cfg.gate_quantile is not None  # checked by the config
            self.tau = quantile_threshold(scores, cfg.gate_quantile)
        return self.tau

    def calibrate(self, step: int) -> None:
        """`gate_calibration: midpoint`, every `calibrate_every` steps from step 0: τ becomes
        the midpoint of the hack pairs' mean gate scores, hacking and clean, under the current
        policy (no rollout, no label). Call it before the step's forward."""
        cfg = self.cfg
        if cfg.gate_calibration != "midpoint" or step % cfg.calibrate_every:
            return
        assert self.direction is not None and self.pairs is not None
        scored = pair_scores(self.model, self.adapters, self.direction, *self.pairs)
        self.tau = pair_midpoint(*scored)

    def _recentred_backward(
        self,
        batch: TokenBatch,
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        adv: torch.Tensor,
        flagged: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> tuple[Any, float]:
        """`route_split: recentre`. The kept part gets the GRPO gradient of the unflagged
        rollouts alone, with advantages re-centred among each group's unflagged rollouts:
        what a run that never sampled the flagged ones would take. The quarantine gets the
        rest of the step's total (`route`) or nothing (`erase`), so the two gradients sum
        to the unrouted one. The kept gradient is a zero-sum GRPO gradient in its own right,
        not a one-sided sum, so under AdamW (each part its own moments) δS moves like a
        vanilla run's δS; `routed_adamw` would scale both parts by the small total's second
        moment and let them run away. With no flags the kept gradient is the total, bit for
        bit, and the quarantine gets exactly zero.

        Returns the full loss's output (for metrics) and the leakage: the norm of what the
        kept part did not get, over it plus the kept gradient's (in δS coordinates)."""
        cfg, adapters = self.cfg, self.adapters
        kept_adv = subset_advantages(
            rewards.to(adv), cfg.group_size, ~flagged.to(adv.device), scale=cfg.advantage
        )
        logp, mask = completion_logprobs(self.model, batch, old_logp.shape[1])
        full = grpo_loss(logp, old_logp, adv, mask, self.loss_config, ref_logp=ref)
        kept = grpo_loss(logp, old_logp, kept_adv, mask, self.loss_config, ref_logp=ref)
        k_params, q_params = adapters.kept_parameters(), adapters.quarantine_parameters()
        params = k_params + q_params
        g_kept = self._grads(kept.loss, params, retain_graph=True)
        g_full = self._grads(full.loss, params)
        kept_sq = routed_sq = 0.0
        for i, p in enumerate(params):
            rest = g_full[i] - g_kept[i]
            if i < len(k_params):
                p.grad = g_kept[i]
                kept_sq += float(g_kept[i].pow(2).sum())
                routed_sq += float(rest.pow(2).sum())  # what the kept part did not get
            else:
                p.grad = rest if cfg.arm != "erase" else None
        total = kept_sq**0.5 + routed_sq**0.5
        return full, (routed_sq**0.5 / total if total > 0 else 0.0)

    def _kept_ablated_backward(
        self,
        batch: TokenBatch,
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        adv: torch.Tensor,
        flagged: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> tuple[Any, float]:
        """Design (b), arm `kept-ablated`. The kept δS gets the GRPO gradient of the unflagged
        rollouts in a forward with the quarantine ablated, as deployed: it is trained to stand
        alone, never to lean on (or to cancel) a quarantine that deploy removes. Its
        advantages are the unflagged rollouts' (`recentre`: re-centred among them;
        `partition`: as sampled, the flagged ones' zeroed) and its KL term, if any, is the
        deployed policy's. The quarantine gets the flagged rollouts' policy gradient in the
        forward with it present, where it acts while training; with no flags it gets exactly
        zero. Both ratios are against the sampling policy's logprobs (kept + quarantine):
        the ablated policy is importance-weighted and clipped like any policy the rollouts
        were not drawn from.

        Returns the full loss's output in the forward with the quarantine present (for
        metrics) and the leakage (`routing.gradient_leakage`)."""
        cfg, adapters = self.cfg, self.adapters
        width = old_logp.shape[1]
        unflagged = ~flagged.to(adv.device)
        if cfg.route_split == "recentre":
            kept_adv = subset_advantages(
                rewards.to(adv), cfg.group_size, unflagged, scale=cfg.advantage
            )
        else:
            kept_adv = torch.where(unflagged, adv, 0)
        with adapters.deploy():
            logp, mask = completion_logprobs(self.model, batch, width)
        kept = grpo_loss(logp, old_logp, kept_adv, mask, self.loss_config, ref_logp=ref)
        logp, mask = completion_logprobs(self.model, batch, width)
        full = grpo_loss(logp, old_logp, adv, mask, self.loss_config, ref_logp=ref)
        policy_only = replace(self.loss_config, kl_coef=0.0)
        routed = grpo_loss(logp, old_logp, torch.where(unflagged, 0, adv), mask, policy_only)
        for params, loss in (
            (adapters.kept_parameters(), kept.loss),
            (adapters.quarantine_parameters(), routed.loss),
        ):
            for p, g in zip(params, self._grads(loss, params), strict=True):
                p.grad = g
        return full, gradient_leakage(adapters)

    @staticmethod
    def _grads(loss: torch.Tensor, params: list, retain_graph: bool = False) -> list:
        grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
