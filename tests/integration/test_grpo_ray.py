"""GRPO rollouts from Ray actors: weight sync reaches every rollout engine, the rollouts
(generated and graded in the actors, off the trainer) carry the synced policy's logprobs,
and a step and an evaluation run through them."""

from __future__ import annotations

import pytest
import torch

from services.trainer.grpo import GRPOConfig, GRPOTrainer
from services.trainer.metrics import EVAL_RATES

ray = pytest.importorskip("ray")


def test_ray_rollout_workers(ray_cluster, tiny_checkpoint, tmp_path):
    cfg = GRPOConfig(
        model=str(tiny_checkpoint("llama")),
        env="addition",
        steps=1,
        prompts_per_step=4,
        group_size=3,
        eval_prompts=4,
        rollout_workers=2,
        out_dir=str(tmp_path),
    )
    trainer = GRPOTrainer(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy that differs from the base
        for m in trainer.adapters.modules.values():
            m.delta_s.copy_(2 * torch.randn(cfg.rank, generator=g))
    version = trainer.sync_weights()
    assert trainer.rollout.versions() == [version, version]
    prompts = ["12+34=", "5+6=", "70+8=", "9+99="]
    rolled = trainer.rollouts(prompts)
    assert [r.prompt for r in rolled] == [p for p in prompts for _ in range(cfg.group_size)]
    assert all(0.0 <= grade.training_view().reward <= 1.0 for grade in (r.grade for r in rolled))
    batch, old_logp = trainer._batch(rolled)
    with torch.no_grad():
        logp, mask = trainer._completion_logp(batch, old_logp.shape[1])
    torch.testing.assert_close(logp[mask], old_logp[mask], atol=1e-4, rtol=0)
    _, grades, _ = trainer.step()
    assert len(grades) == cfg.prompts_per_step * cfg.group_size
    assert trainer.rollout.versions()[0] > version  # the step synced again
    rates = trainer.evaluate()
    assert set(rates) == {f"{v}_{rate}" for v in ("trained", "deploy") for rate in EVAL_RATES}
