"""The controller as a Ray actor: it consumes from the start, and its policies change through
the actor and through its gRPC server."""

from __future__ import annotations

import pytest
import redis

from services.common.auth import ApiKeys
from services.controller.actor import start_controller_actor
from services.controller.client import ControllerClient
from services.controller.messages import READOUT_STREAM, ReadoutEntry, decode_action, encode_entry
from services.controller.redis_server import RedisServer
from services.engine.interventions.actions import RequestSteeringOverride
from tests.integration.test_controller import wait_for
from tests.local_ray import start_local_ray

ray = pytest.importorskip("ray")

LATCH = {
    "kind": "latch",
    "name": "latch",
    "readout": "p",
    "threshold": 0.0,
    "steering": {"vectors": [{"layers": [0], "vector": [1.0, 2.0]}]},
}


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_cpus=1)
    yield
    ray.shutdown()


@pytest.mark.slow  # starting Ray takes most of it
def test_actor_runs_a_controller_with_its_grpc_server(local_ray):
    with RedisServer() as server:
        actor = start_controller_actor(
            server.url, [LATCH], name="ctl", grpc_host="127.0.0.1", grpc_port=0, keys=ApiKeys()
        )
        wait_for(lambda: ray.get(actor.status.remote(), timeout=60)["ready"], "the actor")
        status = ray.get(actor.status.remote(), timeout=30)
        assert (status["running"], status["consumer"]) == (True, "ctl")

        rdb = redis.Redis.from_url(server.url, decode_responses=True)
        for i, score in enumerate((-1.0, 1.0)):
            rdb.xadd(READOUT_STREAM, encode_entry(ReadoutEntry("r0", f"q{i}", 0, 0, {"p": score})))
        status = wait_for(
            lambda: (s := ray.get(actor.status.remote(), timeout=30))["processed"] == 2 and s,
            "two entries",
        )
        assert status["actions_written"] == {"r0": 1}  # only q1 fired
        assert rdb.llen("coxswain:actions:r0") == 1

        address = ray.get(actor.grpc_address.remote(), timeout=30)
        with ControllerClient(address) as client:
            assert [p.name for p in client.list_policies()] == ["latch"]
            client.set_policies([{**LATCH, "name": "second", "threshold": 5.0}])
        names = [p["name"] for p in ray.get(actor.list_policies.remote(), timeout=30)]
        assert names == ["latch", "second"]

        ray.get(actor.stop.remote(), timeout=30)
        assert ray.get(actor.status.remote(), timeout=30)["running"] is False
        ray.kill(actor)
        rdb.close()


@pytest.mark.slow
def test_a_restarted_actor_has_its_policies_and_latches_back(local_ray):
    """Ray restarts a killed controller actor with its original arguments; what changed since
    (a policy added, a conversation latched) comes back from Redis, and steering goes on."""
    scale = {"kind": "scale", "name": "gain", "readout": "p", "target": 0.0, "k": 1.0}
    with RedisServer() as server:
        rdb = redis.Redis.from_url(server.url, decode_responses=True)
        actor = start_controller_actor(
            server.url, [LATCH], name="ctl-restart", actor_options={"max_restarts": -1}
        )
        wait_for(lambda: ray.get(actor.status.remote(), timeout=60)["ready"], "the actor")
        ray.get(actor.set_policies.remote([scale]), timeout=30)
        rdb.xadd(READOUT_STREAM, encode_entry(ReadoutEntry("r0", "q1", 0, 0, {"p": 1.0}, "c1")))
        wait_for(lambda: ray.get(actor.status.remote())["processed"] == 1, "the latch")

        ray.kill(actor, no_restart=False)
        # a new life: ready, and nothing processed yet (the old one had processed q1)
        wait_for(
            lambda: (s := _status_after_restart(actor))["ready"] and s["processed"] == 0,
            "the restarted actor",
            timeout_s=180,  # a new worker process: slow on a loaded machine
        )
        names = [p["name"] for p in ray.get(actor.list_policies.remote(), timeout=30)]
        assert names == ["latch", "gain"]
        assert ray.get(actor.status.remote(), timeout=30)["latched_conversations"] == 1
        # conv c1's next request fires nothing itself: only the restored latch steers it
        rdb.xadd(READOUT_STREAM, encode_entry(ReadoutEntry("r0", "q2", 0, 0, {"p": -1.0}, "c1")))
        wait_for(lambda: "q2" in _overridden(rdb), "the override of q2", timeout_s=60)
        ray.kill(actor)
        rdb.close()


def _status_after_restart(actor) -> dict:
    try:
        return ray.get(actor.status.remote(), timeout=30)
    except ray.exceptions.RayActorError:  # still restarting
        return {"ready": False, "processed": None}


def _overridden(rdb) -> list[str]:
    """Request ids of the steering overrides queued for replica r0."""
    actions = [decode_action(raw)[0] for raw in rdb.lrange("coxswain:actions:r0", 0, -1)]
    return [a.request_id for a in actions if isinstance(a, RequestSteeringOverride)]
