"""Admin state every engine replica must share: global steering and the vector registry.

Serve routes each call to one replica, so an admin change cannot be "sent to every
replica". Instead the gateway checks it (with the engine's own checks, before anything is
recorded), records the desired state in a store, and every replica reconciles its engine to
that state (`Reconciler`), including replicas that start or restart later.

Where the state lives. With `redis_url` (the local cluster and the deploy manifests always
set it) the store is Redis (`RedisStore`): no Ray actor holds the state, so no actor's death
loses it, and the gateway and the replicas read it directly. A change is one Lua script that
checks it, bumps the version and publishes the new version, so a change and its version are
one atomic step. Without Redis the store is a named Ray actor (`ActorStore`), restarted when
it dies (`max_restarts=-1`) and started again by its clients when it was killed for good;
its memory is lost with it.

A store can lose everything (`coxswain up`'s Redis keeps nothing on disk; a restarted actor
starts empty). An empty ("blank") store takes no admin writes until an engine replica seeds
it with the state it has applied, under a new epoch; replicas compare content (digests), not
versions, so they converge whatever epoch they come from. The state therefore survives the
loss of its store for as long as one engine replica lives.

Read-your-writes. Every replica reports the (epoch, version) it has applied under a key that
expires `REPORT_TTL_S` after its last refresh, so a dead replica stops counting by itself.
Reconcilers are woken at once by a change (Redis pub/sub; the actor's long poll) and refresh
their report at least every `RECONCILE_PERIOD_S`. An admin write returns once every live
replica reports its version (`wait_applied`), or fails after a bounded wait saying which
replica is at which version: never a silent success.

Bad entries. Should a recorded entry fail on a replica anyway (recorded by an older version,
or by a gateway for another model sharing the Redis), the reconciler skips it, reports it as
rejected, and applies everything else: one entry never stops a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    public_message,
    unwrap_ray_error,
)

log = logging.getLogger(__name__)

STATE_ACTOR = "coxswain-cluster-state"
NAMESPACE = "coxswain"
RECONCILE_PERIOD_S = 0.5  # the longest a replica goes without re-reading the state
REPORT_TTL_S = 5.0  # a replica silent for this long is taken for dead and not waited for

_PREFIX = "coxswain:cluster:"
EPOCH_KEY, VERSION_KEY = _PREFIX + "epoch", _PREFIX + "version"
GLOBAL_KEY, VECTORS_KEY = _PREFIX + "global", _PREFIX + "vectors"
CHANGED_CHANNEL = _PREFIX + "changed"
REPORT_PREFIX = _PREFIX + "applied:"

Head = tuple[str | None, int]  # (epoch, version); epoch None: the store is blank


@dataclass(frozen=True)
class Desired:
    """The desired admin state at one (epoch, version), as JSON data (tensors packed)."""

    epoch: str | None
    version: int
    global_spec: Any  # a steering spec, or None for no global steering
    vectors: dict[str, Any]  # name -> value

    @property
    def head(self) -> Head:
        return self.epoch, self.version


class ClusterStore(Protocol):
    """Where the desired state and the replicas' reports live (`RedisStore`, `ActorStore`).
    Writes return the new (epoch, version); every failure to reach the store is a
    ServiceUnavailableError."""

    def head(self) -> Head: ...
    def desired(self) -> Desired: ...
    def set_global(self, spec: Any) -> tuple[str, int]: ...
    def put_vector(self, name: str, value: Any, overwrite: bool) -> tuple[str, int]: ...
    def drop_vector(self, name: str) -> tuple[str, int]: ...
    def seed(self, global_spec: Any, vectors: dict[str, Any]) -> bool: ...
    def report(self, replica: str, report: dict, ttl_s: float) -> None: ...
    def reports(self) -> dict[str, dict]: ...
    def wait_change(self, head: Head, timeout_s: float) -> None: ...
    def close(self) -> None: ...


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


# -- values as JSON data -----------------------------------------------------------------------


def json_data(value: Any) -> Any:
    """`value` (dicts, lists, pydantic models, tensors) as JSON data; tensors packed, so
    float values survive exactly (`services.common.wire`)."""
    import torch
    from pydantic import BaseModel

    from services.common.wire import pack_tensor

    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, torch.Tensor):
        return pack_tensor(value)
    if isinstance(value, dict):
        return {str(k): json_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_data(v) for v in value]
    return value


def spec_digest(spec: Any) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


# -- read-your-writes -------------------------------------------------------------------------


def wait_applied(
    store: ClusterStore, head: tuple[str, int], timeout_s: float, *, poll_s: float = 0.02
) -> dict[str, dict]:
    """Block until every live replica reports `head` applied; their reports. After
    `timeout_s`, a ServiceUnavailableError naming each replica's version and the one pending."""
    epoch, version = head
    deadline = time.monotonic() + timeout_s
    while True:
        reports = store.reports()
        behind = {
            replica: r
            for replica, r in reports.items()
            if r.get("epoch") != epoch or r.get("version", -1) < version
        }
        if not behind:
            return reports
        if time.monotonic() >= deadline:
            raise ServiceUnavailableError(_pending(version, timeout_s, reports, epoch))
        time.sleep(poll_s)


