"""What every Coxswain gRPC server shares: starting a blocking-API server the way every
service does (one service plus gRPC Health and reflection, an explicit bind error, and a
handle to stop it gracefully), the per-method key check and error mapping
(`authenticated_rpc`), and bounding the identifiers a request carries.

Identifiers (request, run, conversation and vector ids, site names, ...) are refused past
`MAX_ID_CHARS` before any work: an id is quoted back in errors and sent in metadata, and a
huge one would otherwise come back as gRPC's own "metadata size exceeds limit" text. Only
the fields that hold free text (`FREE_TEXT_FIELDS`) may be longer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import Scope
from services.common.errors import CoxswainError, InvalidRequestError, grpc_abort_args

log = logging.getLogger(__name__)

MAX_ID_CHARS = 256
# Fully qualified string fields that hold text, not identifiers: prompts, stop strings, a
# sweep's text span, a file path on the engine's host.
FREE_TEXT_FIELDS = frozenset(
    {
        "coxswain.v1.Prompt.text",
        "coxswain.v1.ChatMessage.content",
        "coxswain.v1.SamplingParams.stop",
        "coxswain.v1.SweepPosition.span",
        "coxswain.v1.TokenRef.text",
        "coxswain.v1.RegisterVectorRequest.path",
    }
)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def authenticated_rpc(what: str, scope: Scope) -> Callable[[_Method], _Method]:
    """A servicer method decorator: check the caller's bearer key (`self.keys`, an ApiKeys)
    for `scope` and the request's field lengths before any work (before a request stream is
    read), then end the call with our exceptions as gRPC statuses (`grpc_abort_args`);
    anything else is INTERNAL and logged under `what`. The server keeps serving either way."""

    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                self.keys.check(dict(context.invocation_metadata()).get("authorization"), scope)
                check_field_lengths(request)
                return method(self, request, context)
            except Exception as e:
                if not isinstance(e, CoxswainError):
                    if not context.is_active():  # the client went away mid-stream
                        return None
                    log.exception("%s %s failed", what, method.__name__)
                code, details, trailing = grpc_abort_args(e)
                context.set_trailing_metadata(trailing)
                context.abort(code, details)

        return wrapper  # type: ignore[return-value]

    return decorate


def check_field_lengths(message: Any, where: str = "") -> None:
    """InvalidRequestError naming the first string field of `message` (a protobuf message,
    nested messages and map keys included) longer than `MAX_ID_CHARS`, outside
    `FREE_TEXT_FIELDS`. Anything not a message (a request stream) is left to its reader."""
    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.message import Message

    if not isinstance(message, Message):
        return
    for field, value in message.ListFields():
        path = f"{where}.{field.name}" if where else field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key in value:  # a map: its keys are identifiers too
                _check_id(key, f"a key of {path}")
                check_field_lengths(value[key], f"{path}[{key!r}]")
            continue
        items = list(value) if field.is_repeated else [value]
        for i, item in enumerate(items):
            at = f"{path}[{i}]" if field.is_repeated else path
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                check_field_lengths(item, at)
            elif (
                field.type == FieldDescriptor.TYPE_STRING
                and field.full_name not in FREE_TEXT_FIELDS
            ):
                _check_id(item, at)


def _check_id(value: Any, what: str) -> None:
    if isinstance(value, str) and len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(f"{what} is {len(value)} characters long; at most {MAX_ID_CHARS}")


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
