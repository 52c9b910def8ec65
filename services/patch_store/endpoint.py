"""Where a patch store listens, and how a client finds the cluster's patch-store actor again.

Both the client (which follows a store that moved) and the actor (which hands out its
endpoint) speak these types; they live here so that neither module imports the other. Ray
is imported only when a `ray-actor://` target is resolved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from services.common.errors import ServiceUnavailableError

ACTOR_SCHEME = "ray-actor://"  # a target naming the cluster's patch-store actor


@dataclass(frozen=True)
class PatchStoreEndpoint:
    """Where a patch store listens and the bearer key to call it with."""

    address: str  # host:port
    api_key: str | None = None

    def __repr__(self) -> str:  # never log a key
        return f"PatchStoreEndpoint(address={self.address!r})"


Resolver = Callable[[], PatchStoreEndpoint]


def actor_resolver(target: str, *, timeout_s: float = 60.0) -> Resolver:
    """A resolver of `ray-actor://<namespace>/<name>`: the actor's current endpoint (waiting
    up to `timeout_s` for one that is restarting), ServiceUnavailableError when there is none."""
    namespace, _, name = target.removeprefix(ACTOR_SCHEME).partition("/")
    if not namespace or not name:
        raise ValueError(f"a patch store actor target reads {ACTOR_SCHEME}<namespace>/<name>")

    def resolve() -> PatchStoreEndpoint:
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                handle = ray.get_actor(name, namespace=namespace)
                return cast(
                    PatchStoreEndpoint, ray.get(handle.endpoint.remote(), timeout=timeout_s)
                )
            except ray.exceptions.ActorUnavailableError as e:  # restarting: ask again
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                error: Exception = e
            except (ValueError, ray.exceptions.RayError) as e:  # gone for good, or timed out
                error = e
            raise ServiceUnavailableError(
                f"the patch store actor {name!r} (namespace {namespace!r}) is not reachable: "
                f"{type(error).__name__}: {str(error)[:200]}"
            ) from None

    return resolve
