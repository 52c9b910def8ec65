"""The engine's fast path on CPU: overlapped steps give what synchronous steps give, and the
step batch holds exactly the inputs the model needs (CUDA graphs: tests/gpu)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from services.engine.kernels.steer import INTERPRET
from services.engine.parallel import SINGLE_PROCESS
from services.engine.recent_tokens import RecentTokens
from services.engine.sampling_params import SamplingParams as Params
from services.engine.scheduler import StepRequest
from services.engine.sequence import PLACEHOLDER
from services.engine.step_batch import StepBatch, graph_batch_sizes
from tests.interpreted import assert_passes_interpreted

PROMPTS = [
    "The harbour master kept a log",
    "Once upon a time",
    "def add(a, b):",
    "A list of rivers: the Rhine, the",
    "In the beginning",
]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


# Capture tests run both ways a decode block's rows reach their requests: written by the
# device into the requests' arena buffers (the default), or, with no arena, brought home
# whole and assembled by the sink's thread.
WAYS = pytest.mark.parametrize("arena", [None, 0], ids=["placed", "assembled"])


def _workload() -> list[tuple[str, str, SamplingParams]]:
    """Requests that end in every way: length, stop string, stop token, and that sample,
    fork, score logprobs and prompt logprobs."""
    return [
        ("greedy", PROMPTS[0], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
        ("seeded", PROMPTS[1], SamplingParams(max_tokens=7, temperature=0.9, seed=3, top_k=20)),
        ("n2", PROMPTS[2], SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=11)),
        ("lp", PROMPTS[3], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)),
        ("plp", PROMPTS[4], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)),
        ("stop", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, stop=[" the"])),
        ("one", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0.0)),
    ]


def _steered(work: list, hidden: int) -> list:
    """Every other request steered, each by a vector of its own (prefill and decode)."""
    out = []
    for i, (rid, prompt, params) in enumerate(work):
        if i % 2 == 0:
            vec = torch.randn(hidden, generator=torch.Generator().manual_seed(i)) * 4
            site = "post_block" if i % 4 == 0 else "pre_attn"
            steer = {"vectors": [{"layers": [0, 1], "site": site, "vector": vec.tolist()}]}
            params = dataclasses.replace(params, steering=steer)
        out.append((rid, prompt, params))
    return out


def _read_back(work: list, hidden: int) -> list:
    """Every request reads out two probes and has a latching gate (that adds a large vector
    once it fires: on some requests at one token only, so the next token is steered by the
    latch alone), and one has an abort probe: everything whose results come back from the
    device after each step."""
    g = torch.Generator().manual_seed(5)
    probes = [torch.randn(hidden, generator=g) for _ in range(3)]
    reads = [
        {"probe": probes[0].tolist(), "layer": 0, "site": "post_block", "name": "a"},
        {"probe": probes[1].tolist(), "layer": 1, "site": "post_attn", "name": "b"},
    ]
    out = []
    for i, (rid, prompt, params) in enumerate(work):
        gate = {
            "when": {"probe": probes[2].tolist(), "layer": 1, "threshold": 70, "sharpness": 50},
            "scope": "rest_of_request",
            "apply": {"add": {"vector": (torch.randn(hidden, generator=g) * 8).tolist()}},
        }
        steering: dict = {"gates": [gate]}
        if i == 2:
            steering["abort_when"] = [
                {"probe": probes[0].tolist(), "layer": 0, "threshold": 2.0, "sharpness": 1}
            ]
        out.append((rid, prompt, dataclasses.replace(params, readouts=reads, steering=steering)))
    return out


def _run(
    model_dir,
    overlap: bool,
    stagger: bool = True,
    steer: bool = False,
    read_back: bool = False,
    snapshots: list | None = None,
    **config,
) -> dict:
    engine = LLMEngine(
        model_dir,
        EngineConfig(device="cpu", dtype="float32", async_scheduling=overlap, **config),
    )
    work = _workload()
    if steer:
        work = _steered(work, engine.model_config.hidden_size)
    if read_back:
        work = _read_back(work, engine.model_config.hidden_size)
    finished = {}
    steps = 0
    totals = OutputAccumulator()
    while work or engine.has_unfinished_requests():
        # Requests arrive while others run (two per step), so batches keep changing.
        for rid, prompt, params in work[: 2 if stagger else len(work)]:
            engine.add_request(rid, prompt, params)
        work = work[2 if stagger else len(work) :]
        for out in totals.finished(engine.step()):
            finished[out.request_id] = out
        steps += 1
        assert steps < 200
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    if snapshots is not None:
        snapshots.append(engine.steering_snapshot())
    return finished


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        x, y = a[rid], b[rid]
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids, rid
            assert cx.text == cy.text, rid
            assert (cx.finish_reason, cx.stop_reason) == (cy.finish_reason, cy.stop_reason), rid
            if cx.logprobs is not None:
                for dx, dy in zip(cx.logprobs, cy.logprobs, strict=True):
                    assert dx.keys() == dy.keys()
                    for t in dx:
                        assert dx[t] == pytest.approx(dy[t], abs=1e-4)
            # Batches differ between the two runs, so the float32 residuals agree to rounding.
            assert (cx.readouts is None) == (cy.readouts is None), rid
            for rx, ry in zip(cx.readouts or [], cy.readouts or [], strict=True):
                assert rx.keys() == ry.keys()
                for name in rx:
                    assert rx[name] == pytest.approx(ry[name], rel=1e-4, abs=1e-4), rid
        if x.prompt_logprobs is not None:
            assert len(x.prompt_logprobs) == len(y.prompt_logprobs)


def test_overlapped_steps_give_what_synchronous_steps_give(model_dir):
    sync = _run(model_dir, overlap=False)
    overlapped = _run(model_dir, overlap=True)
    _same(overlapped, sync)
    assert overlapped["one"].outputs[0].finish_reason == "length"
    assert overlapped["stop"].outputs[0].finish_reason in ("stop", "length")
    assert len(overlapped["n2"].outputs) == 2


def test_overlap_survives_preemption_and_a_small_cache(model_dir):
    """A cache too small for the batch preempts while a step is in flight."""
    sync = _run(model_dir, overlap=False, stagger=False, num_kv_blocks=12, block_size=4)
    overlapped = _run(model_dir, overlap=True, stagger=False, num_kv_blocks=12, block_size=4)
    _same(overlapped, sync)


def test_an_overlapped_call_returns_the_previous_steps_tokens(model_dir):
    """With overlap the first call only launches the prefill; its token comes back with the
    second call, while the step after it runs. Without overlap the first call returns it."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for overlap, first_call in ((True, 0), (False, 1)):
        engine = LLMEngine(
            model_dir, EngineConfig(device="cpu", dtype="float32", async_scheduling=overlap)
        )
        engine.add_request("r", PROMPTS[0], params)
        outs = engine.step()
        assert [len(o.samples[0].token_ids) for o in outs] == [1] * first_call
        tokens = [t for o in outs for t in o.samples[0].token_ids]
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert len(o.samples[0].token_ids) == 1  # a delta: this step's token only
                tokens += o.samples[0].token_ids
        assert len(tokens) == 3
        assert -1 not in tokens


