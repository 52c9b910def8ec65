"""The controller as a Ray actor: it owns a `Controller` (and, with `grpc_port`, its gRPC
server), so Ray starts, places and restarts it like every other Coxswain service.

Ray is imported only here, and only when needed. A restarted actor starts a fresh controller
under the same consumer name: it loads the policies and latched conversations saved in
Redis (the `policies` it was started with only seed a group with none saved), then takes
back the entries its previous life read but never acknowledged, so none is lost to the
restart. Pass `max_restarts` (the Serve app passes -1) to have Ray restart it.
"""

from __future__ import annotations

import uuid
from typing import Any

from services.common.auth import ApiKeys
from services.controller.controller import Controller
from services.controller.server import ControllerServer, serve

_ANY_HOST = ("0.0.0.0", "::", "")


class ControllerActor:
    """Owns a `Controller` over `redis_url` with `policies`; `controller_args` go to it
    (group, consumer, max_queue_len, ...). With `grpc_port` (0: any free port) it also serves
    the Controller gRPC service, checking `COXSWAIN_API_KEYS` unless `keys` are given. It
    starts consuming at once unless `autostart=False`."""

    def __init__(
        self,
        redis_url: str,
        policies: list[Any] | None = None,
        *,
        grpc_host: str = "127.0.0.1",  # loopback unless the deployment widens it
        grpc_port: int | None = None,
        keys: ApiKeys | None = None,
        autostart: bool = True,
        **controller_args: Any,
    ) -> None:
        self._controller = Controller(redis_url, policies or [], **controller_args)
        if autostart:  # also after Ray restarts the actor: it re-runs the constructor
            self._controller.start()
        self._server: ControllerServer | None = None
        self._host = grpc_host
        if grpc_port is not None:
            self._server = serve(
                self._controller,
                grpc_host,
                grpc_port,
                keys=keys if keys is not None else ApiKeys.from_env(),
            )

    def start(self) -> dict[str, Any]:
        """Start consuming (idempotent); the status."""
        self._controller.start()
        return self._controller.status()

    def stop(self) -> dict[str, Any]:
        """Stop consuming (the gRPC server keeps answering); the status."""
        self._controller.stop()
        return self._controller.status()

    def status(self) -> dict[str, Any]:
        return self._controller.status()

    def set_policies(self, policies: list[Any], replace: bool = False) -> list[dict[str, Any]]:
        """Add or replace policies (config dicts); the active configs as dicts."""
        active = self._controller.set_policies(policies, replace=replace)
        return [c.model_dump() for c in active]

    def list_policies(self) -> list[dict[str, Any]]:
        return [c.model_dump() for c in self._controller.list_policies()]

    def remove_policy(self, name: str) -> None:
        self._controller.remove_policy(name)

    def grpc_address(self) -> str | None:
        """`host:port` of the gRPC server (the node's IP when bound to all interfaces)."""
        if self._server is None:
            return None
        host = _node_ip() if self._host in _ANY_HOST else self._host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self._server.port}"


def start_controller_actor(
    redis_url: str,
    policies: list[Any] | None = None,
    *,
    name: str | None = None,
    num_cpus: float = 0,
    actor_options: dict[str, Any] | None = None,
    **actor_args: Any,
) -> Any:
    """Start a `ControllerActor` (consuming at once) in the connected Ray cluster; its
    handle. `name` makes it a named actor; `actor_options` (namespace, lifetime, max_restarts,
    ...) go to `ray.remote(...).options`; `actor_args` to the actor.

    The consumer name defaults to the actor's name (or a fresh one): Ray restarts an actor
    with the same arguments, so a restarted actor reclaims its own pending entries at once.
    """
    import ray

    actor_args.setdefault("consumer", name or f"controller-{uuid.uuid4().hex[:8]}")
    return (
        ray.remote(ControllerActor)
        .options(name=name, num_cpus=num_cpus, **(actor_options or {}))
        .remote(redis_url, policies, **actor_args)
    )


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
