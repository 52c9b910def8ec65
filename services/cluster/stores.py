"""Where the cluster's admin state lives: Redis (`RedisStore`) when the cluster has one, else
a named Ray actor (`ActorStore` over `ClusterState`). Both implement `ClusterStore` with the
same outcomes: Redis in one Lua script per change, the actor in one method call, so a change
and its version are one atomic step either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from services.cluster.state import (
    NAMESPACE,
    RECONCILE_PERIOD_S,
    ClusterStore,
    Desired,
    Head,
)
from services.common.errors import (
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)


def cluster_store(redis_url: str | None) -> ClusterStore:
    """The cluster's store: Redis when the cluster has one, else the state actor."""
    return RedisStore(redis_url) if redis_url else ActorStore()


def _outcome(result: list | tuple, name: str) -> tuple[str, int]:
    """A write's (epoch, version), or the error its status stands for."""
    status = result[0]
    if status == "ok":
        return str(result[1]), int(result[2])
    if status == "exists":
        raise InvalidRequestError(
            f"vector '{name}' is already registered; pass overwrite=True to replace it"
        )
    if status == "missing":
        raise NotFoundError(f"no vector named '{name}' is registered")
    raise ServiceUnavailableError(
        "the cluster state is empty (a new cluster, or its store restarted) and the engine "
        "replicas are restoring it: retry shortly"
    )


# -- Redis ------------------------------------------------------------------------------------

_PREFIX = "coxswain:cluster:"
EPOCH_KEY, VERSION_KEY = _PREFIX + "epoch", _PREFIX + "version"
GLOBAL_KEY, VECTORS_KEY = _PREFIX + "global", _PREFIX + "vectors"
CHANGED_CHANNEL = _PREFIX + "changed"
REPORT_PREFIX = _PREFIX + "applied:"

# KEYS: epoch, version, global, vectors. ARGV: op (global | put | drop), name, value JSON
# ("" clears the global spec), overwrite (1/0), channel.
_WRITE = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {'blank'} end
local op, name = ARGV[1], ARGV[2]
if op == 'put' and ARGV[4] ~= '1' and redis.call('HEXISTS', KEYS[4], name) == 1 then
  return {'exists'}
end
if op == 'drop' and redis.call('HEXISTS', KEYS[4], name) == 0 then return {'missing'} end
local version = redis.call('INCR', KEYS[2])
if op == 'global' then
  if ARGV[3] == '' then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], ARGV[3]) end
elseif op == 'put' then
  redis.call('HSET', KEYS[4], name, ARGV[3])
else
  redis.call('HDEL', KEYS[4], name)
end
redis.call('PUBLISH', ARGV[5], epoch .. ' ' .. version)
return {'ok', epoch, version}
"""

# Seed a blank store. KEYS as above. ARGV: new epoch, global JSON or "", channel, then
# name, value JSON pairs. Returns 0 when the store is not blank.
_SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('SET', KEYS[2], 0)
if ARGV[2] ~= '' then redis.call('SET', KEYS[3], ARGV[2]) end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[1] .. ' 0')
return 1
"""

_KEYS = [EPOCH_KEY, VERSION_KEY, GLOBAL_KEY, VECTORS_KEY]


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    from services.controller.connection import REDIS_ERRORS

    try:
        yield
    except REDIS_ERRORS as exc:  # never the URL: it may hold the password
        raise ServiceUnavailableError(
            f"the cluster's Redis did not answer ({type(exc).__name__}: {exc}); retry shortly"
        ) from None


class RedisStore:
    """The desired state in Redis, read and written directly by the gateway and every
    replica. `block_s`: the longest `wait_change` blocks."""

    def __init__(self, url: str, *, block_s: float = RECONCILE_PERIOD_S) -> None:
        from services.controller.connection import connect

        self.client = connect(url, block_s=block_s)
        self._write = self.client.register_script(_WRITE)
        self._seed = self.client.register_script(_SEED)
        self._pubsub: Any = None

    def head(self) -> Head:
        with _redis_errors():
            epoch, version = self.client.mget(EPOCH_KEY, VERSION_KEY)
        return epoch, int(version or 0)

    def desired(self) -> Desired:
        with _redis_errors():
            pipe = self.client.pipeline(transaction=True)  # one consistent snapshot
            pipe.mget(EPOCH_KEY, VERSION_KEY).get(GLOBAL_KEY).hgetall(VECTORS_KEY)
            (epoch, version), spec, vectors = pipe.execute()
        return Desired(
            epoch,
            int(version or 0),
            json.loads(spec) if spec else None,
            {name: json.loads(value) for name, value in vectors.items()},
        )

    def _change(self, op: str, name: str = "", value: str = "", overwrite: bool = False):
        with _redis_errors():
            result = self._write(
                keys=_KEYS, args=[op, name, value, int(overwrite), CHANGED_CHANNEL]
            )
        return _outcome(result, name)

    def set_global(self, spec: Any) -> tuple[str, int]:
        return self._change("global", value="" if spec is None else json.dumps(spec))

    def put_vector(self, name: str, value: Any, overwrite: bool) -> tuple[str, int]:
        return self._change("put", name, json.dumps(value), overwrite)

    def drop_vector(self, name: str) -> tuple[str, int]:
        return self._change("drop", name)

    def seed(self, global_spec: Any, vectors: dict[str, Any]) -> bool:
        spec = "" if global_spec is None else json.dumps(global_spec)
        pairs = [x for name, value in vectors.items() for x in (name, json.dumps(value))]
        with _redis_errors():
            seeded = self._seed(keys=_KEYS, args=[uuid.uuid4().hex, spec, CHANGED_CHANNEL, *pairs])
        return bool(seeded)

    def report(self, replica: str, report: dict, ttl_s: float) -> None:
        with _redis_errors():
            self.client.set(REPORT_PREFIX + replica, json.dumps(report), px=int(ttl_s * 1000))

    def reports(self) -> dict[str, dict]:
        with _redis_errors():
            keys = list(self.client.scan_iter(match=REPORT_PREFIX + "*", count=1000))
            values = self.client.mget(keys) if keys else []
        return {
            key[len(REPORT_PREFIX) :]: json.loads(value)
            for key, value in zip(keys, values, strict=True)
            if value is not None  # expired between SCAN and MGET
        }

    def wait_change(self, head: Head, timeout_s: float) -> None:
        """Return when the state may have changed after `head`, or after `timeout_s`."""
        try:
            with _redis_errors():
                if self._pubsub is None:  # subscribe before reading: no change is missed
                    self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    self._pubsub.subscribe(CHANGED_CHANNEL)
                if self.head() == head:
                    self._pubsub.get_message(timeout=timeout_s)
        except ServiceUnavailableError:
            self._close_pubsub()  # a new connection next time
            raise

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
            self._pubsub = None

    def close(self) -> None:
        self._close_pubsub()
        self.client.close()