def test_abort_while_a_step_is_in_flight_frees_everything(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", p, params)
    totals = OutputAccumulator()
    for _ in range(4):
        totals.finished(engine.step())
    out = totals.add(engine.abort("r1"))
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert PLACEHOLDER not in out.outputs[0].token_ids
    done = {}
    while engine.has_unfinished_requests():
        for o in totals.finished(engine.step()):
            done[o.request_id] = o.outputs[0].token_ids
    assert sorted(done) == ["r0", "r2"] and all(len(t) == 20 for t in done.values())
    assert engine.step() == []  # nothing in flight, nothing to schedule
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_steered_steps_overlap_and_give_what_synchronous_steps_give(model_dir):
    sync = _run(model_dir, overlap=False, steer=True)
    overlapped = _run(model_dir, overlap=True, steer=True)
    _same(overlapped, sync)
    plain = _run(model_dir, overlap=True)
    assert plain["greedy"].outputs[0].token_ids != overlapped["greedy"].outputs[0].token_ids


def test_steps_with_read_outs_gates_and_aborts_overlap_and_give_what_synchronous_steps_give(
    model_dir,
):
    """Read-outs and abort probes are taken when a step is accepted, and a latching gate's
    bits reach the step after it on the device (the latch carry): overlapped steps give the
    same tokens, read-outs, latches and aborts as synchronous ones."""
    snaps: list = []
    sync = _run(model_dir, overlap=False, read_back=True, snapshots=snaps)
    overlapped = _run(model_dir, overlap=True, read_back=True, snapshots=snaps)
    _same(overlapped, sync)
    assert snaps[0]["gate_firing"] == snaps[1]["gate_firing"]
    firing = next(iter(snaps[1]["gate_firing"].values()))
    assert 0 < firing["fired"] < firing["tokens"], "the gate should fire on some tokens only"
    assert overlapped["seeded"].outputs[0].readouts, "every request reads out"
    assert snaps[0]["probe_aborts"] == snaps[1]["probe_aborts"]
    # The gates change what is generated (so a lost latch would show).
    plain = _run(model_dir, overlap=True)
    assert any(
        plain[rid].outputs[0].token_ids != overlapped[rid].outputs[0].token_ids
        for rid in ("greedy", "n2", "plp")
    )


def _steady(model_dir) -> tuple[dict, dict]:
    """Four requests that read out and gate, decoding side by side to the same length."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    work = _read_back(_workload(), engine.model_config.hidden_size)
    totals, done = OutputAccumulator(), {}
    for rid, prompt, params in work[:2] + work[3:5]:  # no abort: nothing ends early
        params = dataclasses.replace(params, n=1, max_tokens=16, ignore_eos=True, stop=[])
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            done[out.request_id] = out
    return done, engine.steering_snapshot()


def test_steady_decode_reuses_its_plan_and_gets_what_replanning_gets(model_dir, monkeypatch):
    """An all-decode step of the same sequences as the step before, with nothing changed
    in between, reuses that step's plan; a run that replans every step gives the same."""
    cached, snap = _steady(model_dir)
    assert snap["cached_plans"] >= 8
    from services.engine.interventions.plan_step import StepPlanner

    forgets = property(lambda self: None, lambda self, value: None)  # a cache that never holds
    monkeypatch.setattr(StepPlanner, "_plan_cache", forgets, raising=False)
    replanned, snap2 = _steady(model_dir)
    assert snap2["cached_plans"] == 0
    _same(cached, replanned)
    assert snap["gate_firing"] == snap2["gate_firing"]


def test_what_the_next_plan_needs_turns_overlap_off(model_dir):
    """Steering, read-outs, gates and captures overlap (what a step read back is routed
    when it is accepted); a patch still ahead of its request turns overlap off."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    H = engine.model_config.hidden_size
    vec = torch.randn(H).tolist()
    steer = {"vectors": [{"layers": [1], "site": "post_block", "vector": vec, "scale": 2.0}]}
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=3, steering=steer))
    readouts = [{"probe": vec, "layer": 1, "name": "p"}]
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=3, readouts=readouts))
    capture = {"sites": {"post_block": [0]}, "positions": "all"}
    engine.add_request("c", PROMPTS[2], SamplingParams(max_tokens=3, capture=capture))
    assert engine._can_overlap()
    patch = [{"layer": 0, "site": "post_block", "position": 1, "source": {"vector": vec}}]
    engine.add_request("p", PROMPTS[0], SamplingParams(max_tokens=3, patch=patch))
    assert not engine._can_overlap()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._can_overlap()


def test_a_capture_or_patch_whose_positions_are_all_computed_lets_steps_overlap(model_dir):
    """A last-prompt capture and a prompt patch read nothing back once their prefill is done:
    the decode after it overlaps, and what they captured and patched is what a run without
    overlap gives."""
    H = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32")).model_config.hidden_size
    capture = {"sites": {s: "all" for s in ("pre_attn", "post_attn", "post_block")}}
    patch = [{"layer": 0, "site": "post_block", "position": 2, "source": {"vector": [0.5] * H}}]
    requests = {
        "c": (PROMPTS[0], SamplingParams(max_tokens=6, capture=capture, ignore_eos=True)),
        "p": (PROMPTS[1], SamplingParams(max_tokens=6, patch=patch, ignore_eos=True)),
    }
    results = []
    for overlap in (True, False):
        cfg = EngineConfig(device="cpu", dtype="float32", async_scheduling=overlap)
        engine = LLMEngine(model_dir, cfg)
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        assert not engine._can_overlap()  # the prefill captures and patches
        totals, done, overlapped = OutputAccumulator(), {}, 0
        while engine.has_unfinished_requests():
            for out in totals.finished(engine.step()):
                done[out.request_id] = out
            overlapped += bool(engine._in_flight)
        assert (overlapped > 0) == overlap
        results.append(done)
    with_overlap, without = results
    for rid in requests:
        assert with_overlap[rid].outputs[0].token_ids == without[rid].outputs[0].token_ids
    caps, ref = with_overlap["c"].captures, without["c"].captures
    assert len(caps) == 3 * engine.model_config.num_layers
    assert all(torch.equal(caps[k], ref[k]) and caps[k].shape == (1, H) for k in ref)


ALL_SITES = {site: "all" for site in ("pre_attn", "post_attn", "post_block")}


def _captured(model_dir, **config) -> tuple[dict, dict, LLMEngine]:
    """Three staggered requests capturing every site of every layer at every position, one
    steered at two sites, one stopping early: their outputs, and the capture counters."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", **config))
    H = engine.model_config.hidden_size
    vec = torch.randn(H, generator=torch.Generator().manual_seed(3)).tolist()
    steer = {
        "vectors": [
            {"layers": [0], "site": "post_attn", "vector": vec, "scale": 2.0},
            {"layers": [1], "site": "post_block", "vector": vec, "scale": -1.0},
        ]
    }
    capture = {"sites": ALL_SITES, "positions": "all"}
    work = {
        "a": (PROMPTS[0], dict(max_tokens=7, ignore_eos=True)),
        "b": (PROMPTS[1], dict(max_tokens=5, ignore_eos=True, steering=steer)),
        "c": (PROMPTS[2], dict(max_tokens=9, stop=[" the"])),
    }
    totals, done = OutputAccumulator(), {}
    for i, (rid, (prompt, kw)) in enumerate(work.items()):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, capture=capture, **kw))
        for _ in range(i):  # staggered: later ones join a batch already decoding
            for out in totals.finished(engine.step()):
                done[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            done[out.request_id] = out
    return done, engine.steering_snapshot()["captured_tokens"], engine


def test_decode_captures_through_the_block_equal_eager_copies(model_dir):
    """Decode steps capture into the fixed buffer (every site, by the fused op and the
    capture op); the same run with every capture copied eagerly gives the same rows, and
    the sink keeps nothing once the requests are done."""
    block, counts, engine = _captured(model_dir)
    eager, eager_counts, _ = _captured(model_dir, graph_capture_rows=0)
    assert counts["block"] > 0 and eager_counts["block"] == 0
    assert counts["block"] + counts["eager"] == eager_counts["eager"]
    assert engine.steering_snapshot()["cached_plans"] > 0  # steady capturing steps reuse
    L = engine.model_config.num_layers
    for rid, out in block.items():
        ref = eager[rid]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.capture_positions == ref.capture_positions
        assert (
            len(out.capture_positions)
            == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        )  # every position but the last sampled one, which is never fed
        assert sorted(out.captures) == sorted(ref.captures) and len(out.captures) == 3 * L
        for key, rows in out.captures.items():
            torch.testing.assert_close(rows, ref.captures[key], atol=1e-4, rtol=1e-4)
    sink = engine.interventions.sink
    assert not (sink._rows or sink._blocks), "a finished request's captures are dropped"


@WAYS
def test_captures_survive_preemption_while_a_step_is_in_flight(model_dir, arena):
    """A cache too small for the three capturing requests preempts them mid-decode, with
    steps in flight: their positions are computed again (by a prefill: eager copies,
    then blocks again), placed rows of a recomputed position go to the row it had, and
    every request's captures equal a run with room for all (eager copies throughout)."""
    small, _, engine = _captured(
        model_dir, num_kv_blocks=12, block_size=4, capture_arena_bytes=arena
    )
    assert engine.stats()["num_preemptions"] > 0
    roomy, _, _ = _captured(model_dir, graph_capture_rows=0)
    for rid, out in small.items():
        ref = roomy[rid]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.capture_positions == ref.capture_positions
        for key, rows in out.captures.items():
            torch.testing.assert_close(rows, ref.captures[key], atol=1e-4, rtol=1e-4)
    sink = engine.interventions.sink
    assert not (sink._rows or sink._blocks), "a finished request's captures are dropped"


def test_a_step_with_more_capturing_tokens_than_buffer_rows_copies_eagerly(model_dir):
    few, counts, _ = _captured(model_dir, graph_capture_rows=1)
    eager, _, _ = _captured(model_dir, graph_capture_rows=0)
    assert counts["block"] > 0 and counts["eager"] > 0  # alone it fits; together they do not
    for rid, out in few.items():
        for key, rows in out.captures.items():
            torch.testing.assert_close(rows, eager[rid].captures[key], atol=1e-4, rtol=1e-4)


def _two_capturers(model_dir, **config) -> tuple[dict, list, LLMEngine]:
    """Two requests decoding together, capturing different sites, one in bfloat16: their
    outputs and the capture blocks that carried rows of the first one."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", **config))
    caps = {
        "p": {"sites": {"post_block": "all"}, "positions": "all_generated"},
        "q": {"sites": {"pre_attn": [0], "post_attn": [1]}, "positions": "all",
              "dtype": "bfloat16"},
    }  # fmt: skip
    for rid, cap in caps.items():
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, capture=cap)
        engine.add_request(rid, PROMPTS[0], params)
    totals, done, blocks = OutputAccumulator(), {}, []
    sink = engine.interventions.sink
    write = sink.write_block

    def seen(block, writes):  # the blocks that carried rows of "p"
        blocks.extend([block] if any(w[0] == "p" for w in writes) else [])
        write(block, writes)

    sink.write_block = seen
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            done[out.request_id] = out
    return done, blocks, engine


@pytest.mark.parametrize("arena", [None, 0], ids=["placed", "assembled"])
def test_a_capture_block_carries_the_sites_asked_for_in_the_dtype_asked_for(model_dir, arena):
    """A decode step's block holds the union of its requests' sites, not every site of
    every layer; each request gets its own keys, and one that asked for bfloat16 gets the
    float32 rows rounded to it: written straight into the requests' arena buffers (each
    request's columns of the block by its own column map), or, with no arena, brought home
    whole and assembled."""
    block, blocks, engine = _two_capturers(model_dir, capture_arena_bytes=arena)
    eager, no_blocks, _ = _two_capturers(model_dir, graph_capture_rows=0)
    L = engine.model_config.num_layers
    union = sorted({3 * layer + 2 for layer in range(L)} | {0, 3 + 1})  # capture_slot order
    assert blocks and not no_blocks
    assert all(b.slots == tuple(union) for b in blocks)
    if arena == 0:
        assert all(b.host.shape[1] == len(union) for b in blocks)
    else:  # every row placed: the block brought nothing home itself
        assert all(b.host is None for b in blocks)
        assert engine.interventions.sink.arena.num_bytes > 0
    stats = engine.stats()  # off CUDA a block is the host's at once: no pinned rows, no drain
    assert stats["capture_drain_blocks"] == stats["num_capture_host_waits"] == 0
    assert len(union) < 3 * L
    p, q = block["p"], block["q"]
    assert sorted(p.captures) == [f"{layer}.post_block" for layer in range(L)]
    assert sorted(q.captures) == ["0.pre_attn", "1.post_attn"]
    assert all(t.dtype == torch.float32 for t in p.captures.values())
    assert all(t.dtype == torch.bfloat16 for t in q.captures.values())
    for rid, out in block.items():
        ref = eager[rid]
        assert out.capture_positions == ref.capture_positions
        for key, rows in out.captures.items():
            assert rows.dtype == ref.captures[key].dtype
            torch.testing.assert_close(rows.float(), ref.captures[key].float(), atol=1e-4, rtol=0)


def _hold_rows(monkeypatch, arena: int | None) -> threading.Event:
    """Hold a decode block's rows on their way (none reaches its request) until the
    returned event is set: the device's writes into the arena (`arena` None: the default,
    where rows are placed), or the sink's assembler (`arena` 0: no arena)."""
    from services.engine.interventions.capture import BlockPlacement, InlineCaptureSink

    gate = threading.Event()
    if arena is None:  # as if the copy stream had not got there yet
        done, result = BlockPlacement.done, BlockPlacement.result
        monkeypatch.setattr(BlockPlacement, "done", lambda self: gate.is_set() and done(self))
        monkeypatch.setattr(BlockPlacement, "result", lambda self: gate.wait(30) and result(self))
        return gate
    assemble = InlineCaptureSink._assemble
    monkeypatch.setattr(
        InlineCaptureSink,
        "_assemble",
        staticmethod(lambda block, jobs: gate.wait(30) and assemble(block, jobs)),
    )
    return gate


