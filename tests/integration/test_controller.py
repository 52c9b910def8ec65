"""The async controller closed loop over a real redis-server and a real engine (tiny model).

Read-outs leave the engine through `EngineLink`, the `Controller` runs policies over them and
writes actions back through Redis, and the engine applies them at the top of a later step.
The loop is asynchronous, so where a test needs the action to land at an exact token it holds
the engine after the step that produced the triggering read-out until the action is queued in
it (`HoldForActions`): the controller's reply then applies exactly one step later, and the
result is checked against the same action issued by a sync consumer at that step.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable

import pytest
import redis
import torch

from services.controller.controller import Controller
from services.controller.engine_link import EngineLink
from services.controller.messages import (
    READOUT_STREAM,
    ReadoutEntry,
    action_queue_key,
    decode_action,
    decode_entry,
    encode_action,
    encode_entry,
)
from services.controller.redis_server import RedisServer
from services.engine import AsyncLLM, EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from services.engine.interventions.actions import (
    RequestSteeringOverride,
    SteeringMonitorUpdate,
    SteeringScaleUpdate,
    SteeringVectorUpdate,
)

H = 64
GEN = 12
TIMEOUT_S = 15.0


# -- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def rdb(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def llm(path):
    engine = AsyncLLM(path, device="cpu", dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def link(llm, redis_server):
    with EngineLink(llm, redis_server.url, "replica-0", block_s=0.1) as lk:
        yield lk


@pytest.fixture()
def controller_for(redis_server):
    """`controller_for(policies, **kw)`: a started controller in a fresh group, stopped after."""
    started: list[Controller] = []

    def make(policies, **kw) -> Controller:
        kw.setdefault("group", f"test-{uuid.uuid4().hex[:8]}")
        kw.setdefault("block_ms", 50)
        c = Controller(redis_server.url, policies, **kw).start()
        assert c.wait_ready(TIMEOUT_S)
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float = TIMEOUT_S):
    """Poll until `predicate()` is truthy (returning it), failing with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def vec(seed: int, norm: float = 3.0) -> list[float]:
    v = torch.randn(H, generator=torch.Generator().manual_seed(seed))
    return (v / v.norm() * norm).tolist()


def prompt(seed: int, n: int = 19) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 500) for _ in range(n)]


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, logprobs=3, **kw)


def readouts(probe: list[float]) -> list[dict]:
    # layer 0, before the MLP: steering at layer 1 never changes it at the same position
    return [{"probe": probe, "layer": 0, "site": "post_attn", "name": "p"}]


def generate(llm: AsyncLLM, prompt_ids, sampling: SamplingParams, request_id: str):
    async def run():
        last = None
        totals = OutputAccumulator()
        async for delta in llm.generate(prompt_ids, sampling, request_id=request_id):
            last = totals.add(delta)
        return last

    return asyncio.run(run())


def snapshot(llm: AsyncLLM) -> dict:
    return llm.call(lambda e: e.steering_snapshot())


def logprobs(out) -> list[dict[int, float]]:
    return out.outputs[0].logprobs


def assert_close(a, b, tol: float = 1e-4) -> None:
    """Same tokens and logprobs within `tol` (batch composition changes float rounding)."""
    assert len(a) == len(b)
    for i, (da, db) in enumerate(zip(a, b, strict=True)):
        assert da.keys() == db.keys(), i
        for t in da:
            assert da[t] == pytest.approx(db[t], abs=tol), (i, t)


def differs(a, b, tol: float = 1e-3) -> bool:
    return any(
        da.keys() != db.keys() or any(abs(da[t] - db[t]) > tol for t in da)
        for da, db in zip(a, b, strict=True)
    )