# -- a Ray actor (clusters without Redis) -----------------------------------------------------

STATE_ACTOR = "coxswain-cluster-state"


class ClusterState:
    """The desired state in the memory of one Ray actor (`state_actor`); lost when the actor
    dies, after which it starts blank and the replicas seed it again."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.version = 0
        self.global_spec: Any = None
        self.vectors: dict[str, Any] = {}
        self.expires: dict[str, tuple[float, dict]] = {}  # replica -> (deadline, report)
        self.changed = asyncio.Event()  # set, then replaced, on every change

    def head(self) -> Head:
        return self.epoch, self.version

    def desired(self) -> Desired:
        return Desired(self.epoch, self.version, self.global_spec, dict(self.vectors))

    def change(self, op: str, name: str, value: Any, overwrite: bool) -> list:
        """The same checks and outcomes as Redis's `_WRITE` script."""
        if self.epoch is None:
            return ["blank"]
        if op == "put" and not overwrite and name in self.vectors:
            return ["exists"]
        if op == "drop" and name not in self.vectors:
            return ["missing"]
        if op == "global":
            self.global_spec = value
        elif op == "put":
            self.vectors[name] = value
        else:
            del self.vectors[name]
        self.version += 1
        self._notify()
        return ["ok", self.epoch, self.version]

    def seed(self, global_spec: Any, vectors: dict[str, Any]) -> bool:
        if self.epoch is not None:
            return False
        self.epoch, self.version = uuid.uuid4().hex, 0
        self.global_spec, self.vectors = global_spec, dict(vectors)
        self._notify()
        return True

    def report(self, replica: str, report: dict, ttl_s: float) -> None:
        self.expires[replica] = (time.monotonic() + ttl_s, report)

    def reports(self) -> dict[str, dict]:
        now = time.monotonic()
        self.expires = {r: e for r, e in self.expires.items() if e[0] > now}
        return {replica: report for replica, (_, report) in self.expires.items()}

    async def wait_change(self, head: Head, timeout_s: float) -> None:
        if self.head() == head:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout_s)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


def state_actor() -> Any:
    """The cluster's ClusterState actor: named and detached, restarted when it dies, and
    started again (blank) by whoever calls this after it was killed for good."""
    import ray

    return (
        ray.remote(ClusterState)
        .options(
            name=STATE_ACTOR,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
            # Not in the placement group of whichever TP replica starts it first: removing
            # that group would take the cluster's state with it.
            scheduling_strategy="DEFAULT",
        )
        .remote()
    )


class ActorStore:
    """`ClusterStore` over the state actor. A call to a dead actor starts a new one (blank:
    the replicas seed it); a call while it restarts is a ServiceUnavailableError."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.actor = state_actor()

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        for attempt in range(2):
            try:
                ref = getattr(self.actor, method).remote(*args)
                return ray.get(ref, timeout=timeout_s or self.timeout_s)
            except ActorDiedError:  # killed for good: start a new one, once
                if attempt:
                    break
                self.actor = state_actor()
            except (RayActorError, GetTimeoutError):  # restarting, or too busy to answer
                break
        raise ServiceUnavailableError(
            "the cluster state actor is restarting (it holds no state a replica cannot "
            "restore): retry shortly"
        )

    def head(self) -> Head:
        return tuple(self._call("head"))  # type: ignore[return-value]

    def desired(self) -> Desired:
        return self._call("desired")

    def set_global(self, spec: Any) -> tuple[str, int]:
        return _outcome(self._call("change", "global", "", spec, True), "")

    def put_vector(self, name: str, value: Any, overwrite: bool) -> tuple[str, int]:
        return _outcome(self._call("change", "put", name, value, overwrite), name)

    def drop_vector(self, name: str) -> tuple[str, int]:
        return _outcome(self._call("change", "drop", name, None, False), name)

    def seed(self, global_spec: Any, vectors: dict[str, Any]) -> bool:
        return self._call("seed", global_spec, vectors)

    def report(self, replica: str, report: dict, ttl_s: float) -> None:
        self._call("report", replica, report, ttl_s)

    def reports(self) -> dict[str, dict]:
        return self._call("reports")

    def wait_change(self, head: Head, timeout_s: float) -> None:
        self._call("wait_change", head, timeout_s, timeout_s=timeout_s + self.timeout_s)

    def close(self) -> None:
        pass