@WAYS
def test_a_finished_request_waits_for_its_captured_rows_and_the_engine_does_not(
    model_dir, monkeypatch, arena
):
    """Per-token capture's last rows reach the host a step or more after the last token
    (the device's writes on the copy stream; or copy, drain and assembly on their own
    threads). While they are on their way, the request's final delta waits and the engine
    steps the other requests; once they land, the final delta carries every row, as a run
    whose rows were never held up."""

    cap = {"sites": {"post_block": "all"}, "positions": "all_generated"}
    cfg = EngineConfig(device="cpu", dtype="float32", capture_arena_bytes=arena)

    def run(gate=None):
        engine = LLMEngine(model_dir, cfg)
        short = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, capture=cap)
        long = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        engine.add_request("captures", PROMPTS[0], short)
        engine.add_request("plain", PROMPTS[1], long)
        totals, done, steps_while_held = OutputAccumulator(), {}, 0
        while engine.has_unfinished_requests():
            outs = totals.finished(engine.step())
            done.update((o.request_id, o) for o in outs)
            held = gate is not None and not gate.is_set()
            if held and engine._awaiting_captures:
                steps_while_held += 1
                assert "captures" not in done and "captures" in engine.requests
                if "plain" in done or steps_while_held == 4:
                    gate.set()  # the rows land
        return done, steps_while_held

    want, _ = run()
    gate = _hold_rows(monkeypatch, arena)
    got, steps_while_held = run(gate)
    assert steps_while_held == 4, "the engine went on stepping the other request"
    assert got["plain"].outputs[0].token_ids == want["plain"].outputs[0].token_ids
    out, ref = got["captures"], want["captures"]
    assert out.capture_positions == ref.capture_positions and len(ref.capture_positions) == 2
    assert sorted(out.captures) == sorted(ref.captures)
    for key, rows in ref.captures.items():
        torch.testing.assert_close(out.captures[key], rows, atol=0, rtol=0)


