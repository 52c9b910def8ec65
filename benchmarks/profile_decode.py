"""Where a decode step's time goes: host milliseconds, kernels and launches, device syncs.

On a generated Qwen3-0.6B-shaped checkpoint (context 512), for each batch size it prints:
- wall time per decode step;
- host-busy time: wall time minus the time `engine.step()` waits on the event of the step's
  one device→host copy;
- the host's milliseconds per step in each stage of `LLMEngine.step` (`STAGES`): which
  part of the host's work would bound the step if the device were faster;
- the kernels executed per step and the CUDA API calls per step (`torch.profiler`);
- how many sync warnings `torch.cuda.set_sync_debug_mode("warn")` raised over 5 steps.

Requests are sent as `coxswain serve`'s front end sends them: with `detokenize=False`, since
that process decodes the text (`services/engine/detokenizer.py`); `--engine-detokenizes`
measures the engine decoding it, as `LLM.generate` has it. `--capture` has every request
capture post_block of every layer at every generated token (per-token capture's host
cost). `--device cpu` times the host's stages only, on a two-layer model (the forward small
beside the host's work). The startup heap is frozen, as `coxswain serve` freezes it
(`services/engine/heap.py`). `--cprofile DIR` also writes a cProfile of the timed steps per
batch size: which functions a stage's milliseconds are.

    PYTHONPATH=. python3 benchmarks/profile_decode.py
    PYTHONPATH=. python3 benchmarks/profile_decode.py --device cpu --engine-detokenizes
    PYTHONPATH=. python3 benchmarks/profile_decode.py --batch-sizes 32 --capture --cprofile DIR

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import services.engine.model_runner as model_runner
import services.engine.step_batch as step_batch
from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.heap import freeze_startup_heap
from services.engine.interventions.manager import InterventionManager
from services.engine.model.tiny import make_tiny_checkpoint
from services.engine.scheduler import Scheduler

# The stages of a decode step, as (class, method): scheduling, planning interventions,
# building the step batch, launching it, waiting for the step before, what its
# interventions read back, and taking its tokens into sequences and deltas.
STAGES = [
    (Scheduler, "schedule"),
    (InterventionManager, "plan_step"),
    (model_runner.ModelRunner, "_build"),
    (model_runner.ModelRunner, "launch"),
    (step_batch.PendingStep, "result"),
    (InterventionManager, "observe"),
    (LLMEngine, "_accept"),
]

waited = [0.0]
_result = step_batch.PendingStep.result


def _timed_result(self: step_batch.PendingStep) -> step_batch.StepResult:
    if self.copied is not None:
        t = time.perf_counter()
        self.copied.synchronize()
        waited[0] += time.perf_counter() - t
    return _result(self)


@contextmanager
def stage_times(totals: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in each of `STAGES` to `totals` while inside (nested calls
    count in each stage: `_build` is part of `launch`)."""

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t

        return call

    originals = [(cls, name, getattr(cls, name)) for cls, name in STAGES]
    for cls, name, f in originals:
        setattr(cls, name, timed(name, f))
    try:
        yield
    finally:
        for cls, name, f in originals:
            setattr(cls, name, f)


