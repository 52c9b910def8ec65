"""Where a steered whole run's wall time goes, step by step: `steering_overhead.py`'s workload
(every prompt submitted at once through `LLM.generate`), unsteered, K = 1 and K = K distinct
configs steering the given layers, with each `LLMEngine.step` call timed.

Per config, the median over `--repeats` interleaved runs of: the wall time; the host's time
between the first few steps (`LLM.generate` admitting the next prompts: on a GPU it is
hidden only while the device still has a step to run); the time inside those steps (planning
and launching one, then waiting for the one before); and the time after them (decode).

    python3 benchmarks/steering_phases.py --layers 28 --hidden 1024 --heads 16 --kv-heads 8 \\
        --intermediate 3072 --vocab 151936   # the Qwen3-0.6B shape, 128 x 512 -> 64, one GPU

Prints numbers only; `steering_overhead.py` is the benchmark whose overhead issue 27 names.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from generated_model import add_model_arguments, checkpoint_dir, resolve_device
from steering_overhead import greedy, steered_params, steering_vectors
from throughput import sync

from services.engine import LLM
from services.engine.model.config import load_model_config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--k", type=int, default=128, help="distinct configs of the last row")
    p.add_argument("--steer-layers", help="comma-separated (default: every layer)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--first-steps", type=int, default=5, help="the steps timed apart")
    args = p.parse_args(argv)
    resolve_device(args)
    with tempfile.TemporaryDirectory(prefix="coxswain-bench-") as tmp:
        model_dir = checkpoint_dir(args, Path(tmp), max(1024, args.prompt_len + args.output_len))
        run(args, model_dir)


def run(args: argparse.Namespace, model_dir: Path) -> None:
    cfg = load_model_config(model_dir)
    layers = (
        [int(x) for x in args.steer_layers.split(",")]
        if args.steer_layers
        else list(range(cfg.num_layers))
    )
    llm = LLM(
        model_dir,
        device=str(args.device),
        dtype=args.dtype,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,  # every run prefills the same prompts
        steering_request_rows=max(256, args.k),
        seed=args.seed,
    )
    gen = torch.Generator().manual_seed(args.seed)
    work = [
        torch.randint(cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.num_seqs)
    ]
    vectors = steering_vectors(args.k, cfg.hidden_size, args.seed)
    n = args.output_len
    configs = {
        "unsteered": [greedy(n)],
        "K=1": steered_params(vectors[:1], layers, 4.0, n),
        f"K={args.k}": steered_params(vectors, layers, 4.0, n),
    }
    engine, first = llm.engine, args.first_steps
    results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in configs}
    for c in configs.values():  # untimed: first-use costs
        llm.generate(work, [c[i % len(c)] for i in range(len(work))])
    for _ in range(args.repeats):
        for name, c in configs.items():
            marks: list[tuple[float, float]] = []

            def step(*_: object, marks: list = marks) -> object:
                t = time.perf_counter()
                out = type(engine).step(engine)
                marks.append((t, time.perf_counter()))
                return out

            engine.step = step  # type: ignore[method-assign]
            try:
                sync(args.device)
                start = time.perf_counter()
                llm.generate(work, [c[i % len(c)] for i in range(len(work))])
                sync(args.device)
                end = time.perf_counter()
            finally:
                del engine.step
            ends = [start] + [b for _, b in marks[: first - 1]]
            gaps = sum(a - prev for (a, _), prev in zip(marks[:first], ends, strict=True))
            inside = sum(b - a for a, b in marks[:first])
            results[name].append((end - start, gaps, inside, end - marks[first - 1][1]))
    plain = statistics.median(r[0] for r in results["unsteered"])
    print(
        f"{args.num_seqs} x {args.prompt_len} -> {n}, {len(layers)} layers steered, "
        f"medians of {args.repeats} runs (ms); first {first} steps apart"
    )
    print(
        f"{'config':<10} {'wall':>8} {'vs plain':>9} {'between':>9} {'in step':>9} "
        f"{'after':>8}  walls"
    )
    for name, rs in results.items():
        wall, gaps, inside, after = (1e3 * statistics.median(r[i] for r in rs) for i in range(4))
        vs = "-" if name == "unsteered" else f"{wall / (1e3 * plain) - 1:+.1%}"
        walls = " ".join(f"{1e3 * r[0]:.0f}" for r in rs)
        print(f"{name:<10} {wall:>8.1f} {vs:>9} {gaps:>9.1f} {inside:>9.1f} {after:>8.1f}  {walls}")


if __name__ == "__main__":
    main()