class HoldForActions:
    """An AsyncLLM listener: after the step that produced token `token` of `request_id`, hold
    the engine thread until `count` actions from `source` have been queued in the engine (or
    `timed_out`). Registered after the link's listener, so that step's read-outs are already
    on their way to Redis."""

    def __init__(self, llm: AsyncLLM, request_id: str, token: int, source: str, count: int):
        self.request_id, self.token, self.source, self.count = request_id, token, source, count
        self.held = self.timed_out = False
        llm.add_listener(self)
        self._engine = llm.engine

    def __call__(self, outputs) -> None:
        for out in outputs:
            sample = out.samples[0] if out.samples else None
            if (
                out.request_id == self.request_id
                and sample is not None
                and sample.token_offset <= self.token < sample.token_offset + len(sample.token_ids)
            ):
                deadline = time.monotonic() + TIMEOUT_S
                # in the engine thread, between steps: the snapshot is safe to read here
                while (
                    self._engine.steering_snapshot()["queue"]["enqueued"].get(self.source, 0)
                    < self.count
                ):
                    if time.monotonic() > deadline:
                        self.timed_out = True
                        return
                    time.sleep(0.001)
                self.held = True


class AtStep:
    """A sync consumer that emits `actions` after engine step `step` (the reference)."""

    name, sites = "at-step", {}

    def __init__(self, step: int, actions):
        self.step, self.actions = step, actions

    def on_step(self, view):
        return self.actions if view.step == self.step else None


def reference(path, prompt_ids, sampling: SamplingParams, step: int, actions) -> list:
    """Logprobs of the request when a sync consumer issues `actions` after `step`."""
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"))
    engine.add_consumer(AtStep(step, actions))
    engine.add_request("ref", prompt_ids, sampling)
    totals = OutputAccumulator()
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = totals.add(o)
    return logprobs(out)


def stream_entries(rdb: redis.Redis, request: str, *, prefix: bool = False) -> list[ReadoutEntry]:
    """The read-out entries in the stream of request `request` (or of every request whose id
    starts with it), in stream order."""
    entries = (decode_entry(i, f) for i, f in rdb.xrange(READOUT_STREAM))
    return [
        e
        for e in entries
        if e.request_id == request or (prefix and e.request_id.startswith(request))
    ]


def settled(link: EngineLink) -> dict:
    """The link's read-out counters once everything produced so far is published or lost."""
    return wait_for(
        lambda: (
            (c := link.counters()["readouts"])["buffered"] == 0
            and c["published"] + c["lost"] == c["produced"]
            and c
        ),
        "the link's buffer to drain",
    )


def enqueued(llm: AsyncLLM, source: str) -> int:
    return snapshot(llm)["queue"]["enqueued"].get(source, 0)


def first_new_max(scores: list[float], lo: int, hi: int) -> int | None:
    """The first index in [lo, hi] whose score beats every earlier one."""
    for k in range(max(lo, 1), hi + 1):
        if scores[k] > max(scores[:k]):
            return k
    return None


# -- the closed loop --------------------------------------------------------------------------


def test_a_readout_crossing_its_target_silences_the_requests_steering(
    path, llm, link, rdb, controller_for
):
    """scale: once the probe's score passes the target, the request's steering gain drops to
    0 at the top of the engine's next step. Steps overlap (read-outs do not stop them), so
    when the token whose read-out crossed is delivered, the step making the token after it
    is already running: the action first steers the token after that one."""
    p, v = vec(1, norm=1.0), vec(2, norm=6.0)
    steering = {"vectors": [{"layers": [1], "vector": v, "phase": "decode"}]}
    prompt_ids = prompt(1)
    base = generate(llm, prompt_ids, params(steering=steering, readouts=readouts(p)), "scale-base")
    wait_for(lambda: len(stream_entries(rdb, "scale-base")) == GEN, "the baseline's entries")
    scores = [d["p"] for d in base.outputs[0].readouts]
    k = first_new_max(scores, 1, GEN - 3)
    assert k is not None, scores
    target = (scores[k] + max(scores[:k])) / 2  # crossed first at token k

    controller_for(
        [
            {"kind": "scale", "name": "silence", "readout": "p", "target": target,
             "k": -1e6, "offset": 1.0, "deadband": 0.5, "min_interval_tokens": GEN}
        ]
    )  # fmt: skip
    source = "controller/silence"
    before = snapshot(llm)["queue"]["applied"].get(source, 0)
    hold = HoldForActions(llm, "scale-1", k, source, count=enqueued(llm, source) + 1)
    out = generate(llm, prompt_ids, params(steering=steering, readouts=readouts(p)), "scale-1")
    assert hold.held and not hold.timed_out

    got = logprobs(out)
    # steered up to the token after the crossing one (in flight when the action came)
    assert_close(got[: k + 2], logprobs(base)[: k + 2])
    assert differs(got[k + 2 :], logprobs(base)[k + 2 :])  # then no longer
    # exactly as a sync consumer scaling the row to 0 after step k + 2 (which made token k + 1)
    ref = reference(
        path,
        prompt_ids,
        params(steering=steering),
        k + 2,
        [SteeringScaleUpdate(0.0, request_id="ref")],
    )
    assert_close(got, ref)
    assert snapshot(llm)["queue"]["applied"][source] == before + 1
    wait_for(lambda: link.counters()["actions"]["applied"] >= 1, "the link to count it")


