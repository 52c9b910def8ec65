"""The cluster's admin state against a real redis-server (and a real Ray for the actor
store), with real engines: a recorded entry an engine refuses is skipped and reported, never
fatal; the state survives its store's loss and a replica's restart; a write waits for every
live replica, and a dead one does not block it for longer than its report lives."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from services.cluster.reconciler import Reconciler
from services.cluster.state import ClusterStore, json_data, wait_applied
from services.cluster.stores import ActorStore, RedisStore
from services.common.errors import ServiceUnavailableError
from services.controller.redis_server import RedisServer
from services.engine.service import EngineService
from tests.local_ray import start_local_ray

ENGINE = {"device": "cpu", "dtype": "float32"}
H = 64  # the tiny llama's hidden size


def _vec(seed: int) -> dict:
    return json_data(torch.randn(H, generator=torch.Generator().manual_seed(seed)))


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


class Replica:
    """One engine and its reconciler, run in a thread the way an Engine replica runs it."""

    def __init__(self, model, store: ClusterStore, name: str, ttl_s: float = 5.0):
        self.service = EngineService.from_model(model, model_id="tiny", **ENGINE)
        self.reconciler = Reconciler(store, self._apply, name, ttl_s=ttl_s)
        asyncio.run(self.reconciler.step())  # as the replica's __init__ does: never raises
        self.thread = threading.Thread(
            target=asyncio.run, args=(self.reconciler.run(),), daemon=True
        )
        self.thread.start()

    async def _apply(self, fn, *args):
        result = fn(self.service, *args)
        if hasattr(result, "__await__"):
            result = await result
        return result

    def vectors(self) -> set[str]:
        return {v["name"] for v in self.service.list_vectors()}

    def global_spec(self):
        return self.service.steering_state()["global_spec"]

    def stop(self) -> None:
        self.reconciler.stop()
        self.thread.join(10)
        asyncio.run(self.service.shutdown())


def _retry(write, timeout_s: float = 30.0):
    """`write()` once the store takes writes again (a blank store answers 503 until a
    replica seeded it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return write()
        except ServiceUnavailableError:
            assert time.monotonic() < deadline, "the store never took writes again"
            time.sleep(0.1)


def test_an_entry_the_engine_refuses_is_skipped_and_reported(model, redis_server):
    store = RedisStore(redis_server.url)
    a = Replica(model, store, "a")
    try:
        # Recorded as an older gateway did (no name check), or by a gateway for a model of
        # another width sharing the Redis: every engine refuses these.
        _retry(lambda: store.put_vector("a" * 129, _vec(0), False))
        store.put_vector("too-wide", json_data(torch.ones(H + 1)), False)
        store.put_vector("good", _vec(1), False)
        head = store.set_global({"vectors": [{"layers": [0], "vector": "good"}]})
        reports = wait_applied(store, head, 30)
        assert set(reports["a"]["rejected"]) == {f"vector:{'a' * 129}", "vector:too-wide"}
        assert "invalid vector name" in reports["a"]["rejected"][f"vector:{'a' * 129}"]
        assert "hidden size 65" in reports["a"]["rejected"]["vector:too-wide"]
        assert a.vectors() == {"good"} and a.global_spec()["vectors"][0]["vector"] == "good"

        # A replica starting while the bad entries are recorded starts and has the rest.
        b = Replica(model, RedisStore(redis_server.url), "b")
        try:
            assert b.reconciler.last_error is None and b.reconciler.version == head[1]
            assert b.vectors() == {"good"} and b.global_spec() == a.global_spec()
            # Later writes still apply everywhere; deleting a bad entry clears its report.
            reports = wait_applied(store, store.drop_vector("a" * 129), 30)
            reports = wait_applied(store, store.put_vector("later", _vec(2), False), 30)
            assert a.vectors() == b.vectors() == {"good", "later"}
            assert {r: set(rep["rejected"]) for r, rep in reports.items()} == {
                "a": {"vector:too-wide"},
                "b": {"vector:too-wide"},
            }
        finally:
            b.stop()
    finally:
        a.stop()


def test_the_state_survives_redis_losing_it_and_a_replica_restart(model, redis_server):
    store = RedisStore(redis_server.url)
    a = Replica(model, store, "a")
    try:
        _retry(lambda: store.put_vector("kept", _vec(3), False))
        wait_applied(store, store.set_global({"vectors": [{"layers": [1], "vector": "kept"}]}), 30)
        redis_server.restart()  # comes back empty: it keeps nothing on disk
        # The live replica seeds the blank store with what it applied; writes work again.
        head = _retry(lambda: store.put_vector("after", _vec(4), False))
        wait_applied(store, head, 30)
        desired = store.desired()
        assert set(desired.vectors) == {"kept", "after"}
        assert desired.global_spec["vectors"][0]["vector"] == "kept"
        # An engine replica restarted afterwards gets the vectors and the global steering.
        b = Replica(model, RedisStore(redis_server.url), "b")
        try:
            assert b.vectors() == {"kept", "after"}
            assert b.global_spec()["vectors"][0]["vector"] == "kept"
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_write_waits_for_every_live_replica_but_not_for_a_dead_one(model, redis_server):
    store = RedisStore(redis_server.url)
    a = Replica(model, store, "a")
    b = Replica(model, RedisStore(redis_server.url), "b")
    try:
        head = _retry(lambda: store.put_vector("x", _vec(5), False))
        reports = wait_applied(store, head, 30)
        assert {r: rep["version"] for r, rep in reports.items()} == {"a": head[1], "b": head[1]}
        assert a.vectors() == b.vectors() == {"x"}  # both, as soon as the write returned

        b.stop()  # b dies: it stops reporting, and its report expires after its TTL
        head = store.drop_vector("x")
        with pytest.raises(ServiceUnavailableError) as info:
            wait_applied(store, head, 0.0)  # b's report has not expired yet
        message = str(info.value)
        assert f"cluster version {head[1]}" in message
        assert f"replica b at version {head[1] - 1}" in message
        reports = wait_applied(store, head, 30)  # once b's report expired: a alone
        assert set(reports) == {"a"} and a.vectors() == set()
    finally:
        a.stop()


def _kill(ray, store: ActorStore, no_restart: bool) -> None:
    """Kill the state actor and wait until it is gone (`ray.kill` returns before that)."""
    epoch = store.head()[0]
    ray.kill(store.actor, no_restart=no_restart)
    deadline = time.monotonic() + 30
    while _retry(store.head)[0] == epoch:
        assert time.monotonic() < deadline, "the state actor outlived ray.kill"
        time.sleep(0.05)


def test_the_actor_store_is_restartable_and_reseeded_by_the_replicas(model):
    ray = pytest.importorskip("ray")
    start_local_ray(num_cpus=1)
    try:
        store = ActorStore()
        a = Replica(model, store, "a")
        try:
            _retry(lambda: store.put_vector("v", _vec(6), False))
            wait_applied(store, store.set_global({"vectors": [{"layers": [1], "vector": "v"}]}), 30)
            _kill(ray, store, no_restart=True)  # for good: the next call starts a new one
            head = _retry(lambda: store.put_vector("w", _vec(7), False))
            wait_applied(store, head, 30)
            assert set(store.desired().vectors) == {"v", "w"}
            _kill(ray, store, no_restart=False)  # killed and restarted by Ray, blank
            head = _retry(lambda: store.drop_vector("w"))
            wait_applied(store, head, 30)
            b = Replica(model, ActorStore(), "b")
            try:
                wait_applied(store, _retry(store.head), 30)  # b too, once it reported
                assert a.vectors() == b.vectors() == {"v"}
                assert b.global_spec()["vectors"][0]["vector"] == "v"
            finally:
                b.stop()
        finally:
            a.stop()
    finally:
        ray.shutdown()
