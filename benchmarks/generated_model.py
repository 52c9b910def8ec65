"""The model a benchmark runs on: a local checkpoint, or one generated with random weights.

Shared by the benchmarks that take `--model` or the size of a model to generate, so each
script only declares its own workload flags.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from throughput import DTYPES

from services.engine.model.tiny import make_tiny_checkpoint


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """`--model` or a generated model's shape, plus `--device`, `--dtype`, `--seed`, `--threads`."""
    p.add_argument("--model", type=Path, help="a local HF checkpoint dir (default: generate one)")
    g = p.add_argument_group("generated model (without --model)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--intermediate", type=int, help="default: make_tiny_checkpoint's")
    g.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, else fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; use 1 on a busy machine)"
    )


def resolve_device(args: argparse.Namespace) -> None:
    """Apply `--threads` and fill in the default device and dtype."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")


def checkpoint_dir(args: argparse.Namespace, tmp: Path, max_position_embeddings: int) -> Path:
    """`--model`, or a random checkpoint of the asked shape written under `tmp`."""
    if args.model is not None:
        return args.model
    t = time.perf_counter()
    path = make_tiny_checkpoint(
        tmp / "model",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position_embeddings=max_position_embeddings,
        dtype=args.dtype,
        seed=args.seed,
    )
    print(f"built a random checkpoint in {time.perf_counter() - t:.1f}s")
    return path
