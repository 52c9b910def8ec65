"""The adversarial suite: the cluster attacked as an outsider and a careless client would.

One real local cluster (isolated Ray, a Redis it starts, the Serve application with its
engine gRPC front, the controller and the patch store) is probed on every port it opens:

* **Auth matrix, generated.** Every operation of the gateway's own OpenAPI document and
  every method of every gRPC service (enumerated from the generated descriptors) is called
  without a key, with a wrong key, and with a read key. A new route or method is covered the
  day it appears; only the explicit allow-lists below may stay open, and the admin lists are
  checked both ways (a read key is refused there and accepted everywhere else).
* **Bad-input corpus.** Malformed, hostile and out-of-range inputs over HTTP and gRPC, then
  a bounded schemathesis run against the real Serve app: always a 4xx (never a 5xx), an
  error body naming the cause with no traceback text, and the service serves on. What one
  front refuses, the other refuses too (identifiers, chat roles, an empty global spec).
* **Slow bodies and a store outage.** Sockets that send part of a body and stall get a 408
  and a closed connection while `/health` answers; with Redis down, the steering state
  keeps its shape.

What the cluster keeps through actor deaths is measured by `benchmarks/chaos.py`.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
import schemathesis
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from services.proto.coxswain.v1 import (
    controller_pb2,
    engine_pb2,
    patch_store_pb2,
    steering_pb2,
    sweep_pb2,
)
from tests.serving import serve_app_cluster

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ADMIN_KEY = "adv-admin-" + secrets.token_hex(16)
READ_KEY = "adv-read-" + secrets.token_hex(16)
WRONG_KEY = "adv-wrong-" + secrets.token_hex(16)
MAX_MODEL_LEN = 64  # bounds what any request here (fuzzed ones included) can cost
BODY_LIMIT = 2**20  # the gateway's body cap (max_body_bytes), small to keep the test cheap
BODY_TIMEOUT_S = 3.0  # the gateway's body_timeout_s, short to keep the test quick
H = 64  # the tiny llama's hidden size
LAYERS = 2

# Text that must never reach a user: tracebacks, Ray internals, raw gRPC status dumps.
LEAKS = (
    "Traceback",
    "RayTaskError",
    'File "',
    "\x1b[",
    "pid=",
    "ip=",
    "actor_id",
    "debug_error_string",
    "grpc_status",
    "grpc_message",
    "_InactiveRpcError",
    "StatusCode.",
)
_LEAK = re.compile(
    "|".join(rf"\b{re.escape(m)}" if m[0].isalpha() else re.escape(m) for m in LEAKS)
)

# -- the allow-lists and admin lists (everything else needs a read key) -------------------------

HTTP_PUBLIC = {("GET", "/health")}
HTTP_ADMIN = {
    ("POST", "/v1/steering/set"),
    ("POST", "/v1/steering/clear"),
    ("PUT", "/v1/vectors/{name}"),
    ("DELETE", "/v1/vectors/{name}"),
    ("DELETE", "/v1/patch_source/{run}"),
}
GRPC_PUBLIC_SERVICES = {
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
}
# Methods that change what other clients get. The servers may declare more (merged below).
GRPC_ADMIN_MIN = {
    "/coxswain.v1.Steering/SetGlobal",
    "/coxswain.v1.Steering/ClearGlobal",
    "/coxswain.v1.Steering/RegisterVector",
    "/coxswain.v1.Steering/UnregisterVector",
    "/coxswain.v1.Steering/DropPatchSource",
    "/coxswain.v1.Controller/SetPolicies",
    "/coxswain.v1.Controller/RemovePolicy",
    "/coxswain.v1.PatchStore/PutRun",
    "/coxswain.v1.PatchStore/DropRun",
    "/coxswain.v1.PatchStore/InvalidateAll",
}
PROTO_MODULES = (engine_pb2, sweep_pb2, steering_pb2, controller_pb2, patch_store_pb2)
# Which server serves each service (a service missing here fails the matrix: add it).
SERVICE_TARGET = {
    "coxswain.v1.Engine": "engine",
    "coxswain.v1.Sweep": "engine",
    "coxswain.v1.Steering": "engine",
    "coxswain.v1.Controller": "controller",
    "coxswain.v1.PatchStore": "patch_store",
}
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
CLIENT_FAULTS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def _leaks(text: str) -> list[str]:
    return sorted(set(_LEAK.findall(text)))


def _declared_admin_methods() -> set[str]:
    """What the servers themselves declare admin-only, merged with `GRPC_ADMIN_MIN`."""
    import importlib

    declared = set(GRPC_ADMIN_MIN)
    for module in (
        "services.gateway.grpc_server",
        "services.patch_store.server",
        "services.controller.server",
    ):
        declared |= set(getattr(importlib.import_module(module), "ADMIN_METHODS", ()))
    return declared


# -- the cluster --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory) -> Iterator[dict[str, Any]]:
    from services.gateway import serve_app

    keys = tmp_path_factory.mktemp("adv-keys") / "api_keys"
    keys.write_text(f"admin:admin:{ADMIN_KEY}\nreader:read:{READ_KEY}\n")
    keys.chmod(0o600)
    with serve_app_cluster(
        str(tiny_checkpoint("llama")),
        str(keys),
        redis_password=secrets.token_hex(16),  # as `coxswain up` starts it
        engine={"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16},
        max_body_bytes=BODY_LIMIT,
        body_timeout_s=BODY_TIMEOUT_S,
    ) as app:
        store = ray.get_actor(serve_app.PATCH_STORE_ACTOR, namespace="coxswain")
        controller = ray.get_actor(serve_app.CONTROLLER_ACTOR, namespace="coxswain")
        yield {
            "http": app["http"],
            "engine": app["grpc"],
            "controller": ray.get(controller.grpc_address.remote(), timeout=60),
            "patch_store": ray.get(store.address.remote(), timeout=60),
            "body_limit": BODY_LIMIT,
            "redis": app["redis"],
        }


def _client(cluster: dict, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=cluster["http"], headers=headers, timeout=120)


@pytest.fixture(scope="module")
def admin(cluster) -> Iterator[httpx.Client]:
    with _client(cluster, ADMIN_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def openapi(admin) -> dict:
    r = admin.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def _problems_with_error_body(r: httpx.Response) -> list[str]:
    """Why `r` is not a clean error: `{"error": {"message": ...}}`, no internals."""
    problems = _leaks(r.text)
    try:
        message = r.json()["error"]["message"]
        if not isinstance(message, str) or not message:
            problems.append("empty error message")
    except (ValueError, KeyError, TypeError):
        problems.append(f"not a JSON error body: {r.text[:200]!r}")
    return problems


# -- 1. the auth matrix -------------------------------------------------------------------------

HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def _operations(openapi: dict) -> list[tuple[str, str, bool]]:
    """(METHOD, path template, has a request body) for every operation of the document."""
    return [
        (method.upper(), path, "requestBody" in op)
        for path, item in openapi["paths"].items()
        for method, op in item.items()
        if method in HTTP_METHODS
    ]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "adv-probe", path)


def test_the_allow_and_admin_lists_name_real_routes(openapi):
    ops = {(m, p) for m, p, _ in _operations(openapi)}
    assert not (HTTP_PUBLIC | HTTP_ADMIN) - ops, "a listed route no longer exists"


def test_every_http_route_needs_a_key_and_admin_routes_an_admin_key(cluster, openapi):
    failures: list[str] = []
    wrong = {"Authorization": f"Bearer {WRONG_KEY}"}
    cases = {
        "no key": {},
        "wrong key": wrong,
        "not bearer": {"Authorization": f"Basic {ADMIN_KEY}"},
        "bare bearer": {"Authorization": "Bearer"},
    }
    with httpx.Client(base_url=cluster["http"], timeout=120) as c:
        for method, template, has_body in _operations(openapi):
            op, path = (method, template), _concrete(template)
            body = {"json": {}} if has_body else {}
            for label, headers in cases.items():
                r = c.request(method, path, headers=headers, **body)
                if op in HTTP_PUBLIC:
                    if r.status_code in (401, 403) or r.status_code >= 500:
                        failures.append(
                            f"{method} {template} [{label}]: public, got {r.status_code}"
                        )
                    continue
                if r.status_code != 401:
                    failures.append(f"{method} {template} [{label}]: {r.status_code}, want 401")
                elif bad := _problems_with_error_body(r):
                    failures.append(f"{method} {template} [{label}]: {bad}")
            if op in HTTP_PUBLIC:
                continue
            if has_body:  # auth comes before the body is read: malformed JSON is still a 401
                r = c.request(method, path, content=b'{"prompt": ', headers=wrong)
                if r.status_code != 401:
                    failures.append(
                        f"{method} {template} [wrong key, malformed body]: {r.status_code}, "
                        "want 401 (auth before parsing)"
                    )
            reader = {"Authorization": f"Bearer {READ_KEY}"}
            r = c.request(method, path, headers=reader, **body)
            if op in HTTP_ADMIN:
                if r.status_code != 403:
                    failures.append(f"{method} {template} [read key]: {r.status_code}, want 403")
                elif bad := _problems_with_error_body(r):
                    failures.append(f"{method} {template} [read key]: {bad}")
            elif r.status_code in (401, 403) or r.status_code >= 500:
                failures.append(
                    f"{method} {template} [read key]: {r.status_code} {r.text[:200]!r} "
                    "(not an admin route: a read key must pass auth, and never a 5xx)"
                )
    assert not failures, "\n".join(failures)


def _grpc_methods() -> list[tuple[str, Any]]:
    """(service full name, method descriptor) of every method of every Coxswain service."""
    return [
        (service.full_name, method)
        for module in PROTO_MODULES
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def _grpc_call(
    channel: grpc.Channel,
    service: str,
    method: Any,
    metadata: tuple = (),
    request: Any = None,
) -> tuple[grpc.StatusCode, str]:
    """Call `method` with `request` (default: an empty message) whatever its streaming
    kind; its status code and details."""
    path = f"/{service}/{method.name}"
    req_cls = GetMessageClass(method.input_type)
    resp_cls = GetMessageClass(method.output_type)
    request = request if request is not None else req_cls()
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    call = kind(
        path,
        request_serializer=req_cls.SerializeToString,
        response_deserializer=resp_cls.FromString,
    )
    if method.client_streaming:
        request = iter([request])
    try:
        result = call(request, metadata=metadata, timeout=60)
        if method.server_streaming:
            for _ in result:
                pass
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


@pytest.fixture(scope="module")
def channels(cluster) -> Iterator[dict[str, grpc.Channel]]:
    chans = {t: grpc.insecure_channel(cluster[t]) for t in ("engine", "controller", "patch_store")}
    yield chans
    for c in chans.values():
        c.close()


def test_every_grpc_method_needs_a_key_and_admin_methods_an_admin_key(channels):
    admin_methods = _declared_admin_methods()
    methods = _grpc_methods()
    assert {f"/{s}/{m.name}" for s, m in methods} >= GRPC_ADMIN_MIN, "a listed method is gone"
    failures: list[str] = []
    cases = {
        "no metadata": (),
        "wrong key": (("authorization", f"Bearer {WRONG_KEY}"),),
        "not bearer": (("authorization", ADMIN_KEY),),
    }
    for service, method in methods:
        name = f"/{service}/{method.name}"
        target = SERVICE_TARGET.get(service)
        if target is None:
            failures.append(f"{name}: no server known for {service} (add it to SERVICE_TARGET)")
            continue
        channel = channels[target]
        for label, metadata in cases.items():
            code, details = _grpc_call(channel, service, method, metadata)
            if code != grpc.StatusCode.UNAUTHENTICATED:
                failures.append(
                    f"{name} [{label}]: {code.name} {details[:160]!r}, want UNAUTHENTICATED"
                )
            elif _leaks(details):
                failures.append(f"{name} [{label}]: leaks {_leaks(details)}")
        code, details = _grpc_call(
            channel, service, method, (("authorization", f"Bearer {READ_KEY}"),)
        )
        if name in admin_methods:
            if code != grpc.StatusCode.PERMISSION_DENIED:
                failures.append(f"{name} [read key]: {code.name}, want PERMISSION_DENIED")
        elif code in REFUSED or code not in CLIENT_FAULTS | {grpc.StatusCode.OK}:
            failures.append(
                f"{name} [read key, empty request]: {code.name} {details[:160]!r} (a read method "
                "must pass auth and refuse an empty request as the caller's fault)"
            )
    assert not failures, "\n".join(failures)


def test_health_and_reflection_stay_open(channels):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for target, channel in channels.items():
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING, target
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
        )
        listed = {s.name for r in replies for s in r.list_services_response.service}
        # every service the port serves is in the auth matrix, or explicitly public
        assert listed - GRPC_PUBLIC_SERVICES == {
            s for s, t in SERVICE_TARGET.items() if t == target
        }, target


# -- 2. the bad-input corpus --------------------------------------------------------------------


def _raw(body: Any) -> dict:
    """A body sent as JSON exactly as `json.dumps` writes it (lone surrogates escaped as
    `\\ud800`, NaN as `NaN`), which httpx's own encoder refuses to produce."""
    return _text(json.dumps(body))


