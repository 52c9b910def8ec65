"""The gateway's `/dashboard`: its state route over a real engine and patch store, served by
uvicorn on loopback, and the page itself rendered by headless Chromium (screenshot + DOM)."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from PIL import Image

from services.common.auth import ApiKey, ApiKeys
from services.engine.interventions.actions import SteeringMonitorUpdate, SteeringScaleUpdate
from services.engine.outputs import OutputAccumulator
from services.engine.sampling_params import SamplingParams
from services.engine.service import EngineService
from services.gateway.dashboard import (
    DashboardState,
    dashboard_router,
    dashboard_state,
    read_dashboard_state,
)
from services.gateway.http_app import build_app
from services.gateway.http_errors import install_error_handlers
from services.patch_store.client import PatchStoreClient
from services.patch_store.server import serve
from services.patch_store.store import Manifest, PatchStore
from tests.serving import serve_asgi

LAYERS, HIDDEN = 4, 64
READ_KEY = "dashboard-read-key-0123"
KEYS = ApiKeys([ApiKey("reader", "read", READ_KEY)])
AUTH = {"Authorization": f"Bearer {READ_KEY}"}
RUN = "clean-harbour"
CLEAN_PROMPT = "the harbour at dawn was quiet and grey"
STORE_BUDGET = 64 * 1024
GATED_REQUESTS, GATED_MAX_TOKENS = 3, 6
# Two full KV blocks (block_size 16), so a repeat of it hits the prefix cache.
CACHED_PROMPT = list(range(1, 40))

# Plot colours of dashboard.js (COLORS), as the screenshot shows them.
GENERATED, PROMPT, HIT = (0x25, 0x63, 0xEB), (0xF5, 0x9E, 0x0B), (0x10, 0xB9, 0x81)
POST_BLOCK_BARS, STORE_FILL = (0x08, 0x91, 0xB2), (0x0F, 0x76, 0x6E)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


# -- fixtures ----------------------------------------------------------------------------------


@dataclass
class Served:
    backend: EngineService
    store: PatchStore
    url: str
    clean_prompt_len: int


async def _finish(backend: EngineService, prompt, params: SamplingParams):
    totals = OutputAccumulator()
    outputs = [totals.add(delta) async for delta in backend.generate(prompt, params)]
    return outputs[-1]


async def _steered_traffic(backend: EngineService, vec: list[float]) -> int:
    """A captured clean run, controller actions (one rejected), global steering, gated
    requests and a repeated prompt; the clean prompt's length."""
    clean = await _finish(
        backend,
        CLEAN_PROMPT,
        SamplingParams(
            max_tokens=2,
            capture={
                "sites": {"post_block": "all"},
                "positions": "all_prompt",
                "sink": "patch_store",
                "run": RUN,
            },
        ),
    )
    assert clean.capture_run == RUN
    backend.submit_action(
        SteeringMonitorUpdate(site="post_block", layer=2, probe=vec, threshold=0.5, sharpness=4.0)
    )
    backend.submit_action(SteeringScaleUpdate(scale=2.0, request_id="gone"), "controller/scale")
    await backend.set_global_steering(
        {"vectors": [{"site": "post_block", "layers": [0], "vector": vec, "phase": "decode"}]}
    )
    steering = {
        "vectors": [{"site": "post_block", "layers": [1], "vector": vec, "scale": 2.0}],
        "gates": [
            {  # fires on every decode token
                "when": {"probe": vec, "site": "post_block", "layer": 1, "threshold": -1e4},
                "scope": "this_token",
                "apply": {"add": {"vector": vec, "scale": 1.0}},
            },
            {  # never fires
                "when": {"probe": vec, "site": "pre_attn", "layer": 2, "threshold": 1e4},
                "scope": "rest_of_request",
                "apply": {"attenuate": 1.0},
            },
        ],
    }
    gated = SamplingParams(max_tokens=GATED_MAX_TOKENS, ignore_eos=True, steering=steering)
    await asyncio.gather(
        *(_finish(backend, "once upon a time", gated) for _ in range(GATED_REQUESTS))
    )
    for _ in range(2):
        await _finish(backend, CACHED_PROMPT, SamplingParams(max_tokens=2))
    return len(clean.prompt_token_ids)


