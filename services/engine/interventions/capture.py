"""Where captured activations go: a sink per request.

The engine hands each sink the pristine rows it captured this step, in one of two shapes:
- `write`: rows of one `"<layer>.<site>"` key at some positions, from a step that copied
  them eagerly (more capturing tokens than the capture buffer's rows);
- `write_block`: a step's capture block (`planner.CapturedBlock`: each capturing
  token's rows at the sites the step's requests asked for) and the request's row in it.
  The block is shared by the step's requests, so a step costs one call per request, not
  one per request and key, and the rows stay where the drain put them (pageable memory)
  until the result is built.

The sink assembles them. `InlineCaptureSink` returns them with the request's final output;
with sink "patch_store" the engine writes that result as a run.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from services.engine.host_memory import host_empty
from services.engine.interventions.sites import parse_site
from services.engine.kernels.capture import capture_slot


class CaptureSink(Protocol):
    def write(self, request_id: str, key: str, positions: list[int], rows: torch.Tensor) -> None:
        """Store `rows` ([len(positions), H], CPU) captured at `key` for these positions."""

    def write_block(
        self, request_id: str, position: int, block: Any, row: int, keys: list[str]
    ) -> None:
        """Store row `row` of a `CapturedBlock` as the request's capture at `position`, for
        each of `keys`."""

    def result(
        self, request_id: str, dtype: torch.dtype = torch.float32
    ) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        """The request's captures so far: `{key: [num_positions, H]}` in `dtype`, in
        position order."""

    def drop(self, request_id: str) -> None:
        """Forget the request (finished and delivered, or aborted)."""


def _slot(key: str) -> int:
    """The capture-block slot of a `"<layer>.<site>"` key."""
    layer, site = key.split(".", 1)
    return capture_slot(int(layer), parse_site(site))


class InlineCaptureSink:
    """Keeps captures in memory until the request's final output carries them."""

    def __init__(self) -> None:
        # request -> key -> position -> [H] (float32), from eager copies
        self._rows: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        # request -> position -> (block, row), and the keys its blocks hold rows for
        self._blocks: dict[str, dict[int, tuple[Any, int]]] = {}
        self._block_keys: dict[str, list[str]] = {}
        self._eager: dict[str, set[int]] = {}  # request -> positions in `_rows`

    def write(self, request_id: str, key: str, positions: list[int], rows: torch.Tensor) -> None:
        # A position written again (recomputed after a preemption) takes the new rows.
        by_pos = self._rows.setdefault(request_id, {}).setdefault(key, {})
        blocks = self._blocks.get(request_id, {})
        self._eager.setdefault(request_id, set()).update(positions)
        for p, row in zip(positions, rows, strict=True):
            by_pos[p] = row
            blocks.pop(p, None)

    def write_block(
        self, request_id: str, position: int, block: Any, row: int, keys: list[str]
    ) -> None:
        self._blocks.setdefault(request_id, {})[position] = (block, row)
        self._block_keys[request_id] = keys
        eager = self._eager.get(request_id)
        if eager and position in eager:  # recomputed: the block's rows replace the copies
            eager.discard(position)
            for by_pos in self._rows[request_id].values():
                by_pos.pop(position, None)

    def result(
        self, request_id: str, dtype: torch.dtype = torch.float32
    ) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        rows = self._rows.get(request_id, {})
        blocks = self._blocks.get(request_id, {})
        keys = list(rows) or self._block_keys.get(request_id, [])
        positions = sorted(set(blocks).union(*(by_pos.keys() for by_pos in rows.values())))
        if not keys or not positions:
            return None
        if not blocks and all(len(rows.get(k, ())) == len(positions) for k in keys):
            # Every key copied eagerly at every position (a prompt's captures): one stack.
            flat = torch.stack([rows[k][p] for k in keys for p in positions])
            stacked = flat.to(dtype).view(len(keys), len(positions), -1)
            return {k: stacked[j] for j, k in enumerate(keys)}, positions
        out = {}
        if blocks:  # each position's row of its block (a view), stacked once: [K, P, H]
            slots = tuple(_slot(k) for k in keys)
            parts: list[torch.Tensor] = []
            filler = None  # positions only eager copies hold (set from those below)
            for p in positions:
                hit = blocks.get(p)
                if hit is None:
                    if filler is None:  # in the drained rows' dtype, as the other parts
                        like = next(iter(blocks.values()))[0].rows()
                        filler = like.new_zeros(len(keys), like.shape[-1])
                    parts.append(filler)
                    continue
                block, row = hit
                cols = block.columns(slots)
                host = block.rows()[row]  # [block columns, H]
                parts.append(host if cols is None else host.index_select(0, cols))
            shape = (len(keys), len(positions), parts[0].shape[-1])
            gathered = host_empty(shape, dtype)
            if parts[0].dtype == dtype:
                torch.stack(parts, dim=1, out=gathered)
            else:  # stacked in the block's dtype, converted in one pass
                gathered.copy_(torch.stack(parts, dim=1))
            out = {k: gathered[j] for j, k in enumerate(keys)}
        for k in keys:
            by_pos = rows.get(k, {})
            if not by_pos:
                continue
            if k not in out:
                out[k] = torch.stack([by_pos[p] for p in positions]).to(dtype)
            else:
                for i, p in enumerate(positions):
                    if p in by_pos:
                        out[k][i] = by_pos[p].to(dtype)
        return out, positions

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._blocks.pop(request_id, None)
        self._block_keys.pop(request_id, None)
        self._eager.pop(request_id, None)