def test_latch_keeps_a_conversation_steered_on_its_next_request(
    path, llm, link, rdb, controller_for
):
    """latch: the probe fires in conversation c1's first request; that request is steered from
    the token after next on (the next one is in flight when the action comes: steps
    overlap), c1's next request likewise from its second decode token, and c2 never."""
    p = vec(10, norm=1.0)
    steer = {"vectors": [{"layers": [1], "vector": vec(11, norm=6.0), "phase": "decode"}]}
    # two prompts: A crosses a threshold early that B never reaches
    for seed in range(20, 60, 2):
        a_ids, b_ids = prompt(seed), prompt(seed + 1)
        a = generate(llm, a_ids, params(readouts=readouts(p)), f"latch-a-{seed}")
        b = generate(llm, b_ids, params(readouts=readouts(p)), f"latch-b-{seed}")
        a_scores = [d["p"] for d in a.outputs[0].readouts]
        threshold = max(d["p"] for d in b.outputs[0].readouts) + 1e-3
        k = next((i for i, s in enumerate(a_scores) if s > threshold), None)
        if k is not None and 1 <= k <= GEN - 3:
            break
    else:
        pytest.fail("no prompt pair where one crosses a threshold the other never reaches")
    # the baselines' last read-outs are in the stream before the controller's group starts
    wait_for(lambda: len(stream_entries(rdb, b.request_id)) == GEN, "the baselines' entries")

    ctl = controller_for(
        [{"kind": "latch", "name": "latch", "readout": "p", "threshold": threshold,
          "steering": steer}]
    )  # fmt: skip
    source = "controller/latch"
    applied = snapshot(llm)["queue"]["applied"].get(source, 0)
    queued = enqueued(llm, source)

    hold = HoldForActions(llm, "c1-r1", k, source, count=queued + 1)
    r1 = generate(llm, a_ids, params(readouts=readouts(p), conversation_id="c1"), "c1-r1")
    assert hold.held
    assert_close(logprobs(r1)[: k + 2], logprobs(a)[: k + 2])
    assert differs(logprobs(r1)[k + 2 :], logprobs(a)[k + 2 :])

    hold = HoldForActions(llm, "c1-r2", 0, source, count=queued + 2)
    r2 = generate(llm, b_ids, params(readouts=readouts(p), conversation_id="c1"), "c1-r2")
    assert hold.held
    # overridden from its second decode token: as a sync consumer overriding it after step 2
    ref = reference(path, b_ids, params(), 2, [RequestSteeringOverride("ref", steer)])
    assert_close(logprobs(r2), ref)
    assert differs(logprobs(r2)[2:], logprobs(b)[2:])

    r3 = generate(llm, b_ids, params(readouts=readouts(p), conversation_id="c2"), "c2-r1")
    assert_close(logprobs(r3), logprobs(b))  # another conversation: never latched

    wait_for(
        lambda: all(len(stream_entries(rdb, r)) == GEN for r in ("c1-r1", "c1-r2", "c2-r1")),
        "every read-out of r1, r2 and r3",
    )
    status = wait_for(
        lambda: (s := ctl.status())["lag"] == 0 and s["pending"] == 0 and s,
        "the controller to process them",
    )
    (latch,) = status["policies"]
    assert (latch["actions"], latch["latched_conversations"]) == (2, 1)
    assert status["latched_conversations"] == 1
    assert snapshot(llm)["queue"]["applied"][source] == applied + 2


