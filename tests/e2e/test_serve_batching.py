"""Concurrent requests through the Serve application share engine steps.

With Serve's default `max_ongoing_requests` (5) an engine replica never saw more than 5
requests at once: 20 concurrent requests ran in four waves, and `/health` queued behind
them. The deployments are sized from the engine's capacity, so all 20 run in one batch.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serving import serve_app_cluster

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ADMIN = "admin:admin:" + "a" * 32
KEY = ADMIN.split(":")[2]
CONCURRENT = 20


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{ADMIN}\n")
    with serve_app_cluster(
        str(tiny_checkpoint("llama")), str(keys), grpc_port=None, controller_grpc_port=None
    ) as cluster:
        yield cluster["http"]


def test_twenty_concurrent_requests_run_in_one_batch(url):
    async def main() -> tuple[int, list[int], int]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as c:
            started = 0
            all_started = asyncio.Event()

            async def one(i: int) -> int:
                nonlocal started
                body = {"prompt": f"request {i}", "max_tokens": 200, "ignore_eos": True}
                tokens = 0
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data:") or "[DONE]" in line:
                            continue
                        # A chunk carries every token since the last one the reader took.
                        choice = json.loads(line[5:])["choices"][0]
                        new = len((choice.get("coxswain") or {}).get("token_ids") or [])
                        if tokens == 0 and new:
                            started += 1
                            if started == CONCURRENT:
                                all_started.set()
                        tokens += new
                return tokens

            tasks = [asyncio.create_task(one(i)) for i in range(CONCURRENT)]
            # every request streams before any has finished: they share the engine's steps
            await asyncio.wait_for(all_started.wait(), timeout=240)
            running = (await c.get("/v1/stats")).json()["requests_running"]
            health = (await c.get("/health")).status_code
            return running, await asyncio.gather(*tasks), health

    running, tokens, health = asyncio.run(main())
    assert health == 200
    assert running == CONCURRENT  # Serve's default would have let in 5
    assert all(t >= 200 for t in tokens)
