"""The gateway's live dashboard: `GET /dashboard` (a dependency-free HTML page) and
`GET /v1/dashboard/state` (the one JSON snapshot the page polls about once a second).

The page is served without a key so a browser can open it; it asks for a key once (or
takes `?key=`, which `coxswain up` prints), keeps it in sessionStorage and sends it as
`Authorization: Bearer` on every poll. The snapshot route needs read scope, like every
other state route. `dashboard_state` is the pure function that turns what the engine
service and the patch store report into the snapshot; the router only gathers its inputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from services.common.auth import ApiKeys
from services.common.errors import CoxswainError
from services.engine.interventions.sites import SITES
from services.engine.service import EngineService
from services.gateway.http_auth import require
from services.patch_store.store import Manifest

STATIC_DIR = Path(__file__).parent / "static"
# The page's files, served as `/dashboard/<name>`; anything else there is not served.
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
MAX_RUNS_LISTED = 50  # stored runs in a snapshot (most recently used first)


# -- the snapshot ------------------------------------------------------------------------------


class ModelInfo(BaseModel):
    id: str
    num_layers: int
    hidden_size: int
    device: str
    dtype: str


class EngineRates(BaseModel):
    """Throughput over the engine's sliding window, cache and scheduler figures."""

    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    rate_window_s: float
    prefix_cache_hit_rate: float = Field(description="Prefix-cache block hits / lookups.")
    prefix_cache_hits: int
    prefix_cache_queries: int
    requests_running: int
    requests_waiting: int
    steps: int
    preemptions: int
    kv_blocks: int
    kv_blocks_free: int
    generated_tokens: int
    prompt_tokens: int


class GateFiring(BaseModel):
    """How often the declarative gates at one (layer, site) fired, since the engine started."""

    layer: int
    site: str
    tokens: int = Field(description="Decode tokens the gates here were evaluated on.")
    fired: int = Field(description="Of those, tokens where a gate fired (weight > 0.5).")
    rate: float


class Monitor(BaseModel):
    layer: int
    site: str
    threshold: float
    sharpness: float
    gate_rows: bool


class Pool(BaseModel):
    used: int
    size: int


class ConsumerTiming(BaseModel):
    name: str
    calls: int
    mean_ms: float
    max_ms: float
    errors: int
    last_error: str | None


class SteeringTiers(BaseModel):
    """Which tiers steer where, the installed monitors, row pools and the closed loop."""

    global_prefill: list[str] = Field(description="`layer.site`s of the global prefill tier.")
    global_decode: list[str]
    global_scale: dict[str, float]
    dynamic_sites: list[str]
    dynamic_gain: float
    monitors: list[Monitor]
    active_sites: list[str]
    per_request_pool: Pool
    dynamic_pool: Pool
    admissions_waiting_for_rows: int
    probe_aborts: int
    latched_sequences: int
    consumers: list[ConsumerTiming]


class QueueSource(BaseModel):
    source: str
    enqueued: int
    applied: int
    rejected: int
    dropped: int
    last_rejection: str | None


class ActionQueueState(BaseModel):
    capacity: int
    depth: int
    sources: list[QueueSource]


class Lease(BaseModel):
    run: str
    holders: list[str]
    expires_in_s: float = Field(description="Until the latest of the run's leases runs out.")
    bytes: int


class StoredRun(BaseModel):
    run: str
    bytes: int
    layers: list[int]
    sites: list[str]
    positions: int
    leased: bool
    age_s: float


class PatchStoreState(BaseModel):
    """Occupancy against the byte budget, leases, and the store's counters."""

    runs: int
    bytes: int
    budget_bytes: int
    bytes_over_budget: int
    occupancy: float = Field(description="bytes / budget_bytes; above 1 when leases hold runs.")
    leased_runs: int
    leases_active: int
    counters: dict[str, int]
    leases: list[Lease]
    recent_runs: list[StoredRun] = Field(description="Most recently used first.")


class DashboardState(BaseModel):
    """Everything the dashboard shows, read at `time` (unix seconds, server clock)."""

    time: float
    model: ModelInfo
    engine: EngineRates
    steering: SteeringTiers
    gates: list[GateFiring] = Field(description="By layer, then site.")
    queue: ActionQueueState
    patch_store: PatchStoreState | None = Field(description="Null when no store is attached.")
    patch_store_error: str | None = Field(
        None, description="Why the store could not be read (the rest is still current)."
    )


