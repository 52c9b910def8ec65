"""The HTTP gateway over a real engine, served by uvicorn on loopback, called with httpx.

Results are checked against the offline `LLM` on the same checkpoint: what goes over HTTP
must be what the engine computes (logprobs, captures, patches, sweeps), and a bad request
must be a 4xx that leaves the server serving.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Mount

from services.common.auth import ApiKey, ApiKeys
from services.common.wire import unpack_tensor
from services.engine import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.service import EngineService
from services.engine.sweep import Sweep, SweepSpec
from services.gateway.http_app import build_app, public_paths
from services.gateway.limits import DEFAULT_MAX_BODY_BYTES
from services.patch_store.store import PatchStore
from tests.serving import serve_asgi

ADMIN_A, ADMIN_B, READER = "admin-a-" + "a" * 24, "admin-b-" + "b" * 24, "reader-" + "r" * 24
KEYS = ApiKeys(
    [
        ApiKey("admin-a", "admin", ADMIN_A),
        ApiKey("admin-b", "admin", ADMIN_B),
        ApiKey("reader", "read", READER),
    ]
)
ENGINE = dict(device="cpu", dtype="float32", max_model_len=512)
H = 64  # the tiny checkpoint's hidden size
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61]


def _vec(seed: int, norm: float = 4.0) -> list[float]:
    v = torch.randn(H, generator=torch.Generator().manual_seed(seed))
    return (v / v.norm() * norm).tolist()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def store():
    return PatchStore(budget_bytes=64 * 2**20)


@pytest.fixture(scope="module")
def backend(path, store):
    svc = EngineService.from_model(path, model_id="tiny", patch_store=store, **ENGINE)
    yield svc
    svc.llm.shutdown()


@pytest.fixture(scope="module")
def url(backend, store):
    with serve_asgi(build_app(backend, KEYS, patch_store=store)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, headers=_auth(ADMIN_A), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(path):
    return LLM(path, **ENGINE)


def _complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _token_logprobs(resp: dict, choice: int = 0) -> list[float]:
    return resp["choices"][choice]["logprobs"]["token_logprobs"]


def _sse(response: httpx.Response) -> list[tuple[str, str]]:
    """(event name, data) of each server-sent event."""
    events, name, data = [], "message", []
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data.append(line.split(":", 1)[1].strip())
        elif not line and data:
            events.append((name, "\n".join(data)))
            name, data = "message", []
    return events


def _stream(client, route: str, body: dict) -> list[dict]:
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1] == ("message", "[DONE]")
    return [json.loads(d) for _, d in events[:-1]]


# -- generation matches the engine -----------------------------------------------------------------


def test_steered_completion_differs_from_plain_and_matches_offline(client, offline):
    steering = {"vectors": [{"layers": [0, 1], "vector": _vec(1), "scale": 2.0}]}
    readouts = [{"probe": _vec(2, 1.0), "layer": 1, "name": "p"}]
    plain = _complete(client, max_tokens=6, logprobs=2)
    steered = _complete(client, max_tokens=6, logprobs=2, steering=steering, readouts=readouts)
    want = offline.generate(
        [PROMPT],
        SamplingParams(
            max_tokens=6, temperature=0, logprobs=2, steering=steering, readouts=readouts
        ),
    )[0].outputs[0]
    choice = steered["choices"][0]
    assert choice["coxswain"]["token_ids"] == want.token_ids
    assert _token_logprobs(steered) == pytest.approx(
        [want.logprobs[i][t] for i, t in enumerate(want.token_ids)], abs=1e-4
    )
    got_reads = [r["p"] for r in choice["coxswain"]["readouts"]]
    assert got_reads == pytest.approx([r["p"] for r in want.readouts], abs=1e-4)
    assert (
        max(
            abs(a - b)
            for a, b in zip(_token_logprobs(plain), _token_logprobs(steered), strict=True)
        )
        > 1e-3
    )
    assert steered["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 6,
        "total_tokens": len(PROMPT) + 6,
    }


def test_requested_token_logprobs_and_top_logprobs_match_offline(client, offline):
    resp = _complete(client, max_tokens=3, logprobs=3, logprob_token_ids=[5, 300])
    want = offline.generate(
        [PROMPT],
        SamplingParams(max_tokens=3, temperature=0, logprobs=3, logprob_token_ids=[5, 300]),
    )[0].outputs[0]
    choice = resp["choices"][0]
    for i, step in enumerate(choice["coxswain"]["requested_logprobs"]):
        want_step = {"5": want.logprobs[i][5], "300": want.logprobs[i][300]}
        assert step == pytest.approx(want_step, abs=1e-4)
    top = choice["logprobs"]["top_logprobs"]
    assert [len(t) for t in top] == [3, 3, 3]
    # the sampled (greedy) token is the most likely one
    for lps, tok_lp in zip(top, _token_logprobs(resp), strict=True):
        assert max(lps.values()) == pytest.approx(tok_lp)


def test_captures_decode_to_the_offline_tensors(client, offline):
    capture = {"sites": {"post_block": [0, 1], "pre_attn": [1]}, "positions": "all_prompt"}
    resp = _complete(client, max_tokens=2, capture=capture)
    want = offline.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, capture=capture))
    prompt_extras = resp["coxswain"]["prompts"][0]
    assert prompt_extras["capture_positions"] == list(range(len(PROMPT)))
    assert (
        set(prompt_extras["captures"])
        == set(want[0].captures)
        == {
            "0.post_block",
            "1.post_block",
            "1.pre_attn",
        }
    )
    for key, packed in prompt_extras["captures"].items():
        got = unpack_tensor(packed)
        assert got.shape == (len(PROMPT), H)
        torch.testing.assert_close(got, want[0].captures[key], atol=1e-4, rtol=0)


def test_a_patched_request_matches_offline_and_differs_from_plain(client, offline):
    # at layer 0, so layer 1's attention carries it to the last position
    patch = [{"layer": 0, "position": 4, "source": {"vector": _vec(3, 10.0)}}]
    plain = _complete(client, max_tokens=2, logprobs=1)
    patched = _complete(client, max_tokens=2, logprobs=1, patch=patch)
    want = offline.generate(
        [PROMPT], SamplingParams(max_tokens=2, temperature=0, logprobs=1, patch=patch)
    )[0].outputs[0]
    assert patched["choices"][0]["coxswain"]["token_ids"] == want.token_ids
    assert _token_logprobs(patched) == pytest.approx(
        [want.logprobs[i][t] for i, t in enumerate(want.token_ids)], abs=1e-4
    )
    assert abs(_token_logprobs(patched)[0] - _token_logprobs(plain)[0]) > 1e-4


def test_abort_when_probe_finishes_with_reason_probe(client, offline):
    probe = _vec(4, 1.0)
    cond = {"probe": probe, "layer": 1, "threshold": -1e6, "sharpness": 1.0}  # fires at once
    resp = _complete(client, max_tokens=5, steering={"abort_when": cond})
    want = offline.generate(
        [PROMPT], SamplingParams(max_tokens=5, temperature=0, steering={"abort_when": cond})
    )[0].outputs[0]
    choice = resp["choices"][0]
    assert choice["finish_reason"] == want.finish_reason == "probe"
    assert choice["coxswain"]["stop_reason"] == want.stop_reason
    assert choice["coxswain"]["token_ids"] == want.token_ids


def test_several_prompts_and_samples_index_choices_like_openai(client):
    prompts = ["the cat sat", "on the mat"]
    body = {"prompt": prompts, "max_tokens": 3, "n": 2, "temperature": 0.9, "seed": 3}
    resp = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert [c["coxswain"]["prompt_index"] for c in resp["choices"]] == [0, 0, 1, 1]
    again = client.post("/v1/completions", json=body).json()  # seeded: reproducible
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in resp["choices"]]


# -- streams ---------------------------------------------------------------------------------------


def test_streamed_chunks_concatenate_to_the_non_stream_text(client):
    body = {"prompt": [PROMPT, PROMPT[:4]], "max_tokens": 12, "n": 2, "temperature": 0.8}
    body |= {"seed": 7, "logprobs": 1}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    chunks = _stream(client, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            ids.setdefault(c["index"], []).extend(c["coxswain"]["token_ids"])
            assert len(c["logprobs"]["tokens"]) == len(c["coxswain"]["token_ids"])
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        assert ids[c["index"]] == c["coxswain"]["token_ids"]
        assert finish[c["index"]] == c["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_a_stop_string_never_leaks_into_a_stream(client):
    base = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    text = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[5:7]  # two characters the greedy continuation is sure to produce
    whole = client.post("/v1/completions", json=base | {"stop": stop}).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and stop not in whole["text"]
    chunks = _stream(client, "/v1/completions", base | {"stop": [stop]})
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == whole["text"]


def test_echo_prepends_the_prompt_in_responses_and_streams(client):
    body = {"prompt": "the cat sat", "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json=body | {"echo": True}).json()["choices"][0]
    assert echoed["text"] == "the cat sat" + plain
    chunks = _stream(client, "/v1/completions", body | {"echo": True})
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == echoed["text"]


def test_chat_matches_offline_and_its_stream(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = {"messages": messages, "max_completion_tokens": 8, "temperature": 0}
    resp = client.post("/v1/chat/completions", json=body | {"logprobs": True, "top_logprobs": 2})
    assert resp.status_code == 200, resp.text
    resp = resp.json()
    want = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    choice = resp["choices"][0]
    assert resp["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["coxswain"]["token_ids"] == want.token_ids
    content = choice["logprobs"]["content"]
    assert len(content) == len(want.token_ids) and all(len(c["top_logprobs"]) == 2 for c in content)
    chunks = _stream(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["delta"].get("content", "") for ch in chunks for c in ch["choices"])
    assert streamed == want.text
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)


def test_client_disconnect_aborts_the_request(client, backend):
    finished: list[str] = []
    backend.llm.add_listener(lambda outs: finished.extend(o.request_id for o in outs if o.finished))
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
    rid = json.loads(first.split(":", 1)[1])["id"] + "-0"
    deadline = time.monotonic() + 60
    while backend.stats()["requests_running"] or backend.stats()["requests_waiting"]:
        assert time.monotonic() < deadline, "the request kept running after the client left"
        time.sleep(0.05)
    assert rid not in finished  # it was aborted, not run to its 480 tokens


# -- errors ----------------------------------------------------------------------------------------

BAD_BODIES = {
    "negative temperature": {"prompt": "x", "temperature": -1},
    "unknown field": {"prompt": "x", "logit_bias": {"1": 2}},
    "unknown site": {"prompt": "x", "steering": {"vectors": [{"site": "top", "vector": "v"}]}},
    "vector length": {"prompt": "x", "steering": {"vectors": [{"layers": [0], "vector": [1.0]}]}},
    "layer out of range": {
        "prompt": "x",
        "steering": {"vectors": [{"layers": [9], "vector": _vec(1)}]},
    },
    "token out of vocab": {"prompt": [1, 2, 100000]},
    "empty token list": {"prompt": [[]]},
    "empty prompt list": {"prompt": []},
    "n over max_num_seqs": {"prompt": "x", "n": 100},
    "penalty": {"prompt": "x", "presence_penalty": 0.5},
    "stream_options without stream": {"prompt": "x", "stream_options": {"include_usage": True}},
    "capture past the prompt": {
        "prompt": "x y",
        "max_tokens": 1,
        "capture": {"sites": {"post_block": [0]}, "positions": [50]},
    },
    "capture with n > 1": {"prompt": "x", "n": 2, "capture": {"sites": {"post_block": [0]}}},
    "unknown stored run": {
        "prompt": PROMPT,
        "patch": [{"layer": 0, "position": 1, "source": {"run": "nope", "position": 1}}],
    },
    "patch past the prompt": {
        "prompt": "x",
        "patch": [{"layer": 0, "position": 99, "source": {"zeros": True}}],
    },
    "second prompt bad": {"prompt": [[1, 2, 3], [1, 100000]]},
    "empty prompt": {"prompt": ""},
    "empty second prompt": {"prompt": ["ok", ""]},
    "string max_tokens": {"prompt": "x", "max_tokens": "8"},
    "string stream": {"prompt": "x", "stream": "true"},
    "string temperature": {"prompt": "x", "temperature": "0.5"},
    "float n": {"prompt": "x", "n": 2.0},
    "max_tokens past the context": {"prompt": PROMPT, "max_tokens": 1000},
    "token prompt past the context": {"prompt": [5] * 600, "max_tokens": None},
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_input_is_a_4xx_and_the_next_request_succeeds(client, name):
    r = client.post("/v1/completions", json=BAD_BODIES[name])
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"]
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    assert client.get("/v1/stats").json()["requests_running"] == 0  # nothing left behind


def test_malformed_json_and_unknown_model(client):
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["coxswain"]["hidden_size"] == H
    r = client.post("/v1/completions", json={"prompt": "x", "model": "tiny", "max_tokens": 1})
    assert r.status_code == 200


def test_a_streamed_bad_request_fails_before_the_stream_starts(client):
    r = client.post("/v1/completions", json={"prompt": [100000], "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"


# -- auth ------------------------------------------------------------------------------------------


def test_auth_scopes_and_key_rotation(url):
    with httpx.Client(base_url=url, timeout=60) as anon:
        assert anon.get("/health").json()["status"] == "ok"
        r = anon.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert anon.get("/metrics").status_code == 401
        assert anon.get("/v1/stats", headers=_auth("not-a-key-at-all-0000")).status_code == 401
        reader = _auth(READER)
        assert anon.get("/v1/steering", headers=reader).status_code == 200
        assert (
            anon.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=reader
            ).status_code
            == 200
        )
        for method, route, body in (
            ("POST", "/v1/steering/clear", None),
            ("POST", "/v1/steering/set", {"vectors": []}),
            ("PUT", "/v1/vectors/v", {"value": _vec(1)}),
            ("DELETE", "/v1/vectors/v", None),
            ("DELETE", "/v1/patch_source/r", None),
        ):
            r = anon.request(method, route, json=body, headers=reader)
            assert r.status_code == 403, (route, r.text)
            assert r.json()["error"]["code"] == "PermissionDeniedError"
        for key in (ADMIN_A, ADMIN_B):  # two admin keys at once: rotation without downtime
            assert anon.post("/v1/steering/clear", headers=_auth(key)).status_code == 200


# -- steering control and the registry -------------------------------------------------------------


def test_global_steering_set_shows_in_state_changes_logprobs_and_clears(client, offline):
    spec = {"vectors": [{"layers": [1], "vector": _vec(5), "scale": 3.0}]}
    base = _token_logprobs(_complete(client, max_tokens=4, logprobs=1))
    try:
        state = client.post("/v1/steering/set", json=spec)
        assert state.status_code == 200, state.text
        assert state.json()["global_spec"]["vectors"][0]["layers"] == [1]
        steered = _token_logprobs(_complete(client, max_tokens=4, logprobs=1))
        shown = client.get("/v1/steering").json()
        assert shown["global"]["prefill"] == ["1.post_block"] == shown["global"]["decode"]
        assert shown["global_spec"]["vectors"][0]["scale"] == 3.0
        want = offline.generate(
            [PROMPT], SamplingParams(max_tokens=4, temperature=0, logprobs=1, steering=spec)
        )[0].outputs[0]
        assert steered == pytest.approx(
            [want.logprobs[i][t] for i, t in enumerate(want.token_ids)], abs=1e-4
        )
        assert max(abs(a - b) for a, b in zip(base, steered, strict=True)) > 1e-3
    finally:
        cleared = client.post("/v1/steering/clear")
    assert cleared.status_code == 200 and cleared.json()["global_spec"] is None
    assert _token_logprobs(_complete(client, max_tokens=4, logprobs=1)) == pytest.approx(
        base, abs=1e-4
    )
    assert client.get("/v1/steering").json()["global"]["decode"] == []
    bad = client.post("/v1/steering/set", json={"vectors": [{"layers": [0], "vector": [1.0]}]})
    assert bad.status_code == 400 and client.get("/v1/steering").json()["global_spec"] is None


def test_dynamic_state_reports_probe_aborts_and_gate_firing(client):
    before = client.get("/v1/steering/dynamic").json()
    assert before["dynamic"]["gain"] == 1.0 and before["monitors"] == {}
    assert before["override_pool"]["used"] == 0 and before["override_pool"]["size"] > 0
    always = {"probe": _vec(8, 1.0), "layer": 1, "threshold": -1e6, "sharpness": 1.0}
    gate = {"when": always, "apply": {"add": {"vector": _vec(9), "scale": 1.0}}}
    resp = _complete(client, max_tokens=3, steering={"gates": [gate]})
    assert resp["choices"][0]["finish_reason"] == "length"
    _complete(client, max_tokens=3, steering={"abort_when": always})
    after = client.get("/v1/steering/dynamic").json()
    assert after["probe_aborts"] == before["probe_aborts"] + 1
    fired = after["gate_firing"]["1.post_block"]
    was = before["gate_firing"].get("1.post_block", {"tokens": 0, "fired": 0})
    # the gate saw and fired on every decode token that fed a sample (the last one has none)
    assert fired["fired"] - was["fired"] == fired["tokens"] - was["tokens"] >= 2


def test_vector_registry_round_trip(client):
    vec = _vec(6)
    r = client.put("/v1/vectors/team/honesty.v1", json={"value": vec})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "name": "team/honesty.v1",
        "hidden_size": H,
        "layers": None,
        "source": "api",
    }
    assert client.put("/v1/vectors/team/honesty.v1", json={"value": vec}).status_code == 400
    assert (
        client.put(
            "/v1/vectors/team/honesty.v1", json={"value": vec, "overwrite": True}
        ).status_code
        == 200
    )
    names = [v["name"] for v in client.get("/v1/vectors").json()["data"]]
    assert "team/honesty.v1" in names
    got = client.get("/v1/vectors/team/honesty.v1").json()
    torch.testing.assert_close(unpack_tensor(got["value"]), torch.tensor(vec))
    by_name = {"vectors": [{"layers": [0], "vector": "team/honesty.v1"}]}
    inline = {"vectors": [{"layers": [0], "vector": vec}]}
    assert _token_logprobs(_complete(client, max_tokens=3, logprobs=1, steering=by_name)) == (
        pytest.approx(_token_logprobs(_complete(client, max_tokens=3, logprobs=1, steering=inline)))
    )
    per_layer = client.put("/v1/vectors/pl", json={"value": {"1": _vec(7)}}).json()
    assert per_layer["layers"] == [1]
    assert client.delete("/v1/vectors/team/honesty.v1").status_code == 200
    assert client.get("/v1/vectors/team/honesty.v1").status_code == 404
    assert client.delete("/v1/vectors/team/honesty.v1").status_code == 404
    r = client.post("/v1/completions", json={"prompt": "x", "steering": by_name})
    assert r.status_code == 400 and "team/honesty.v1" in r.json()["error"]["message"]


# -- patching --------------------------------------------------------------------------------------


def test_streamed_patch_sweep_equals_an_offline_sweep(client, path):
    rng = random.Random(5)
    clean = [rng.randrange(8, 500) for _ in range(7)]
    corrupt = [*clean[:3], rng.randrange(8, 500), *clean[4:]]
    body = {
        "clean_prompt": clean,
        "corrupt_prompt": corrupt,
        "answer_token": 17,
        "foil_token": 42,
        "metric": "logit_diff",
        "layers": [0, 1],
        "positions": [2, 3, 4],
        "sites": ["post_block", "pre_attn"],
    }
    # other traffic runs alongside the sweep's cells
    other = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/completions", json=other) as side:
        with client.stream("POST", "/v1/patch_sweep", json=body) as r:
            assert r.status_code == 200
            events = _sse(r)
        assert _sse(side)[-1] == ("message", "[DONE]")
    names = [name for name, _ in events]
    assert names == ["cell"] * 12 + ["summary"]
    summary = json.loads(events[-1][1])
    ref = Sweep(LLMEngine(path, EngineConfig(**ENGINE)), SweepSpec(**body)).run()
    assert summary["layers"] == ref.layers and summary["positions"] == ref.positions
    assert summary["sites"] == ref.sites and summary["tokens"] == ref.tokens
    grid = torch.tensor(summary["grid"], dtype=torch.float64)
    torch.testing.assert_close(grid, torch.from_numpy(ref.grid), atol=1e-4, rtol=0)
    assert summary["corrupt"] == pytest.approx(ref.corrupt, abs=1e-4)
    assert summary["clean"] == pytest.approx(ref.clean, abs=1e-4)
    assert summary["noise_floor"] < 1e-4
    si = {s: i for i, s in enumerate(ref.sites)}
    for _, data in events[:-1]:
        cell = json.loads(data)
        want = ref.grid[si[cell["site"]], cell["layer"], ref.positions.index(cell["position"])]
        assert cell["value"] == pytest.approx(want, abs=1e-4)
        assert cell["value"] == pytest.approx(cell["logprob_answer"] - cell["logprob_foil"])


def test_a_bad_sweep_is_a_4xx_before_any_event(client):
    r = client.post(
        "/v1/patch_sweep",
        json={"clean_prompt": "a", "corrupt_prompt": "b", "answer_token": 1, "layers": [7]},
    )
    assert r.status_code == 400 and "layers" in r.json()["error"]["message"]
    r = client.post(
        "/v1/patch_sweep", json={"source_run": "gone", "corrupt_prompt": "b c", "answer_token": 1}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "RunNotFoundError"


def test_delete_patch_source_drops_a_stored_run(client, store):
    capture = {"sites": {"post_block": "all"}, "positions": "all_prompt", "sink": "patch_store"}
    resp = _complete(client, max_tokens=1, capture=capture | {"run": "clean-http"})
    assert resp["coxswain"]["prompts"][0]["capture_run"] == "clean-http"
    assert [m.run_id for m in store.manifests(["clean-http"])] == ["clean-http"]
    patched = {"layer": 1, "position": 2, "source": {"run": "clean-http", "position": 2}}
    assert (
        client.post(
            "/v1/completions", json={"prompt": PROMPT, "patch": [patched], "max_tokens": 1}
        ).status_code
        == 200
    )
    r = client.delete("/v1/patch_source/clean-http", headers=_auth(READER))
    assert r.status_code == 403
    r = client.delete("/v1/patch_source/clean-http")
    assert r.status_code == 200 and r.json()["bytes_freed"] > 0
    assert "clean-http" not in [m.run_id for m in store.manifests()]
    assert client.delete("/v1/patch_source/clean-http").status_code == 404
    r = client.post("/v1/completions", json={"prompt": PROMPT, "patch": [patched], "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "RunNotFoundError"


# -- observability ---------------------------------------------------------------------------------


def _metrics(client) -> dict[str, list]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def _count(samples, **labels) -> float:
    return sum(
        s.value for s in samples if s.name.endswith("_total") and labels.items() <= s.labels.items()
    )


def test_metrics_parse_and_count_requests(client, url):
    before = _metrics(client)
    for _ in range(3):
        client.get("/health")
    httpx.get(url + "/v1/stats")  # no key: 401, before routing (so under "unmatched")
    after = _metrics(client)
    reqs_before, reqs = before["coxswain_http_requests"], after["coxswain_http_requests"]
    assert (
        _count(reqs, route="/health", status="200")
        - _count(reqs_before, route="/health", status="200")
        == 3
    )
    assert (
        _count(reqs, route="unmatched", status="401")
        - _count(reqs_before, route="unmatched", status="401")
        == 1
    )
    assert _count(reqs, route="/v1/completions", method="POST", status="200") >= 1
    hist = after["coxswain_http_request_duration_seconds"]
    assert any(s.name.endswith("_count") and s.labels["route"] == "/health" for s in hist)
    assert after["coxswain_engine_steps"][0].value > 0
    assert after["coxswain_engine_generated_tokens"][0].value > 0
    applied = _count(after["coxswain_steering_actions"], outcome="applied")
    assert applied >= 2  # the global steering test's set and clear
    assert after["coxswain_gateway_patch_store_runs"][0].value == 0


def test_stats_and_health(client, backend):
    stats = client.get("/v1/stats").json()
    assert stats["model"] == "tiny" and stats["num_steps"] > 0
    assert stats["generation_tokens_per_s"] >= 0 and 0 <= stats["prefix_cache_hit_rate"] <= 1
    assert stats["prefix_cache_hits"] > 0  # the same prompt ran many times
    assert "patch_store" in stats
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny" and health["steps"] > 0
    assert not math.isnan(stats["prompt_tokens_per_s"])


def test_openapi_document_describes_the_api(client):
    doc = client.get("/openapi.json").json()
    assert doc["info"]["title"] == "Coxswain"
    paths = doc["paths"]
    for route in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/steering/set",
        "/v1/steering/clear",
        "/v1/steering",
        "/v1/steering/dynamic",
        "/v1/vectors",
        "/v1/vectors/{name}",
        "/v1/patch_sweep",
        "/v1/patch_source/{run}",
        "/v1/stats",
        "/health",
        "/metrics",
    ):
        assert route in paths, route
    body = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"steering", "capture", "patch", "readouts", "logprob_token_ids"} <= set(body)
    assert "SteeringSpec" in doc["components"]["schemas"]
    assert "ApiKey" in doc["components"]["securitySchemes"]


# -- strict types, the context, Unicode, sizes -------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "true"}, "stream"),
        ("/v1/completions", {"prompt": "x", "seed": "1"}, "seed"),
        ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"},
            "logprobs",
        ),
        ("/v1/vectors/strict", {"value": _vec(1), "overwrite": "true"}, "overwrite"),
        ("/v1/patch_sweep", {"corrupt_prompt": PROMPT, "answer_token": 5, "alpha": "1"}, "alpha"),
        # nested Coxswain extras are as strict as the body's own fields
        (
            "/v1/completions",
            {
                "prompt": "x",
                "steering": {"vectors": [{"layers": [0], "vector": _vec(1), "scale": "2"}]},
            },
            "steering.vectors.0.scale",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "readouts": [{"probe": "p", "layer": "0"}]},
            "readouts.0.layer",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "patch": [{"layer": 0, "position": "1", "source": {"zeros": True}}]},
            "patch.0.position",
        ),
        (
            "/v1/steering/set",
            {"vectors": [{"layers": ["0"], "vector": _vec(1)}]},
            "vectors.0.layers.0",
        ),
    ],
)
def test_string_typed_numbers_and_booleans_are_a_400_naming_the_field(client, route, body, field):
    method = "PUT" if route.startswith("/v1/vectors") else "POST"
    r = client.request(method, route, json=body)
    assert r.status_code == 400, r.text
    assert f"body.{field}:" in r.json()["error"]["message"]


def test_max_tokens_past_the_context_is_a_400_naming_the_lengths(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 600})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "max_tokens is too large: 600" in msg and "context length is 512 tokens" in msg
    assert f"{len(PROMPT)} input tokens" in msg
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "max_tokens is too large: 600" in r.text
    fits = _complete(client, max_tokens=512 - len(PROMPT), ignore_eos=True)
    assert len(fits["choices"][0]["coxswain"]["token_ids"]) == 512 - len(PROMPT)


@pytest.mark.parametrize(
    ("route", "raw", "where"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt is"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
        (
            "/v1/completions",
            b'{"prompt": "x", "readouts": [{"name": "\\ud800", "probe": "v", "layer": 0}]}',
            "readouts[0].name",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
            "messages[0].content",
        ),
        (
            "/v1/patch_sweep",
            b'{"corrupt_prompt": "a\\ud800b c", "clean_prompt": "a b c", "answer_token": 5}',
            "corrupt_prompt",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_not_a_server_error(client, route, raw, where):
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert where in msg and "not valid Unicode: a lone surrogate" in msg
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_a_prompt_over_the_size_limit_is_a_413_naming_the_limit(client, backend):
    limit = backend.max_prompt_bytes
    r = client.post("/v1/completions", json={"prompt": "w" * (limit + 1), "max_tokens": 1})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert f"limit of {limit} bytes" in err["message"] and err["code"] == "TooLargeError"
    body = {"messages": [{"role": "user", "content": "w" * (limit + 1)}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 413 and f"limit of {limit} bytes" in r.text


# -- auth before the body, and the body limit ---------------------------------------------------


class _Body:
    """A request body streamed in 1 MiB chunks, counting how many the server pulled."""

    def __init__(self, total: int):
        self.total, self.pulled = total, 0

    async def __aiter__(self):
        chunk = b" " * 2**20
        for _ in range(self.total // len(chunk)):
            self.pulled += 1
            yield chunk


def _post_streamed(app, body: _Body, headers: dict) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.post("/v1/completions", content=body, headers=headers)

    return asyncio.run(post())


def test_auth_comes_before_the_body_and_the_body_is_capped(backend, store):
    app = build_app(backend, KEYS, patch_store=store, max_body_bytes=4 * 2**20)
    declared = {"content-type": "application/json", "content-length": str(300 * 2**20)}
    for headers in (declared, {**declared, **_auth("not-a-key-at-all-0000")}):
        body = _Body(300 * 2**20)
        r = _post_streamed(app, body, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert body.pulled == 0  # refused before a byte of the body was read
    body = _Body(300 * 2**20)
    r = _post_streamed(app, body, {**declared, **_auth(READER)})
    assert r.status_code == 413 and body.pulled == 0
    err = r.json()["error"]
    assert f"is {300 * 2**20} bytes" in err["message"]
    assert f"limit of {4 * 2**20} bytes" in err["message"] and err["code"] == "TooLargeError"
    # a streamed body (no Content-Length) is cut off as soon as it passes the limit
    body = _Body(300 * 2**20)
    r = _post_streamed(app, body, {"content-type": "application/json", **_auth(READER)})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    assert body.pulled <= 5


def test_the_body_limit_is_configurable_and_holds_over_a_real_connection(backend, store, url):
    small = build_app(backend, KEYS, patch_store=store, max_body_bytes=1024)
    with serve_asgi(small) as small_url, httpx.Client(base_url=small_url, timeout=60) as c:
        body = {"prompt": "x" * 2000, "max_tokens": 1}
        r = c.post("/v1/completions", json=body, headers=_auth(READER))
        assert r.status_code == 413 and "limit of 1024 bytes" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=_auth(READER))
        assert r.status_code == 200
    big = b"{" + b" " * (40 * 2**20) + b"}"  # past the default 16 MiB
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 401
        r = c.post("/v1/completions", content=big, headers=_auth(READER))
        assert r.status_code == 413 and str(DEFAULT_MAX_BODY_BYTES) in r.text


def test_exactly_these_routes_are_public(backend, store, url):
    """`/health`, the dashboard page and its assets, and the OpenAPI document with its
    viewers need no key (they describe the API, hold no data); every other route does."""
    app = build_app(backend, KEYS, patch_store=store)
    public = {
        "/health",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/dashboard",
        "/dashboard/dashboard.js",
        "/dashboard/dashboard.css",
    }
    assert public_paths(app) == public
    doc = httpx.get(f"{url}/openapi.json", timeout=60).json()
    with httpx.Client(base_url=url, timeout=60) as anon:
        for path in public:
            assert anon.get(path).status_code == 200, path
        for path, ops in doc["paths"].items():
            concrete = path.replace("{name}", "v").replace("{run}", "r")
            for method in ops:
                r = anon.request(method.upper(), concrete, content=b"{}")
                expected = 200 if path in public else 401
                assert r.status_code == expected, (method, path, r.text)
        assert anon.get("/no/such/route").status_code == 401  # nothing about routes leaks

    async def under_a_prefix() -> tuple[int, int]:  # as Serve mounts an app's route_prefix
        mounted = Starlette(routes=[Mount("/tp2", app=app)])
        transport = httpx.ASGITransport(app=mounted)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            health, stats = await c.get("/tp2/health"), await c.get("/tp2/v1/stats")
            return health.status_code, stats.status_code

    assert asyncio.run(under_a_prefix()) == (200, 401)


# -- TransformerLens site names ------------------------------------------------------------------


def _sweep_summary(client, body: dict) -> dict:
    with client.stream("POST", "/v1/patch_sweep", json=body) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r)
    return json.loads(events[-1][1])


def test_transformerlens_hook_names_work_wherever_a_site_is_named(client):
    """`blocks.L.hook_resid_*` names a site and its layer: over HTTP it gives exactly what
    the site name with that layer gives, in steering, read-outs, captures, patches, sweeps."""
    probe, vec = _vec(7), _vec(8, 6.0)
    ours = {
        "steering": {"vectors": [{"site": "post_attn", "layers": [1], "vector": vec}]},
        "readouts": [{"name": "p", "site": "pre_attn", "layer": 1, "probe": probe}],
        "capture": {"sites": {"post_block": [0, 1], "pre_attn": [1]}},
        "patch": [{"layer": 0, "site": "post_block", "position": 4, "source": {"zeros": True}}],
    }
    theirs = {
        "steering": {"vectors": [{"site": "blocks.1.hook_resid_mid", "vector": vec}]},
        "readouts": [{"name": "p", "site": "blocks.1.hook_resid_pre", "probe": probe}],
        "capture": {
            "sites": {
                "blocks.0.hook_resid_post": "all",
                "blocks.1.hook_resid_post": [1],
                "blocks.1.hook_resid_pre": "all",
            }
        },
        "patch": [{"site": "blocks.0.hook_resid_post", "position": 4, "source": {"zeros": True}}],
    }
    a = _complete(client, max_tokens=3, logprobs=1, **ours)
    b = _complete(client, max_tokens=3, logprobs=1, **theirs)
    assert b["choices"][0]["coxswain"]["token_ids"] == a["choices"][0]["coxswain"]["token_ids"]
    assert _token_logprobs(b) == pytest.approx(_token_logprobs(a), abs=1e-4)
    ra, rb = (r["choices"][0]["coxswain"]["readouts"] for r in (a, b))
    assert [x["p"] for x in rb] == pytest.approx([x["p"] for x in ra], abs=1e-4)
    ca, cb = (r["coxswain"]["prompts"][0]["captures"] for r in (a, b))
    assert set(cb) == set(ca) == {"0.post_block", "1.post_block", "1.pre_attn"}
    for key in ca:
        torch.testing.assert_close(
            unpack_tensor(cb[key]), unpack_tensor(ca[key]), atol=1e-4, rtol=0
        )
    sweep = {"clean_prompt": PROMPT, "corrupt_prompt": [*PROMPT[:3], 9, *PROMPT[4:]]}
    sweep |= {"answer_token": 17, "positions": [2, 3]}
    sa = _sweep_summary(client, {**sweep, "sites": ["post_block", "pre_attn"], "layers": [1]})
    sb = _sweep_summary(client, {**sweep, "sites": ["blocks.1.hook_resid_post", "hook_resid_pre"]})
    assert sb["sites"] == sa["sites"] and sb["layers"] == sa["layers"] == [1]
    torch.testing.assert_close(
        torch.tensor(sb["grid"]), torch.tensor(sa["grid"]), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        (
            "/v1/completions",
            {
                "prompt": "x",
                "steering": {
                    "vectors": [{"site": "blocks.1.hook_resid_mid", "layers": [0], "vector": "v"}]
                },
            },
            "names layer 1, but layers is [0]",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "capture": {"sites": {"blocks.0.hook_resid_post": [1]}}},
            "names layer 0, but its layers are [1]",
        ),
        (
            "/v1/patch_sweep",
            {
                "corrupt_prompt": PROMPT,
                "answer_token": 5,
                "sites": ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre"],
            },
            "a sweep is a grid of sites",
        ),
    ],
)
def test_a_hook_name_whose_layer_disagrees_is_a_400(client, route, body, message):
    r = client.post(route, json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
