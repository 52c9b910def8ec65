"""An engine replica's lost read-outs reach Prometheus: an engine and its `EngineLink` in a
Ray actor (as in a Serve replica) publish to a Redis that is not there, its small buffer
overflows, and the node's Prometheus endpoint (Ray's metrics export) shows the loss."""

from __future__ import annotations

import re
import sys
import time
import urllib.request

import pytest

from services.common.net import free_port
from services.controller.redis_server import RedisServer
from services.engine.outputs import OutputAccumulator
from tests.local_ray import start_local_ray

ray = pytest.importorskip("ray")

GEN = 12
BUFFER = 2


@pytest.fixture(scope="module")
def metrics_port():
    port = free_port("127.0.0.1")
    start_local_ray(
        num_cpus=1,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    yield port
    ray.shutdown()


class LinkedEngine:
    """An AsyncLLM with an EngineLink, in one Ray actor (an engine replica's process)."""

    def __init__(self, path: str, redis_url: str) -> None:
        from services.controller.engine_link import EngineLink
        from services.engine import AsyncLLM

        self.llm = AsyncLLM(path, device="cpu", dtype="float32")
        self.link = EngineLink(self.llm, redis_url, "r-metrics", buffer_size=BUFFER, block_s=0.1)

    async def generate(self) -> int:
        from services.engine import SamplingParams

        probe = [1.0] * 64
        params = SamplingParams(
            max_tokens=GEN,
            temperature=0.0,
            ignore_eos=True,
            readouts=[{"probe": probe, "layer": 0, "name": "p"}],
        )
        last = None
        totals = OutputAccumulator()
        async for delta in self.llm.generate([5, 6, 7, 8], params, request_id="m-1"):
            last = totals.add(delta)
        return len(last.outputs[0].token_ids)

    def counters(self) -> dict:
        return self.link.counters()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _lost(text: str) -> float | None:
    for line in text.splitlines():
        ours = 'outcome="lost"' in line and 'replica="r-metrics"' in line
        if line.startswith("ray_coxswain_engine_link_readouts") and ours:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow  # Ray and a model in an actor
def test_lost_readouts_are_exported_to_prometheus(metrics_port, tiny_checkpoint):
    # workers cannot import this test module by name: ship the actor class by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    dead = RedisServer()  # a free port with no server on it: every publish fails
    engine = ray.remote(LinkedEngine).remote(str(tiny_checkpoint("llama")), dead.url)
    assert ray.get(engine.generate.remote(), timeout=300) == GEN
    lost = ray.get(engine.counters.remote(), timeout=60)["readouts"]["lost"]
    assert lost >= GEN - BUFFER

    deadline = time.monotonic() + 60
    exported = None
    while time.monotonic() < deadline:
        exported = _lost(_scrape(metrics_port))
        if exported is not None and exported >= GEN - BUFFER:
            break
        time.sleep(0.5)
    assert exported is not None, "no ray_coxswain_engine_link_readouts{outcome=lost} series"
    assert exported >= GEN - BUFFER
    assert re.search(
        r"ray_coxswain_engine_link_redis_errors\S*\{[^}]*r-metrics", _scrape(metrics_port)
    )
    ray.kill(engine)
