"""The cluster end to end: a real local Ray, the Serve application (gateway + two engine
replicas, and a second application whose engine replica is a TP=2 group of rank actors),
called over real HTTP and gRPC. Results are checked against the offline engine on the same
checkpoint; admin changes must reach every replica; killing the engine replicas mid-request
must fail that request clearly, and the restarted replicas must serve again.

Ray is given logical GPUs (a machine without any has them as plain resources, and Ray still
assigns ids and sets CUDA_VISIBLE_DEVICES) and every rank asks for one, as `coxswain up
--device cuda` does, while the engines compute on CPU: each replica must hold GPUs no
other holds, a TP replica's ranks in one placement group."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from services.common.wire import unpack_tensor
from services.engine import LLM, SamplingParams
from services.engine.sweep import Sweep, SweepSpec
from tests.local_ray import start_local_ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ADMIN, READER = "admin:admin:" + "a" * 32, "reader:read:" + "r" * 32
ADMIN_KEY, READ_KEY = ADMIN.split(":")[2], READER.split(":")[2]
ENGINE = {"device": "cpu", "dtype": "float32"}
# Two 1-rank replicas and a TP=2 one hold 4; the rest lets replaced replicas start at once.
LOGICAL_GPUS = 8
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61]
H = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vec(seed: int, norm: float = 4.0) -> list[float]:
    v = torch.randn(H, generator=torch.Generator().manual_seed(seed))
    return (v / v.norm() * norm).tolist()


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def redis_server():
    from services.controller.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory, redis_server):
    from services.gateway.serve_app import build_app

    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{ADMIN}\n{READER}\n")
    start_local_ray(num_cpus=8, num_gpus=LOGICAL_GPUS, namespace="coxswain")
    http_port, grpc_port = _free_port(), _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    args = {
        "model": str(model),
        "api_keys_file": str(keys),
        "grpc_port": grpc_port,
        "patch_store_budget_gb": 0.0625,
        "redis_url": redis_server.url,  # as `coxswain up` and the deploy manifests do
        "controller_grpc_port": _free_port(),
        "num_gpus_per_rank": 1,
        **ENGINE,
    }
    serve.run(build_app({**args, "engine_replicas": 2}), name="coxswain", route_prefix="/")
    tp_args = {**args, "tp": 2, "grpc_port": None}
    serve.run(build_app(tp_args), name="tp2", route_prefix="/tp2")
    yield {"http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=cluster["http"], headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model):
    return LLM(model, **ENGINE)


def _complete(client, route: str = "/v1/completions", **body) -> dict:
    r = client.post(route, json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _logprobs(resp: dict) -> list[float]:
    return resp["choices"][0]["logprobs"]["token_logprobs"]


def _want(offline, **params) -> list[float]:
    out = offline.generate([PROMPT], SamplingParams(temperature=0, **params))[0].outputs[0]
    return [out.logprobs[i][t] for i, t in enumerate(out.token_ids)]


def test_generations_take_direct_links_to_every_engine_replica(client, offline):
    """The gateway streams from each replica's delta server (not through Serve's handle):
    it links to both replicas, and what comes back is what the engine computes."""
    deadline = time.monotonic() + 60
    while client.get("/health").json().get("engine_links") != 2:
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.5)
    want = _want(offline, max_tokens=4, logprobs=1)
    for _ in range(4):  # least-loaded picks: both replicas serve some of them
        assert _logprobs(_complete(client, max_tokens=4, logprobs=1)) == pytest.approx(
            want, abs=1e-4
        )


def test_steered_captured_patched_requests_match_the_offline_engine(client, offline):
    steering = {"vectors": [{"layers": [0, 1], "vector": _vec(1), "scale": 2.0}]}
    patch = [{"layer": 0, "position": 4, "source": {"vector": _vec(3, 10.0)}}]
    capture = {"sites": {"post_block": [0, 1]}, "positions": "all_prompt"}
    for extra in ({}, {"steering": steering}, {"patch": patch}):
        got = _complete(client, max_tokens=5, logprobs=1, **extra)
        assert _logprobs(got) == pytest.approx(
            _want(offline, max_tokens=5, logprobs=1, **extra), abs=1e-4
        )
    resp = _complete(client, max_tokens=1, capture=capture)
    want = offline.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, capture=capture))
    captures = resp["coxswain"]["prompts"][0]["captures"]
    assert set(captures) == {"0.post_block", "1.post_block"}
    for key, packed in captures.items():
        torch.testing.assert_close(unpack_tensor(packed), want[0].captures[key], atol=1e-4, rtol=0)


def test_a_streamed_sweep_over_http(client, model):
    body = {
        "clean_prompt": PROMPT,
        "corrupt_prompt": [*PROMPT[:3], 200, *PROMPT[4:]],
        "answer_token": 17,
        "layers": [0, 1],
        "positions": [2, 3],
    }
    with client.stream("POST", "/v1/patch_sweep", json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith(("event:", "data:"))]
    events = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("event:")]
    assert events == ["cell"] * 4 + ["summary"]
    summary = json.loads([ln for ln in lines if ln.startswith("data:")][-1][5:])
    from services.engine import EngineConfig, LLMEngine

    ref = Sweep(LLMEngine(model, EngineConfig(**ENGINE)), SweepSpec(**body)).run()
    grid = torch.tensor(summary["grid"], dtype=torch.float64)
    torch.testing.assert_close(grid, torch.from_numpy(ref.grid), atol=1e-4, rtol=0)


def test_grpc_front_of_the_gateway(cluster, offline):
    from services.client import CoxswainClient
    from services.common.errors import PermissionDeniedError

    steering = {"vectors": [{"layers": [1], "vector": _vec(5)}]}
    with CoxswainClient(cluster["grpc"], api_key=ADMIN_KEY) as c:
        out = c.complete(PROMPT, max_tokens=4, temperature=0.0, logprobs=1, steering=steering)
        got = [out.outputs[0].logprobs[i][t] for i, t in enumerate(out.outputs[0].token_ids)]
    assert got == pytest.approx(
        _want(offline, max_tokens=4, logprobs=1, steering=steering), abs=1e-4
    )
    with (
        CoxswainClient(cluster["grpc"], api_key=READ_KEY) as c,
        pytest.raises(PermissionDeniedError),
    ):
        c.set_global_steering(steering)


# Admin writes read back: each returns once every live engine replica applied it, so the
# requests right after it see it, whichever replica serves them (Serve spreads them).
FOLLOW_UPS = 20


def _http_api(client) -> SimpleNamespace:
    def ok(method: str, path: str, body: dict | None = None) -> dict:
        r = client.request(method, path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(**extra) -> list[float] | str:
        body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 2, "logprobs": 1, **extra}
        r = client.post("/v1/completions", json=body)
        return _logprobs(r.json()) if r.status_code == 200 else r.json()["error"]["message"]

    return SimpleNamespace(
        put=lambda name, value: ok("PUT", f"/v1/vectors/{name}", {"value": value}),
        delete=lambda name: ok("DELETE", f"/v1/vectors/{name}"),
        set=lambda spec: ok("POST", "/v1/steering/set", spec),
        clear=lambda: ok("POST", "/v1/steering/clear"),
        complete=complete,
    )


def _grpc_api(c) -> SimpleNamespace:
    from services.common.errors import InvalidRequestError

    def complete(**extra) -> list[float] | str:
        try:
            out = c.complete(PROMPT, max_tokens=2, temperature=0.0, logprobs=1, **extra)
        except InvalidRequestError as exc:
            return str(exc)
        return [out.outputs[0].logprobs[i][t] for i, t in enumerate(out.outputs[0].token_ids)]

    return SimpleNamespace(
        put=c.register_vector,
        delete=c.unregister_vector,
        set=c.set_global_steering,
        clear=c.clear_global_steering,
        complete=complete,
    )


def _read_your_writes(api: SimpleNamespace, offline, name: str) -> None:
    vec = _vec(21, 8.0)
    by_name = {"vectors": [{"layers": [0, 1], "vector": name}]}
    plain = _want(offline, max_tokens=2, logprobs=1)  # the unsteered control
    steered = _want(
        offline, max_tokens=2, logprobs=1, steering={"vectors": [{"layers": [0, 1], "vector": vec}]}
    )
    assert max(abs(a - b) for a, b in zip(plain, steered, strict=True)) > 1e-2

    api.put(name, vec)
    for _ in range(FOLLOW_UPS):
        assert api.complete(steering=by_name) == pytest.approx(steered, abs=1e-4)
    api.set(by_name)
    for _ in range(FOLLOW_UPS):
        assert api.complete() == pytest.approx(steered, abs=1e-4)
    api.clear()
    for _ in range(FOLLOW_UPS):
        assert api.complete() == pytest.approx(plain, abs=1e-4)
    api.delete(name)
    for _ in range(FOLLOW_UPS):
        got = api.complete(steering=by_name)
        assert isinstance(got, str) and f"unknown vector name '{name}'" in got, got


def test_admin_writes_over_http_are_seen_by_the_next_requests(client, offline):
    _read_your_writes(_http_api(client), offline, "ryw-http")
    state = client.get("/v1/steering").json()["cluster"]  # every live replica, one version
    assert {r["version"] for r in state["replicas"].values()} == {state["version"]}
    assert len(state["replicas"]) == 3  # two replicas here, one in the tp2 application
    bad = client.post("/v1/steering/set", json={"vectors": [{"layers": [0], "vector": [1.0] * 7}]})
    assert bad.status_code == 400
    reader = client.post("/v1/steering/clear", headers={"Authorization": f"Bearer {READ_KEY}"})
    assert reader.status_code == 403


def test_admin_writes_over_grpc_are_seen_by_the_next_requests(cluster, offline):
    from services.client import CoxswainClient

    with CoxswainClient(cluster["grpc"], api_key=ADMIN_KEY) as c:
        _read_your_writes(_grpc_api(c), offline, "ryw-grpc")


def test_vector_names_are_checked_before_anything_is_recorded(client, cluster):
    from services.client import CoxswainClient
    from services.common.errors import InvalidRequestError

    long = "a" * 129
    for name in (long, "two words", "semi;colon"):
        r = client.put(f"/v1/vectors/{name}", json={"value": _vec(1)})
        assert r.status_code == 400, r.text
        assert "invalid vector name" in r.json()["error"]["message"]
    with (
        CoxswainClient(cluster["grpc"], api_key=ADMIN_KEY) as c,
        pytest.raises(InvalidRequestError, match="invalid vector name"),
    ):
        c.register_vector(long, _vec(1))
    # Nothing was recorded: later writes apply on every replica, none rejects anything.
    assert client.put("/v1/vectors/" + "a" * 128, json={"value": _vec(1)}).status_code == 200
    assert long not in {v["name"] for v in client.get("/v1/vectors").json()["data"]}
    replicas = client.get("/v1/steering").json()["cluster"]["replicas"]
    assert replicas and all(r["rejected"] == {} for r in replicas.values())
    assert client.delete("/v1/vectors/" + "a" * 128).status_code == 200


def test_dashboard_state_through_the_cluster(client, cluster):
    _complete(client, max_tokens=2)
    state = client.get("/v1/dashboard/state")
    assert state.status_code == 200, state.text
    body = state.json()
    # one replica's engine figures (the dashboard shows the replica that answered)
    assert body["engine"]["steps"] >= 0 and body["model"]["id"]
    assert body["patch_store"]["budget_bytes"] == 64 * 2**20
    assert httpx.get(cluster["http"] + "/v1/dashboard/state").status_code == 401
    page = httpx.get(cluster["http"] + "/dashboard")
    assert page.status_code == 200 and "<canvas" in page.text


def test_tensor_parallel_replica_through_ray_actors(client, offline):
    steering = {"vectors": [{"layers": [0, 1], "vector": _vec(1), "scale": 2.0}]}
    got = _complete(client, "/tp2/v1/completions", max_tokens=5, logprobs=1, steering=steering)
    want = _want(offline, max_tokens=5, logprobs=1, steering=steering)
    assert _logprobs(got) == pytest.approx(want, abs=1e-4)


def replica_stats(client, route: str, replicas: int, tries: int = 200) -> dict[str, dict]:
    """`/v1/stats` of each engine replica, by the replica id in its `placement`: asked until
    `replicas` different replicas answered (Serve picks one per call)."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        r = client.get(route)
        assert r.status_code == 200, r.text
        seen[r.json()["placement"]["replica"]] = r.json()
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"only replicas {sorted(seen)} answered {route}")


