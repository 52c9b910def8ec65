"""Tensor and pipeline parallelism on CPU (gloo): a replica of 2 or 4 processes gives the same
tokens, logprobs, read-outs and captures as one process, with steering (per request, global,
registry names), capture, patching and an adapter (trained and deploy variants, LoRA
quarantine) all active in one batch."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from services.engine import EngineConfig, LLMEngine
from services.engine.local_replica import _reap, launch_local
from tests import parallel_workload

CONFIG = EngineConfig(
    device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=16, **parallel_workload.ADAPTERS
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=parallel_workload.LAYERS, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return parallel_workload.run(LLMEngine(checkpoint, CONFIG))


def _close_dicts(a, b, tol=1e-4):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert set(x) == set(y)
        for k in x:
            # read-outs reach ~150, where float32's own spacing is ~1e-5: relative there too
            assert math.isclose(x[k], y[k], rel_tol=1e-5, abs_tol=tol), (k, x[k], y[k])


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_replica_matches_one_process(checkpoint, reference, tp, pp):
    got = launch_local(str(checkpoint), tp, pp, parallel_workload.run, engine_config=CONFIG)
    assert len(got) == len(reference)
    for i, (g, r) in enumerate(zip(got, reference, strict=True)):
        _close_dicts(g["prompt_logprobs"], r["prompt_logprobs"])
        pairs = zip(g["samples"], r["samples"], strict=True)
        for (gt, glp, gro, gfr), (rt, rlp, rro, rfr) in pairs:
            assert gt == rt, f"request {i}: tokens differ"
            assert gfr == rfr
            _close_dicts(glp, rlp)
            _close_dicts(gro, rro)
        assert g["capture_positions"] == r["capture_positions"]
        assert (g["captures"] is None) == (r["captures"] is None)
        if r["captures"]:
            assert set(g["captures"]) == set(r["captures"])
            for key, t in r["captures"].items():
                torch.testing.assert_close(g["captures"][key], t, atol=1e-4, rtol=1e-5)
    # the batch really exercised what it claims to
    steered, plain = reference[1]["samples"][0][1], reference[0]["samples"][0][1]
    assert steered != plain
    assert reference[4]["samples"][0][2] and "late" in reference[4]["samples"][0][2][0]
    assert len(reference[2]["captures"]) == parallel_workload.LAYERS + 2
    adapted, deployed = reference[6]["samples"][0][1], reference[7]["samples"][0][1]
    assert adapted != plain and deployed != reference[2]["samples"][0][1]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_bad_adapter_is_refused_on_the_driver_for_any_stage(checkpoint, tp, pp):
    """The driver checks every module's entry of an adapter's state, its own stage's or
    not, against the whole model's shapes: a fault in another stage's layer is refused
    with its cause before any rank installs anything, and the replica goes on."""
    got = launch_local(
        str(checkpoint), tp, pp, parallel_workload.refused_adapters, engine_config=CONFIG
    )
    assert pp == 1 or got["last"] not in got["local"]  # the fault sits on the other stage
    assert "state must cover exactly the target modules" in got["errors"]["missing"]
    assert got["last"] in got["errors"]["missing"]
    assert "needs lora_a [k, " in got["errors"]["bad_lora"]
    assert len(got["tokens"]) == 3


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_rank_whose_steering_state_drifted_fails_the_step(checkpoint, tp, pp):
    """Every step compares each rank's steering-state digest (one small all-gather under
    TP, with the driver's tokens; the object exchange under PP)."""
    got = launch_local(str(checkpoint), tp, pp, parallel_workload.diverge, engine_config=CONFIG)
    assert got == "ranks [1] of this replica hold different steering state than rank 0"


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_a_sweep_runs_as_patch_passes_on_a_parallel_replica(checkpoint, tp, pp):
    """Every rank runs each layered patch pass's forward, between steps, in lock-step with
    the driver (stage by stage across pipeline stages, the last one's result shared): the
    grid is one process's, from as many passes."""
    want = parallel_workload.sweep(LLMEngine(checkpoint, CONFIG))
    got = launch_local(str(checkpoint), tp, pp, parallel_workload.sweep, engine_config=CONFIG)
    assert want["passes"] > 0 and got["passes"] == want["passes"]
    assert math.isclose(got["corrupt"], want["corrupt"], abs_tol=1e-4)
    np.testing.assert_allclose(got["grid"], want["grid"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_a_parallel_replica_overlaps_steps_like_one_process(checkpoint, tp, pp):
    """Steps overlap on every split (the last pipeline stage sends its sampled tokens to the
    first, which fills the next step's placeholders with them): the same tokens in as many
    steps as one process."""
    want = parallel_workload.overlapped(LLMEngine(checkpoint, CONFIG))
    got = launch_local(str(checkpoint), tp, pp, parallel_workload.overlapped, engine_config=CONFIG)
    assert want["overlapped"] and got["overlapped"]
    assert got == want


def test_a_rank_freezes_its_startup_heap(checkpoint):
    """A rank's process serves its engine for its life, so the objects it holds once the
    engine is built leave the cyclic collector's generations (`heap.freeze_startup_heap`):
    its oldest-generation collections no longer stall every request in flight."""
    frozen = launch_local(
        str(checkpoint), 2, 1, parallel_workload.frozen_heap, engine_config=CONFIG
    )
    assert frozen > 10_000


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_microbatches_take_turns_and_decode_like_one_process(checkpoint, tp):
    """`pipeline_microbatches=2` on two stages: overlapped decode steps carry disjoint
    halves of the batch in turn, two of them in flight (a half's tokens reach the first
    stage on the device, for its step after next), and every request gets one process's
    tokens and logprobs."""
    want = parallel_workload.microbatched(LLMEngine(checkpoint, CONFIG))
    config = dataclasses.replace(CONFIG, pipeline_microbatches=2)
    got = launch_local(str(checkpoint), tp, 2, parallel_workload.microbatched, engine_config=config)
    assert got["tokens"] == want["tokens"]
    for rid, lps in want["logprobs"].items():
        _close_dicts(got["logprobs"][rid], lps)
    assert all(len(s) == 5 for s in want["steps"])  # one process: the whole batch each step
    assert want["depth"] == 1 and got["depth"] == 2
    halves = got["steps"]
    assert len(halves) >= 4 and all(len(s) <= 3 for s in halves)
    for a, b in itertools.pairwise(halves):
        assert not set(a) & set(b), (a, b)


def test_pipeline_microbatches_on_one_stage_are_logged_and_not_used(checkpoint, caplog):
    config = dataclasses.replace(CONFIG, pipeline_microbatches=2)
    with caplog.at_level("WARNING", logger="services.engine.llm_engine"):
        got = parallel_workload.microbatched(LLMEngine(checkpoint, config))
    assert "pipeline_microbatches applies to pipeline stages: not used" in caplog.text
    assert got["steps"] and all(len(s) == 5 for s in got["steps"])


def test_a_rank_that_dies_before_the_driver_reports_fails_the_launch_at_once(tmp_path):
    """No checkpoint: every rank dies building its engine. The launch says so as soon as a
    rank has exited, rather than waiting out its timeout for a result that cannot come."""
    with pytest.raises(RuntimeError, match=r"rank\(s\) exited before the driver finished"):
        launch_local(str(tmp_path / "missing"), 2, 1, len, timeout_s=300)


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_driver_rank_keeps_captures(checkpoint, rank):
    """`StepSync.attach`: a rank that delivers no outputs computes what the driver does but
    copies no capture to the host and keeps none (at TP=4 each worker would hold, and page
    in, every request's captures for nothing); the driver keeps them all."""
    from services.engine import LLM, SamplingParams
    from services.engine.distributed import StepSync
    from services.engine.parallel import ParallelContext

    engine = LLMEngine(checkpoint, CONFIG)
    StepSync(ParallelContext(tp_rank=rank, tp_size=2)).attach(engine)
    capture = {"sites": {"post_block": "all"}, "positions": "all"}
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, capture=capture)
    out = LLM(engine=engine).generate(["the quick brown fox"], params)[0]
    observer = engine.interventions.observer
    captured = observer.num_block_captures + observer.num_eager_captures
    assert len(out.outputs[0].token_ids) == 5
    if rank == 0:
        # each prompt position, each generated one but the last (never fed back)
        positions = list(range(len(out.prompt_token_ids) + 5 - 1))
        assert out.capture_positions == positions and captured == len(positions)
        assert set(out.captures) == {f"{L}.post_block" for L in range(parallel_workload.LAYERS)}
    else:
        assert captured == 0 and not out.captures


def test_a_replica_past_its_time_says_where_every_rank_waits(checkpoint, capfd):
    """A hung replica is a failure with every rank's stacks (printed before the parent gives
    up), not a silent timeout: the driver's stack names the function it is stuck in. The
    stacks come 5 s before the timeout, counted from each rank's start: 7 s leaves a loaded
    machine time to build the engine first (a 6 s timeout, stacks at 1 s, once caught a
    driver still starting up)."""
    with pytest.raises(RuntimeError, match="did not finish within 12 s"):
        launch_local(
            str(checkpoint), 2, 1, parallel_workload.stalled, engine_config=CONFIG, timeout_s=12
        )
    err = capfd.readouterr().err
    assert "in stalled" in err and err.count("Current thread") + err.count("Thread 0x") >= 2


def test_ranks_still_running_after_the_result_are_stopped_and_say_where(capfd):
    """A rank whose teardown hangs after the driver's result (three NCCL workers at TP=4
    each outlived a 30 s join) is stopped once the grace is over, and prints its stacks
    first; a rank that exits on its own is left to."""
    mp = torch.multiprocessing.get_context("spawn")
    ready = [mp.Event(), mp.Event()]
    procs = [
        mp.Process(target=parallel_workload.linger, args=(s, r))
        for s, r in zip((600.0, 0.0), ready, strict=True)
    ]
    for p in procs:
        p.start()
    assert all(r.wait(60) for r in ready)
    procs[1].join(60)  # its own exit, however slow the machine, before the grace starts
    _reap(procs, grace_s=1.0)
    assert not any(p.is_alive() for p in procs)
    assert procs[0].exitcode < 0  # stopped by a signal, not its sleep running out
    assert procs[1].exitcode == 0
    assert "in linger" in capfd.readouterr().err
