"""A controller that restarts keeps its policies and latched conversations (they live in
Redis), reads nothing before it has them back, reports a failure only while it lasts, and
lets the action queues of replicas that died expire. Real redis-server, no engine: entries
are written to the stream as an engine's link writes them."""

from __future__ import annotations

import json
import uuid

import pytest
import redis

from services.common.errors import ServiceUnavailableError
from services.controller import saved_state
from services.controller.controller import Controller
from services.controller.messages import (
    READOUT_STREAM,
    ReadoutEntry,
    action_queue_key,
    decode_action,
    encode_entry,
)
from services.controller.policies import parse_policy
from services.controller.redis_server import RedisServer
from services.engine.interventions.actions import RequestSteeringOverride
from tests.integration.test_controller import TIMEOUT_S, wait_for

LATCH = {
    "kind": "latch",
    "name": "latch",
    "readout": "p",
    "threshold": 0.0,
    "steering": {"vectors": [{"layers": [0], "vector": [1.0, 2.0]}]},
}
SCALE = {"kind": "scale", "name": "gain", "readout": "p", "target": 0.0, "k": 1.0}


@pytest.fixture()
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture()
def rdb(server):
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def started(server):
    """`started(policies, **kw)`: a started, ready controller on `server`, stopped after."""
    controllers: list[Controller] = []

    def make(policies=(), **kw) -> Controller:
        kw.setdefault("block_ms", 50)
        kw.setdefault("backoff_max_s", 0.2)
        c = Controller(server.url, list(policies), **kw).start()
        assert c.wait_ready(TIMEOUT_S)
        controllers.append(c)
        return c

    yield make
    for c in controllers:
        c.stop()


def publish(rdb, replica: str, request: str, score: float, conversation: str | None) -> None:
    entry = ReadoutEntry(replica, request, 0, 0, {"p": score}, conversation_id=conversation)
    rdb.xadd(READOUT_STREAM, encode_entry(entry))


def overrides(rdb, replica: str) -> list[str]:
    """Request ids of the steering overrides queued for `replica`."""
    out = []
    for raw in rdb.lrange(action_queue_key(replica), 0, -1):
        action, _ = decode_action(raw)
        if isinstance(action, RequestSteeringOverride):
            out.append(action.request_id)
    return out


def test_policies_and_latches_survive_a_restart_and_steer_what_came_meanwhile(rdb, started):
    group = f"g-{uuid.uuid4().hex[:6]}"
    a = started([LATCH], group=group, consumer="a")
    a.set_policies([SCALE])  # an admin change after start
    publish(rdb, "r0", "q1", 1.0, "conv-1")  # fires: conv-1 latches
    wait_for(lambda: a.status()["processed"] == 1, "A to handle the entry")
    assert overrides(rdb, "r0") == ["q1"]
    a.stop()

    # While no controller runs, conv-1's next request starts (below the threshold: only the
    # latch steers it) and another conversation's request fires nothing.
    publish(rdb, "r0", "q2", -1.0, "conv-1")
    publish(rdb, "r0", "q3", -1.0, "conv-2")

    # A new controller (a new process: no policies of its own) in the same group.
    b = started([], group=group, consumer="b")
    assert b.list_policies() == [parse_policy(LATCH), parse_policy(SCALE)]
    status = wait_for(lambda: (s := b.status())["processed"] == 2 and s, "B to catch up")
    assert status["policies_loaded"] and status["latched_conversations"] == 1
    assert overrides(rdb, "r0") == ["q2", "q1"]  # the latch held across the restart

    b.remove_policy("gain")
    c = started([LATCH, SCALE], group=group, consumer="c")  # its seed loses to what is saved
    assert [p.name for p in c.list_policies()] == ["latch"]


def test_an_empty_redis_gets_the_policies_and_latches_back(server, rdb, started):
    group = f"g-{uuid.uuid4().hex[:6]}"
    a = started([LATCH], group=group)
    publish(rdb, "r0", "q1", 1.0, "conv-9")
    wait_for(lambda: a.status()["processed"] == 1, "the entry")
    server.restart()  # empty: stream, group, saved policies and latches all gone
    rdb.connection_pool.reset()
    # The policies and the latches are written back one after the other: wait for both.
    latched = saved_state.latched_key(group, "latch")
    wait_for(
        lambda: rdb.exists(saved_state.policies_key(group)) and rdb.exists(latched),
        "the policies and latches to be re-saved",
    )
    saved = json.loads(rdb.get(saved_state.policies_key(group)))
    assert [p["name"] for p in saved] == ["latch"]
    assert rdb.zrange(latched, 0, -1) == ["conv-9"]


def test_an_admin_change_while_redis_is_down_fails_and_changes_nothing(server, started):
    a = started([LATCH], group=f"g-{uuid.uuid4().hex[:6]}")
    server.stop()
    with pytest.raises(ServiceUnavailableError, match="nothing changed"):
        a.set_policies([SCALE])
    server.start()
    assert a.list_policies() == [parse_policy(LATCH)]


def test_last_error_is_set_during_an_outage_and_clears_after_recovery(server, started):
    a = started([LATCH], group=f"g-{uuid.uuid4().hex[:6]}")
    assert a.status()["last_error"] is None
    server.stop()
    down = wait_for(lambda: (s := a.status())["last_error"] and s, "the failure to show")
    assert not down["connected"] and down["redis_errors"] >= 1
    server.start()
    up = wait_for(lambda: (s := a.status())["connected"] and s, "the reconnect")
    assert up["last_error"] is None and up["redis_errors"] >= 1  # history stays counted


def test_the_action_queue_of_a_replica_that_died_expires(rdb, started):
    a = started([LATCH], group=f"g-{uuid.uuid4().hex[:6]}", action_ttl_s=1)
    publish(rdb, "gone", "q1", 1.0, None)  # no engine drains replica "gone"
    wait_for(lambda: a.status()["actions_written"].get("gone") == 1, "the action")
    assert 0 < rdb.ttl(action_queue_key("gone")) <= 1
    wait_for(lambda: not rdb.exists(action_queue_key("gone")), "the queue to expire")