@WAYS
def test_a_requests_capture_buffer_holds_the_positions_its_capture_can_bring(model_dir, arena):
    """Block rows go into a buffer (or a first arena segment) sized from the request's
    capture: one row for the last prompt position, `max_tokens` rows for every generated
    one. (Sized from `max_tokens` alone, a last-prompt capture of 84 keys held 64 rows of
    each: 22 MB a request to fault in on the Qwen3-0.6B shape, for one row.)"""
    cfg = EngineConfig(device="cpu", dtype="float32", capture_arena_bytes=arena)
    engine = LLMEngine(model_dir, cfg)
    last = {"sites": {"pre_attn": "all", "post_block": "all"}, "positions": "last_prompt"}
    generated = {"sites": {"post_block": "all"}, "positions": "all_generated"}
    for rid, cap, n in (("last", last, 64), ("generated", generated, 5)):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, capture=cap)
        engine.add_request(rid, PROMPTS[0], params)
    sink, totals, done = engine.interventions.sink, OutputAccumulator(), {}
    capacity = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in totals.finished(engine.step()))
        for rid, rows in sink._blocks.items():
            rows.wait()
            assert rows.direct == (arena is None)
            capacity[rid] = rows.segments[0].capacity if rows.direct else rows.buf.shape[1]
    assert capacity == {"last": 1, "generated": 5}
    prompt = len(done["last"].prompt_token_ids)
    assert done["last"].capture_positions == [prompt - 1]
    assert len(done["last"].captures) == 2 * engine.model_config.num_layers
    assert done["generated"].capture_positions == list(range(prompt, prompt + 4))


