"""The patch store as a Ray actor: the actor owns a `PatchStore` and serves it over gRPC from
its own process, so engines anywhere in the cluster reach it with a `PatchStoreClient`.

The port authenticates with the cluster's API keys plus a service key the actor makes at
start: engines write captures and the gateway reads stats with it, whatever keys users hold
(even none, on an `allow_no_auth` development cluster). The service key never leaves Ray:
clients inside the cluster ask the actor for it (`endpoint()`), and whoever can call Ray
actors already controls the cluster.

The actor is restartable (`max_restarts=-1` by default). A restarted actor starts an empty
store on a new port with a new service key: clients built on `actor_target(...)` re-resolve
the endpoint when the old one fails, and the new store answers runs it lost with
RunNotFoundError saying the store restarted.

Ray is imported only here and in `endpoint.actor_resolver`, and only when needed; the rest of
the patch store runs without it.
"""

from __future__ import annotations

import secrets
from typing import Any

from services.common.auth import ApiKey, ApiKeys
from services.patch_store.endpoint import ACTOR_SCHEME, PatchStoreEndpoint
from services.patch_store.server import DEFAULT_MAX_MESSAGE_BYTES, PatchStoreServer, serve
from services.patch_store.store import DEFAULT_MAX_LEASE_S, PatchStore

_ANY_HOST = ("0.0.0.0", "::", "")
SERVICE_KEY_NAME = "patch-store-service"


class PatchStoreActor:
    """Owns a `PatchStore` of `budget_bytes` and a gRPC server for it on `host:port` (port 0:
    any free port; host "0.0.0.0" to take connections from other nodes). `address()` names
    the node's IP when bound to all interfaces. `keys` are accepted beside the service key.
    `max_lease_s` and `max_lease_bytes_per_reader` bound leases (see `PatchStore`)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        keys: ApiKeys | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_lease_s: float = DEFAULT_MAX_LEASE_S,
        max_lease_bytes_per_reader: int | None = None,
    ) -> None:
        import ray

        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._store = PatchStore(
            budget_bytes,
            max_lease_s=max_lease_s,
            max_lease_bytes_per_reader=max_lease_bytes_per_reader,
            restarted=restarted,
        )
        self._service_key = secrets.token_urlsafe(32)
        service = ApiKey(SERVICE_KEY_NAME, "admin", self._service_key)
        accepted = ApiKeys([*(keys.keys if keys is not None else []), service])
        self._server: PatchStoreServer = serve(
            self._store, host, port, max_message_bytes, keys=accepted
        )
        self._host = _node_ip() if host in _ANY_HOST else host

    def address(self) -> str:
        """`host:port` to give a `PatchStoreClient`."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._server.port}"

    def endpoint(self) -> PatchStoreEndpoint:
        """The address and the service key (admin scope) for clients inside the cluster."""
        return PatchStoreEndpoint(self.address(), self._service_key)

    def stats(self) -> dict[str, int]:
        """The store's `stats()`."""
        return self._store.stats()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the gRPC server (the actor itself lives on until killed)."""
        self._server.stop(grace_s)


def start_patch_store_actor(
    budget_bytes: int,
    *,
    keys: ApiKeys | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_lease_s: float = DEFAULT_MAX_LEASE_S,
    max_lease_bytes_per_reader: int | None = None,
    name: str | None = None,
    num_cpus: float = 0,
    max_restarts: int = -1,
    **options: Any,
) -> Any:
    """Start a `PatchStoreActor` in the connected Ray cluster; its actor handle. `name` makes it
    a named actor (then `actor_target(name, namespace)` is its clients' target); other
    `options` (namespace, lifetime, resources, ...) go to `ray.remote(...).options`. It is
    restarted when it dies unless `max_restarts` says otherwise."""
    import ray

    actor_cls = ray.remote(PatchStoreActor)
    return actor_cls.options(
        name=name, num_cpus=num_cpus, max_restarts=max_restarts, **options
    ).remote(
        budget_bytes,
        keys=keys,
        host=host,
        port=port,
        max_message_bytes=max_message_bytes,
        max_lease_s=max_lease_s,
        max_lease_bytes_per_reader=max_lease_bytes_per_reader,
    )


def actor_target(name: str, namespace: str) -> str:
    """The client target naming the patch-store actor `name` in `namespace`: a
    `PatchStoreClient` given it resolves the actor's endpoint, again after a restart."""
    return f"{ACTOR_SCHEME}{namespace}/{name}"


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
