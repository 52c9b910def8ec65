"""The patch store as a Ray actor: the actor owns a `PatchStore` and serves it over gRPC from
its own process, so engines anywhere in the cluster reach it with a `PatchStoreClient`.

Ray is imported only here, and only when needed; the rest of the patch store runs without it.
A restarted actor starts empty: runs do not survive the process.
"""

from __future__ import annotations

from typing import Any

from services.patch_store.server import DEFAULT_MAX_MESSAGE_BYTES, PatchStoreServer, serve
from services.patch_store.store import PatchStore

_ANY_HOST = ("0.0.0.0", "::", "")


class PatchStoreActor:
    """Owns a `PatchStore` of `budget_bytes` and a gRPC server for it on `host:port` (port 0:
    any free port). `address()` names the node's IP when bound to all interfaces."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._store = PatchStore(budget_bytes)
        self._server: PatchStoreServer = serve(self._store, host, port, max_message_bytes)
        self._host = _node_ip() if host in _ANY_HOST else host

    def address(self) -> str:
        """`host:port` to give a `PatchStoreClient`."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._server.port}"

    def stats(self) -> dict[str, int]:
        """The store's `stats()`."""
        return self._store.stats()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the gRPC server (the actor itself lives on until killed)."""
        self._server.stop(grace_s)


def start_patch_store_actor(
    budget_bytes: int,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    name: str | None = None,
    num_cpus: float = 0,
    **options: Any,
) -> Any:
    """Start a `PatchStoreActor` in the connected Ray cluster; its actor handle. `name` makes it
    a named actor; other `options` (namespace, lifetime, max_restarts, resources, ...) go to
    `ray.remote(...).options`."""
    import ray

    actor_cls = ray.remote(PatchStoreActor)
    return actor_cls.options(name=name, num_cpus=num_cpus, **options).remote(
        budget_bytes, host=host, port=port, max_message_bytes=max_message_bytes
    )


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
