"""Starting a blocking-API gRPC server the way every Coxswain service does: one service plus
gRPC Health and reflection, an explicit bind error, and a handle to stop it gracefully."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import CoxswainError

log = logging.getLogger(__name__)


@dataclass
class GrpcServer:
    """A started server: its gRPC server, bound address, and health servicer."""

    server: grpc.Server
    host: str
    port: int
    health: health.HealthServicer

    @property
    def address(self) -> str:
        """`host:port` for a client (IPv6 hosts in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 2.0) -> None:
        """Report NOT_SERVING, let calls in flight finish for `grace_s`, then stop."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops (True) or `timeout_s` passes (False)."""
        return self.server.wait_for_termination(timeout_s)


def start_grpc_server(
    what: str,
    service_name: str,
    add_servicer: Callable[[grpc.Server], None],
    host: str,
    port: int,
    *,
    max_workers: int,
    options: list[tuple[str, Any]] | None = None,
) -> GrpcServer:
    """Serve what `add_servicer` registers (the service `service_name`) on `host:port` (port 0:
    any free port) with Health and reflection; `what` names it in errors and logs."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers, thread_name_prefix=what.replace(" ", "-")),
        # a port in use is an error, not a shared port
        options=[*(options or []), ("grpc.so_reuseport", 0)],
    )
    add_servicer(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError as e:  # grpc raises when it cannot bind
        raise CoxswainError(f"{what} cannot listen on {host}:{port}: {e}") from None
    if bound == 0:
        raise CoxswainError(f"{what} cannot listen on {host}:{port}")
    server.start()
    for service in ("", service_name):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s:%d", what, host, bound)
    return GrpcServer(server=server, host=host, port=bound, health=health_servicer)
