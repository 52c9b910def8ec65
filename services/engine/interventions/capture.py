"""Where captured activations go: a sink per request.

The engine hands each sink the pristine rows it captured this step, in one of two shapes:
- `write`: rows of one `"<layer>.<site>"` key at some positions, from a step that copied
  them eagerly (a prompt's positions, or more capturing tokens than the capture buffer's
  rows);
- `write_block`: a decode step's capture block (`planner.CapturedBlock`: each capturing
  token's rows at the sites the step's requests asked for), once a step, with each
  capturing request's row in it.

The sink assembles them. `InlineCaptureSink` returns them with the request's final output;
with sink "patch_store" the engine writes that result as a run.

Per-token capture at every layer brings a request's rows home one block at a time: a
Llama-3-8B request of 48 tokens captures 25 MB in float32, and a batch of 128 finishes
about three such requests a step. Stacking a finished request's rows out of its blocks on
the engine's thread cost 12 ms a request on an H200 host (13% of plain decode at batch
128). So the rows go into the request's own host buffer as its blocks come back, on a
thread of the sink's own (`capture-assemble`: a block's rows are copied while the engine
runs the next steps), and a finished request's result is a view of that buffer.

That thread and the drain's cost the engine's thread a step's worth of GIL handoffs at
batch 128 (about 70% of plain decode on an H200 host). So where it can, the sink plans
where each block row goes before the step runs (`place`): a request's buffer is then a
region of a host chunk the device writes into directly (`host_rows.CaptureArena`, pinned
on CUDA), the block's rows go there by one kernel on the capture copy stream
(`kernels.capture.scatter_rows`), and no thread of ours touches them until the request is
delivered, when its rows are copied out of the chunk in one copy and its region goes back.
Buffers are segments, grown as a request's rows outgrow them. A request the arena has no
room for (or whose next segment it has none for, from that row on) takes the drain and the
assembler.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from services.engine.host_memory import host_empty, host_rows
from services.engine.interventions.host_rows import CaptureArena, Lease
from services.engine.interventions.sites import parse_site
from services.engine.kernels.capture import capture_slot, lowest


class BlockWrite(NamedTuple):
    """A capturing request's row of a decode step's capture block."""

    request_id: str
    position: int
    row: int  # its row of the block
    keys: list[str]  # what it captures, `"<layer>.<site>"`
    dtype: torch.dtype  # what it asked its rows in
    max_rows: int | None = None  # the most positions its blocks can bring (None: unknown)


class CaptureSink(Protocol):
    def write(self, request_id: str, key: str, positions: list[int], rows: torch.Tensor) -> None:
        """Store `rows` ([len(positions), H], CPU) captured at `key` for these positions."""

    def place(self, writes: list[BlockWrite], slots: tuple[int, ...]) -> BlockPlacement | None:
        """Before a step runs: where the device writes its block rows (`writes`, in block row
        order; `slots` the block's columns), or None where no row has a place."""

    def write_block(self, block: Any, writes: list[BlockWrite]) -> None:
        """Store each write's row of a `CapturedBlock` as its request's capture at its
        position, for each of its keys."""

    def result(
        self, request_id: str, dtype: torch.dtype = torch.float32
    ) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        """The request's captures so far: `{key: [num_positions, H]}` in `dtype`, in
        position order."""

    def ready(self, request_id: str) -> bool:
        """Whether `result` would return at once (the request's rows are all home). Asked of
        a finished request only: it may start bringing them together."""

    def drop(self, request_id: str) -> None:
        """Forget the request (finished and delivered, or aborted)."""


def _slot(key: str) -> int:
    """The capture-block slot of a `"<layer>.<site>"` key."""
    layer, site = key.split(".", 1)
    return capture_slot(int(layer), parse_site(site))


class BlockPlacement:
    """Where the device writes a step's capture block rows on the host, planned before the
    step (`InlineCaptureSink.place`): per dtype written, the arena's chunks of it and a table
    of `[R, 3]` int64 (each block row's address, or -1 where the row goes elsewhere; the
    elements between its request's keys; its column map) followed by the column maps
    `[M, C]` (each map's key of each block column, or -1), as `kernels.capture.scatter_rows`
    reads them. `complete`: every row has a place here, so the block needs no other way
    home. `landed` is the copy stream's event once the writes are queued (None on CPU, where
    they are done at once); `result()` and `done()` answer for them as a future's would."""

    def __init__(self, writes: list[tuple[list[torch.Tensor], np.ndarray]], complete: bool):
        self.writes = writes
        self.complete = complete
        self.queued = False  # set once the writes are queued (or done, on CPU)
        self.landed: Any = None  # torch.cuda.Event

    def result(self) -> None:
        """Wait for the writes; raise if they were never queued (the step did not run: its
        rows will not come, and a write queued before may still be on its way)."""
        if not self.queued:
            raise RuntimeError("the step that was to write them did not run")
        if self.landed is not None:
            self.landed.synchronize()

    def done(self) -> bool:
        return not self.queued or self.landed is None or self.landed.query()


class _Segment(NamedTuple):
    """Rows of a request the device writes: `rows` `[keys, capacity, H]`, a run of an arena
    chunk held by `lease`, holding the request's rows from `start` on, at `address` (the
    run's start in bytes, which `place` turns into `scatter_rows`' element address)."""

    start: int
    capacity: int
    rows: torch.Tensor
    lease: Lease
    address: int


class _BlockRows:
    """One request's rows from decode blocks: `[len(keys), capacity, H]` host rows in the
    request's dtype, a row a position in the order the positions came (a position computed
    again, after a preemption, writes its row again). The engine's thread assigns the rows
    (`row_of`); the assembler thread allocates, grows (doubling) and fills them; a reader
    waits for the last job that wrote here (`last`). Each key's rows are a prefix of its
    part of the buffer, so the result is a tensor of each key's rows alone (`host_rows`:
    contiguous, and pickling one sends its rows only) without a copy."""

    FIRST_ROWS = 64  # rows at first where a request's length is not known
    FIRST_BYTES = 1 << 30  # at most at first (a mapping's untouched pages cost nothing)
    # Buffers from this size get a mapping of their own, so a result is its buffer sliced:
    # a bfloat16 request of the Qwen3-0.6B shape (28 keys x 41 rows, 2.4 MB) was copied
    # out key by key under the 4 MB default, 1.7 ms on the engine's thread on an H200 host.
    # Not smaller: each kept result holds its mapping, and a process has a limit of them
    # (vm.max_map_count, 65,530 by default), which results kept by the thousand (a probe
    # dataset's last-prompt rows) would reach.
    SLICED_BYTES = 1 << 20

    def __init__(self, keys: list[str], dtype: torch.dtype, max_rows: int | None):
        self.keys, self.dtype, self.max_rows = keys, dtype, max_rows
        self.slots = tuple(_slot(k) for k in keys)
        self.row_of: dict[int, int] = {}  # position -> row (engine thread)
        self.num_rows = 0  # rows assigned so far (engine thread)
        self.buf: torch.Tensor | None = None  # assembler thread
        self.last: Future | None = None
        self.error: BaseException | None = None  # why a row of it was lost, if one was
        # Rows the device writes (`InlineCaptureSink.place`): regions of arena chunks, one
        # after another (`_Segment`s, each from its first row on, doubling), assigned as
        # steps are planned (`planned`: position -> row; a position joins `row_of` once its
        # step is accepted). Rows from `spilled_at` on, where the arena had no room, come
        # home with their blocks into `buf` (the assembler's). `placed` is the last
        # placement that wrote here.
        self.direct = False
        self.segments: list[_Segment] = []
        self.planned: dict[int, int] = {}
        self.spilled_at: int | None = None
        self.placed: BlockPlacement | None = None
        # its first rows copied out of its segments on the sink's thread (`ready`)
        self.gathered: tuple[int, Future] | None = None
        self.map_index, self.map_epoch = 0, -1  # its column map in the sink's `_maps`

    def segment(self, i: int) -> _Segment | None:
        """The segment holding row `i`, if one does."""
        for seg in reversed(self.segments):  # the last, but for positions computed again
            if seg.start <= i:
                return seg if i < seg.start + seg.capacity else None
        return None

    @property
    def num_placed_rows(self) -> int:
        """Rows the segments hold."""
        return self.segments[-1].start + self.segments[-1].capacity if self.segments else 0

    def reserve(self, i: int, hidden: int) -> None:
        """Allocate the buffer, or grow it, to hold row `i`."""
        have = 0 if self.buf is None else self.buf.shape[1]
        if i >= have:
            if have:
                rows = max(i + 1, 2 * have)
            else:  # the request's most rows, if known and not too many: it seldom grows
                row_bytes = len(self.keys) * hidden * self.dtype.itemsize
                rows = min(self.max_rows or self.FIRST_ROWS, self.FIRST_BYTES // row_bytes)
                rows = max(rows, i + 1)
            # On a mapping of its own from SLICED_BYTES: the result is then each key's rows
            # sliced off it (`host_rows`), not copied.
            grown = host_empty((len(self.keys), rows, hidden), self.dtype, self.SLICED_BYTES)
            if self.buf is not None:
                grown[:, :have].copy_(self.buf)
            self.buf = grown

    def wait(self) -> None:
        """Wait for the last job and the last placement that wrote here; raise if any row
        was lost."""
        if self.last is not None:
            self.last.result()
        if self.placed is not None:
            self.placed.result()
        if self.error is not None:
            raise RuntimeError(f"capture rows were lost: {self.error}") from self.error


class InlineCaptureSink:
    """Keeps captures in memory until the request's final output carries them."""

    def __init__(self, arena: CaptureArena | None = None) -> None:
        self.arena = arena  # where `place` carves buffers the device writes (None: nowhere)
        self.num_placed = 0  # block rows `place` gave a place in the arena
        self._maps: dict[tuple[int, ...], int] = {}  # a request's slot order -> its column map
        self._maps_table: tuple[tuple[int, ...], np.ndarray] | None = None
        self._maps_epoch = 0  # counts the times `_maps` started again
        # request -> key -> position -> [H] (float32), from eager copies
        self._rows: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        self._eager: dict[str, set[int]] = {}  # request -> positions in `_rows`
        self._blocks: dict[str, _BlockRows] = {}  # request -> its rows from decode blocks
        # the assembler: its thread starts with the first block
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="capture-assemble")

    def write(self, request_id: str, key: str, positions: list[int], rows: torch.Tensor) -> None:
        # A position written again (recomputed after a preemption) takes the new rows.
        by_pos = self._rows.setdefault(request_id, {}).setdefault(key, {})
        self._eager.setdefault(request_id, set()).update(positions)
        blocks = self._blocks.get(request_id)
        for p, row in zip(positions, rows, strict=True):
            by_pos[p] = row
            if blocks is not None:
                blocks.row_of.pop(p, None)

    def place(self, writes: list[BlockWrite], slots: tuple[int, ...]) -> BlockPlacement | None:
        """Plan where the device writes the block of the step about to run (`writes`: every
        row of it, in order): each capturing request's row for this position (a position
        computed again takes its row again) in its segments of the arena, a new segment
        where its rows outgrow them. A request the arena has no first segment for, and a
        request's rows past a segment it had no room for, come home with the block (the
        drain and the assembler). `write_block` then takes the step's accepted positions.
        (128 rows a step at batch 128: the loop is lean.)"""
        if self.arena is None or not writes:
            return None
        if len(self._maps) > 256:  # slot orders of requests long gone: start again, before
            self._maps.clear()  # this step's rows are given map indices
            self._maps_table = None
            self._maps_epoch += 1
        placement = BlockPlacement([], complete=True)
        blocks, maps, hidden, epoch = self._blocks, self._maps, self.arena.hidden, self._maps_epoch
        # per dtype: block rows, their addresses (elements), key strides and column maps
        by_dtype: dict[torch.dtype, tuple[list[int], list[int], list[int], list[int]]] = {}
        for row, (request_id, position, _, keys, dtype, max_rows) in enumerate(writes):
            rows = blocks.get(request_id)
            if rows is None:
                rows = blocks[request_id] = _BlockRows(keys, dtype, max_rows)
                rows.direct = self._grow(rows, 0) is not None
            if not rows.direct:  # its rows come home with the block
                placement.complete = False
                continue
            planned = rows.planned
            i = planned.get(position)
            if i is None:
                i = planned[position] = len(planned)
            seg = rows.segments[-1]  # the last, unless a position was computed again
            if not seg.start <= i < seg.start + seg.capacity:
                seg = rows.segment(i)
                if seg is None and rows.spilled_at is None:
                    seg = self._grow(rows, i)
                    if seg is None:
                        rows.spilled_at = i
                if seg is None:
                    placement.complete = False
                    continue
            if rows.map_epoch != epoch:  # its column map's index (kept: hashing its slots
                m = maps.get(rows.slots)  # a row a step is what it saves)
                if m is None:
                    m = maps[rows.slots] = len(maps)
                rows.map_index, rows.map_epoch = m, epoch
            lists = by_dtype.get(dtype)
            if lists is None:
                lists = by_dtype[dtype] = ([], [], [], [])
            lists[0].append(row)
            lists[1].append(seg.address // dtype.itemsize + (i - seg.start) * hidden)
            lists[2].append(seg.capacity * hidden)
            lists[3].append(rows.map_index)
            rows.placed = placement
        if not by_dtype:
            return None
        column_maps = self._column_maps(slots)
        for dtype, (placed_rows, addresses, strides, map_of) in by_dtype.items():
            self.num_placed += len(placed_rows)
            chunks = [c.flat for c in self.arena.chunks[dtype]]
            origin = lowest(chunks).data_ptr() // dtype.itemsize
            table = np.full((len(writes), 3), -1, np.int64)
            table[placed_rows, 0] = np.array(addresses, np.int64) - origin  # from the lowest
            table[placed_rows, 1] = strides
            table[placed_rows, 2] = map_of
            placement.writes.append((chunks, np.concatenate([table.ravel(), column_maps.ravel()])))
        return placement

    def _column_maps(self, slots: tuple[int, ...]) -> np.ndarray:
        """`[M, C]`: for each request slot order in `_maps`, its key of each of the block's
        columns `slots` (-1: not asked for). Kept while the block's columns and the orders
        stay (a server sees few)."""
        cached = self._maps_table
        if cached is not None and cached[0] == slots and len(cached[1]) == len(self._maps):
            return cached[1]
        table = np.full((len(self._maps), len(slots)), -1, np.int64)
        for request_slots, m in self._maps.items():
            key = {slot: k for k, slot in enumerate(request_slots)}
            table[m] = [key.get(slot, -1) for slot in slots]
        self._maps_table = (slots, table)
        return table

    # A request's first segment, unless its capture brings fewer: most generations fit it
    # whole, so their rows take one segment, and an engine that has served them a while
    # page-locks no more chunks (`CaptureArena`: page-locking a chunk mid-run stalls steps).
    FIRST_SEGMENT_ROWS = 256

    def _grow(self, rows: _BlockRows, i: int) -> _Segment | None:
        """A new segment of `rows` from its next row, holding row `i`: as many rows as it
        holds already (doubling; the first `FIRST_SEGMENT_ROWS`, or the positions its
        capture brings if fewer), not more than the rest of those positions or a chunk
        holds. None where the arena has no room."""
        assert self.arena is not None
        start, keys = rows.num_placed_rows, len(rows.keys)
        capacity = max(start, self.FIRST_SEGMENT_ROWS)
        if rows.max_rows is not None and rows.max_rows > start:
            capacity = min(capacity, rows.max_rows - start)
        per_chunk = self.arena.rows_per_chunk(rows.dtype)
        capacity = max(min(capacity, per_chunk // keys), i + 1 - start)
        got = self.arena.take(keys * capacity, rows.dtype)
        if got is None:
            return None
        run, lease = got
        view = run.view(keys, capacity, self.arena.hidden)
        seg = _Segment(start, capacity, view, lease, run.data_ptr())
        rows.segments.append(seg)
        return seg

    def write_block(self, block: Any, writes: list[BlockWrite]) -> None:
        jobs = []
        for request_id, position, row, keys, dtype, max_rows in writes:
            rows = self._blocks.get(request_id)
            if rows is None:
                rows = self._blocks[request_id] = _BlockRows(keys, dtype, max_rows)
            eager = self._eager.get(request_id)
            if eager and position in eager:  # recomputed: the block's rows replace the copies
                eager.discard(position)
                for by_pos in self._rows[request_id].values():
                    by_pos.pop(position, None)
            if rows.direct:  # the device wrote its row where `place` said, or it spilled
                i = rows.planned.get(position)
                if i is None:  # not placed before its step ran: never expected, so say so
                    rows.error = rows.error or RuntimeError(f"position {position} had no place")
                    continue
                rows.row_of[position] = i
                if rows.spilled_at is not None and i >= rows.spilled_at:
                    jobs.append((rows, i, row))
                continue
            i = rows.row_of.get(position)
            if i is None:
                i = rows.row_of[position] = rows.num_rows
                rows.num_rows += 1
            jobs.append((rows, i, row))
        if not jobs:
            return
        done = self._pool.submit(self._assemble, block, jobs)
        for rows, _, _ in jobs:
            rows.last = done

    @staticmethod
    def _assemble(block: Any, jobs: list[tuple[_BlockRows, int, int]]) -> None:
        """Copy each request's row of `block` into its buffer (the assembler thread), all
        in one call that holds the GIL only to start (`_foreach_copy_`): the engine's
        thread needs it too. A row that cannot be had or kept marks its request (its
        result raises), not the others."""
        try:
            host = block.rows()  # waits for the drain; raises if the rows were lost
        except Exception as exc:
            for rows, _, _ in jobs:
                rows.error = rows.error or exc
            return
        # Each buffer grown first, once: a prefill chunk brings a request several rows in
        # one block, and a view taken before a growth would write the old buffer.
        top: dict[_BlockRows, int] = {}
        for rows, i, _ in jobs:
            top[rows] = max(i, top.get(rows, i))
        for rows, i in top.items():
            try:
                rows.reserve(i, host.shape[-1])
            except Exception as exc:  # e.g. no memory for its buffer
                rows.error = rows.error or exc
        # Views by plain indexing, which keeps the GIL, where a method (`select`) would let
        # it go and take it back: 128 handoffs a step to the engine's thread, each a wait
        # for it. (A request asking other columns than the block's is gathered by a tensor
        # index, which still lets it go: one handoff for each such row.)
        by_row = host.unbind(0)
        dsts, srcs, kept = [], [], []
        for rows, i, row in jobs:
            buf = rows.buf
            if buf is None or i >= buf.shape[1]:
                continue  # its buffer could not be had (marked above)
            cols = block.columns(rows.slots)
            dsts.append(buf[:, i])
            srcs.append(by_row[row] if cols is None else by_row[row][cols])
            kept.append(rows)
        try:
            torch._foreach_copy_(dsts, srcs)
        except Exception as exc:
            for rows in kept:
                rows.error = rows.error or exc

    def result(
        self, request_id: str, dtype: torch.dtype = torch.float32
    ) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        rows = self._rows.get(request_id, {})
        blocks = self._blocks.get(request_id)
        if blocks is not None and not blocks.row_of:
            blocks = None  # every block position was written again eagerly
        keys = blocks.keys if blocks is not None else list(rows)
        eager_positions = (r.keys() for r in rows.values())
        positions = sorted(set(blocks.row_of if blocks else ()).union(*eager_positions))
        if not keys or not positions:
            return None
        if blocks is None:  # a prompt's captures: each key's rows stacked (a tensor of its own)
            return {k: torch.stack([rows[k][p] for p in positions]).to(dtype) for k in keys}, (
                positions
            )
        blocks.wait()
        order = [blocks.row_of.get(p, -1) for p in positions]
        buf = blocks.buf
        if blocks.direct:
            n_rows, gathered = blocks.gathered or (None, None)
            if gathered is None or n_rows != max(order) + 1:
                buf = self._gathered(blocks, max(order) + 1)
            else:
                try:
                    buf = gathered.result()
                except Exception as exc:  # e.g. no memory for it: this request alone fails
                    raise RuntimeError(f"capture rows were lost: {exc}") from exc
        if buf is None:  # no job reached it: say so in its output, fail nothing else
            raise RuntimeError("capture rows were lost: none of its blocks' rows arrived")
        n = len(positions)
        if order == list(range(n)):  # the common case: no copy (of a gathered buffer's)
            out = dict(zip(keys, host_rows(buf, n), strict=True))
        else:  # positions out of order, rows written again, or eager positions among them
            have = [j for j, r in enumerate(order) if r >= 0]
            index = torch.tensor([order[j] for j in have])
            out = {}
            for k_i, k in enumerate(keys):
                t = out[k] = host_empty((len(positions), buf.shape[-1]), blocks.dtype)
                t[have] = buf[k_i].index_select(0, index)
                for j, p in enumerate(positions):
                    if order[j] < 0:
                        t[j] = rows[k][p]
        if blocks.dtype != dtype:
            out = {k: t.to(dtype) for k, t in out.items()}
        return out, positions

    @staticmethod
    def _gathered(blocks: _BlockRows, n: int) -> torch.Tensor:
        """A request's first `n` rows out of its arena segments (and its spilled rows out of
        its assembled buffer) into one buffer of its own, `[keys, n, H]`: the one copy its
        rows take on the host, after which its segments can go back."""
        hidden = blocks.segments[0].rows.shape[-1]
        shape = (len(blocks.keys), n, hidden)
        out = host_empty(shape, blocks.dtype, _BlockRows.SLICED_BYTES)
        end = n if blocks.spilled_at is None else min(n, blocks.spilled_at)
        for seg in blocks.segments:
            if seg.start < end:
                m = min(seg.capacity, end - seg.start)
                out[:, seg.start : seg.start + m].copy_(seg.rows[:, :m])
        if end < n:
            assert blocks.buf is not None, "spilled rows are assembled"
            out[:, end:n].copy_(blocks.buf[:, end:n])
        return out

    def ready(self, request_id: str) -> bool:
        """Asked of a finished request: whether its rows are home. Once the device's writes
        have landed, a request in the arena has its rows copied out of its segments on the
        sink's thread (`_gathered`, megabytes a request: off the engine's thread), and is
        ready when that is done."""
        blocks = self._blocks.get(request_id)
        if blocks is None:
            return True
        landed = blocks.placed is None or blocks.placed.done()
        if not (landed and (blocks.last is None or blocks.last.done())):
            return False
        if not blocks.direct or not blocks.row_of:
            return True
        n = max(blocks.row_of.values()) + 1
        if blocks.gathered is None or blocks.gathered[0] != n:
            hidden = blocks.segments[0].rows.shape[-1]
            if len(blocks.keys) * n * hidden * blocks.dtype.itemsize < self.GATHER_ON_POOL:
                return True  # small: `result` copies it at once, this step
            blocks.gathered = (n, self._pool.submit(self._gathered, blocks, n))
        return blocks.gathered[1].done()

    # Rows of a finished request from this many bytes are copied out of the arena on the
    # sink's thread (delivered a step later); smaller ones by `result`, in the same step.
    GATHER_ON_POOL = 1 << 20

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        blocks = self._blocks.pop(request_id, None)
        if blocks is not None:  # a failed gather's traceback would hold its segments
            blocks.gathered = None
        self._eager.pop(request_id, None)
