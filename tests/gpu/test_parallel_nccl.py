"""Tensor and pipeline parallelism over NCCL: a TP=2 and a PP=2 replica on two GPUs give the
tokens, logprobs, read-outs and captures of one GPU, with steering, capture and patching.
Float32, so the only difference is the all-reduce's summation order."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from services.engine import EngineConfig, LLMEngine
from services.engine.local_replica import launch_local
from services.engine.model.tiny import make_tiny_checkpoint
from tests import parallel_workload

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
CONFIG = EngineConfig(
    device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=16, **parallel_workload.ADAPTERS
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny"), "llama", layers=parallel_workload.LAYERS
    )


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_nccl_replica_matches_one_gpu(checkpoint, tp, pp):
    want = parallel_workload.run(LLMEngine(checkpoint, CONFIG))
    got = launch_local(
        str(checkpoint), tp, pp, parallel_workload.run, engine_config=CONFIG, device_type="cuda"
    )
    for g, r in zip(got, want, strict=True):
        for (gt, glp, _, _), (rt, rlp, _, _) in zip(g["samples"], r["samples"], strict=True):
            assert gt == rt
            for a, b in zip(glp or [], rlp or [], strict=True):
                assert all(math.isclose(a[k], b[k], abs_tol=1e-3) for k in b)
        for key, t in (r["captures"] or {}).items():
            torch.testing.assert_close(g["captures"][key], t, atol=1e-3, rtol=0)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_nccl_sweep_runs_patch_passes_like_one_gpu(checkpoint, tp, pp):
    """Each layered patch pass runs on every rank (all-reduces, and the stage hand-off of
    the packed residual, over NCCL), between steps."""
    want = parallel_workload.sweep(LLMEngine(checkpoint, CONFIG))
    got = launch_local(
        str(checkpoint), tp, pp, parallel_workload.sweep, engine_config=CONFIG, device_type="cuda"
    )
    assert want["passes"] > 0 and got["passes"] == want["passes"]
    assert math.isclose(got["corrupt"], want["corrupt"], abs_tol=1e-3)
    np.testing.assert_allclose(got["grid"], want["grid"], atol=1e-3, rtol=0)


GRAPH_CONFIG = dataclasses.replace(CONFIG, graph_steering_sites=parallel_workload.GRAPH_SITES)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_decode_replays_graphs_like_one_gpu(checkpoint, tp, pp, caplog):
    """Decode steps that steer at three sites, capture every layer, read out and run an
    adapter replay CUDA graphs on every rank (the all-reduces, the logits' all-gather and
    the stage hand-off inside them) and give one GPU's tokens, logprobs, read-outs and
    captures; they replay as many graphs of each kind as one GPU does. (Pipeline stages
    fill no capture buffer, so their one-GPU reference does not either.) Then every rank
    leaves its process groups by itself: graphs that captured NCCL collectives once kept
    the communicators from shutting down, until `launch_local` stopped the ranks."""
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} CUDA devices")
    reference = GRAPH_CONFIG
    if pp > 1:
        reference = dataclasses.replace(GRAPH_CONFIG, graph_capture_rows=0)
    want = parallel_workload.graph_decode(LLMEngine(checkpoint, reference))
    got = launch_local(
        str(checkpoint),
        tp,
        pp,
        parallel_workload.graph_decode,
        engine_config=GRAPH_CONFIG,
        device_type="cuda",
    )
    stopped = [r.getMessage() for r in caplog.records if "stopping it" in r.getMessage()]
    assert not stopped, stopped
    assert want["graph_steps"]["num_steered_graph_steps"] > 0
    assert want["graph_steps"]["num_adapted_graph_steps"] > 0
    assert (want["graph_steps"]["num_capture_graph_steps"] > 0) == (pp == 1)
    assert got["graph_steps"] == want["graph_steps"]
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g["token_ids"] == w["token_ids"]
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            assert all(math.isclose(a[k], b[k], abs_tol=1e-3) for k in b)
        for a, b in zip(g["readouts"] or [], w["readouts"] or [], strict=True):
            assert a == pytest.approx(b, abs=1e-3)
        for key, t in (w["captures"] or {}).items():
            torch.testing.assert_close(g["captures"][key], t, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "tp,dtype", [(2, "float32"), (2, "bfloat16"), (4, "float32"), (4, "bfloat16")]
)
def test_fused_all_reduce_norm_decodes_like_the_unfused_replica(checkpoint, tmp_path, tp, dtype):
    """`fused_all_reduce_norm`: a TP replica whose plain steps all-reduce inside the norm
    after each sub-block (one kernel over symmetric memory, in the decode graphs too) gives
    the tokens and logprobs of a TP replica that keeps them apart, and of one GPU. Four
    ranks push their rows to three peers each (the 70B shape's TP=4): float32 shows the
    kernel exact up to summation order there, as at TP=2."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA devices")
    if tp == 4:  # every rank keeps whole KV heads
        checkpoint = make_tiny_checkpoint(
            tmp_path, "llama", layers=parallel_workload.LAYERS, hidden=128, heads=8, kv_heads=4
        )
    config = dataclasses.replace(CONFIG, dtype=dtype, fused_all_reduce_norm=False)
    # At TP=2 the default (None) is the fused kernel: the replica must show it on.
    fused = dataclasses.replace(config, fused_all_reduce_norm=True if tp > 2 else None)
    one = parallel_workload.plain_decode(LLMEngine(checkpoint, config))
    # A wrong barrier hangs the ranks: fail in minutes rather than the default ten.
    apart, together = (
        launch_local(str(checkpoint), tp, 1, parallel_workload.plain_decode, engine_config=c,
                     device_type="cuda", timeout_s=240)
        for c in (config, fused)
    )  # fmt: skip
    assert together["fused"] and not apart["fused"]
    assert together["graph_steps"] > 0 and together["graph_steps"] == apart["graph_steps"]
    # Float32: only the summation order differs, so the tokens are the same and the logprobs
    # within 1e-3. Bf16: the TP split itself rounds partial sums that one GPU never rounds,
    # and the two replicas round them differently (NCCL's sum in bf16, the fused kernel's in
    # float32 and once; with two ranks a sum of two bf16 values rounds once either way, so
    # there they agree). So each replica is about `split` from one GPU (the fused one is
    # allowed tol + split), and the two are up to both deviations apart (2 tol). A greedy
    # token may flip where the reference ranked the two closer than twice the gap allowed
    # between the runs (a tiny random model's logits are nearly flat), never elsewhere.
    split, split_flips = _compare(apart, one)
    fused_gap, fused_flips = _compare(together, apart)
    gap, flips = _compare(together, one)
    if dtype == "float32":
        assert not (split_flips or fused_flips or flips), (split_flips, fused_flips, flips)
        tol = 1e-3
    else:
        tol = max(5e-2, split)
        assert all(m <= 2 * tol for m in split_flips), split_flips
        assert all(m <= 4 * tol for m in fused_flips), fused_flips  # twice its gap, 2 tol
        assert all(m <= 2 * (tol + split) for m in flips), flips
    gaps = f"fused-unfused {fused_gap:.4f}, fused-one GPU {gap:.4f}, unfused-one GPU {split:.4f}"
    print(f"tp={tp} {dtype}: {gaps}")
    assert fused_gap <= (tol if dtype == "float32" else 2 * tol), gaps
    assert gap <= tol + split, gaps