def test_monitor_policy_installs_a_gated_dynamic_vector(path, redis_server, controller_for):
    """monitor: once enough tokens fire, the in-graph monitor and the dynamic vector it gates
    are installed, exactly as if a sync consumer had installed them one step after the
    token that completed the window (the step after it was in flight: steps overlap)."""
    p, v = vec(30, norm=1.0), vec(31, norm=6.0)
    monitor = {"layer": 1, "probe": p, "threshold": -1e4, "sharpness": 1.0}  # gate wide open
    dynamic = {"layers": [1], "vector": v}
    controller_for(
        [{"kind": "monitor", "name": "mon", "readout": "p", "fire_threshold": -1e9,
          "window": 4, "min_tokens": 4, "install_rate": 1.0, "clear_rate": 0.0,
          "monitor": monitor, "dynamic": dynamic}]
    )  # fmt: skip
    engine = AsyncLLM(path, device="cpu", dtype="float32")  # its own: a monitor is engine-wide
    try:
        with EngineLink(engine, redis_server.url, f"mon-{uuid.uuid4().hex[:6]}", block_s=0.1):
            hold = HoldForActions(engine, "m1", 3, "controller/mon", count=2)
            out = generate(engine, prompt(3), params(readouts=readouts(p)), "m1")
            assert hold.held
            snap = snapshot(engine)
    finally:
        engine.shutdown()
    assert snap["monitors"]["1.post_block"]["gate_rows"] is False
    assert snap["dynamic"]["sites"] == ["1.post_block"]
    ref = reference(
        path,
        prompt(3),
        params(),
        5,
        [
            SteeringVectorUpdate("post_block", [1], v),
            SteeringMonitorUpdate("post_block", 1, p, threshold=-1e4, sharpness=1.0),
        ],
    )
    assert_close(logprobs(out), ref)


# -- bounds -----------------------------------------------------------------------------------


def test_a_full_replica_queue_drops_the_newest_actions_and_counts_them(rdb, controller_for):
    replica = f"ghost-{uuid.uuid4().hex[:6]}"  # no engine drains it
    ctl = controller_for(
        [{"kind": "latch", "name": "all", "readout": "p", "threshold": -1e30,
          "steering": {"vectors": [{"layers": [0], "vector": [1.0]}]}}],
        max_queue_len=2,
    )  # fmt: skip
    for i in range(3):
        rdb.xadd(READOUT_STREAM, encode_entry(ReadoutEntry(replica, f"q{i}", 0, 0, {"p": 0.0})))
    status = wait_for(lambda: (s := ctl.status())["processed"] == 3 and s, "3 entries")
    assert status["actions_written"] == {replica: 2}
    assert status["actions_dropped"] == {replica: 1}
    queued = [decode_action(rdb.rpop(action_queue_key(replica)))[0] for _ in range(2)]
    assert [a.request_id for a in queued] == ["q0", "q1"]  # the oldest kept, in order
    assert rdb.llen(action_queue_key(replica)) == 0


def test_engine_link_drops_what_a_full_engine_queue_refuses_and_rejects_malformed_actions(
    path, redis_server, rdb
):
    engine = AsyncLLM(path, device="cpu", dtype="float32", action_queue_size=1)
    key = action_queue_key("idle")
    try:
        with EngineLink(engine, redis_server.url, "idle", block_s=0.1) as lk:
            # an idle engine does not step, so its queue of one stays full after the first
            for gain in (0.5, 0.25, 0.125):
                rdb.lpush(key, encode_action(SteeringScaleUpdate(gain, tier="dynamic"), "x"))
            rdb.lpush(key, "{not json")
            rdb.lpush(key, '{"type": "Explode"}')
            wait_for(lambda: lk.counters()["actions"]["received"] == 5, "5 actions")
            c = lk.counters()["actions"]
            assert (c["submitted"], c["dropped"], c["malformed"]) == (1, 2, 2)
            assert "unknown action type 'Explode'" in c["last_rejection"]
            snap = snapshot(engine)["queue"]
            assert (snap["depth"], snap["dropped"]) == (1, {"controller/x": 2})
            # the engine keeps serving, and the queued action applies at its next step
            out = generate(engine, prompt(4), params(), "after")
            assert len(out.outputs[0].token_ids) == GEN
            snap = snapshot(engine)
            assert snap["dynamic"]["gain"] == 0.5
            assert lk.counters()["actions"]["applied"] == 1
            assert lk.counters()["actions"]["rejected"] == 2  # the malformed two
    finally:
        engine.shutdown()