def dashboard_state(
    *,
    model: dict,
    stats: dict,
    steering: dict,
    dynamic: dict,
    store_stats: dict | None = None,
    manifests: Sequence[Manifest] = (),
    store_now: float = 0.0,
    now: float,
    store_error: str | None = None,
) -> DashboardState:
    """Combine `EngineService.model_card()`, `.stats()`, `.steering_state()` and
    `.dynamic_state()` with the patch store's `stats()` and `manifests()` (read at
    `store_now` in the store's clock) into one snapshot taken at `now` (unix seconds)."""
    queue = steering["queue"]
    pools = steering["pools"]
    outcomes = ("enqueued", "applied", "rejected", "dropped")
    sources = sorted(set().union(*(queue[k] for k in outcomes)))
    patch_store = None
    if store_stats is not None:
        patch_store = _patch_store_state(store_stats, manifests, store_now, now)
    return DashboardState(
        time=now,
        model=ModelInfo(**{k: model[k] for k in ModelInfo.model_fields}),
        engine=EngineRates(
            generation_tokens_per_s=stats["generation_tokens_per_s"],
            prompt_tokens_per_s=stats["prompt_tokens_per_s"],
            rate_window_s=stats["rate_window_s"],
            prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
            prefix_cache_hits=stats["prefix_cache_hits"],
            prefix_cache_queries=stats["prefix_cache_queries"],
            requests_running=stats["requests_running"],
            requests_waiting=stats["requests_waiting"],
            steps=stats["num_steps"],
            preemptions=stats["num_preemptions"],
            kv_blocks=stats["num_kv_blocks"],
            kv_blocks_free=stats["num_free_kv_blocks"],
            generated_tokens=stats["num_generated_tokens"],
            prompt_tokens=stats["num_prompt_tokens_computed"],
        ),
        steering=SteeringTiers(
            global_prefill=steering["global"]["prefill"],
            global_decode=steering["global"]["decode"],
            global_scale=steering["global"]["scale"],
            dynamic_sites=steering["dynamic"]["sites"],
            dynamic_gain=steering["dynamic"]["gain"],
            monitors=[
                Monitor(**_split_site_key(key), **{k: m[k] for k in _MONITOR_FIELDS})
                for key, m in steering["monitors"].items()
            ],
            active_sites=steering["active_sites"],
            per_request_pool=Pool(**pools["per_request"]),
            dynamic_pool=Pool(**pools["dynamic"]),
            admissions_waiting_for_rows=pools["admissions_waiting_for_rows"],
            probe_aborts=steering["probe_aborts"],
            latched_sequences=dynamic["latched_sequences"],
            consumers=[
                ConsumerTiming(name=name, **{k: t[k] for k in _TIMING_FIELDS})
                for name, t in sorted(steering["consumers"].items())
            ],
        ),
        gates=sorted(
            (
                GateFiring(
                    **_split_site_key(key),
                    tokens=g["tokens"],
                    fired=g["fired"],
                    rate=g["fired"] / g["tokens"] if g["tokens"] else 0.0,
                )
                for key, g in steering["gate_firing"].items()
            ),
            key=lambda g: (g.layer, SITES.index(g.site)),
        ),
        queue=ActionQueueState(
            capacity=queue["capacity"],
            depth=queue["depth"],
            sources=[
                QueueSource(
                    source=s,
                    **{k: queue[k].get(s, 0) for k in outcomes},
                    last_rejection=queue["last_rejection"].get(s),
                )
                for s in sources
            ],
        ),
        patch_store=patch_store,
        patch_store_error=store_error,
    )


_MONITOR_FIELDS = ("threshold", "sharpness", "gate_rows")
_TIMING_FIELDS = ("calls", "mean_ms", "max_ms", "errors", "last_error")
_STORE_FIELDS = ("runs", "bytes", "budget_bytes", "bytes_over_budget", "leased_runs")


def _split_site_key(key: str) -> dict[str, Any]:
    layer, site = key.split(".", 1)  # the engine's `site_key`: "3.post_block"
    return {"layer": int(layer), "site": site}


