"""What it costs the host to take one decode step's capture block out of pinned memory.

Per-token capture brings each decode step's block (`tokens x layers x sites x hidden` in
the model's dtype) to pinned rows, and `CaptureDrain` copies it into pageable memory in the
dtype the requests asked for. That copy runs in memory that is fresh every step (the rows
stay with their requests until delivered). This times it three ways, on this host's CPU:
into fresh allocator memory (4 KiB page faults), into `host_memory.host_empty`'s
huge-page-advised mapping, and into memory already touched (the copy alone):

    PYTHONPATH=. python3 benchmarks/host_copy.py --tokens 32 --layers 80 --hidden 8192

Defaults: the Llama-3-70B shape at batch 32, post_block of every layer, bf16 -> float32.
Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.engine.host_memory import host_empty, transparent_huge_pages


def timed(fn, reps: int) -> float:
    """Best ms of `reps` calls, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--sites", type=int, default=1)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--to", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, help="ATen threads (default: ATen's own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = (args.tokens, args.layers * args.sites, args.hidden)
    src = torch.randn(shape).to(torch.bfloat16)
    dtype = getattr(torch, args.to)
    touched = torch.empty(shape, dtype=dtype)
    rows = {
        "fresh (allocator)": timed(lambda: torch.empty(shape, dtype=dtype).copy_(src), args.reps),
        "fresh (host_empty)": timed(lambda: host_empty(shape, dtype).copy_(src), args.reps),
        "touched (copy alone)": timed(lambda: touched.copy_(src), args.reps),
    }
    mb = src.numel() * dtype.itemsize / 1e6
    print(f"block {tuple(shape)} bf16 -> {args.to}: {mb:.1f} MB written, "
          f"{torch.get_num_threads()} ATen threads, transparent huge pages: "
          f"{transparent_huge_pages()}")  # fmt: skip
    for name, ms in rows.items():
        print(f"{name:<22} {ms:7.2f} ms  {mb / ms:6.1f} GB/s")
    fresh, advised = rows["fresh (allocator)"], rows["fresh (host_empty)"]
    print(f"host_empty ÷ allocator: {fresh / advised:.2f}× faster")


if __name__ == "__main__":
    main()
