"""Admin state every engine replica must share: global steering and the vector registry.

Serve routes each call to one replica, so an admin change cannot be "sent to every
replica". Instead the gateway records it here (a named Ray actor) and every replica
reconciles against it in the background (`Reconciler`), including replicas that start or
restart later. Changes are checked against a live replica before they are recorded, so a
bad spec is a 4xx at the call, and reach every replica within `RECONCILE_PERIOD_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from typing import Any

from services.common.errors import InvalidRequestError, NotFoundError

log = logging.getLogger(__name__)

STATE_ACTOR = "coxswain-cluster-state"
NAMESPACE = "coxswain"
RECONCILE_PERIOD_S = 0.5


class ClusterState:
    """Desired admin state with a version that grows with every change (a Ray actor)."""

    def __init__(self) -> None:
        self.version = 0
        self.global_spec: Any = None
        self.vectors: dict[str, tuple[int, Any]] = {}  # name -> (version set, value)

    def set_global(self, spec: Any) -> int:
        self.version += 1
        self.global_spec = spec
        return self.version

    def put_vector(self, name: str, value: Any, overwrite: bool) -> int:
        if name in self.vectors and not overwrite:
            raise InvalidRequestError(
                f"vector '{name}' is already registered; pass overwrite=True to replace it"
            )
        self.version += 1
        self.vectors[name] = (self.version, value)
        return self.version

    def drop_vector(self, name: str) -> int:
        if name not in self.vectors:
            raise NotFoundError(f"no vector named '{name}' is registered")
        del self.vectors[name]
        self.version += 1
        return self.version

    def desired(self, since: int = -1) -> dict | None:
        """The whole desired state, or None when nothing changed after version `since`."""
        if since == self.version:
            return None
        return {
            "version": self.version,
            "global_spec": self.global_spec,
            "vectors": {name: list(entry) for name, entry in self.vectors.items()},
        }


def state_actor(create: bool = True) -> Any:
    """The cluster's ClusterState actor (created detached on first use)."""
    import ray

    cls = ray.remote(num_cpus=0)(ClusterState)
    if create:
        return cls.options(
            name=STATE_ACTOR, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote()
    return ray.get_actor(STATE_ACTOR, namespace=NAMESPACE)


def spec_digest(spec: Any) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


class Reconciler:
    """Brings one replica's engine to the desired state, polling the state actor."""

    def __init__(self, state: Any, apply: Any):
        """`apply(fn)` runs `fn(service)` against the replica's EngineService (awaitable)."""
        self.state, self.apply = state, apply
        self.version = -1
        self.global_digest: str | None = None
        self.vectors: dict[str, int] = {}  # name -> the version it was registered at
        self.last_error: str | None = None

    async def once(self) -> None:
        desired = await self.state.desired.remote(self.version)
        if desired is None:
            return
        spec = desired["global_spec"]
        digest = spec_digest(spec)
        # Vectors first: the global spec may name one.
        for name, (version, value) in desired["vectors"].items():
            if self.vectors.get(name) != version:
                await self.apply(_register, name, value)
                self.vectors[name] = version
        for name in set(self.vectors) - set(desired["vectors"]):
            await self.apply(_unregister, name)
            del self.vectors[name]
        if digest != self.global_digest:
            await self.apply(_set_global, spec)
            self.global_digest = digest
        self.version = desired["version"]

    async def run(self, period_s: float = RECONCILE_PERIOD_S) -> None:
        while True:
            try:
                await self.once()
                self.last_error = None
            except Exception as exc:  # keep serving; retry next period
                if repr(exc) != self.last_error:
                    log.warning("reconciling admin state failed: %r", exc)
                self.last_error = repr(exc)
            await asyncio.sleep(period_s)


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
