"""A request body that does not arrive in time is a 408 and its connection is closed.

A client that declares `Content-Length: 1000`, sends 10 bytes and stalls used to hold its
connection and its request open for as long as it liked; 1,030 of them stalled every
completion and `/health` of the gateway for 40 s. The HTTP app (`build_app`, which every
HTTP front end serves) now gives a body `body_timeout_s` from the request's start. These
tests run the real app under uvicorn on a loopback port and attack it with raw sockets.
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import InvalidRequestError
from services.engine.service import EngineService
from services.gateway.http_app import build_app
from services.gateway.http_auth import AuthBeforeBody
from tests.serving import serve_asgi

KEY = "reader-" + "r" * 24
KEYS = ApiKeys([ApiKey("reader", "read", KEY)])
BODY_TIMEOUT_S = 1.0
# How long a socket waits for the server's reply before the test calls it stalled: far past
# the body timeout, so a slow machine never fails a server that keeps its word.
STALLED_S = 30.0


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    svc = EngineService.from_model(
        tiny_checkpoint("llama"), model_id="tiny", device="cpu", dtype="float32"
    )
    yield svc
    svc.llm.shutdown()


@pytest.fixture(scope="module")
def url(backend):
    with serve_asgi(build_app(backend, KEYS, body_timeout_s=BODY_TIMEOUT_S)) as base:
        yield base


def _open_partial(url: str, declared: int = 1000, sent: bytes = b'{"prompt":') -> socket.socket:
    """A connection that sent a completion's headers (a valid key, `declared` bytes of body)
    and the first bytes of its body, then stalls."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=STALLED_S)
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: {parts.netloc}\r\n"
        f"Authorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def _reply_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it
    neither replies nor closes within STALLED_S)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _status_and_body(reply: bytes) -> tuple[int, dict, str]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":  # one chunk: size line, data, 0
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return int(lines[0].split()[1]), json.loads(body), headers.get("connection", "")


def test_a_stalled_body_is_a_408_and_the_connection_closes(url):
    sock = _open_partial(url)
    try:
        status, body, connection = _status_and_body(_reply_until_closed(sock))
    finally:
        sock.close()
    assert status == 408
    assert "body_timeout_s" in body["error"]["message"]
    assert "10 bytes came" in body["error"]["message"]
    assert connection == "close"


def test_a_body_dripping_slowly_is_timed_as_a_whole(url):
    """Bytes that keep coming, too slowly, do not reset the clock: the body as a whole
    must arrive in time."""
    sock = _open_partial(url, declared=10_000, sent=b"{")
    try:
        for _ in range(int(STALLED_S / 0.2)):  # at most 150 of the 10,000 bytes
            # Wait for the answer rather than sleep: a byte sent after the server closed
            # draws a reset, which would discard the answer (seen on a loaded CI host).
            if select.select([sock], [], [], 0.2)[0]:  # the server answered
                break
            sock.sendall(b" ")
        else:
            pytest.fail("the server never answered a body dripping in too slowly")
        assert _status_and_body(_reply_until_closed(sock))[0] == 408
    finally:
        sock.close()


def test_health_and_completions_answer_beside_stalled_bodies(url):
    stalled = [_open_partial(url) for _ in range(64)]
    try:
        with httpx.Client(base_url=url, timeout=STALLED_S) as client:
            assert client.get("/health").json()["status"] == "ok"
            r = client.post(
                "/v1/completions",
                json={"prompt": "hello", "max_tokens": 2},
                headers={"Authorization": f"Bearer {KEY}"},
            )
            assert r.status_code == 200, r.text
        assert {_status_and_body(_reply_until_closed(s))[0] for s in stalled} == {408}
    finally:
        for s in stalled:
            s.close()


def test_a_stream_longer_than_the_body_timeout_is_not_cut(url):
    """The timeout covers the body only: a response that streams for longer (the server
    listens for the client's disconnect meanwhile) runs to its end."""
    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    tokens, finish = 0, None
    with httpx.Client(base_url=url, timeout=STALLED_S) as client:
        headers = {"Authorization": f"Bearer {KEY}"}
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += len(choice["coxswain"]["token_ids"])
                    finish = choice["finish_reason"] or finish
                    time.sleep(0.01)  # a slow reader: the response outlasts the timeout
    assert (tokens, finish) == (200, "length")


def test_the_body_timeout_must_be_positive(backend):
    with pytest.raises(InvalidRequestError, match="body_timeout_s"):
        AuthBeforeBody(build_app(backend, KEYS), KEYS, (), body_timeout_s=0)