def kernels_and_syncs(engine: LLMEngine, top_kernels: int) -> None:
    """Print the kernels and CUDA API calls of a decode step, and the syncs of five."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(5):
            engine.step()
        torch.cuda.set_sync_debug_mode("default")
    # Not "synchroniz" alone: the once-per-process notice that the debug mode is a
    # prototype says "Synchronization" too, and is no sync.
    syncs = sum("synchronizing cuda operation" in str(w.message).lower() for w in caught)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    api = {e.key: e.count / 10 for e in events if e.key.startswith("cu") and e.count >= 5}
    calls = ", ".join(f"{k} {v:g}" for k, v in sorted(api.items()))
    print(f"  {kernels / 10:.0f} kernels/step; sync warnings in 5 steps: {syncs}")
    print(f"  CUDA API calls per step: {calls}")
    # Which kernels they are (where fusion would cut launches): count and device time a step.
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_events.sort(key=lambda e: -e.count)
    print("  kernels a step (count, µs on the device), most frequent first:")
    for e in device_events[:top_kernels]:
        us = e.self_device_time_total / 10
        print(f"    {e.count / 10:6.1f}  {us:8.1f} µs  {e.key[:100]}")


def host_functions(engine: LLMEngine, steps: int, path: Path) -> None:
    """cProfile of `steps` engine steps, the 40 costliest functions by their own time and by
    time inside them, per step, written to `path`: which functions a stage's milliseconds
    are (the drain thread's work is not in it: cProfile follows this thread only)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    out = io.StringIO()
    out.write(f"cProfile of {steps} decode steps (divide the times by {steps} for a step)\n")
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine-detokenizes", action="store_true")
    p.add_argument(
        "--capture-arena-bytes",
        type=int,
        help="EngineConfig.capture_arena_bytes (default: the engine's; 0: drain and assembler)",
    )
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument(
        "--capture",
        action="store_true",
        help="every request captures post_block of every layer at every generated token",
    )
    p.add_argument(
        "--top-kernels", type=int, default=25, help="kernels listed per batch size (CUDA)"
    )
    p.add_argument(
        "--cprofile",
        type=Path,
        help="also write a cProfile of the timed steps per batch size here (host functions)",
    )
    args = p.parse_args()
    cuda = args.device == "cuda"
    step_batch.PendingStep.result = _timed_result  # count the time blocked on the device
    shape = dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072)
    if not cuda:
        shape = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    path = make_tiny_checkpoint(
        tempfile.mkdtemp() + "/m", "qwen3", **shape, vocab=151936, max_position_embeddings=2048,
        dtype="bfloat16" if cuda else "float32",
    )  # fmt: skip
    cfg = EngineConfig(
        device=args.device, dtype="bfloat16" if cuda else "float32", max_num_seqs=128,
        max_num_batched_tokens=8192, max_model_len=1024, enable_prefix_caching=False,
        capture_arena_bytes=args.capture_arena_bytes,
    )  # fmt: skip
    engine = LLMEngine(path, cfg)
    freeze_startup_heap()  # as a serving process does (`coxswain serve`)
    rng = random.Random(0)
    capture = {"sites": {"post_block": "all"}, "positions": "all_generated"}
    params = SamplingParams(
        max_tokens=400, temperature=0.0, ignore_eos=True, detokenize=args.engine_detokenizes,
        capture=capture if args.capture else None,
    )  # fmt: skip
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"text decoded by {'the engine' if args.engine_detokenizes else 'the front end'}")
    if args.capture:
        print(f"every request captures {capture}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        rids = [f"{batch}-{i}" for i in range(batch)]
        for rid in rids:
            engine.add_request(rid, [rng.randrange(100, 150000) for _ in range(512)], params)
        while any(g.seqs[0].num_generated == 0 for g in engine.requests.values()):
            engine.step()
        for _ in range(4):
            engine.step()
        sync()
        waited[0], n = 0.0, 64
        t = time.perf_counter()
        for _ in range(n):
            engine.step()
        sync()
        wall = (time.perf_counter() - t) / n
        host_ms = 1e3 * (wall - waited[0] / n)
        print(f"batch {batch}: {wall * 1e3:.2f} ms/step, host busy {host_ms:.2f} ms")
        if cuda:
            kernels_and_syncs(engine, args.top_kernels)
        totals: dict[str, float] = collections.defaultdict(float)
        with stage_times(totals):
            for _ in range(n):
                engine.step()
        parts = ", ".join(f"{name} {1e3 * totals[name] / n:.3f}" for _, name in STAGES)
        print(f"  host ms/step by stage: {parts}")
        if args.cprofile is not None:
            path = args.cprofile / f"batch{batch}{'-capture' if args.capture else ''}.txt"
            host_functions(engine, n, path)
            print(f"  host functions: {path}")
        for rid in rids:
            engine.abort(rid)
        engine.step()


if __name__ == "__main__":
    main()
