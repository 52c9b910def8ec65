"""The Serve deployments' `max_ongoing_requests`, sized from the engine's capacity.

Serve's default (5) capped an engine's batch at 5 requests (20 concurrent requests ran in
four waves) and queued `/health` behind generation; the builder sizes both deployments
from the engine's `max_num_seqs` instead.
"""

from __future__ import annotations

from services.engine.config import EngineConfig
from services.gateway.serve_app import (
    ENGINE_CONTROL_CALLS,
    GATEWAY_MIN_ONGOING,
    build_app,
)


def _ongoing(args: dict) -> tuple[int, int]:
    gateway = build_app(args)._bound_deployment
    engine = gateway.init_args[0]._bound_deployment
    assert (engine.name, gateway.name) == ("Engine", "Gateway")
    return engine.max_ongoing_requests, gateway.max_ongoing_requests


def test_an_engine_replica_takes_a_full_batch_and_as_many_waiting():
    engine, gateway = _ongoing({"model": "tiny"})
    seqs = EngineConfig().resolved_for("cpu").max_num_seqs
    assert engine == 2 * seqs + ENGINE_CONTROL_CALLS
    assert gateway >= max(GATEWAY_MIN_ONGOING, 2 * engine) > engine
    assert engine > 20  # 20 concurrent requests share one batch


def test_the_limits_follow_max_num_seqs_and_the_replica_count():
    engine, gateway = _ongoing({"model": "tiny", "engine": {"max_num_seqs": 8}})
    assert engine == 16 + ENGINE_CONTROL_CALLS and gateway == GATEWAY_MIN_ONGOING
    engine, gateway = _ongoing(
        {"model": "tiny", "engine": {"max_num_seqs": 512}, "engine_replicas": 4}
    )
    assert engine == 1024 + ENGINE_CONTROL_CALLS
    assert gateway == 2 * engine * 4  # every replica's share, with room for the gateway's own
