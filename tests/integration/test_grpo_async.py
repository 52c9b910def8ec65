"""Asynchronous GRPO rollouts through a real Redis stream, produced by real Ray actors.

The producers keep sampling and grading while the trainer trains; every group carries the
policy version that sampled it, the trainer keeps only groups within `max_staleness` of its
own version and drops (and counts) the rest, a group at the current version carries exactly
the trainer's logprobs, and a dead producer fails `take()` with a clear error instead of a
hang.
"""

from __future__ import annotations

import time

import pydantic
import pytest
import torch

from services.controller.redis_server import RedisServer
from services.trainer.async_rollouts import AsyncRollouts, RolloutStreamError
from services.trainer.grpo import GRPOConfig, GRPOTrainer, read_log, run
from services.trainer.weight_sync import engine_adapter_state

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def _config(tiny_checkpoint, tmp_path, redis_url, **kw) -> GRPOConfig:
    base = dict(
        model=str(tiny_checkpoint("llama")),
        env="addition",
        steps=3,
        prompts_per_step=2,
        group_size=3,
        eval_prompts=4,
        eval_every=3,
        lr=0.2,
        rollout_workers=2,
        rollout_mode="async",
        redis_url=redis_url,
        max_staleness=1,
        out_dir=str(tmp_path),
    )
    return GRPOConfig(**{**base, **kw})


def test_async_mode_needs_workers_and_redis(tiny_checkpoint, tmp_path):
    with pytest.raises(pydantic.ValidationError, match="rollout_workers >= 1 and a redis_url"):
        GRPOConfig(model=str(tiny_checkpoint("llama")), rollout_mode="async", rollout_workers=2)
    with pytest.raises(pydantic.ValidationError, match="rollout_workers >= 1"):
        GRPOConfig(model=str(tiny_checkpoint("llama")), rollout_mode="async", redis_url="redis://x")


def test_async_run_bounds_staleness_and_logs_it(ray_cluster, redis_url, tiny_checkpoint, tmp_path):
    records = run(_config(tiny_checkpoint, tmp_path, redis_url), resume=False)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0 <= r["staleness"] <= 1 for r in train)
    assert read_log(tmp_path / "metrics.jsonl")[-1]["kind"] == "eval"
    assert (tmp_path / "rates.png").is_file()


def test_fresh_groups_carry_the_trainers_logprobs_and_stale_ones_are_dropped(
    ray_cluster, redis_url, tiny_checkpoint, tmp_path
):
    trainer = GRPOTrainer(_config(tiny_checkpoint, tmp_path, redis_url, max_staleness=0))
    rollout = trainer.rollout
    assert isinstance(rollout, AsyncRollouts)
    try:
        trainer.step()
        trainer.step()
        # Producers refill the queue under the versions published so far (on a loaded
        # machine they may not have yet: wait for one group); then jump ahead.
        deadline = time.monotonic() + 120
        while rollout.stream.backlog() < 1:
            assert time.monotonic() < deadline, "the producers never refilled the stream"
            time.sleep(0.05)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in trainer.adapters.modules.values():
                m.delta_s.copy_(2 * torch.randn(m.delta_s.shape, generator=g))
        version = trainer.step_index + 10
        rollout.publish(version, engine_adapter_state(trainer.adapters))
        rolled, took = rollout.take(2, version)
        assert took.dropped >= 1  # the backlog sampled under older weights
        assert took.staleness == 0
        assert {r.policy_version for r in rolled} == {version}
        assert len(rolled) == 2 * trainer.cfg.group_size
        batch, old_logp = trainer._batch([r.for_training() for r in rolled])
        with torch.no_grad():
            logp, mask = trainer._completion_logp(batch, old_logp.shape[1])
        torch.testing.assert_close(logp[mask], old_logp[mask], atol=1e-4, rtol=0)

        for actor in rollout.actors:  # every producer dies: take() fails loudly
            ray.kill(actor)
        with pytest.raises(RolloutStreamError, match="producer"):
            rollout.take(2, version + 1)
    finally:
        trainer.close()
