"""Counters with which the programs of one launch find the last of them to finish.

A kernel split over K (or over a context's keys) needs its partial results summed. Rather
than a second launch for the sum, each program stores its partial, draws a ticket (an
atomic add on its output tile's counter, acquire-release at GPU scope, after a barrier so
every thread's stores come before it), and the program that draws the last ticket sums
the partials, in a fixed order (so the result does not depend on which program was last),
writes the output and zeroes the counter for the next launch. This is the split-K "last
block reduces" pattern (CUTLASS's semaphore has the same shape). Used by the one-kernel
decode attention (`decode_attention.py`) and the split-K skinny GEMM (`skinny_gemm.py`).
"""

from __future__ import annotations

import torch


class Tickets:
    """One int32 counter per output tile, zero between launches (the program that draws
    a tile's last ticket zeroes it). One set per engine, whose launches run one after
    another on its stream; two engines must not share one (concurrent launches would
    draw each other's tickets).

    The buffer exists before any graph captures it (each capture's warm-up run comes first,
    the largest bucket first, so later buckets find it big enough), and it may not grow
    inside a capture. Should an eager step ever need more, the new buffer is added and the
    old one kept: a graph holds the old one's address, and its launches must keep finding
    live, zeroed counters there."""

    def __init__(self) -> None:
        self._tickets: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []  # earlier buffers, which graphs may read

    def get(self, count: int, device: torch.device) -> torch.Tensor:
        """At least `count` zeroed counters on `device` (`cuda` is the current CUDA device)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._tickets
        if t is None or t.numel() < count or t.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"kernel tickets would grow to {count} inside a CUDA graph capture: "
                    "run the step eagerly first"
                )
            if t is not None:
                self._retired.append(t)
            t = self._tickets = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        return t