# -- controller restart -----------------------------------------------------------------------


def test_a_stopped_controllers_pending_entries_are_reclaimed_by_the_next(
    llm, link, rdb, controller_for
):
    """Controller A reads entries but cannot write their actions (Redis out of memory) and is
    stopped without acknowledging them; B claims and processes them."""
    group = f"reclaim-{uuid.uuid4().hex[:6]}"
    policy = {"kind": "latch", "name": "latch-rc", "readout": "p", "threshold": -1e30,
              "steering": {"vectors": [{"layers": [1], "vector": vec(40)}]}}  # fmt: skip
    a = controller_for([policy], group=group, consumer="a")
    a.stop()  # the group exists; nothing is pending
    generate(llm, prompt(5), params(readouts=readouts(vec(41))), "rc-1")
    wait_for(lambda: len(stream_entries(rdb, "rc-1")) == GEN, "the read-outs to reach Redis")

    rdb.config_set("maxmemory", 1)  # writes refused (OOM); reads still served
    try:
        a.start()
        wait_for(
            lambda: "OutOfMemoryError" in (a.status()["last_error"] or ""),
            "A to fail writing its actions",
        )
        pending = rdb.xpending_range(READOUT_STREAM, group, "-", "+", 100, consumername="a")
        assert len(pending) == GEN
        a.stop()
    finally:
        rdb.config_set("maxmemory", 0)
    assert rdb.xpending(READOUT_STREAM, group)["pending"] == GEN  # still A's, unacknowledged

    received = link.counters()["actions"]["received"]
    b = controller_for([policy], group=group, consumer="b", claim_idle_ms=0)
    status = b.status()  # ready: the reclaim has run
    assert (status["reclaimed"], status["pending"]) == (GEN, 0)
    assert status["policies"][0]["actions"] == 1  # one override for rc-1
    wait_for(lambda: link.counters()["actions"]["received"] == received + 1, "B's action")


def test_every_readout_of_a_burst_is_published(llm, link, rdb):
    """Concurrent requests, each with a conversation: the stream gets one entry per generated
    token with its score, and the last one carries the finish reason."""
    probe = readouts(vec(42))

    async def burst():
        async def one(i):
            last = None
            sampling = params(readouts=probe, conversation_id=f"talk-{i}")
            totals = OutputAccumulator()
            async for delta in llm.generate(prompt(100 + i), sampling, request_id=f"burst-{i}"):
                last = totals.add(delta)
            return last

        return await asyncio.gather(*(one(i) for i in range(6)))

    outs = {o.request_id: o for o in asyncio.run(burst())}
    entries = wait_for(
        lambda: len(e := stream_entries(rdb, "burst-", prefix=True)) == 6 * GEN and e,
        "an entry per token",
    )
    for rid, out in outs.items():
        mine = [e for e in entries if e.request_id == rid]
        assert [e.token for e in mine] == list(range(GEN))
        assert [e.scores for e in mine] == out.outputs[0].readouts
        assert {e.conversation_id for e in mine} == {f"talk-{rid.removeprefix('burst-')}"}
        assert [e.finish_reason for e in mine] == [None] * (GEN - 1) + ["length"]


def test_a_conversation_without_readouts_publishes_its_start_and_finish(llm, link, rdb):
    generate(llm, prompt(7), params(conversation_id="quiet"), "quiet-1")
    entries = wait_for(lambda: len(e := stream_entries(rdb, "quiet-1")) == 2 and e, "2 entries")
    assert [(e.token, e.scores, e.finish_reason) for e in entries] == [
        (0, {}, None),
        (None, {}, "length"),
    ]