def _compare(a: dict, b: dict) -> tuple[float, list[float]]:
    """Greedy runs `a` against the reference `b`: the largest |logprob difference| over the
    tokens both rank among the top-k, at every position where both saw the same context
    (each request's tokens until the first that differs, that one included), and at each
    such flip how far apart `b` ranked the two tokens (inf if `a`'s was not in `b`'s
    top-k). At least half of all tokens must be compared."""
    gaps, flips, compared, total = [], [], 0, 0
    for (at, alp), (bt, blp) in zip(a["outputs"], b["outputs"], strict=True):
        total += len(bt)
        for x, y, xl, yl in zip(at, bt, alp, blp, strict=True):
            gaps += [abs(xl[k] - yl[k]) for k in xl.keys() & yl.keys()]
            compared += 1
            if x != y:
                flips.append(yl[y] - yl.get(x, float("-inf")))
                break
    assert compared >= total / 2, f"only {compared} of {total} tokens before the flips"
    return max(gaps), flips


def test_pipeline_microbatches_decode_like_one_gpu(checkpoint):
    """`pipeline_microbatches=2` on two GPUs: overlapped decode steps carry disjoint halves
    of the batch in turn, two in flight (each half's tokens sent stage to stage over NCCL,
    for its step after next), with one GPU's tokens and logprobs."""
    want = parallel_workload.microbatched(LLMEngine(checkpoint, CONFIG))
    config = dataclasses.replace(CONFIG, pipeline_microbatches=2)
    got = launch_local(
        str(checkpoint), 1, 2, parallel_workload.microbatched, engine_config=config,
        device_type="cuda", timeout_s=240,
    )  # fmt: skip
    assert got["tokens"] == want["tokens"]
    for rid, lps in want["logprobs"].items():
        for a, b in zip(got["logprobs"][rid], lps, strict=True):
            assert all(math.isclose(a[k], b[k], abs_tol=1e-3) for k in b)
    assert got["depth"] == 2
    halves = got["steps"]
    assert len(halves) >= 4 and all(len(s) <= 3 for s in halves)
    assert all(not set(a) & set(b) for a, b in itertools.pairwise(halves))
