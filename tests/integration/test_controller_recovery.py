"""Redis dies mid-run: the engine keeps serving, the link and the controller count what they
lose, and once redis-server is back on the same port (empty) the closed loop resumes."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.controller import Controller
from services.controller.engine_link import EngineLink
from services.controller.redis_server import RedisServer
from services.engine import AsyncLLM, OutputAccumulator
from tests.integration.test_controller import (
    GEN,
    TIMEOUT_S,
    HoldForActions,
    enqueued,
    generate,
    params,
    prompt,
    readouts,
    settled,
    snapshot,
    vec,
    wait_for,
)

BUFFER = 8  # the link keeps this many read-outs while Redis is away


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


@pytest.fixture()
def cluster(path):
    """A redis-server, an engine with its link, and a latch controller, all fresh."""
    server = RedisServer().start()
    llm = AsyncLLM(path, device="cpu", dtype="float32")
    link = EngineLink(llm, server.url, "r0", buffer_size=BUFFER, block_s=0.1, backoff_max_s=0.2)
    controller = Controller(
        server.url,
        [{"kind": "latch", "name": "latch", "readout": "p", "threshold": -1e30,  # always fires
          "steering": {"vectors": [{"layers": [1], "vector": vec(7, norm=6.0)}]}}],
        block_ms=50,
        backoff_max_s=0.2,
    ).start()  # fmt: skip
    assert controller.wait_ready(TIMEOUT_S)
    yield server, llm, link, controller
    controller.stop()
    link.close(timeout_s=1)
    llm.shutdown()
    server.close()


def closes_the_loop(llm: AsyncLLM, request_id: str, conversation: str) -> None:
    """A request whose first read-out latches it gets the controller's override while it runs
    (held after its first token until the override is queued), and the engine applies it."""
    source = "controller/latch"
    applied = snapshot(llm)["queue"]["applied"].get(source, 0)
    hold = HoldForActions(llm, request_id, 0, source, count=enqueued(llm, source) + 1)
    sampling = params(readouts=readouts(vec(8)), conversation_id=conversation)
    out = generate(llm, prompt(9), sampling, request_id)
    assert hold.held and not hold.timed_out
    assert len(out.outputs[0].token_ids) == GEN
    assert snapshot(llm)["queue"]["applied"][source] == applied + 1


def quiesce(link: EngineLink, controller: Controller) -> None:
    """Wait until every read-out is published, processed, and its actions drained."""
    settled(link)
    wait_for(
        lambda: (
            (s := controller.status())["lag"] == 0
            and s["pending"] == 0
            and link.counters()["actions"]["received"] == sum(s["actions_written"].values())
        ),
        "the loop to go quiet",
    )


def test_engine_serves_through_a_redis_outage_and_the_loop_resumes(cluster):
    server, llm, link, controller = cluster
    closes_the_loop(llm, "before", "k0")

    server.stop()  # SIGKILL: as abrupt as a crash

    async def traffic():
        async def one(i):
            last = None
            sampling = params(readouts=readouts(vec(8)), conversation_id=f"down-{i}")
            totals = OutputAccumulator()
            async for delta in llm.generate(prompt(20 + i), sampling, request_id=f"down-{i}"):
                last = totals.add(delta)
            return last

        return await asyncio.gather(*(one(i) for i in range(3)))

    outs = asyncio.run(traffic())  # the engine never waits on Redis
    assert [len(o.outputs[0].token_ids) for o in outs] == [GEN] * 3
    assert all(o.outputs[0].finish_reason == "length" for o in outs)

    counters = wait_for(
        lambda: (
            (c := link.counters())["readouts"]["lost"] >= 3 * GEN - BUFFER
            and not c["connected"]
            and c
        ),
        "the link to count its losses",
    )
    assert counters["readouts"]["buffered"] <= BUFFER
    assert counters["readouts"]["publish_errors"] >= 1
    status = wait_for(
        lambda: (s := controller.status())["redis_errors"] > 0 and not s["connected"] and s,
        "the controller to notice",
    )
    assert status["lag"] is None and status["pending"] is None  # unknown while Redis is away

    server.start()  # same port, empty: no stream, no group
    wait_for(lambda: link.connected, "the link to reconnect")
    wait_for(lambda: controller.status()["connected"], "the controller to reconnect")
    quiesce(link, controller)  # the read-outs buffered through the outage are handled first
    closes_the_loop(llm, "after", "k1")

    status = controller.status()
    assert status["stream_resets"] >= 1 and status["reconnects"] >= 1
    assert link.counters()["reconnects"] >= 1