def _patch_store_state(
    stats: dict, manifests: Sequence[Manifest], store_now: float, now: float
) -> PatchStoreState:
    figures = {k: stats[k] for k in _STORE_FIELDS}
    counters = {
        k: v
        for k, v in stats.items()
        if k not in _STORE_FIELDS and k != "leases_active" and isinstance(v, int)
    }
    leased = [m for m in manifests if m.leased_until is not None]
    leased.sort(key=lambda m: m.leased_until or 0.0)
    return PatchStoreState(
        **figures,
        occupancy=stats["bytes"] / stats["budget_bytes"],
        leases_active=stats["leases_active"],
        counters=counters,
        leases=[
            Lease(
                run=m.run_id,
                holders=list(m.holders),
                expires_in_s=max(0.0, (m.leased_until or 0.0) - store_now),
                bytes=m.bytes,
            )
            for m in leased
        ],
        recent_runs=[
            StoredRun(
                run=m.run_id,
                bytes=m.bytes,
                layers=list(m.layers),
                sites=list(m.sites),
                positions=len(m.positions),
                leased=m.leased_until is not None,
                age_s=max(0.0, now - m.created_at),
            )
            # manifests() lists least recently used first
            for m in list(reversed(manifests))[:MAX_RUNS_LISTED]
        ],
    )


def read_dashboard_state(backend: EngineService, patch_store: Any = None) -> DashboardState:
    """Read every source now and combine them. Blocks on the engine lock (at most one step):
    call it from a worker thread. A store that cannot be read is reported, not fatal."""
    store = patch_store
    if store is None:  # the store the engine resolves run sources from, if any
        store = backend.engine.interventions.patch_sources
    store_stats, manifests, store_now, store_error = None, [], 0.0, None
    if store is not None:
        try:
            store_stats = store.stats()
            manifests = store.manifests()
            # A local store times leases by its own clock; a client gives this process's.
            store_now = getattr(store, "clock", time.monotonic)()
        except CoxswainError as exc:  # e.g. a remote store that does not answer
            store_stats, manifests, store_error = None, [], f"{type(exc).__name__}: {exc}"
    return dashboard_state(
        model=backend.model_card(),
        stats=backend.stats(),
        steering=backend.steering_state(),
        dynamic=backend.dynamic_state(),
        store_stats=store_stats,
        manifests=manifests,
        store_now=store_now,
        now=time.time(),
        store_error=store_error,
    )


# -- the routes --------------------------------------------------------------------------------


def _read_static(name: str) -> str:
    path = STATIC_DIR / name
    if not path.is_file():  # a broken install: fail when the app is built, not on a visit
        raise FileNotFoundError(f"dashboard asset missing: {path} (package data not installed?)")
    return path.read_text(encoding="utf-8")


def dashboard_router(
    backend: EngineService, keys: ApiKeys, *, patch_store: Any = None
) -> APIRouter:
    """`GET /dashboard` (the page and its two assets, no key needed) and
    `GET /v1/dashboard/state` (read scope). `patch_store` defaults to the backend's store."""
    page = _read_static("dashboard.html")
    assets = {name: (_read_static(name), media) for name, media in ASSETS.items()}
    # Browsers revalidate on each load, so an upgraded gateway's page is seen at once.
    no_cache = {"Cache-Control": "no-cache"}

    router = APIRouter(tags=["service"])

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers=no_cache)

    for name, (text, media) in assets.items():
        router.add_api_route(
            f"/dashboard/{name}",
            _asset_endpoint(text, media, no_cache),
            methods=["GET"],
            include_in_schema=False,
        )

    @router.get(
        "/v1/dashboard/state",
        response_model=DashboardState,
        dependencies=[require(keys, "read")],
        summary="Dashboard snapshot",
        description="One snapshot for the `/dashboard` page: engine throughput and prefix-"
        "cache hit rate, steering tiers and monitors, gate firing rates by layer, action-"
        "queue counters per source, and patch-store occupancy, leases and runs.",
    )
    def dashboard_snapshot() -> DashboardState:
        return read_dashboard_state(backend, patch_store)

    return router


def _asset_endpoint(text: str, media: str, headers: dict[str, str]):
    def asset() -> Response:
        return Response(text, media_type=media, headers=headers)

    return asset
