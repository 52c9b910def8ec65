"""The one-row Linear (`services/engine/kernels/gemv.py`) against cuBLAS at the decode shapes.

For each shape (a Linear of the Qwen3-0.6B and Llama-3-8B shapes, one GPU and one of two
TP ranks) it times `torch.mm` (cuBLAS, as `F.linear` runs a one-row input) and the GEMV
kernel at every tile of a small sweep, each as 40 launches in one CUDA graph over enough
copies of the weight (400 MB) that every launch streams from HBM. Prints µs a launch, the
weight bytes read a second, the best tile, and the tile the engine picks (`gemv_triton`).

    PYTHONPATH=. python3 benchmarks/gemv_sweep.py          # one CUDA GPU

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from services.engine.kernels import gemv
from services.engine.kernels.gemv import BLOCK_N, block_k, gemv_reference
from services.engine.kernels.timing import timed

SHAPES = {  # name: (N, K) of W
    "llama3-8b tp2 qkv": (3072, 4096),
    "llama3-8b tp2 o": (4096, 2048),
    "llama3-8b tp2 gate_up": (14336, 4096),
    "llama3-8b tp2 down": (4096, 7168),
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o": (4096, 4096),
    "llama3-8b down": (4096, 14336),
    "qwen3-0.6b qkv": (4096, 1024),
    "qwen3-0.6b o": (1024, 2048),
    "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
}
TILES = list(itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3)))  # n, k, warps, stages


def launch(x, w, y, bn: int, bk: int, warps: int, stages: int) -> None:
    gemv.launch(x, w, y, block_n=bn, tile_k=bk, num_warps=warps, num_stages=stages)


def per_launch_us(fn, weights: list[torch.Tensor], reps: int = 40) -> float:
    """µs a launch of `fn`: `reps` launches over the weights in turn, one CUDA graph replayed
    (`kernels/timing.py`)."""

    def step() -> None:
        for i in range(reps):
            fn(weights[i % len(weights)])

    return timed(step, 5, torch.device("cuda")) / reps * 1e6


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, bf16; µs a launch (GB/s of weights read)")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(max(4, (400 << 20) // nbytes))
        ]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        want = gemv_reference(x, weights[0]).float()
        cublas = per_launch_us(lambda w, x=x, y=y: torch.mm(x, w.t(), out=y), weights)
        times = {}
        for tile in TILES:
            launch(x, weights[0], y, *tile)
            err = (y.float() - want).abs().max().item()
            assert err <= 0.05 * want.abs().max().item(), (name, tile, err)
            times[tile] = per_launch_us(lambda w, t=tile, x=x, y=y: launch(x, w, y, *t), weights)
        best = min(times, key=times.get)
        picked = (BLOCK_N, block_k(n), 8, 3)  # what gemv_triton launches
        print(
            f"{name:22} {nbytes / 1e6:6.1f} MB  cuBLAS {cublas:6.2f} ({nbytes / cublas / 1e3:5.0f})"
            f"  best {times[best]:6.2f} ({nbytes / times[best] / 1e3:5.0f}) {best}"
            f"  picked {times[picked]:6.2f} ({nbytes / times[picked] / 1e3:5.0f})"
            f"  {cublas / times[picked]:.2f}x cuBLAS"
        )
        del weights


if __name__ == "__main__":
    main()
