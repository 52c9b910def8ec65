"""The Engine deployment's resources (issue 26): each Serve replica holds its engine
replica's `tp * pp` GPUs, so that Ray gives every replica (and every rank) GPUs of its own,
and a TP replica's ranks are reserved together on one node. Also the batch an engine sizes
for its device, which the deployment's `max_ongoing_requests` follows."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.engine.config import BATCH_LIMITS, EngineConfig
from services.gateway.serve_app import (
    ENGINE_CONTROL_CALLS,
    AppArgs,
    build_app,
    engine_resources,
)


def _engine(args: dict):
    gateway = build_app(args)._bound_deployment
    engine = gateway.init_args[0]._bound_deployment
    assert engine.name == "Engine"
    return engine


def test_one_rank_replicas_each_hold_a_gpu():
    engine = _engine({"model": "tiny", "device": "cuda", "num_gpus_per_rank": 1})
    assert engine.ray_actor_options["num_gpus"] == 1
    assert engine._replica_config.placement_group_bundles is None


def test_a_tensor_parallel_replica_reserves_one_gpu_per_rank_on_one_node():
    engine = _engine({"model": "tiny", "device": "cuda", "tp": 2, "pp": 2, "num_gpus_per_rank": 1})
    replica = engine._replica_config
    # Serve places the replica's own actor in the first bundle; the ranks take the others.
    assert replica.placement_group_bundles == [{"CPU": 1}] + [{"GPU": 1}] * 4
    assert replica.placement_group_strategy == "STRICT_PACK"
    assert engine.ray_actor_options.get("num_gpus", 0) == 0


def test_cpu_replicas_ask_for_no_gpu():
    for tp in (1, 2):
        options = engine_resources(AppArgs(model="tiny", device="cpu", tp=tp))
        assert options == {"ray_actor_options": {"num_cpus": 1}}


def test_args_that_would_share_a_gpu_are_refused():
    with pytest.raises(ValidationError, match="needs num_gpus_per_rank: 1"):
        AppArgs(model="tiny", device="cuda", tp=2)
    with pytest.raises(ValidationError, match="use device cuda"):
        AppArgs(model="tiny", device="cuda:1", num_gpus_per_rank=1)


def test_unset_batch_limits_are_sized_for_the_device():
    cuda, cpu = EngineConfig().resolved_for("cuda"), EngineConfig().resolved_for("cpu")
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == BATCH_LIMITS["cuda"] == (256, 8192)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == BATCH_LIMITS["cpu"] == (64, 2048)
    assert EngineConfig(max_num_seqs=8).resolved_for("cuda").max_num_seqs == 8  # the user's


def test_max_ongoing_requests_follow_the_batch_the_engines_size_for_their_device():
    def engine_ongoing(**args) -> int:
        return _engine({"model": "tiny", **args}).max_ongoing_requests

    want = {d: 2 * BATCH_LIMITS[d][0] + ENGINE_CONTROL_CALLS for d in ("cpu", "cuda")}
    assert engine_ongoing(device="cpu") == engine_ongoing(device="auto") == want["cpu"]
    assert engine_ongoing(device="cuda", num_gpus_per_rank=1) == want["cuda"]
    # auto: cuda when the ranks ask Ray for GPUs
    assert engine_ongoing(device="auto", num_gpus_per_rank=1) == want["cuda"]
    assert engine_ongoing(device="cuda", num_gpus_per_rank=1, engine={"max_num_seqs": 8}) == (
        16 + ENGINE_CONTROL_CALLS
    )


def test_an_engine_left_to_its_device_sizes_its_batch_for_it(tiny_checkpoint):
    from services.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny_checkpoint("llama"), EngineConfig(device="cpu", num_kv_blocks=64))
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (64, 2048)
    assert engine.scheduler.max_num_seqs == 64
    assert engine.stats()["config"]["max_num_seqs"] == 64
