"""A gRPC client of the controller with the Python API of `Controller`'s policy methods.

Errors come back as the exceptions the server raised (`InvalidRequestError`, `NotFoundError`,
`UnauthenticatedError`, ...); an unreachable or slow server raises `ServiceUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import services.controller.convert as convert
from services.common.grpc_client import GrpcClient
from services.controller.policies import parse_policy
from services.proto.coxswain.v1 import controller_pb2 as pb
from services.proto.coxswain.v1 import controller_pb2_grpc as pb_grpc


class ControllerClient(GrpcClient):
    """Talks to a controller server at `address` (`host:port`), with `api_key` as the bearer
    token when the server checks keys. Every call waits at most `timeout_s`."""

    def __init__(self, address: str, *, api_key: str | None = None, timeout_s: float = 10.0):
        super().__init__(address, service="controller", api_key=api_key, timeout_s=timeout_s)
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

    @staticmethod
    def _policies(msg: pb.PolicyList) -> list[Any]:
        return [convert.policy_from_proto(p) for p in msg.policies]
