"""Coherence steps (issue 28, design d, expand-route-ablate): after the last GRPO step the
quarantine is ablated, as deploy runs it, and K label-free steps fine-tune the kept part
alone, so that what the ablation broke can be mended without reading a label.

The objective (the issue leaves it open): rejection-sampled self-distillation. Each step
samples `prompts_per_step × group_size` completions from the deployed policy (kept part
only, at the run's temperature) and maximises, in the deployed forward, the mean token
log-likelihood of those the training grader rewards (`reward > 0`: every env's grader gives a
failed answer 0). The reward is the same gameable signal GRPO learns from; no oracle label
(true pass, hacked, well-formed) is read: the rollouts reach the update as
`TrainingRollout`s inside a `training_scope`, as in a GRPO step. The optimiser is a fresh
AdamW over the kept δS only, at the run's `lr`: the RL moments belong to another objective,
and the quarantine (ablated, so without gradient) does not move. A run does the phase once,
after training, then evaluates again; a checkpoint written after it says so, and one written
before it (a run stopped mid-phase) repeats the whole phase, from the same seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.engine import SamplingParams
from services.trainer.envs import training_scope
from services.trainer.rollouts import POLICY, TrainingRollout
from services.trainer.routed_backward import completion_logprobs

if TYPE_CHECKING:
    from services.trainer.grpo import GRPOTrainer

# Offsets the phase's sampling seeds from the GRPO steps' (seed · 1_000_003 + step).
SEED_OFFSET = 500_000


class CoherencePhase:
    """The coherence steps of one trainer: `update` is the label-free step on rollouts
    already sampled from the deployed policy; `run` samples, updates and logs all K."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        kept = trainer.adapters.kept_parameters()
        cfg = trainer.cfg
        self.optimizer = torch.optim.AdamW(kept, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def sample(self, index: int) -> list[TrainingRollout]:
        """Coherence step `index`'s completions from the deployed policy, without labels
        (the grades stay here: this phase logs none of them)."""
        t, cfg = self.trainer, self.trainer.cfg
        t.sync_weights()
        params = SamplingParams(
            n=cfg.group_size,
            max_tokens=t.max_new,
            temperature=cfg.temperature,
            logprobs=0,
            seed=cfg.seed * 1_000_003 + t.step_index + SEED_OFFSET + index,
            adapter=POLICY,
            adapter_variant="deploy",
        )
        prompts = t.env.sample_prompts(cfg.prompts_per_step, t.rng)
        return [r.for_training() for r in t.rollout.rollouts(prompts, params)]

    def update(self, rolled: list[TrainingRollout]) -> dict[str, float | None]:
        """One step on the rewarded completions: the mean token NLL in the deployed forward,
        into the kept δS only. Returns the step's loss (None: nothing rewarded, no update),
        the share of completions kept and their mean reward."""
        t = self.trainer
        keep = [r for r in rolled if r.reward > 0]
        metrics: dict[str, float | None] = {
            "reward": sum(r.reward for r in rolled) / len(rolled),
            "kept_share": len(keep) / len(rolled),
            "loss": None,
        }
        if not keep:
            return metrics
        batch, old_logp = t._batch(keep)
        self.optimizer.zero_grad(set_to_none=True)
        with t.adapters.deploy():
            logp, mask = completion_logprobs(t.model, batch, old_logp.shape[1])  # [B, W]
        loss = -(logp * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        self.optimizer.step()
        metrics["loss"] = float(loss.detach())
        return metrics

    def run(self, emit: Callable[[dict], None]) -> None:
        """The K steps, each logged as a `coherence` record, then an evaluation (the run's
        last, so the one a study reads) marked with `coherence_steps`."""
        t, k = self.trainer, self.trainer.cfg.coherence_steps
        for index in range(k):
            rolled = self.sample(index)
            with training_scope("coherence step"):
                metrics = self.update(rolled)
            norms = t.adapters.norms()
            emit(
                {
                    "kind": "coherence", "step": t.step_index, "coherence_step": index + 1,
                    **metrics, "kept_norm": norms.kept, "quarantine_norm": norms.quarantine,
                    "sum_norm": norms.total,
                }
            )  # fmt: skip
        emit({"step": t.step_index, "kind": "eval", "coherence_steps": k, **t.evaluate()})
