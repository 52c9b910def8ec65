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

Here: what the state is (`Desired` at a `Head`), what a store must do (`ClusterStore`), how
values become JSON data, and the gateway's wait for every replica (`wait_applied`). The two
stores are in `stores.py`, the replica's side (`Reconciler`) in `reconciler.py`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.errors import ServiceUnavailableError

NAMESPACE = "coxswain"
RECONCILE_PERIOD_S = 0.5  # the longest a replica goes without re-reading the state
REPORT_TTL_S = 5.0  # a replica silent for this long is taken for dead and not waited for

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
