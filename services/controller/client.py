"""A gRPC client of the controller with the Python API of `Controller`'s policy methods.

Errors come back as the exceptions the server raised (`InvalidRequestError`, `NotFoundError`,
`UnauthenticatedError`, ...); an unreachable or slow server raises `ServiceUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc

from services.common.errors import CoxswainError, error_from_rpc
from services.controller import convert
from services.controller.policies import parse_policy
from services.proto.coxswain.v1 import controller_pb2 as pb
from services.proto.coxswain.v1 import controller_pb2_grpc as pb_grpc


class ControllerClient:
    """Talks to a controller server at `address` (`host:port`), with `api_key` as the bearer
    token when the server checks keys. Every call waits at most `timeout_s`."""

    def __init__(self, address: str, *, api_key: str | None = None, timeout_s: float = 10.0):
        self.address, self.timeout_s = address, timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.ControllerStub(self._channel)

    def set_policies(self, configs: Iterable[Any], *, replace: bool = False) -> list[Any]:
        """Add or replace policies (configs or their dicts); the configs now active."""
        request = pb.SetPoliciesRequest(
            policies=[convert.policy_to_proto(parse_policy(c)) for c in configs],
            replace_all=replace,
        )
        return self._policies(self._call(self._stub.SetPolicies, request))

    def list_policies(self) -> list[Any]:
        return self._policies(self._call(self._stub.ListPolicies, pb.ListPoliciesRequest()))

    def remove_policy(self, name: str) -> list[Any]:
        """Remove a policy by name; the configs still active."""
        request = pb.RemovePolicyRequest(name=name)
        return self._policies(self._call(self._stub.RemovePolicy, request))

    def status(self) -> dict[str, Any]:
        """The controller's `status()`."""
        return convert.status_from_proto(self._call(self._stub.Status, pb.StatusRequest()))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _policies(msg: pb.PolicyList) -> list[Any]:
        return [convert.policy_from_proto(p) for p in msg.policies]

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e, self.address) from None


def _error(e: grpc.RpcError, address: str) -> CoxswainError:
    return error_from_rpc(e, f"controller at {address}")
