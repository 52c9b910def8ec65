"""The patch store as a Ray actor: it serves authenticated gRPC on loopback from inside the
actor, and when the actor is killed Ray restarts it (new port, new service key) and every
client built on its target follows it: the engine writes captures to the new store, the
gateway's /v1/stats and /metrics answer again, and a run lost with the old store is a 404
that says so."""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import RunNotFoundError, UnauthenticatedError, http_status
from services.patch_store.actor import actor_target, start_patch_store_actor
from services.patch_store.client import PatchStoreClient
from tests.local_ray import start_local_ray
from tests.serving import serve_asgi

ray = pytest.importorskip("ray")

NAMESPACE = "patch-store-test"
ADMIN = "admin-secret-0123456789"
KEYS = ApiKeys([ApiKey("ops", "admin", ADMIN)])
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61]


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_cpus=2, namespace=NAMESPACE)
    yield
    ray.shutdown()


def test_actor_serves_grpc_and_a_client_round_trips_a_run(local_ray):
    actor = start_patch_store_actor(2**20, keys=KEYS, max_message_bytes=2**20, name="round-trip")
    address = ray.get(actor.address.remote(), timeout=60)
    assert address.startswith("127.0.0.1:")  # loopback unless told otherwise
    rows = {(layer, "post_block"): torch.randn(3, 32).to(torch.bfloat16) for layer in (0, 1)}
    with PatchStoreClient(actor_target("round-trip", NAMESPACE), timeout_s=10) as client:
        assert client.target == address  # resolved, with the actor's service key
        assert client.health() == "SERVING"
        m = client.put_run("clean", rows, [4, 5, 6], model="tiny@1")
        assert m.keys == ((0, "post_block"), (1, "post_block"))
        got = client.get_rows("clean", [(1, "post_block", 6), (0, "post_block", 4)])
        expected = torch.stack([rows[(1, "post_block")][2], rows[(0, "post_block")][0]])
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    anonymous = PatchStoreClient(address, timeout_s=10)
    with anonymous, pytest.raises(UnauthenticatedError):
        anonymous.manifests()
    with PatchStoreClient(address, api_key=ADMIN, timeout_s=10) as user:  # the cluster's keys
        assert [m.run_id for m in user.manifests()] == ["clean"]
    stats = ray.get(actor.stats.remote(), timeout=30)
    assert (stats["puts"], stats["hits"], stats["bytes"]) == (1, 1, 2 * 3 * 32 * 2)
    ray.get(actor.stop.remote(), timeout=30)
    ray.kill(actor, no_restart=True)


def _metrics(client: httpx.Client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if s.name.startswith("coxswain_gateway_patch_store_")
    }


def _restarted(actor, old, attempts: int = 600):
    """The endpoint of the actor once Ray has restarted it (`ray.kill` returns at once)."""
    for _ in range(attempts):
        try:
            endpoint = ray.get(actor.endpoint.remote(), timeout=30)
            if endpoint != old:
                return endpoint
            ray.get(actor.stats.remote(), timeout=30)  # the old actor still answers: wait
        except ray.exceptions.ActorUnavailableError:  # the call met the restart: ask again
            continue
    raise AssertionError("the patch store actor did not restart")


def test_a_killed_store_restarts_and_every_client_follows_it(local_ray, tiny_checkpoint):
    from services.engine.service import EngineService
    from services.gateway.http_app import build_app

    actor = start_patch_store_actor(2**24, keys=KEYS, name="restarts")
    target = actor_target("restarts", NAMESPACE)
    engine_store = PatchStoreClient(target, timeout_s=10)  # what an engine replica holds
    gateway_store = PatchStoreClient(target, timeout_s=10)  # what the gateway holds
    backend = EngineService.from_model(
        tiny_checkpoint("llama"),
        model_id="tiny",
        patch_store=engine_store,
        device="cpu",
        dtype="float32",
        max_model_len=256,
    )
    capture = {"sites": {"post_block": "all"}, "positions": "all_prompt", "sink": "patch_store"}
    patch = [{"layer": 1, "position": 2, "source": {"run": "clean", "position": 2}}]
    try:
        with (
            serve_asgi(build_app(backend, KEYS, patch_store=gateway_store)) as url,
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as http,
        ):

            def complete(**body):
                return http.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **body}, timeout=60
                )

            r = complete(capture=capture | {"run": "clean"})
            assert r.json()["coxswain"]["prompts"][0]["capture_run"] == "clean", r.text
            assert complete(patch=patch).status_code == 200
            assert http.get("/v1/stats").json()["patch_store"]["runs"] == 1
            old = ray.get(actor.endpoint.remote(), timeout=30)

            ray.kill(actor, no_restart=False)  # Ray restarts it: a new store, port and key
            new = _restarted(actor, old)
            assert new.address != old.address and new.api_key != old.api_key

            # The clients were not told: their next calls fail on the dead address, resolve
            # the actor again and go to the new store. The gateway's stats and metrics answer.
            stats = http.get("/v1/stats")
            assert stats.status_code == 200, stats.text
            assert stats.json()["patch_store"]["runs"] == 0
            assert _metrics(http)["coxswain_gateway_patch_store_runs"] == 0
            # A run lost in the restart is an explicit 404 for whoever references it.
            lost = complete(patch=patch)
            assert lost.status_code == 404, lost.text
            assert lost.json()["error"]["code"] == "RunNotFoundError"
            assert "patch store restarted" in lost.json()["error"]["message"]
            with pytest.raises(RunNotFoundError, match="patch store restarted at") as e:
                gateway_store.get_rows("clean", [(1, "post_block", 2)])
            assert http_status(e.value) == 404
            # The engine writes to the new store, and the gateway sees what it wrote.
            r = complete(capture=capture | {"run": "clean"})
            assert r.json()["coxswain"]["prompts"][0]["capture_run"] == "clean", r.text
            assert complete(patch=patch).status_code == 200
            assert [m.run_id for m in gateway_store.manifests()] == ["clean"]
            assert http.get("/v1/stats").json()["patch_store"]["runs"] == 1
    finally:
        backend.llm.shutdown()
        engine_store.close()
        gateway_store.close()
        ray.kill(actor, no_restart=True)