@pytest.fixture(scope="module")
def served(tiny_checkpoint) -> Iterator[Served]:
    store = PatchStore(STORE_BUDGET)
    backend = EngineService.from_model(
        tiny_checkpoint("llama", layers=LAYERS, hidden=HIDDEN),
        patch_store=store,
        device="cpu",
        dtype="float32",
    )
    vec = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0)).tolist()
    prompt_len = asyncio.run(_steered_traffic(backend, vec))
    store.lease(RUN, 600.0, "researcher")
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(dashboard_router(backend, KEYS, patch_store=store))
    try:
        with serve_asgi(app) as url:
            yield Served(backend, store, url, prompt_len)
    finally:
        asyncio.run(backend.shutdown())


@contextmanager
def _background_traffic(backend: EngineService) -> Iterator[None]:
    """Plain requests in a loop, so throughput is nonzero while a browser polls."""
    stop = threading.Event()

    def loop() -> None:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        while not stop.is_set():
            asyncio.run(_finish(backend, "a steady stream of tokens", params))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


# -- the state route ---------------------------------------------------------------------------


def test_state_needs_a_read_key_but_the_page_does_not(served):
    r = httpx.get(f"{served.url}/v1/dashboard/state")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "UnauthenticatedError"
    r = httpx.get(f"{served.url}/v1/dashboard/state", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "unknown API key"

    page = httpx.get(f"{served.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="dashboard/dashboard.js"' in page.text
    js = httpx.get(f"{served.url}/dashboard/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "v1/dashboard/state" in js.text
    css = httpx.get(f"{served.url}/dashboard/dashboard.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert httpx.get(f"{served.url}/dashboard/dashboard.py").status_code == 404


def test_state_reports_the_steered_traffic(served):
    r = httpx.get(f"{served.url}/v1/dashboard/state", headers=AUTH)
    assert r.status_code == 200
    state = r.json()
    assert set(state) == set(DashboardState.model_fields)
    assert state["model"]["num_layers"] == LAYERS and state["model"]["hidden_size"] == HIDDEN

    # Every gated request forwarded GATED_MAX_TOKENS - 1 decode tokens through both gates.
    tokens = GATED_REQUESTS * (GATED_MAX_TOKENS - 1)
    assert state["gates"] == [
        {"layer": 1, "site": "post_block", "tokens": tokens, "fired": tokens, "rate": 1.0},
        {"layer": 2, "site": "pre_attn", "tokens": tokens, "fired": 0, "rate": 0.0},
    ]

    st = state["steering"]
    assert st["monitors"] == [
        {"layer": 2, "site": "post_block", "threshold": 0.5, "sharpness": 4.0, "gate_rows": False}
    ]
    assert st["global_decode"] == ["0.post_block"] and st["global_prefill"] == []
    assert "2.post_block" in st["active_sites"]

    sources = {s["source"]: s for s in state["queue"]["sources"]}
    assert sources["controller/scale"]["enqueued"] == 1
    assert sources["controller/scale"]["rejected"] == 1
    assert sources["controller/scale"]["applied"] == 0
    assert "gone" in sources["controller/scale"]["last_rejection"]
    assert sources["api"]["applied"] == sources["api"]["enqueued"] >= 1
    assert sources["api"]["rejected"] == 0 and sources["api"]["last_rejection"] is None

    (manifest,) = served.store.manifests()
    ps = state["patch_store"]
    assert ps["runs"] == 1 and ps["bytes"] == manifest.bytes
    assert ps["budget_bytes"] == STORE_BUDGET
    assert ps["occupancy"] == pytest.approx(manifest.bytes / STORE_BUDGET)
    (lease,) = ps["leases"]
    assert lease["run"] == RUN and lease["holders"] == ["researcher"]
    assert 0 < lease["expires_in_s"] <= 600
    (run,) = ps["recent_runs"]
    assert run["run"] == RUN and run["leased"] is True
    assert run["layers"] == list(range(LAYERS)) and run["sites"] == ["post_block"]
    assert run["positions"] == served.clean_prompt_len
    assert ps["counters"]["puts"] == 1 and ps["counters"]["leases_granted"] == 1
    assert state["patch_store_error"] is None

    engine = state["engine"]
    assert engine["generated_tokens"] >= GATED_REQUESTS * GATED_MAX_TOKENS
    assert engine["prefix_cache_hits"] > 0
    assert engine["prefix_cache_hit_rate"] == pytest.approx(
        engine["prefix_cache_hits"] / engine["prefix_cache_queries"]
    )


def test_state_reads_a_remote_store_and_reports_one_that_is_down(served):
    server = serve(served.store, "127.0.0.1", 0)
    try:
        with PatchStoreClient(server.address, timeout_s=10) as client:
            state = read_dashboard_state(served.backend, client)
    finally:
        server.stop()
    (lease,) = state.patch_store.leases
    assert lease.run == RUN and 0 < lease.expires_in_s <= 600

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        port = dead.getsockname()[1]
        with PatchStoreClient(f"127.0.0.1:{port}", timeout_s=5) as client:
            state = read_dashboard_state(served.backend, client)
    finally:
        dead.close()
    assert state.patch_store is None
    assert state.patch_store_error.startswith("ServiceUnavailableError")
    assert state.gates  # the engine's part is still there


def test_build_app_serves_the_dashboard(served):
    app = build_app(served.backend, KEYS, patch_store=served.store)
    with serve_asgi(app) as url:
        assert httpx.get(f"{url}/dashboard").status_code == 200
        assert httpx.get(f"{url}/v1/dashboard/state").status_code == 401
        r = httpx.get(f"{url}/v1/dashboard/state", headers=AUTH)
        assert r.status_code == 200 and r.json()["patch_store"]["runs"] == 1
        paths = httpx.get(f"{url}/openapi.json", headers=AUTH).json()["paths"]
        assert "/v1/dashboard/state" in paths and "/dashboard" not in paths


# -- the page in headless Chromium -------------------------------------------------------------


def _run_chromium(tmp_path: Path, url: str, output: str) -> str:
    chromium = _chromium()
    assert chromium is not None
    profile = tmp_path / f"profile-{output.lstrip('-').split('=')[0]}"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",  # our own profile: other runs may use the default one
        "--window-size=1280,1600",
        "--virtual-time-budget=5000",  # about five polls
        output,
        url,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _mask_near(image: np.ndarray, rgb: tuple[int, int, int], tol: int = 24) -> np.ndarray:
    return np.abs(image - np.array(rgb)).max(axis=-1) <= tol


def _pixels_near(image: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int(_mask_near(image, rgb).sum())


def _attr(dom: str, element_id: str, attr: str) -> str:
    m = re.search(rf'<[^>]*id="{element_id}"[^>]*>', dom)
    assert m, f"no element #{element_id}"
    m = re.search(rf'{attr}="([^"]*)"', m.group(0))
    assert m, f"#{element_id} has no {attr}"
    return m.group(1)


def _tbody(dom: str, element_id: str) -> str:
    m = re.search(rf'<tbody id="{element_id}">(.*?)</tbody>', dom, re.S)
    assert m, f"no table body #{element_id}"
    return m.group(1)


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed")
def test_dashboard_renders_in_chromium(served, tmp_path):
    page = f"{served.url}/dashboard?key={READ_KEY}"
    with _background_traffic(served.backend):
        _run_chromium(tmp_path, page, f"--screenshot={tmp_path / 'dashboard.png'}")
        dom = _run_chromium(tmp_path, page, "--dump-dom")

    image = np.asarray(Image.open(tmp_path / "dashboard.png").convert("RGB")).astype(int)
    assert image.shape == (1600, 1280, 3)

    def plot(canvas_id: str) -> np.ndarray:  # the canvas's pixels in the screenshot
        x, y, w, h = (int(v) for v in _attr(dom, canvas_id, "data-box").split(","))
        assert w > 100 and h > 40 and y + h <= image.shape[0]
        return image[y : y + h, x : x + w]

    # Each plot shows its data in its own colours: the two throughput lines, the hit-rate
    # line, the bar of the always-firing gate (full height), the store's occupancy bar.
    assert _pixels_near(plot("plot-throughput"), GENERATED) > 300
    assert _pixels_near(plot("plot-throughput"), PROMPT) > 300
    assert _pixels_near(plot("plot-cache"), HIT) > 300
    bars = plot("plot-gates")  # the gate firing on every token: a bar to the 100% line
    tallest = _mask_near(bars, POST_BLOCK_BARS).sum(axis=0).max()
    assert tallest > 0.8 * bars.shape[0]
    # The occupancy bar is 18 px high and as long as bytes / budget of the canvas's width.
    store = plot("plot-store")
    occupancy = served.store.stats()["bytes"] / STORE_BUDGET
    expected = 18 * store.shape[1] * occupancy
    assert _pixels_near(store, STORE_FILL) == pytest.approx(expected, rel=0.1)

    assert re.search(r'id="status" class="pill pill-live">live<', dom)
    assert int(_attr(dom, "plot-throughput", "data-points")) >= 2
    assert int(_attr(dom, "plot-cache", "data-points")) >= 2
    assert _attr(dom, "plot-gates", "data-bars") == "2"
    assert float(_attr(dom, "plot-store", "data-occupancy")) == pytest.approx(occupancy)
    generated = re.search(r'id="t-gen">([0-9.]+)k?<', dom)
    assert generated and float(generated.group(1)) > 0
    assert RUN in _tbody(dom, "leases") and "researcher" in _tbody(dom, "leases")
    assert "controller/scale" in _tbody(dom, "queue") and "gone" in _tbody(dom, "queue")
    assert "post_block" in _tbody(dom, "monitors")
    assert "0.post_block" in _tbody(dom, "tiers")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed")
def test_dashboard_asks_for_a_key_without_one(served, tmp_path):
    dom = _run_chromium(tmp_path, f"{served.url}/dashboard", "--dump-dom")
    assert '<main id="main" hidden="">' in dom
    assert re.search(r'<form id="key-form" class="key-form">', dom)  # shown
    assert "API key needed" in dom


# -- the state-combining function --------------------------------------------------------------


def _manifest(run_id: str, nbytes: int, leased_until: float | None, holders=()) -> Manifest:
    return Manifest(
        run_id=run_id,
        model="tiny",
        hidden_size=8,
        dtype="float32",
        keys=((0, "post_block"), (2, "pre_attn")),
        positions=(0, 1, 2),
        token_ids=(),
        created_at=900.0,
        bytes=nbytes,
        leased_until=leased_until,
        holders=tuple(holders),
    )


def _engine_reports() -> dict:
    """Inputs shaped like `EngineService`'s reports."""
    return {
        "model": {
            "id": "tiny",
            "max_model_len": 512,
            "num_layers": 4,
            "hidden_size": 8,
            "vocab_size": 512,
            "sites": ["pre_attn", "post_attn", "post_block"],
            "dtype": "float32",
            "device": "cpu",
        },
        "stats": {
            "num_steps": 40,
            "num_running": 1,
            "num_waiting": 2,
            "num_preemptions": 0,
            "num_kv_blocks": 64,
            "num_free_kv_blocks": 60,
            "num_cached_blocks": 3,
            "num_evictions": 0,
            "prefix_cache_queries": 8,
            "prefix_cache_hits": 2,
            "num_generated_tokens": 120,
            "num_prompt_tokens_computed": 300,
            "requests_running": 1,
            "requests_waiting": 2,
            "prefix_cache_hit_rate": 0.25,
            "generation_tokens_per_s": 12.0,
            "prompt_tokens_per_s": 30.0,
            "rate_window_s": 10.0,
        },
        "steering": {
            "queue": {
                "capacity": 16,
                "depth": 3,
                "enqueued": {"api": 4, "controller/latch": 2},
                "dropped": {"sync/probe": 5},
                "applied": {"api": 3, "controller/latch": 2},
                "rejected": {"api": 1},
                "last_rejection": {"api": "SteeringScaleUpdate: no unfinished request 'x'"},
            },
            "pools": {
                "per_request": {"used": 2, "size": 256},
                "dynamic": {"used": 1, "size": 32},
                "admissions_waiting_for_rows": 7,
            },
            "global": {"prefill": [], "decode": ["1.post_block"], "scale": {"prefill": 1.0}},
            "dynamic": {"gain": 0.5, "sites": ["3.post_attn"]},
            "monitors": {"3.post_attn": {"threshold": 0.1, "sharpness": 9.0, "gate_rows": True}},
            "active_sites": ["1.post_block", "3.post_attn"],
            "consumers": {
                "probe": {
                    "calls": 5,
                    "mean_ms": 0.2,
                    "last_ms": 0.1,
                    "max_ms": 0.4,
                    "errors": 1,
                    "last_error": "ValueError()",
                }
            },
            "probe_aborts": 2,
            "gate_firing": {
                "3.post_attn": {"tokens": 10, "fired": 1},
                "0.post_block": {"tokens": 8, "fired": 6},
                "0.pre_attn": {"tokens": 4, "fired": 4},
            },
            "global_spec": None,
        },
        "dynamic": {"latched_sequences": 3},
    }


def test_dashboard_state_combines_engine_and_store_reports():
    reports = _engine_reports()
    manifests = [  # least recently used first, as the store lists them
        _manifest("old", 1000, None),
        _manifest("hot", 3000, 130.0, ("ana", "sweep-7")),
        _manifest("warm", 2000, 110.0, ("ana",)),
    ]
    store_stats = {
        "runs": 3,
        "bytes": 6000,
        "budget_bytes": 5000,
        "bytes_over_budget": 1000,
        "leased_runs": 2,
        "leases_active": 3,
        "puts": 3,
        "evictions": 4,
    }
    state = dashboard_state(
        **reports, store_stats=store_stats, manifests=manifests, store_now=100.0, now=1000.0
    )

    assert state.time == 1000.0 and state.model.num_layers == 4
    assert [(g.layer, g.site, g.rate) for g in state.gates] == [
        (0, "pre_attn", 1.0),  # by layer, then in site order
        (0, "post_block", 0.75),
        (3, "post_attn", 0.1),
    ]
    assert [
        (s.source, s.enqueued, s.applied, s.rejected, s.dropped) for s in state.queue.sources
    ] == [
        ("api", 4, 3, 1, 0),
        ("controller/latch", 2, 2, 0, 0),
        ("sync/probe", 0, 0, 0, 5),  # only ever dropped: still listed
    ]
    assert state.queue.sources[0].last_rejection.startswith("SteeringScaleUpdate")
    assert (state.queue.capacity, state.queue.depth) == (16, 3)

    st = state.steering
    assert st.monitors[0].model_dump() == {
        "layer": 3,
        "site": "post_attn",
        "threshold": 0.1,
        "sharpness": 9.0,
        "gate_rows": True,
    }
    assert (st.global_decode, st.global_prefill) == (["1.post_block"], [])
    assert (st.dynamic_sites, st.dynamic_gain) == (["3.post_attn"], 0.5)
    assert (st.per_request_pool.used, st.dynamic_pool.size) == (2, 32)
    assert (st.admissions_waiting_for_rows, st.probe_aborts, st.latched_sequences) == (7, 2, 3)
    assert st.consumers[0].name == "probe" and st.consumers[0].errors == 1

    e = state.engine
    assert (e.steps, e.kv_blocks_free, e.generated_tokens, e.prompt_tokens) == (40, 60, 120, 300)
    assert (e.requests_running, e.requests_waiting, e.prefix_cache_hit_rate) == (1, 2, 0.25)

    ps = state.patch_store
    assert ps.occupancy == pytest.approx(1.2) and ps.bytes_over_budget == 1000
    assert ps.counters == {"puts": 3, "evictions": 4}
    # Leases: soonest expiry first, in seconds from the store's clock.
    assert [(lease.run, lease.holders, lease.expires_in_s) for lease in ps.leases] == [
        ("warm", ["ana"], 10.0),
        ("hot", ["ana", "sweep-7"], 30.0),
    ]
    assert [r.run for r in ps.recent_runs] == ["warm", "hot", "old"]
    assert ps.recent_runs[2].model_dump() == {
        "run": "old",
        "bytes": 1000,
        "layers": [0, 2],
        "sites": ["post_block", "pre_attn"],
        "positions": 3,
        "leased": False,
        "age_s": 100.0,
    }


def test_dashboard_state_without_a_store_says_why():
    state = dashboard_state(**_engine_reports(), now=5.0)
    assert state.patch_store is None and state.patch_store_error is None
    state = dashboard_state(**_engine_reports(), now=5.0, store_error="ServiceUnavailableError: x")
    assert state.patch_store is None
    assert state.patch_store_error == "ServiceUnavailableError: x"
