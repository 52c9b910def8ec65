"""What the collectives of one tensor-parallel decode step cost, on this host's GPUs.

A TP decode step of an L-layer model all-reduces its `[batch, hidden]` residual twice a
layer (after attention and after the MLP), once more for the embedding, and all-gathers the
logits; between steps the ranks exchange two small host tensors over gloo (the top-of-step
broadcast and the end-of-step digest and tokens). This prints, per batch size, the time of
`2L + 1` all-reduces replayed in one CUDA graph through NCCL and, where this PyTorch has
symmetric memory, through the one-shot all-reduce a replica uses, beside the gloo round trip:

    PYTHONPATH=. python3 benchmarks/tp_collectives.py --world 2 --hidden 4096 --layers 32

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.net import free_port
from services.engine.parallel import SymmetricAllReduce


def _timed_graph(fn, reps: int) -> float:
    """ms per replay of a graph of `fn`, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / reps


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    gloo = dist.new_group(backend="gloo")
    n = 2 * args.layers + 1
    rows = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        x = torch.randn(batch, args.hidden, dtype=torch.bfloat16, device="cuda")

        def nccl(x=x):
            for _ in range(n):
                dist.all_reduce(x)

        row = {"nccl": _timed_graph(nccl, args.reps)}
        try:  # what a replica runs (services/engine/parallel.py)
            fast = SymmetricAllReduce(dist.group.WORLD, x.device, x.numel() * x.element_size())

            def one_shot(x=x, fast=fast):
                y = x
                for _ in range(n):
                    y = fast(y)

            row["symm_mem one-shot"] = _timed_graph(one_shot, args.reps)
        except Exception as exc:  # not every build or GPU has it
            row["symm_mem one-shot"] = f"unavailable: {type(exc).__name__}: {exc}"[:80]
        rows[batch] = row
    small = torch.zeros(64, dtype=torch.long)
    parts = [torch.empty_like(small) for _ in range(world)]
    t = time.perf_counter()
    for _ in range(args.reps):
        dist.broadcast(small[:1], src=0, group=gloo)
        dist.all_gather(parts, small, group=gloo)
    gloo_ms = 1e3 * (time.perf_counter() - t) / args.reps
    if rank == 0:
        out.put((rows, gloo_ms))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, args, out)) for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    rows, gloo_ms = out.get(timeout=600)
    for proc in procs:
        proc.join()
    n = 2 * args.layers + 1
    print(f"{n} all-reduces of [batch, {args.hidden}] bf16 in one CUDA graph, {args.world} GPUs")
    for batch, row in rows.items():
        cells = ", ".join(
            f"{k} {v:.3f} ms ({1e3 * v / n:.1f} us each)" if isinstance(v, float) else f"{k} {v}"
            for k, v in row.items()
        )
        print(f"batch {batch:>4}: {cells}")
    print(f"gloo: one step's broadcast + all-gather of small host tensors {gloo_ms:.3f} ms")


if __name__ == "__main__":
    main()
