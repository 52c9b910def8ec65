"""The Controller gRPC service on a loopback port over a real controller and redis-server:
policy management, status, API-key scopes, errors as status codes, health and reflection."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import (
    GRPC_ERROR_METADATA_KEY,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from services.common.wire import pack_tensor
from services.controller.client import ControllerClient
from services.controller.controller import Controller
from services.controller.policies import parse_policy
from services.controller.redis_server import RedisServer
from services.controller.server import SERVICE_NAME, serve
from services.proto.coxswain.v1 import controller_pb2 as pb
from services.proto.coxswain.v1 import controller_pb2_grpc as pb_grpc

READ, ADMIN = "r" * 16 + "-read", "a" * 16 + "-admin"
PROBE = pack_tensor(torch.linspace(-1, 1, 8))
LATCH = {
    "kind": "latch",
    "name": "latch",
    "readout": "honesty",
    "threshold": 0.5,
    "steering": {"vectors": [{"layers": [1], "vector": PROBE, "phase": "decode"}]},
}
MONITOR = {
    "kind": "monitor",
    "name": "mon",
    "readout": "honesty",
    "fire_threshold": 1.0,
    "monitor": {"layer": 1, "probe": PROBE, "threshold": 0.5, "sharpness": 4.0},
}
SCALE = {"kind": "scale", "name": "gain", "readout": "honesty", "target": 0.0, "k": -1.0}


@pytest.fixture(scope="module")
def controller():
    with RedisServer() as redis_server:
        c = Controller(redis_server.url, block_ms=50).start()
        assert c.wait_ready(10)
        yield c
        c.stop()


@pytest.fixture(scope="module")
def server(controller):
    keys = ApiKeys([ApiKey("reader", "read", READ), ApiKey("ops", "admin", ADMIN)])
    srv = serve(controller, "127.0.0.1", 0, keys=keys)
    yield srv
    srv.stop(grace_s=0)


@pytest.fixture()
def admin(server, controller):
    controller.set_policies([], replace=True)
    with ControllerClient(server.address, api_key=ADMIN) as c:
        yield c


def test_policies_are_set_listed_and_removed(admin):
    active = admin.set_policies([LATCH, MONITOR])
    assert [p.name for p in active] == ["latch", "mon"]
    assert admin.list_policies() == [parse_policy(LATCH), parse_policy(MONITOR)]
    # by name: a new one is added, an existing one replaced
    changed = {**SCALE, "k": -2.0}
    assert [p.name for p in admin.set_policies([SCALE, {**MONITOR, "window": 32}])] == [
        "latch",
        "mon",
        "gain",
    ]
    assert admin.list_policies()[1].window == 32
    assert admin.set_policies([changed], replace=True) == [parse_policy(changed)]
    assert admin.remove_policy("gain") == []


def test_status_reports_the_loop_and_each_policy(admin, controller):
    admin.set_policies([LATCH, SCALE])
    status = admin.status()
    assert (status["running"], status["ready"], status["connected"]) == (True, True, True)
    assert status["group"] == controller.group and status["consumer"] == controller.consumer
    assert (status["lag"], status["pending"]) == (0, 0)
    assert [(p["name"], p["kind"]) for p in status["policies"]] == [
        ("latch", "latch"),
        ("gain", "scale"),
    ]
    assert status["policies"][0]["latched_conversations"] == 0
    assert status == {**controller.status(), "last_error": status["last_error"]}


def test_keys_and_scopes(server, admin):
    anonymous = ControllerClient(server.address)
    with anonymous, pytest.raises(UnauthenticatedError, match="missing bearer API key"):
        anonymous.list_policies()
    wrong = ControllerClient(server.address, api_key="x" * 20)
    with wrong, pytest.raises(UnauthenticatedError, match="unknown API key"):
        wrong.status()
    with ControllerClient(server.address, api_key=READ) as reader:
        assert reader.list_policies() == []
        assert reader.status()["running"] is True
        with pytest.raises(PermissionDeniedError, match="admin needed"):
            reader.set_policies([LATCH])
        with pytest.raises(PermissionDeniedError):
            reader.remove_policy("latch")
    assert admin.list_policies() == []  # nothing a refused call asked for happened


def test_errors_come_back_as_status_codes_naming_the_class(server, admin):
    admin.set_policies([LATCH])
    with pytest.raises(NotFoundError, match="no policy named 'ghost'"):
        admin.remove_policy("ghost")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ControllerStub(channel)
        bad = pb.Policy(
            name="m",
            readout="honesty",
            monitor=pb.MonitorPolicy(
                install_rate=0.1,
                clear_rate=0.2,
                monitor=pb.MonitorSpec(layer=0, probe={"name": "honesty"}),
            ),
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.SetPolicies(
                pb.SetPoliciesRequest(policies=[pb.Policy(name="ok", readout="x"), bad]),
                metadata=(("authorization", f"Bearer {ADMIN}"),),
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "give one of scale, monitor or latch" in info.value.details()
    assert dict(info.value.trailing_metadata())[GRPC_ERROR_METADATA_KEY] == "InvalidRequestError"
    with pytest.raises(InvalidRequestError, match="policy names must be unique"):
        admin.set_policies([SCALE, SCALE])
    assert [p.name for p in admin.list_policies()] == ["latch"]  # all or nothing


def test_health_and_reflection_are_open(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
