"""What every blocking gRPC client here shares: one channel, the bearer-key metadata, a
deadline on each unary call, failures turned back into the exception the server raised
(`errors.error_from_rpc`), the health check, waiting for the channel, and closing it.

The engine, patch-store and controller clients subclass `GrpcClient` and add their stubs
and methods; the asyncio engine client uses `channel_options` and `bearer_metadata`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import CoxswainError, ServiceUnavailableError, error_from_rpc


def channel_options(max_message_bytes: int | None) -> list[tuple[str, Any]]:
    """Channel options raising gRPC's message-size limits (None: gRPC's defaults)."""
    if max_message_bytes is None:
        return []
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer <key>` call metadata, or none without a key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class GrpcClient:
    """A blocking channel to `target` (`host:port`) of the server named `service` (in error
    messages: "<service> at <target>"). `credentials` make the channel TLS; `limit_hint`
    is added to a message gRPC refused as too large."""

    def __init__(
        self,
        target: str,
        *,
        service: str,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int | None = None,
        limit_hint: str = "",
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._where = f"{service} at {target}"
        self._limit_hint = limit_hint
        self._metadata = bearer_metadata(api_key)
        options = channel_options(max_message_bytes)
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(target, options=options)
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def health(self, service: str = "") -> str:
        """The server's health status name (`SERVING`, `NOT_SERVING`, ...); needs no key."""
        request = health_pb2.HealthCheckRequest(service=service)
        status = self._call(self._health.Check, request).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects; ServiceUnavailableError after `timeout_s`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ServiceUnavailableError(
                f"{self._where} not reachable within {timeout_s}s"
            ) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, e: grpc.RpcError) -> CoxswainError:
        return error_from_rpc(e, self._where, limit_hint=self._limit_hint)

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        """One unary call under the deadline, a failure raised as the server's exception."""
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise self._error(e) from None
