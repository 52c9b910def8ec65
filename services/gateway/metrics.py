"""Prometheus metrics of one gateway app, in the app's own `CollectorRegistry`.

Two sources: `RequestMetrics`, an ASGI middleware counting requests and timing them per
route template (never per raw path, so ids in paths don't explode the label set); and
`EngineCollector`, which reads the engine's counters, steering state and the patch store
at scrape time, so a scrape always shows current values without a background poller.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Streams (completions, sweeps) are timed to their last byte, hence the long tail.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestMetrics:
    """ASGI middleware: `coxswain_http_requests_total{route, method, status}` and
    `coxswain_http_request_duration_seconds{route, method}`."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter(
            "coxswain_http_requests",
            "HTTP requests by route template, method and status code.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "coxswain_http_request_duration_seconds",
            "Time from request to the response's last byte, by route template and method.",
            ["route", "method"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # unless a response starts: an exception escaped the app

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")  # set by the router on the scope it was given
            # `/v1/vectors/{name:path}` reads as the OpenAPI document names it
            path = getattr(route, "path", "unmatched").replace(":path}", "}")
            method = scope["method"]
            self.requests.labels(path, method, str(status)).inc()
            self.latency.labels(path, method).observe(time.perf_counter() - start)


class EngineCollector(Collector):
    """Engine throughput, KV cache, steering and patch-store figures, read per scrape from
    `backend.stats()`, `backend.steering_state()` and the patch store's `stats()`."""

    def __init__(self, backend: Any, patch_store: Any = None):
        self.backend, self.patch_store = backend, patch_store

    def describe(self) -> list[Metric]:
        return []  # registering must not call the engine; names are checked per scrape

    def collect(self) -> Iterator[Metric]:
        yield from self._engine(self.backend.stats())
        yield from self._steering(self.backend.steering_state())
        if self.patch_store is not None:
            yield from self._patch_store(self.patch_store.stats())

    def _engine(self, s: dict) -> Iterator[Metric]:
        gauges = {
            "requests_running": ("requests_running", "Requests being scheduled."),
            "requests_waiting": ("requests_waiting", "Requests waiting for admission."),
            "num_kv_blocks": ("kv_blocks", "KV cache blocks in total."),
            "num_free_kv_blocks": ("kv_blocks_free", "KV cache blocks free."),
            "num_cached_blocks": ("kv_blocks_cached", "KV blocks held by the prefix cache."),
            "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prefix cache hits / queries."),
            "generation_tokens_per_s": (
                "generation_tokens_per_second",
                "Generated tokens per second over the rate window.",
            ),
            "prompt_tokens_per_s": (
                "prompt_tokens_per_second",
                "Prompt tokens computed per second over the rate window.",
            ),
            "capture_arena_bytes": (
                "capture_arena_bytes",
                "Page-locked host bytes held for captured rows the device writes directly.",
            ),
        }
        counters = {
            "num_steps": ("steps", "Engine steps taken."),
            "num_preemptions": ("preemptions", "Sequences preempted (recomputed later)."),
            "num_evictions": ("kv_evictions", "Prefix-cache blocks evicted."),
            "prefix_cache_queries": ("prefix_cache_queries", "Prefix-cache block lookups."),
            "prefix_cache_hits": ("prefix_cache_hits", "Prefix-cache block hits."),
            "num_generated_tokens": ("generated_tokens", "Tokens generated."),
            "num_prompt_tokens_computed": ("prompt_tokens", "Prompt tokens computed."),
            "capture_rows_placed": (
                "capture_rows_placed",
                "Captured token rows the device wrote into requests' arena buffers.",
            ),
            "capture_arena_refused": (
                "capture_arena_refused",
                "Capture buffers the arena had no room for (their rows took the drain).",
            ),
        }
        for key, (name, doc) in gauges.items():
            if key in s:
                yield GaugeMetricFamily(f"coxswain_engine_{name}", doc, value=s[key])
        for key, (name, doc) in counters.items():
            if key in s:
                yield CounterMetricFamily(f"coxswain_engine_{name}", doc, value=s[key])

    def _steering(self, st: dict) -> Iterator[Metric]:
        q = st.get("queue", {})
        actions = CounterMetricFamily(
            "coxswain_steering_actions",
            "Steering actions by source and outcome (enqueued, dropped, applied, rejected).",
            labels=["source", "outcome"],
        )
        for outcome in ("enqueued", "dropped", "applied", "rejected"):
            for source, n in sorted(q.get(outcome, {}).items()):
                actions.add_metric([source, outcome], n)
        yield actions
        yield GaugeMetricFamily(
            "coxswain_steering_queue_depth", "Actions waiting for the next step.", q.get("depth", 0)
        )
        rows = GaugeMetricFamily(
            "coxswain_steering_rows_used", "Steering table rows in use, by pool.", labels=["pool"]
        )
        size = GaugeMetricFamily(
            "coxswain_steering_rows", "Steering table rows, by pool.", labels=["pool"]
        )
        pools = st.get("pools", {})
        for pool in ("per_request", "dynamic"):
            if pool in pools:
                rows.add_metric([pool], pools[pool]["used"])
                size.add_metric([pool], pools[pool]["size"])
        yield rows
        yield size
        yield CounterMetricFamily(
            "coxswain_steering_admissions_waiting_for_rows",
            "Admissions deferred because a steering row pool was full.",
            value=pools.get("admissions_waiting_for_rows", 0),
        )
        yield CounterMetricFamily(
            "coxswain_steering_probe_aborts",
            "Requests stopped by an abort_when probe.",
            value=st.get("probe_aborts", 0),
        )
        captured = CounterMetricFamily(
            "coxswain_captured_tokens",
            "Captured tokens, by path: a decode step's capture block (in the CUDA graph) or "
            "eager copies.",
            labels=["path"],
        )
        for path, n in st.get("captured_tokens", {}).items():
            captured.add_metric([path], n)
        yield captured
        yield GaugeMetricFamily(
            "coxswain_steering_monitors", "Installed monitors.", value=len(st.get("monitors", {}))
        )
        tokens = CounterMetricFamily(
            "coxswain_steering_gate_tokens",
            "Decode tokens that probe gates were evaluated on, by layer and site.",
            labels=["layer", "site"],
        )
        fired = CounterMetricFamily(
            "coxswain_steering_gate_fired",
            "Decode tokens on which a probe gate fired, by layer and site.",
            labels=["layer", "site"],
        )
        for key, counts in sorted(st.get("gate_firing", {}).items()):
            layer, _, site = key.partition(".")
            tokens.add_metric([layer, site], counts["tokens"])
            fired.add_metric([layer, site], counts["fired"])
        yield tokens
        yield fired

    def _patch_store(self, s: dict) -> Iterator[Metric]:
        for key, value in sorted(s.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(
                    f"coxswain_gateway_patch_store_{key}", f"Patch store: {key}.", value=value
                )
