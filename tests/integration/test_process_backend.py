"""The HTTP front end in its own process over an engine served from this one
(`services/gateway/process_backend.py`): what crosses the socket must be what the engine
computes, errors keep their status and message, and a reader leaving aborts its request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from multiprocessing.connection import AuthenticationError, Client

import httpx
import pytest

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import InvalidRequestError
from services.engine.service import EngineService
from services.gateway.http_app import build_app
from services.gateway.process_backend import BackendServer, ProcessBackend, http_frontend
from tests.serving import serve_asgi

ADMIN = "admin-" + "a" * 24
KEYS = ApiKeys([ApiKey("admin", "admin", ADMIN)])
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256)
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def service(path):
    svc = EngineService.from_model(path, model_id="tiny", **ENGINE)
    yield svc
    svc.llm.shutdown()


@pytest.fixture(scope="module")
def server(service):
    server = BackendServer(service)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def remote(server, path):
    """An HTTP client of the front end running in two child processes."""
    with (
        http_frontend(server.address, path, KEYS, workers=2) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def local(service):
    """An HTTP client of the same app over the service in this process."""
    with (
        serve_asgi(build_app(service, KEYS)) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c,
    ):
        yield c


def _idle(service: EngineService, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while service.llm.call(lambda e: bool(e.requests)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _stream(client: httpx.Client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completions_over_the_process_front_end_match_the_in_process_one(remote, local):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "n": 2}
    got, want = remote.post("/v1/completions", json=body), local.post("/v1/completions", json=body)
    assert got.status_code == want.status_code == 200, got.text
    for g, w in zip(got.json()["choices"], want.json()["choices"], strict=True):
        assert g["coxswain"]["token_ids"] == w["coxswain"]["token_ids"]
        assert g["text"] == w["text"] and g["finish_reason"] == w["finish_reason"] == "length"
        lp = g["logprobs"]["token_logprobs"]
        assert lp == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-4)
    chunks = _stream(remote, body | {"n": 1, "stream_options": {"include_usage": True}})
    ids = [t for c in chunks for ch in c["choices"] for t in ch["coxswain"]["token_ids"]]
    assert ids == want.json()["choices"][0]["coxswain"]["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_the_front_end_decodes_the_text_the_engine_would_have(remote, local, service):
    """Generations without stop strings leave the engine without text (this process decodes
    it: `detokenizer.py`) and reach the client with the in-process server's text; with a
    stop string the engine decodes it, to match the string, and stops there."""
    seen: dict[str, list[str]] = {}
    finished: set[str] = set()
    heard = threading.Condition()

    def listen(deltas: list) -> None:
        with heard:
            for d in deltas:
                seen.setdefault(d.request_id, []).extend(s.text for s in d.samples)
                if d.finished:
                    finished.add(d.request_id)
            heard.notify_all()

    def all_heard() -> bool:
        # Our three requests, and any an earlier test left for the listeners to hear, done.
        return len(finished) >= 3 and finished >= seen.keys()

    service.llm.add_listener(listen)
    body = {"prompt": "the quick brown", "max_tokens": 16, "temperature": 0}
    try:
        got = remote.post("/v1/completions", json=body)
        want = local.post("/v1/completions", json=body)
        text = want.json()["choices"][0]["text"]
        stop = text[2:4]
        stopped = remote.post("/v1/completions", json=body | {"stop": [stop]})
        # Listeners hear a step after its callers do: wait until every request heard
        # (ours, and any final delta an earlier test's request still owed) has finished.
        with heard:
            assert heard.wait_for(all_heard, timeout=10), (seen, finished)
    finally:
        service.llm.remove_listener(listen)
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == text and len(text) > 4
    assert stopped.json()["choices"][0]["text"] == text[: text.index(stop)]
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    with heard:
        engine_texts = ["".join(t) for t in seen.values()]
    assert "" in engine_texts  # the front end's plain request: decoded there
    assert text in engine_texts  # the in-process server's: decoded by the engine
    assert text[: text.index(stop)] in engine_texts  # the stop string's: by the engine


def test_errors_keep_their_status_and_message_and_the_server_serves_on(remote, service):
    too_long = remote.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 250})
    assert too_long.status_code == 400
    assert "max_tokens is too large: 250" in too_long.json()["error"]["message"]
    bad_steer = {"vectors": [{"layers": [7], "vector": [0.0] * 64}]}
    r = remote.post("/v1/completions", json={"prompt": PROMPT, "steering": bad_steer})
    assert r.status_code == 400 and "layer" in r.json()["error"]["message"]
    assert "Traceback" not in r.text
    ok = remote.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert _idle(service)


def test_a_reader_leaving_aborts_its_request(remote, service):
    before = service.stats()["num_generated_tokens"]
    body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with remote.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then the client goes away
    assert _idle(service)
    stats = service.stats()
    assert stats["num_running"] == 0 and stats["num_generated_tokens"] - before < 240


def test_admin_calls_and_sweeps_cross_the_socket(remote, local):
    steer = {"vectors": [{"layers": [0], "vector": [0.1] * 64, "scale": 2.0}]}
    state = remote.post("/v1/steering/set", json=steer)
    assert state.status_code == 200, state.text
    assert remote.get("/v1/steering").json()["global_spec"] is not None
    assert remote.post("/v1/steering/clear").json()["global_spec"] is None
    clean = [17, 250, 33, 401, 98, 12, 77]
    sweep = {
        "clean_prompt": clean,
        "corrupt_prompt": [*clean[:3], 402, *clean[4:]],
        "answer_token": 17,
        "foil_token": 42,
        "metric": "logit_diff",
        "layers": [0, 1],
        "positions": [2, 3],
    }

    def events(client: httpx.Client) -> list[dict]:
        with client.stream("POST", "/v1/patch_sweep", json=sweep) as r:
            assert r.status_code == 200
            return [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:")]

    got, want = events(remote), events(local)
    assert len(got) == len(want) == 5  # four cells and the summary
    flat = [v for row in got[-1]["grid"][0] for v in row]
    assert flat == pytest.approx([v for row in want[-1]["grid"][0] for v in row], abs=1e-4)
    stats = remote.get("/v1/stats").json()  # the sweep ran on the remote engine, as passes
    assert stats["num_patch_passes"] > 0 and stats["num_patch_pass_tokens"] > 0


def test_the_socket_opens_only_to_the_key_and_only_the_services_interface(server, path):
    with pytest.raises(AuthenticationError):
        Client(server.address.path, "AF_UNIX", authkey=b"x" * 32)
    backend = ProcessBackend(server.address, path)
    try:
        assert backend.model_card()["id"] == "tiny"
        with pytest.raises(Exception, match="not a method a front end may call"):
            backend._call("shutdown")

        async def bad_prompt() -> None:
            async for _ in backend.generate([10**6], _params()):
                pass

        with pytest.raises(InvalidRequestError, match="out of range"):
            asyncio.run(bad_prompt())
    finally:
        backend.close()
    assert repr(server.address.authkey) not in repr(server.address)  # never in a log line


def _params():
    from services.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1)