def _text(body: str) -> dict:
    return {"content": body.encode(), "headers": {"Content-Type": "application/json"}}


def _body(**fields: Any) -> dict:
    return {"json": fields}


def _gen(**extra: Any) -> dict:
    """A valid short completion body with `extra` fields changed."""
    return {"prompt": "hello", "max_tokens": 2, "temperature": 0, **extra}


def _comp(**extra: Any) -> dict:
    return {"json": _gen(**extra)}


def _steer(vector: Any, layers: list[int] | None = None, **more: Any) -> dict:
    return {"vectors": [{"layers": [0] if layers is None else layers, "vector": vector, **more}]}


VEC = [0.01] * H
NAME_129 = "a" * 129
RUN_10K = "r" * 10_000
EMOJI = "\N{GRINNING FACE}"
NAN, INF = float("nan"), float("inf")
CMP, CHAT, SWEEP, VECS = "/v1/completions", "/v1/chat/completions", "/v1/patch_sweep", "/v1/vectors"
PUT_VEC = _body(value=VEC)
ZEROS = {"zeros": True}
SW = {"corrupt_prompt": [5, 6], "clean_prompt": [5, 7], "answer_token": 5}
A_RUN = "adv-no-such-run"

# (label, method, path, request kwargs, the status wanted: one code, or None for any 4xx)
# fmt: off
HTTP_CORPUS: list[tuple[str, str, str, dict, int | None]] = [
    ("empty prompt", "POST", CMP, _comp(prompt=""), 400),
    ("empty token list", "POST", CMP, _comp(prompt=[]), 400),
    ("empty chat", "POST", CHAT, _body(messages=[]), 400),
    ("lone surrogate prompt", "POST", CMP, _raw(_gen(prompt="a\ud800b")), 400),
    ("lone surrogate chat", "POST", CHAT,
     _raw({"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}), 400),
    ("lone surrogate stop", "POST", CMP, _raw(_gen(stop=["\ud800"])), 400),
    ("string max_tokens", "POST", CMP, _comp(max_tokens="8"), 400),
    ("string temperature", "POST", CMP, _comp(temperature="0"), 400),
    ("string stream", "POST", CMP, _comp(stream="false"), 400),
    ("string echo", "POST", CMP, _comp(echo="true"), 400),
    ("string n", "POST", CMP, _comp(n="1"), 400),
    ("string overwrite", "PUT", f"{VECS}/adv-str", _body(value=VEC, overwrite="true"), 400),
    ("max_tokens over context", "POST", CMP, _comp(max_tokens=MAX_MODEL_LEN + 1), 400),
    ("max_tokens huge", "POST", CMP, _comp(max_tokens=10**12), 400),
    ("max_tokens over int64", "POST", CMP, _comp(max_tokens=2**70), 400),
    ("max_tokens negative", "POST", CMP, _comp(max_tokens=-1), 400),
    ("prompt over context", "POST", CMP, _comp(prompt=[5] * (MAX_MODEL_LEN + 8)), 400),
    ("token id out of vocab", "POST", CMP, _comp(prompt=[10**9]), 400),
    ("negative temperature", "POST", CMP, _comp(temperature=-1), 400),
    ("top_p above 1", "POST", CMP, _comp(top_p=2), 400),
    ("huge n", "POST", CMP, _comp(n=10**9), 400),
    ("huge logprobs", "POST", CMP, _comp(logprobs=10**6), 400),
    ("huge seed", "POST", CMP, _comp(seed=2**70), 400),
    ("NaN temperature", "POST", CMP, _raw(_gen(temperature=NAN)), 400),
    ("Infinity top_p", "POST", CMP, _raw(_gen(top_p=INF)), 400),
    ("1e400 temperature", "POST", CMP, _text('{"prompt": "x", "temperature": 1e400}'), 400),
    ("unknown field", "POST", CMP, _comp(max_tokenz=2), 400),
    ("not JSON", "POST", CMP, _text("{not json"), 400),
    ("JSON array body", "POST", CMP, {"json": [1, 2, 3]}, 400),
    ("wrong model", "POST", CMP, _comp(model="no-such-model"), 404),
    # vector names: length and charset, on every verb that takes one
    ("129-char vector name", "PUT", f"{VECS}/{NAME_129}", PUT_VEC, 400),
    ("129-char vector get", "GET", f"{VECS}/{NAME_129}", {}, None),
    ("129-char vector delete", "DELETE", f"{VECS}/{NAME_129}", {}, None),
    ("vector name with space", "PUT", f"{VECS}/has%20space", PUT_VEC, 400),
    ("vector name with NUL", "PUT", f"{VECS}/a%00b", PUT_VEC, 400),
    ("vector name with newline", "PUT", f"{VECS}/a%0Ab", PUT_VEC, None),  # may not route
    ("vector name with markup", "PUT", f"{VECS}/%3Cscript%3E", PUT_VEC, 400),
    ("vector name non-ASCII", "PUT", f"{VECS}/%C3%A4%E2%80%AE", PUT_VEC, 400),
    ("vector name surrogate", "PUT", f"{VECS}/%ED%A0%80", PUT_VEC, 400),
    ("129-char name in steering", "POST", CMP, _comp(steering=_steer(NAME_129)), 400),
    ("vector name with newline in steering", "POST", CMP, _comp(steering=_steer("a\nb")), 400),
    # vectors: values and shapes
    ("NaN vector", "PUT", f"{VECS}/adv-nan", _raw({"value": [NAN] * H}), 400),
    ("Infinity vector", "PUT", f"{VECS}/adv-inf", _raw({"value": [INF] * H}), 400),
    ("1e400 vector", "PUT", f"{VECS}/adv-big", _text(f'{{"value": [{",".join(["1e400"] * H)}]}}'),
     400),
    ("short vector", "PUT", f"{VECS}/adv-short", _body(value=[0.1] * 7), 400),
    ("empty vector", "PUT", f"{VECS}/adv-empty", _body(value=[]), 400),
    ("per-layer rows wrong", "PUT", f"{VECS}/adv-rows", _body(value=[VEC] * (LAYERS + 3)), 400),
    ("layer key out of range", "PUT", f"{VECS}/adv-layer", _body(value={"99": VEC}), 400),
    ("ragged vector", "PUT", f"{VECS}/adv-ragged", _body(value=[VEC, [0.1]]), 400),
    ("string vector", "PUT", f"{VECS}/adv-string", _body(value="not a vector"), 400),
    ("packed tensor lies", "PUT", f"{VECS}/adv-packed",
     _body(value={"dtype": "float32", "shape": [H], "data": "AAAA"}), 400),
    ("NaN steering vector", "POST", CMP, _raw(_gen(steering=_steer([NAN] * H))), 400),
    ("short steering vector", "POST", CMP, _comp(steering=_steer([1.0] * 7)), 400),
    ("1e400 steering scale", "POST", CMP,
     _text(json.dumps(_gen(steering=_steer(VEC, scale=7))).replace(": 7}", ": 1e400}")), 400),
    ("short global vector", "POST", "/v1/steering/set", {"json": _steer([1.0] * 7)}, 400),
    ("unknown global vector", "POST", "/v1/steering/set", {"json": _steer("adv-no-such")}, None),
    # sites and layers
    ("unknown steering layer", "POST", CMP, _comp(steering=_steer(VEC, [99])), 400),
    ("negative steering layer", "POST", CMP, _comp(steering=_steer(VEC, [-100])), 400),
    ("unknown steering site", "POST", CMP, _comp(steering=_steer(VEC, site="no_such")), 400),
    ("unknown capture site", "POST", CMP, _comp(capture={"sites": {"no_such": [0]}}), 400),
    ("unknown capture layer", "POST", CMP, _comp(capture={"sites": {"post_block": [99]}}), 400),
    ("capture position beyond prompt", "POST", CMP,
     _comp(capture={"sites": {"post_block": [0]}, "positions": [10**6]}), 400),
    ("unknown patch layer", "POST", CMP,
     _comp(patch=[{"layer": 99, "position": 0, "source": ZEROS}]), 400),
    ("patch position beyond prompt", "POST", CMP,
     _comp(patch=[{"layer": 0, "position": 10**6, "source": ZEROS}]), 400),
    ("unknown readout layer", "POST", CMP, _comp(readouts=[{"probe": VEC, "layer": 99}]), 400),
    ("unknown TL hook", "POST", CMP,
     _comp(capture={"sites": {"blocks.0.hook_nonsense": [0]}}), 400),
    # run ids
    ("10k-char run id drop", "DELETE", f"/v1/patch_source/{RUN_10K}", {}, None),
    ("10k-char run id patch", "POST", CMP,
     _comp(patch=[{"layer": 0, "position": 0, "source": {"run": RUN_10K, "position": 0}}]), 400),
    ("10k-char capture run", "POST", CMP,
     _comp(capture={"sites": {"post_block": [0]}, "sink": "patch_store", "run": RUN_10K}), 400),
    ("10k-char sweep source", "POST", SWEEP,
     _body(corrupt_prompt="a b c", answer_token=5, source_run=RUN_10K), 400),
    ("capture run naming a version", "POST", CMP,
     _comp(capture={"sites": {"post_block": [0]}, "sink": "patch_store", "run": "x@125"}), 400),
    ("capture run with newline", "POST", CMP,
     _comp(capture={"sites": {"post_block": [0]}, "sink": "patch_store", "run": "a\nb"}), 400),
    ("capture run with emoji", "POST", CMP,
     _comp(capture={"sites": {"post_block": [0]}, "sink": "patch_store", "run": EMOJI}), 400),
    ("10k-emoji readout name", "POST", CMP,
     _comp(readouts=[{"probe": VEC, "layer": 0, "name": EMOJI * 10_000}]), 400),
    ("readout name with newline", "POST", CMP,
     _comp(readouts=[{"probe": VEC, "layer": 0, "name": "a\nb"}]), 400),
    # what the gRPC front refuses
    ("chat role root", "POST", CHAT,
     _body(messages=[{"role": "root", "content": "hi"}], max_tokens=2), 400),
    ("empty global spec", "POST", "/v1/steering/set", {"json": {}}, 400),
    ("global spec with no vectors", "POST", "/v1/steering/set", {"json": {"vectors": []}}, 400),
    ("unknown run drop", "DELETE", f"/v1/patch_source/{A_RUN}", {}, 404),
    ("unknown patch run", "POST", CMP,
     _comp(patch=[{"layer": 0, "position": 0, "source": {"run": A_RUN, "position": 0}}]), 404),
    # sweeps
    ("sweep empty corrupt", "POST", SWEEP, _body(**{**SW, "corrupt_prompt": ""}), 400),
    ("sweep unknown layer", "POST", SWEEP, _body(**SW, layers=[99]), 400),
    ("sweep unknown site", "POST", SWEEP, _body(**SW, sites=["nope"]), 400),
    ("sweep answer not one token", "POST", SWEEP,
     _body(**{**SW, "answer_token": "not a single token at all"}), 400),
]
# fmt: on


def test_every_bad_http_input_is_a_clean_4xx(cluster, admin):
    failures: list[str] = []
    for label, method, path, kwargs, want in HTTP_CORPUS:
        try:
            r = admin.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            failures.append(f"{label}: the connection failed ({type(e).__name__}: {e})")
            continue
        ok = r.status_code == want if want is not None else 400 <= r.status_code < 500
        if not ok:
            failures.append(f"{label}: {r.status_code} {r.text[:240]!r}, want {want or '4xx'}")
        elif bad := _problems_with_error_body(r):
            failures.append(f"{label}: {r.status_code} {bad} {r.text[:240]!r}")
    assert not failures, f"{len(failures)} of {len(HTTP_CORPUS)}:\n" + "\n".join(failures)


def test_oversized_bodies_are_refused_before_they_are_read(cluster, admin):
    limit = cluster["body_limit"]
    body = {"prompt": "x" * (limit + 3 * 2**20), "max_tokens": 1}
    data = json.dumps(body).encode()
    r = admin.post("/v1/completions", content=data, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert not _problems_with_error_body(r), r.text[:300]
    with httpx.Client(base_url=cluster["http"], timeout=120) as anonymous:
        r = anonymous.post("/v1/completions", content=data)
    assert r.status_code in (401, 413), r.text[:300]  # never read, never parsed


def test_a_prompt_of_many_megabytes_under_the_body_cap_is_a_400(cluster, admin):
    """A prompt string whose body fits the cap but whose bytes exceed the prompt bound is
    refused before it is tokenised, never a 5xx (at most 4 MB here)."""
    size = min(cluster["body_limit"], 4 * 2**20) - 4096
    r = admin.post("/v1/completions", json={"prompt": "ab " * (size // 3), "max_tokens": 1})
    assert r.status_code in (400, 413), r.text[:300]
    assert not _problems_with_error_body(r)


def _tensor(values: list[float]) -> Any:
    import torch

    from services.patch_store.convert import tensor_to_proto

    return tensor_to_proto(torch.tensor(values, dtype=torch.float32))


def _grpc_corpus() -> list[tuple[str, str, str, Any]]:
    """(label, service, method, request) for the gRPC equivalents of the HTTP corpus."""
    pb, st = engine_pb2, steering_pb2
    ok_vec = pb.VectorValue(tensor=_tensor(VEC))

    def gen(prompt: Any = None, **params: Any) -> Any:
        prompt = prompt if prompt is not None else pb.Prompt(text="hello")
        params.setdefault("max_tokens", 2)
        return pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params))

    def steer(layers: list[int], vector: Any, site: str = "") -> Any:
        return pb.SteeringSpec(vectors=[pb.SteerVector(site=site, layers=layers, vector=vector)])

    def vec(values: list[float]) -> Any:
        return pb.VectorValue(tensor=_tensor(values))

    def register(name: str, values: list[float] | None = None, path: str = "") -> Any:
        if path:
            return st.RegisterVectorRequest(name=name, path=path)
        return st.RegisterVectorRequest(name=name, vector=_tensor(values or VEC))

    def capture(run: str) -> Any:
        layers = pb.CaptureLayers(layers=[0])
        return pb.CaptureSpec(sites={"post_block": layers}, sink="patch_store", run=run)

    ids = pb.TokenIds
    E, S = "coxswain.v1.Engine", "coxswain.v1.Steering"
    # fmt: off
    return [
        ("empty text prompt", E, "Generate", gen(pb.Prompt(text=""))),
        ("empty token prompt", E, "Generate", gen(pb.Prompt(token_ids=ids(ids=[])))),
        ("no prompt", E, "Generate", pb.GenerateRequest(params=pb.SamplingParams(max_tokens=2))),
        ("max_tokens over context", E, "Generate", gen(max_tokens=MAX_MODEL_LEN + 1)),
        ("max_tokens huge", E, "Generate", gen(max_tokens=2**31 - 1)),
        ("negative n", E, "Generate", gen(n=-5)),
        ("NaN temperature", E, "Generate", gen(temperature=NAN)),
        ("top_p above 1", E, "Generate", gen(top_p=2.0)),
        ("huge logprobs", E, "Generate", gen(logprobs=10**6)),
        ("token id out of vocab", E, "Generate", gen(pb.Prompt(token_ids=ids(ids=[10**9])))),
        ("NaN steering vector", E, "Generate", gen(steering=steer([0], vec([NAN] * H)))),
        ("short steering vector", E, "Generate", gen(steering=steer([0], vec([1.0] * 7)))),
        ("unknown steering layer", E, "Generate", gen(steering=steer([99], ok_vec))),
        ("unknown steering site", E, "Generate", gen(steering=steer([0], ok_vec, "no_such"))),
        ("129-char name in steering", E, "Generate",
         gen(steering=steer([0], pb.VectorValue(name=NAME_129)))),
        ("abort without id", E, "Abort", pb.AbortRequest()),
        # what the HTTP front refuses
        ("chat role root", E, "Generate",
         gen(pb.Prompt(chat=pb.Chat(messages=[pb.ChatMessage(role="root", content="hi")])))),
        ("capture run naming a version", E, "Generate", gen(capture=capture("x@125"))),
        ("capture run with newline", E, "Generate", gen(capture=capture("a\nb"))),
        ("capture run with emoji", E, "Generate", gen(capture=capture(EMOJI))),
        ("readout name with emoji", E, "Generate",
         gen(readouts=[pb.Readout(probe=ok_vec, layer=0, name=EMOJI * 8)])),
        ("vector name with newline in steering", E, "Generate",
         gen(steering=steer([0], pb.VectorValue(name="a\nb")))),
        ("129-char vector name", S, "RegisterVector", register(NAME_129)),
        ("vector name with space", S, "RegisterVector", register("has space")),
        ("vector name with newline", S, "RegisterVector", register("a\nb")),
        ("empty vector name", S, "RegisterVector", register("")),
        ("NaN vector", S, "RegisterVector", register("adv-g-nan", [NAN] * H)),
        ("short vector", S, "RegisterVector", register("adv-g-short", [1.0] * 7)),
        ("vector file not a vector", S, "RegisterVector", register("adv-g-f", path="/etc/passwd")),
        ("129-char get", S, "GetVector", st.GetVectorRequest(name=NAME_129)),
        ("129-char unregister", S, "UnregisterVector", st.UnregisterVectorRequest(name=NAME_129)),
        ("short global vector", S, "SetGlobal", steer([0], vec([1.0] * 7))),
        ("empty global spec", S, "SetGlobal", pb.SteeringSpec()),
        ("10k-char run id", S, "DropPatchSource", st.DropPatchSourceRequest(run=RUN_10K)),
        ("unknown run", S, "DropPatchSource", st.DropPatchSourceRequest(run=A_RUN)),
    ]
    # fmt: on


def test_every_bad_grpc_input_is_the_callers_fault(channels):
    methods = {(s, m.name): m for s, m in _grpc_methods()}
    metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
    failures: list[str] = []
    corpus = _grpc_corpus()
    for label, service, name, request in corpus:
        code, details = _grpc_call(
            channels["engine"], service, methods[(service, name)], metadata, request
        )
        if code not in CLIENT_FAULTS:
            failures.append(f"{label} ({name}): {code.name} {details[:240]!r}")
        elif _leaks(details):
            failures.append(
                f"{label} ({name}): {code.name} leaks {_leaks(details)}: {details[:240]!r}"
            )
    assert not failures, f"{len(failures)} of {len(corpus)}:\n" + "\n".join(failures)


# -- schemathesis against the real Serve app ----------------------------------------------------


@pytest.fixture(scope="module")
def api_schema(cluster):
    return schemathesis.openapi.from_url(
        f"{cluster['http']}/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )


def no_traceback_in_errors(ctx: Any, response: Any, case: Any) -> bool | None:
    """A schemathesis check: an error body never carries internals."""
    if response.status_code >= 400:
        leaked = _leaks(response.text)
        if leaked:
            raise AssertionError(f"{response.status_code} body leaks {leaked}")
    return None


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_a_5xx(case, cluster):
    case.call_and_validate(
        base_url=cluster["http"],
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        checks=[not_a_server_error, no_traceback_in_errors],
        timeout=60,
    )


# -- slow bodies, and the cluster store away ------------------------------------------------------


def _stalled_completion(cluster: dict) -> socket.socket:
    """A connection that sent a completion's headers (a valid key, a 1,000-byte body
    declared) and 10 bytes of the body, then stalls."""
    parts = urlsplit(cluster["http"])
    sock = socket.create_connection((parts.hostname, parts.port), timeout=120)
    sock.sendall(
        (
            "POST /v1/completions HTTP/1.1\r\n"
            f"Host: {parts.netloc}\r\nAuthorization: Bearer {READ_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            '{"prompt":'
        ).encode()
    )
    return sock


def test_stalled_bodies_get_a_408_and_a_close_while_health_answers(cluster, admin):
    """Sockets that declare a body, send part of it and stall used to hold the gateway:
    every completion and `/health` timed out while they stood, and a stalled one got no
    reply and no close. Each now gets a 408 once body_timeout_s has passed, and its
    connection closes (recv ends); meanwhile the service answers."""
    stalled = [_stalled_completion(cluster) for _ in range(32)]
    try:
        assert admin.get("/health").status_code == 200
        r = admin.post("/v1/completions", json=_gen())
        assert r.status_code == 200, r.text
        for sock in stalled:
            reply = b""
            while chunk := sock.recv(65536):  # socket.timeout: neither a reply nor a close
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert b"body_timeout_s" in reply and not _leaks(reply.decode()), reply[:400]
    finally:
        for sock in stalled:
            sock.close()


def test_the_steering_state_keeps_its_shape_while_redis_is_down(cluster, admin):
    """The cluster view always has `version` and `replicas`: null, with `store_error`
    saying why, while the cluster store does not answer (the replica's own view shows)."""
    redis = cluster["redis"]
    redis.stop()
    try:
        r = admin.get("/v1/steering")
        assert r.status_code == 200, r.text
        view = r.json()["cluster"]
        assert view["version"] is None and view["replicas"] is None, view
        assert "Redis" in view["store_error"] and not _leaks(view["store_error"]), view
        assert view["replica"] and view["applied_version"] is not None, view
    finally:
        redis.start()  # empty: the replicas seed it again from what they hold
    deadline = time.monotonic() + 120
    while (r := admin.post("/v1/steering/clear")).status_code == 503:  # not seeded yet
        assert time.monotonic() < deadline, f"the cluster did not recover: {r.text}"
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    view = r.json()["cluster"]
    assert view["version"] is not None and not view["store_error"], view


# -- and afterwards, nothing was lost -----------------------------------------------------------


def test_the_cluster_serves_normally_after_the_attacks(admin, channels):
    """Runs last (module order): whatever the corpus and the fuzzer did, the service answers,
    a valid admin write applies at once, and no bad entry broke reconciliation."""
    assert admin.get("/health").status_code == 200
    admin.post("/v1/steering/clear")  # the fuzzer may have set global steering
    r = admin.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["coxswain"]["token_ids"]) == 2
    r = admin.put("/v1/vectors/adv-after", json={"value": VEC, "overwrite": True})
    assert r.status_code == 200, r.text
    steered = {"vectors": [{"layers": [0], "vector": "adv-after"}]}
    r = admin.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "steering": steered})
    assert r.status_code == 200, r.text  # read-your-writes: the next request sees the vector
    names = {v["name"] for v in admin.get("/v1/vectors").json()["data"]}
    assert "adv-after" in names
    assert not [n for n in names if len(n) > 128 or not n.isprintable()], names
    cluster_view = admin.get("/v1/steering").json().get("cluster") or {}
    # nothing the API accepted was refused by a replica, and reconciliation is healthy
    assert not cluster_view.get("last_error"), cluster_view
    assert not cluster_view.get("rejected"), cluster_view
    assert admin.delete("/v1/vectors/adv-after").status_code == 200
    code, details = _grpc_call(
        channels["engine"],
        "coxswain.v1.Engine",
        engine_pb2.DESCRIPTOR.services_by_name["Engine"].methods_by_name["ModelInfo"],
        (("authorization", f"Bearer {READ_KEY}"),),
    )
    assert code == grpc.StatusCode.OK, details
    code, details = _grpc_call(
        channels["patch_store"],
        "coxswain.v1.PatchStore",
        patch_store_pb2.DESCRIPTOR.services_by_name["PatchStore"].methods_by_name["Stats"],
        (("authorization", f"Bearer {ADMIN_KEY}"),),
    )
    assert code == grpc.StatusCode.OK, details  # the patch store still answers