def ranks_of(client, route: str, replicas: int) -> list[list[dict]]:
    """Each engine replica's ranks: where they run (`placement`)."""
    return [s["placement"]["ranks"] for s in replica_stats(client, route, replicas).values()]


def gpu_of(rank: dict) -> str:
    """The one GPU a rank holds: Ray's id, and all that CUDA_VISIBLE_DEVICES shows it."""
    (gpu,) = rank["gpu_ids"]
    assert rank["cuda_visible_devices"] == gpu
    return gpu


def test_every_engine_rank_holds_a_gpu_of_its_own(client):
    one_rank = ranks_of(client, "/v1/stats", replicas=2)
    assert all(len(ranks) == 1 for ranks in one_rank)
    (tp,) = ranks_of(client, "/tp2/v1/stats", replicas=1)
    assert [r["rank"] for r in tp] == [0, 1]
    gpus = [gpu_of(r) for ranks in [*one_rank, tp] for r in ranks]
    assert len(set(gpus)) == len(gpus) == 4, gpus


def test_a_tensor_parallel_replicas_ranks_share_one_placement_group(client):
    (tp,) = ranks_of(client, "/tp2/v1/stats", replicas=1)
    (pg_id,) = {r["placement_group"] for r in tp}
    assert pg_id is not None and len({r["node_id"] for r in tp}) == 1
    table = ray.util.placement_group_table()[pg_id]
    assert table["strategy"] == "STRICT_PACK"
    # The Serve replica's own bundle, then one GPU per rank.
    bundles = [table["bundles"][i] for i in sorted(table["bundles"])]
    assert [b.get("GPU", 0) for b in bundles] == [0, 1, 1]


