"""Errors and aborts through the real Serve application (gateway + one engine replica, so
every engine call crosses Ray): an error raised in the replica reaches HTTP and gRPC users
as its own message and status, never Ray's traceback; a reused gRPC request id is refused
without touching the request holding it; and gRPC Abort ends that request's stream with
finish_reason "abort" (the replica's stream is cancelled under it, which used to surface as
UNAVAILABLE "replica failed")."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.serving import serve_app_cluster

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ADMIN = "admin:admin:" + "e" * 32
ADMIN_KEY = ADMIN.split(":")[2]
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61]
LEAKS = re.compile(r"RayTaskError|Traceback|\x1b\[|pid=|ip=|\d+\.\d+\.\d+\.\d+|\.py\b")
UNKNOWN_VECTOR = {"vectors": [{"layers": [0], "vector": "no-such-vector"}]}


@pytest.fixture(scope="module")
def app(tiny_checkpoint, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{ADMIN}\n")
    with serve_app_cluster(
        str(tiny_checkpoint("llama")), str(keys), controller_grpc_port=None
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def grpc_client(app):
    from services.client import CoxswainClient

    with CoxswainClient(app["grpc"], api_key=ADMIN_KEY, stream_timeout_s=300) as c:
        yield c


def test_an_error_raised_in_the_replica_is_its_own_message_over_http(app):
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=app["http"], headers=headers, timeout=120) as http:
        r = http.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 2, "steering": UNKNOWN_VECTOR},
        )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "no-such-vector" in message and len(message) < 500
    assert not LEAKS.search(message), message


def test_an_error_raised_in_the_replica_is_its_own_message_over_grpc(grpc_client):
    from services.common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        grpc_client.complete(PROMPT, max_tokens=2, steering=UNKNOWN_VECTOR)
    assert "no-such-vector" in str(err.value) and len(str(err.value)) < 500
    assert not LEAKS.search(str(err.value)), str(err.value)


def test_a_reused_request_id_is_refused_and_abort_ends_the_original(grpc_client):
    from services.common.errors import DuplicateRequestError

    stream = grpc_client.generate(PROMPT, request_id="e2e-held", max_tokens=400, ignore_eos=True)
    assert next(stream).request_id == "e2e-held"
    with pytest.raises(DuplicateRequestError):
        grpc_client.complete(PROMPT, request_id="e2e-held", max_tokens=2)
    grpc_client.abort("e2e-held")
    *_, last = stream  # ends normally: no ServiceUnavailableError
    assert last.finished and last.samples[0].finish_reason == "abort"
    assert last.samples[0].token_offset + len(last.samples[0].token_ids) < 400