def test_requests_the_arena_cannot_hold_take_the_drains_way_beside_placed_ones(
    model_dir, monkeypatch
):
    """Where the arena holds one request's buffer and not the others' (here a chunk holds
    one), that one's rows are placed and the others' blocks come home whole and are
    assembled, in the same steps; every request gets the rows eager copies give."""
    from services.engine.interventions.host_rows import CaptureArena

    eager, _, ref = _captured(model_dir, graph_capture_rows=0)
    H, L = ref.model_config.hidden_size, ref.model_config.num_layers
    chunk = 3 * L * 24 * H * 4  # 24 positions of every site, float32
    monkeypatch.setattr(CaptureArena, "CHUNK_BYTES", chunk)
    mixed, counts, engine = _captured(model_dir, capture_arena_bytes=chunk)
    stats = engine.stats()
    assert stats["capture_arena_bytes"] > 0 and stats["capture_arena_refused"] > 0
    assert stats["capture_rows_placed"] > 0  # some placed, some not
    assert stats["capture_drain_blocks"] == 0  # off CUDA: no drain, blocks at once
    assert counts["block"] > 0
    for rid, out in mixed.items():
        assert out.capture_positions == eager[rid].capture_positions
        for key, rows in out.captures.items():
            torch.testing.assert_close(rows, eager[rid].captures[key], atol=1e-4, rtol=1e-4)