def _pending(version: int, timeout_s: float, reports: dict[str, dict], epoch: str) -> str:
    def where(replica: str, r: dict) -> str:
        at = f"replica {replica} at version {r.get('version')}"
        if r.get("epoch") != epoch:
            at += " of an earlier state"
        return at + (f" (last error: {r['error']})" if r.get("error") else "")

    shown = "; ".join(where(replica, r) for replica, r in sorted(reports.items()))
    return (
        f"the change was recorded as cluster version {version}, but not every live engine "
        f"replica applied it within {timeout_s:g}s (admin_apply_timeout_s): {shown}. Version "
        f"{version} is pending on the replicas behind it and applies when they catch up; "
        "GET /v1/steering shows each replica's version"
    )


# -- the replica's side ------------------------------------------------------------------------

Apply = Callable[..., Awaitable[Any]]


class Reconciler:
    """Brings one replica's engine to the desired state and reports what it applied.

    `apply(fn, *args)` runs `fn(service, *args)` against the replica's EngineService
    (awaitable). Entries are applied one by one, by content: an entry the engine refuses
    (a 4xx error) is skipped and reported in `rejected`; any other failure leaves the
    version unapplied, so the whole pass is retried.
    """

    def __init__(
        self,
        store: ClusterStore,
        apply: Apply,
        replica: str,
        *,
        period_s: float = RECONCILE_PERIOD_S,
        ttl_s: float = REPORT_TTL_S,
        extra: dict | None = None,
    ) -> None:
        """`extra`: more of this replica to report with its versions (where its engine
        takes generations: `backend`)."""
        self.store, self.apply, self.replica = store, apply, replica
        self.extra = dict(extra or {})
        self.period_s, self.ttl_s = period_s, ttl_s
        self.epoch: str | None = None
        self.version = -1  # nothing applied yet
        self.global_spec: Any = None  # the engine starts with no global steering
        self.vectors: dict[str, tuple[str, Any]] = {}  # name -> (digest, value) applied
        self._rejected: dict[str, tuple[str, str]] = {}  # entry -> (digest, reason)
        self.last_error: str | None = None
        self._stop = threading.Event()

    @property
    def rejected(self) -> dict[str, str]:
        """Entries this replica refused and why: `vector:<name>` or `global`."""
        return {entry: reason for entry, (_, reason) in sorted(self._rejected.items())}

    def report(self) -> dict:
        return {
            **self.extra,
            "epoch": self.epoch,
            "version": self.version,
            "rejected": self.rejected,
            "error": self.last_error,
        }

    async def step(self) -> None:
        """Report (before the first read, so no write committed after it goes unwaited for),
        bring the engine to the desired state, report again. Never raises: a failure is
        kept in `last_error` and the next step retries."""
        try:
            await asyncio.to_thread(self.store.report, self.replica, self.report(), self.ttl_s)
            await self.once()
            self.last_error = None
            await asyncio.to_thread(self.store.report, self.replica, self.report(), self.ttl_s)
        except Exception as exc:
            message = public_message(unwrap_ray_error(exc, "the engine"), 500)
            message = message or type(exc).__name__
            if message != self.last_error:
                log.warning("reconciling admin state failed (retrying): %s", message)
            self.last_error = message

    async def run(self) -> None:
        """`step()` whenever the state changes, and every `period_s` (the report's refresh)."""
        while not self._stop.is_set():
            await self.step()
            if self.last_error is not None:  # the state is still newer: retry after a period
                await asyncio.sleep(self.period_s)
                continue
            try:
                head = (self.epoch, self.version)
                await asyncio.to_thread(self.store.wait_change, head, self.period_s)
            except Exception:  # the store is unreachable: retry after a period
                await asyncio.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()

    async def once(self) -> None:
        """Seed a blank store with what this replica applied, then converge to the store."""
        head = await asyncio.to_thread(self.store.head)
        if head[0] is None:
            values = {name: value for name, (_, value) in self.vectors.items()}
            if await asyncio.to_thread(self.store.seed, self.global_spec, values):
                log.warning(
                    "the cluster state was blank: seeded it with this replica's %d vector(s) "
                    "and %s global steering",
                    len(values),
                    "its" if self.global_spec is not None else "no",
                )
            head = await asyncio.to_thread(self.store.head)
        if head == (self.epoch, self.version):
            return
        await self._converge(await asyncio.to_thread(self.store.desired))

    async def _converge(self, desired: Desired) -> None:
        # Vectors first (the global spec may name one), removals last (it may have named one).
        for name, value in desired.vectors.items():
            digest = spec_digest(value)
            if self.vectors.get(name, ("",))[0] != digest and await self._try(
                f"vector:{name}", digest, _register, name, value
            ):
                self.vectors[name] = (digest, value)
        digest = spec_digest(desired.global_spec)
        if digest != spec_digest(self.global_spec) and await self._try(
            "global", digest, _set_global, desired.global_spec
        ):
            self.global_spec = desired.global_spec
        for name in set(self.vectors) - set(desired.vectors):
            await self.apply(_unregister, name)
            del self.vectors[name]
        for entry in list(self._rejected):
            if entry.startswith("vector:") and entry[len("vector:") :] not in desired.vectors:
                del self._rejected[entry]
        self.epoch, self.version = desired.head

    async def _try(self, entry: str, digest: str, fn: Any, *args: Any) -> bool:
        """Apply one entry; False (recorded in `rejected`) when the engine refuses it."""
        if self._rejected.get(entry, ("",))[0] == digest:
            return False  # refused already: the same value is refused again
        try:
            await self.apply(fn, *args)
        except Exception as exc:
            reason = _refusal(exc)
            if reason is None:
                raise
            log.warning("admin state: skipping %s, which this engine refuses: %s", entry, reason)
            self._rejected[entry] = (digest, reason)
            return False
        self._rejected.pop(entry, None)
        return True


def _refusal(exc: BaseException) -> str | None:
    """Why the engine refused an entry (a 4xx error, also behind a Ray error), or None."""
    err = unwrap_ray_error(exc)
    if isinstance(err, CoxswainError) and 400 <= err.http_status < 500:
        return str(err)
    return None


async def _register(service: Any, name: str, value: Any) -> None:
    service.register_vector(name, value, overwrite=True)


async def _unregister(service: Any, name: str) -> None:
    with contextlib.suppress(NotFoundError):
        service.unregister_vector(name)


async def _set_global(service: Any, spec: Any) -> None:
    if spec is None:
        await service.clear_global_steering()
    else:
        await service.set_global_steering(spec)