def _stream_then_kill(client, route: str, kill) -> list[dict]:
    """Start a long stream, call `kill()` once its first chunk arrived; the error events."""
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data:"))
        assert "choices" in first
        kill()
        rest = [ln for ln in lines if ln.startswith("data:")]
    return [json.loads(ln[5:]) for ln in rest if ln[5:].strip() != "[DONE]" and "error" in ln]


def _wait_serving(client, route: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:  # Serve replaces the dead replicas; new requests succeed again
        r = client.post(route, json={"prompt": PROMPT, "max_tokens": 2})
        if r.status_code == 200:
            return
        assert r.status_code == 503, r.text
        assert "retry shortly" in r.json()["error"]["message"]
        assert time.monotonic() < deadline, "the engine replicas did not come back"
        time.sleep(0.5)


def test_killing_one_rank_of_a_tensor_parallel_replica(client):
    def kill_rank1():
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].endswith("-rank1")
        ]
        assert len(names) == 1
        ray.kill(ray.get_actor(names[0], namespace="coxswain"))

    errors = _stream_then_kill(client, "/tp2/v1/completions", kill_rank1)
    assert errors and "engine replica failed" in errors[-1]["error"]["message"]
    _wait_serving(client, "/tp2/v1/completions")


DURABLE = {"vectors": [{"layers": [0, 1], "vector": "durable"}]}