def test_an_arena_too_small_to_hold_a_chunk_is_refused_with_the_reason(model_dir):
    with pytest.raises(InvalidRequestError, match=r"capture_arena_bytes must be 0 \(off\) or"):
        LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", capture_arena_bytes=1))


def test_a_request_whose_captured_rows_are_lost_says_so_and_the_rest_run_on(model_dir, monkeypatch):
    """A row the assembler cannot keep (no memory for the request's buffer) fails that
    request's captures in its output (`capture_error`), not the step or other requests."""
    from services.engine.interventions import capture

    def no_memory(self, *args):
        raise MemoryError("no memory for the buffer")

    monkeypatch.setattr(capture._BlockRows, "reserve", no_memory)
    engine = LLMEngine(
        model_dir, EngineConfig(device="cpu", dtype="float32", capture_arena_bytes=0)
    )
    cap = {"sites": {"post_block": "all"}, "positions": "all_generated"}
    engine.add_request("captures", PROMPTS[0], SamplingParams(max_tokens=4, capture=cap))
    engine.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    totals, done = OutputAccumulator(), {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in totals.finished(engine.step()))
    assert "capture rows were lost: no memory for the buffer" in done["captures"].capture_error
    assert done["captures"].captures == {}
    assert len(done["plain"].outputs[0].token_ids) == 6


