"""The engine's fast path on CPU: overlapped steps give what synchronous steps give, and the
step batch holds exactly the inputs the model needs (CUDA graphs: tests/gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from services.engine.model_runner import StepBatch, graph_batch_sizes
from services.engine.sampling_params import SamplingParams as Params
from services.engine.scheduler import StepRequest
from services.engine.sequence import PLACEHOLDER

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


def _run(model_dir, overlap: bool, stagger: bool = True, steer: bool = False, **config) -> dict:
    engine = LLMEngine(
        model_dir,
        EngineConfig(device="cpu", dtype="float32", async_scheduling=overlap, **config),
    )
    work = _workload()
    if steer:
        work = _steered(work, engine.model_config.hidden_size)
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


def test_steering_overlaps_but_what_is_read_back_does_not(model_dir):
    """Steering is planned from host state, so its steps overlap; a read-out (or capture,
    patch, gate, consumer) is read on the host after each step, so it turns overlap off
    until its request ends."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    vec = torch.randn(engine.model_config.hidden_size).tolist()
    steer = {"vectors": [{"layers": [1], "site": "post_block", "vector": vec, "scale": 2.0}]}
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=3, steering=steer))
    assert engine._can_overlap()
    readouts = [{"probe": vec, "layer": 1, "name": "p"}]
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=3, readouts=readouts))
    assert not engine._can_overlap()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._can_overlap()


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
    runner._prev_sampled = None
    t, qsl, lens, fills = runner._build(reqs, pad_to=0)
    assert (t, qsl, lens, fills) == (6, [0, 3, 4, 6], [3, 6, 6], False)
    assert np_["input_ids"][:6].tolist() == [5, 6, 7, 8, 3, 4]
    assert np_["positions"][:6].tolist() == [0, 1, 2, 5, 4, 5]
    assert np_["slot_mapping"][:6].tolist() == [8, 9, 10, 5, 12, 13]
    assert np_["logits_rows"][:3].tolist() == [2, 3, 5]
    assert np_["seq_lens"][:3].tolist() == [3, 6, 6]
    # a placeholder token reads the previous step's sampled row; padding writes scratch
    runner._prev_sampled = (torch.tensor([42, 43]), {7: 1})
    t, qsl, lens, fills = runner._build([_req(7, [PLACEHOLDER], 2, [3])], pad_to=2)
    assert fills and np_["prev_rows"][:1].tolist() == [1] and np_["input_ids"][0] == 0
    assert np_["slot_mapping"][:2].tolist() == [14, 99] and np_["seq_lens"][:2].tolist() == [3, 0]
    runner._fill_placeholders(t)
    assert batch.dev["input_ids"][0].item() == 43


def test_graph_buckets_cover_every_batch_size():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
