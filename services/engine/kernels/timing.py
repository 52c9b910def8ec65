"""Seconds a call of a GPU step takes, as the engine's CUDA graphs run it.

A decode step's kernels are launched from a CUDA graph, so a kernel that is timed by eager
launches pays the host's launch cost and loses to one it would beat inside the graph.
`timed` captures the step once and times its replays with events: what `EngineConfig.gemv`
picks its kernel by at load, and what the kernel benchmarks report.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(step: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per call of `step`: one CUDA graph of it replayed `iters` times (CUDA), or
    eager calls (CPU)."""
    step()  # compile and allocate outside any capture
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - t) / iters
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / iters