@WAYS
def test_a_failed_step_delivers_the_requests_awaiting_their_captures(model_dir, monkeypatch, arena):
    """A step that fails fails the requests in flight, but not one that had finished and
    was only waiting for its captured rows: that one gets its final output, rows and all."""
    from services.engine import AsyncLLM

    gate = _hold_rows(monkeypatch, arena)
    llm = AsyncLLM(model_dir, device="cpu", dtype="float32", capture_arena_bytes=arena)
    got: dict[str, list] = {"captures": [], "plain": []}
    try:
        engine = llm.engine
        cap = {"sites": {"post_block": "all"}, "positions": "all_generated"}
        short = SamplingParams(max_tokens=3, ignore_eos=True, capture=cap)
        long = SamplingParams(max_tokens=engine.max_model_len - 64, ignore_eos=True)
        # queued by the engine thread between steps (`submit` could wait on the engine's
        # lock until `plain` had run out), `plain` first: an engine with only `captures`
        # left, awaiting its held rows, would wait for them (up to the gate's 30 s) before
        # it took `plain`, which a loaded host once let `captures` reach
        admitted = [
            llm.admit("plain", PROMPTS[1], None, long, got["plain"].append),
            llm.admit("captures", PROMPTS[0], None, short, got["captures"].append),
        ]
        for future in admitted:
            future.result(timeout=30)
        for _ in range(3000):
            if "captures" in engine._awaiting_captures:
                break
            time.sleep(0.01)
        assert "captures" in engine._awaiting_captures
        launch = engine.runner.launch

        def fail(*args, **kwargs):  # the rows land, then the step fails
            gate.set()
            engine.runner.launch = launch
            raise RuntimeError("boom")

        engine.runner.launch = fail
        for _ in range(3000):
            if got["plain"] and isinstance(got["plain"][-1], BaseException):
                break
            time.sleep(0.01)
    finally:
        gate.set()
        llm.shutdown()
    final = got["captures"][-1]
    assert not isinstance(final, BaseException) and final.finished
    assert final.capture_positions is not None and len(final.capture_positions) == 2
    assert "boom" in str(got["plain"][-1])


def _req(seq_id, tokens, start, blocks, samples=True) -> StepRequest:
    return StepRequest(seq_id, tokens, start, blocks, samples, Params(), None)


def test_the_step_batch_holds_every_input_at_its_offset():
    batch = StepBatch(max_tokens=16, max_seqs=4, max_blocks=3, device=torch.device("cpu"))
    np_ = batch.np
    reqs = [
        _req(0, [5, 6, 7], 0, [2, 9]),  # a prefill from 0
        _req(1, [8], 5, [4, 1]),  # a decode at position 5 (block 1, offset 1)
        _req(2, [3, 4], 4, [7, 3, 6], samples=False),  # a chunk over 4 cached tokens
    ]
    block_size = 4
    # what ModelRunner._build writes, checked field by field
    from services.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.batch, runner.block_size, runner.scratch_slot = batch, block_size, 99
    runner.ctx, runner.recent = SINGLE_PROCESS, RecentTokens()
    t, qsl, lens, fills = runner._build(reqs, pad_to=0)
    assert (t, qsl, lens, fills) == (6, [0, 3, 4, 6], [3, 6, 6], False)
    assert np_["input_ids"][:6].tolist() == [5, 6, 7, 8, 3, 4]
    assert np_["positions"][:6].tolist() == [0, 1, 2, 5, 4, 5]
    assert np_["slot_mapping"][:6].tolist() == [8, 9, 10, 5, 12, 13]
    assert np_["logits_rows"][:3].tolist() == [2, 3, 5]
    assert np_["seq_lens"][:3].tolist() == [3, 6, 6]
    # a placeholder token reads the previous step's sampled row; padding writes scratch
    runner.recent.add(torch.tensor([42, 43]), {7: 1})
    t, qsl, lens, fills = runner._build([_req(7, [PLACEHOLDER], 2, [3])], pad_to=2)
    assert fills and np_["prev_rows"][:1].tolist() == [1] and np_["input_ids"][0] == 0
    assert np_["slot_mapping"][:2].tolist() == [14, 99] and np_["seq_lens"][:2].tolist() == [3, 0]
    runner.recent.fill(batch.dev["input_ids"][:t], batch.dev["prev_rows"][:t])
    assert batch.dev["input_ids"][0].item() == 43
    # two steps back (pipeline microbatches): each placeholder from the newest step that
    # sampled its sequence, in the steps' tokens end to end
    runner.recent.lookback = 2
    runner.recent.add(torch.tensor([50, 51, 52]), {8: 0, 7: 2})
    reqs = [_req(7, [PLACEHOLDER], 2, [3]), _req(9, [PLACEHOLDER], 2, [4])]
    runner.recent.add(torch.tensor([60]), {9: 0})  # 9 in the newest, 7 in the one before
    t, qsl, lens, fills = runner._build(reqs, pad_to=2)
    assert np_["prev_rows"][:2].tolist() == [2, 3]
    runner.recent.fill(batch.dev["input_ids"][:t], batch.dev["prev_rows"][:t])
    assert batch.dev["input_ids"][:2].tolist() == [52, 60]