def test_admin_state_survives_its_redis_losing_everything(client, redis_server, offline):
    from services.cluster.stores import STATE_ACTOR

    # With Redis no actor holds the state (there is none to kill and lose it with).
    assert STATE_ACTOR not in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    vec = _vec(31, 8.0)
    assert client.put("/v1/vectors/durable", json={"value": vec}).status_code == 200
    assert client.post("/v1/steering/set", json=DURABLE).status_code == 200
    redis_server.restart()  # back empty (no RDB/AOF): the live replicas restore the state
    deadline = time.monotonic() + 60
    while (r := client.put("/v1/vectors/durable-2", json={"value": vec})).status_code != 200:
        assert r.status_code == 503, r.text  # "retry shortly", until a replica re-seeded it
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert {"durable", "durable-2"} <= {v["name"] for v in client.get("/v1/vectors").json()["data"]}
    steered = _want(offline, max_tokens=2, logprobs=1, steering=_inline(DURABLE, vec))
    for _ in range(4):
        assert _logprobs(_complete(client, max_tokens=2, logprobs=1)) == pytest.approx(
            steered, abs=1e-4
        )


def _inline(spec: dict, vec: list[float]) -> dict:
    return {"vectors": [{**v, "vector": vec} for v in spec["vectors"]]}


def test_killing_the_engine_replicas_fails_in_flight_requests_and_they_come_back(client, offline):
    def kill_engines():
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if "#Engine#" in actor["name"] and "coxswain#" in actor["name"]:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))

    errors = _stream_then_kill(client, "/v1/completions", kill_engines)
    assert errors, "the in-flight stream ended without an error"
    assert "replica" in errors[-1]["error"]["message"]
    _wait_serving(client, "/v1/completions")
    # The new replicas got the registered vectors and the global steering back.
    steered = _want(offline, max_tokens=2, logprobs=1, steering=_inline(DURABLE, _vec(31, 8.0)))
    for _ in range(4):
        assert "durable" in {v["name"] for v in client.get("/v1/vectors").json()["data"]}
        assert _logprobs(_complete(client, max_tokens=2, logprobs=1)) == pytest.approx(
            steered, abs=1e-4
        )
