"""`skinny_gemm` against cuBLAS on a decoder layer's Linears, without an engine.

`decode.py --systems coxswain,coxswain-fa+skinny` measured the skinny kernels slower than
cuBLAS at decode batch sizes, and the step slower still than its kernels' device time
(benchmarks/README.md, "Both measured, and both missed"). This times the GEMMs alone, the
way a decode step replays them: each system's launches for every layer of the shape (distinct
weights a layer, so the L2 cache cannot keep them between layers) captured in one CUDA graph,
replayed, timed by events. Per batch size it prints, for each Linear of a layer (qkv, o,
gate-up with its activation, down) and for the four in sequence (`layer`), the microseconds
a layer and the rate the weights are read at, for:

- cublas: `F.linear` (cuBLAS, with its split-K reduce where it picks one), and `silu_mul`
  after the gate-up, as the engine runs them without `EngineConfig.skinny_gemm`;
- skinny: `skinny_linear`, split over K by the layer's tickets, as the engine runs it;
- skinny-1: `skinny_linear` with no tickets: one program a block of columns, no split.

Every system's output is first checked against cuBLAS's (bf16 tolerance); a mismatch is an
error, not a number. `--profile DIR` also writes, per batch size and system, the profiler's
kernel table of a few replays and its Chrome trace (`*.trace.json`: gaps between the kernels
inside a replay are time the GPU waited). `--device cpu` runs a tiny shape under
`TRITON_INTERPRET=1` (set it in the environment): a check that the script runs, whose times
mean nothing.

    PYTHONPATH=. python3 benchmarks/skinny_gemm.py --shape qwen3-0.6b --rows 1,8,16
    PYTHONPATH=. python3 benchmarks/skinny_gemm.py --shape llama3-8b --rows 1 --profile runs/skinny
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from services.engine.kernels.skinny_gemm import MAX_ROWS, skinny_linear
from services.engine.kernels.tickets import Tickets
from services.engine.kernels.timing import timed

SHAPES = {  # hidden, q + 2 kv columns of qkv, q width (o_proj's K), intermediate, layers
    "qwen3-0.6b": (1024, 4096, 2048, 3072, 28),
    "llama3-8b": (4096, 6144, 4096, 14336, 32),
    "llama3-70b-tp4": (8192, 2560, 2048, 7168, 80),  # one rank's shard at TP=4
    "tiny": (64, 128, 64, 96, 2),
}
SYSTEMS = ("cublas", "skinny", "skinny-1")


def linears(hidden: int, qkv: int, q: int, inter: int) -> dict[str, tuple[int, int, bool]]:
    """A layer's Linears as (output columns of W, K, gated)."""
    return {
        "qkv": (qkv, hidden, False),
        "o": (hidden, q, False),
        "gate_up": (2 * inter, hidden, True),
        "down": (hidden, inter, False),
    }


def kernel(system: str, tickets: Tickets) -> Callable[..., torch.Tensor]:
    """`system`'s y = x Wᵀ (gated: silu(gate) · up), as the engine launches it."""
    if system == "cublas":

        def run(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
            y = F.linear(x, w)
            if not gated:
                return y
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up

        return run
    split = tickets if system == "skinny" else None
    return lambda x, w, gated: skinny_linear(x, w, gated=gated, tickets=split)


def launches(
    run: Callable[..., torch.Tensor], calls: list[tuple[torch.Tensor, torch.Tensor, bool]]
) -> Callable[[], None]:
    """A step that makes `run`'s launches for `calls` ((x, W, gated) each), in order."""

    def step() -> None:
        for x, w, gated in calls:
            run(x, w, gated)

    return step


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise if `got` is not `want` within bf16 rounding of a K-long dot product."""
    scale = want.float().abs().max().item() or 1.0
    err = (got.float() - want.float()).abs().max().item() / scale
    if err > 2e-2:
        raise SystemExit(f"{name}: output differs from cuBLAS's by {err:.3g} of its scale")


def profiled(step: Callable[[], None], path: Path) -> None:
    """A profiler table of 5 replays of `step`'s graph, and their Chrome trace, at `path`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    path.write_text(f"5 replays\n{table}")
    prof.export_chrome_trace(str(path.with_suffix(".trace.json")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--rows", default="1,8,16", help=f"batch sizes, at most {MAX_ROWS}")
    p.add_argument("--iters", type=int, default=100, help="graph replays timed")
    p.add_argument("--layers", type=int, help="distinct weight sets (default: the shape's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", type=Path, help="kernel tables and Chrome traces here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the Triton kernel under TRITON_INTERPRET=1: set it")
    if device.type == "cpu" and args.shape != "tiny":
        raise SystemExit("--device cpu is a smoke run: use --shape tiny")
    rows = [int(r) for r in args.rows.split(",")]
    if not rows or max(rows) > MAX_ROWS or min(rows) < 1:
        raise SystemExit(f"--rows: batch sizes from 1 to {MAX_ROWS}")
    hidden, qkv, q, inter, layers = SHAPES[args.shape]
    layers = args.layers or layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:  # on the device: an 8B shape's 10 GB in seconds
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    shapes = linears(hidden, qkv, q, inter)
    weights = {  # [layers] of W per Linear (scaled like a trained layer's)
        name: [draw(n, k) / k**0.5 for _ in range(layers)] for name, (n, k, _) in shapes.items()
    }
    gb = {name: sum(w.numel() * w.element_size() for w in ws) / 1e9 for name, ws in weights.items()}
    gb["layer"] = sum(gb.values())
    print(
        f"{args.shape}: {layers} layers, weights {gb['layer']:.2f} GB in all "
        f"({', '.join(f'{n} {gb[n] / layers * 1e3:.1f} MB' for n in shapes)} a layer), "
        f"{dtype}, on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
    )
    for m in rows:
        ins = {name: draw(m, k) for name, (_, k, _) in shapes.items()}  # each K wide
        cublas = kernel("cublas", Tickets())
        wants = {name: cublas(ins[name], weights[name][0], g) for name, (_, _, g) in shapes.items()}
        results: dict[str, dict[str, float]] = {}
        for system in SYSTEMS:
            run = kernel(system, Tickets())
            for name, (_, _, gated) in shapes.items():
                got = run(ins[name], weights[name][0], gated)
                check(f"{system} {name} at {m} rows", got, wants[name])

            steps = {
                name: launches(run, [(ins[name], w, shapes[name][2]) for w in weights[name]])
                for name in shapes
            }
            steps["layer"] = launches(  # the four in sequence, layer after layer
                run,
                [
                    (ins[name], weights[name][i], gated)
                    for i in range(layers)
                    for name, (_, _, gated) in shapes.items()
                ],
            )
            results[system] = {n: timed(s, args.iters, device) / layers for n, s in steps.items()}
            if args.profile is not None and device.type == "cuda":
                profiled(steps["layer"], args.profile / f"rows{m}" / f"{system}.txt")
        print(f"\nbatch {m}: µs a layer (the weights' read rate), and cublas's time ÷ this")
        print(f"{'':10}" + "".join(f"{n:>28}" for n in steps))
        for system in SYSTEMS:
            cells = []
            for n in steps:
                s = results[system][n]
                rate = gb[n] / layers / s
                ratio = results["cublas"][n] / s
                cells.append(f"{s * 1e6:8.1f} ({rate:6.0f} GB/s) {ratio:4.2f}×")
            print(f"{system:10}" + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