def test_graph_buckets_cover_every_batch_size():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]


def test_attention_backend_choice_follows_the_head_dim_and_graphs_need_a_capturable_one():
    """The Triton kernels tile a head whole: "auto" picks SDPA for a head dim that is not a
    power of two (on CUDA too), "triton" refuses it with the reason, and only a backend
    whose decode steps are capturable gets CUDA graphs."""
    from services.engine.attention import SdpaBackend, TritonBackend
    from services.engine.device import make_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects: no CUDA needed
    assert isinstance(make_attention_backend("auto", cuda, 128), TritonBackend)
    assert isinstance(make_attention_backend("auto", cuda, 96), SdpaBackend)
    assert isinstance(make_attention_backend("auto", cpu, 128), SdpaBackend)
    with pytest.raises(ValueError, match=r"power-of-two head_dim.*96"):
        make_attention_backend("triton", cuda, 96)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_attention_backend("triton", cpu, 128)
    assert TritonBackend.supports_graphs and not SdpaBackend.supports_graphs
    # The one-kernel decode attention is the Triton kernel's: where SDPA runs, asking is an error.
    assert make_attention_backend("auto", cuda, 128, fused_decode=True).tickets is not None
    assert make_attention_backend("auto", cuda, 128).tickets is None
    for device, head_dim in ((cpu, 128), (cuda, 96)):
        with pytest.raises(
            ValueError, match=r"fused_decode_attention is the Triton decode kernel.* runs on SDPA"
        ):
            make_attention_backend("auto", device, head_dim, fused_decode=True)


interpreted_only = pytest.mark.skipif(
    not INTERPRET, reason="run under TRITON_INTERPRET=1 by test_one_kernel_decode_interpreted"
)


def test_one_kernel_decode_interpreted():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "interpreted_engine")


@interpreted_only
@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # with and without the per-head norms
def test_interpreted_engine_decodes_alike_with_one_kernel_attention(
    tiny_checkpoint, monkeypatch, arch
):
    """The engine on the Triton backend (every kernel interpreted on CPU), with and without
    `fused_decode_attention`, requests arriving a step apart: the layer hands its raw q, k,
    v to the one-kernel decode on decode steps, mixed steps' decode rows merge by ticket,
    and the tokens and float32 logprobs are the separate kernels'."""
    from services.engine import llm_engine
    from services.engine.attention import TritonBackend

    calls = {"raw": 0, "mixed": 0}

    def backend(name, device, head_dim=None, fused_decode=False):
        made = TritonBackend(fused_decode=fused_decode)
        attend_raw, decode_part = made.attend_raw, made._decode_part

        def raw(*args, **kwargs):
            calls["raw"] += 1
            return attend_raw(*args, **kwargs)

        def mixed(*args, **kwargs):  # a mixed step's decode rows
            calls["mixed"] += made.tickets is not None
            return decode_part(*args, **kwargs)

        made.attend_raw, made._decode_part = raw, mixed
        return made

    monkeypatch.setattr(llm_engine, "make_attention_backend", backend)
    path = tiny_checkpoint(arch)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = []
    for fused in (False, True):
        config = EngineConfig(device="cpu", max_num_batched_tokens=64, fused_decode_attention=fused)
        engine = LLMEngine(path, config)
        pending = list(enumerate(PROMPTS[:4]))
        totals, done = OutputAccumulator(), {}
        while pending or engine.has_unfinished_requests():
            if pending:  # one arrives each step: its prefill beside the others' decodes
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, params)
            for out in totals.finished(engine.step()):
                done[out.request_id] = out.outputs[0]
        outs.append([done[str(i)] for i in range(4)])
        # decode steps took the one-kernel path, mixed steps' decode rows the tickets
        assert (calls["raw"] > 0) == (calls["mixed"] > 0) == fused
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert [la[t] for t in la] == pytest.approx([lb[t] for t in la], abs=1e-4)
