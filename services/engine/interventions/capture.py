"""Where captured activations go: a sink per request.

The engine hands each sink the pristine rows it captured this step, keyed
`"<layer>.<site>"` with their positions; the sink assembles them. `InlineCaptureSink`
returns them with the request's final output; the patch-store sink (next) writes a run.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CaptureSink(Protocol):
    def write(self, request_id: str, key: str, positions: list[int], rows: torch.Tensor) -> None:
        """Store `rows` ([len(positions), H], CPU) captured at `key` for these positions."""

    def result(self, request_id: str) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        """The request's captures so far: `{key: [num_positions, H]}` in position order."""

    def drop(self, request_id: str) -> None:
        """Forget the request (finished and delivered, or aborted)."""


class InlineCaptureSink:
    """Keeps captures in memory until the request's final output carries them."""

    def __init__(self) -> None:
        # request -> key -> position -> [H]; a position recomputed after preemption overwrites.
        self._rows: dict[str, dict[str, dict[int, torch.Tensor]]] = {}

    def write(self, request_id: str, key: str, positions: list[int], rows: torch.Tensor) -> None:
        by_pos = self._rows.setdefault(request_id, {}).setdefault(key, {})
        for p, row in zip(positions, rows, strict=True):
            by_pos[p] = row

    def result(self, request_id: str) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        keys = self._rows.get(request_id)
        if not keys:
            return None
        positions = sorted(next(iter(keys.values())))
        return {k: torch.stack([v[p] for p in positions]) for k, v in keys.items()}, positions

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
