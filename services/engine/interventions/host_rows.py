"""Pinned host rows for capture blocks, reserved once, and the drain that frees them.

A decode step that captures copies its block of rows to pinned host memory on a copy stream
of its own. Page-locking a fresh block for each step costs milliseconds per megabyte-scale
block (38-40 ms of host time for the 96 MB block of 128 Llama-3-8B tokens), so `PinnedRows`
page-locks an arena of rows at start and hands out contiguous runs of them (first fit over a
sorted free list, neighbours merged on release). A run goes back when its `Lease` is
garbage-collected.

`CaptureDrain` is what lets go of it: a thread that waits for each block's copy to land,
moves the rows into pageable memory in the dtype the step's requests asked for, and drops
the lease, so pinned rows are held for the copy alone (about a step), not until the
requests are delivered, and the arena is a ring reused step after step. When it is full
(the drain behind), `take` waits for rows to come back: back-pressure on the engine, which
is cheaper than page-locking a block. Only a block larger than the whole arena is pinned on
its own, and counted.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
import weakref
from typing import Any

import torch

from services.engine.host_memory import host_empty

log = logging.getLogger(__name__)


class Lease:
    """Holds a run of a `PinnedRows` arena: the run goes back when this is collected."""

    __slots__ = ("__weakref__",)


class PinnedRows:
    """An arena of `num_rows` host rows of shape `row_shape` (pinned with `pin`), handed out
    in runs. Runs come back from whichever thread drops their owner, so a lock guards the
    free list."""

    def __init__(
        self, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = True
    ):
        self.num_rows = num_rows
        self.row_shape = row_shape
        self.dtype = dtype
        self.pin = pin
        self._arena = torch.empty((num_rows, *row_shape), dtype=dtype, pin_memory=pin)
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # notified as runs come back
        # Free runs as parallel sorted lists: starts and their lengths.
        self._starts: list[int] = [0] if num_rows else []
        self._lengths: list[int] = [num_rows] if num_rows else []
        self.num_misses = 0  # blocks that did not fit and were page-locked on their own
        self.num_waits = 0  # takes that waited for rows to come back (back-pressure)
        self.wait_s = 0.0  # the time they waited, all told

    @property
    def flat(self) -> torch.Tensor:
        """The whole arena, one dimension (where `kernels.capture.scatter_rows` writes)."""
        return self._arena.view(-1)

    @property
    def num_free(self) -> int:
        with self._lock:
            return sum(self._lengths)

    def take(self, n: int, wait_s: float = 0.0) -> tuple[torch.Tensor, Lease | None]:
        """A pinned `[n, *row_shape]` host tensor and its lease: a run of the arena, given
        back when the lease is garbage-collected (so whoever reads the rows holds the
        lease, and keeps no view of them past it). If no free run holds `n` rows, waits up
        to `wait_s` for leased rows to come back; after that (or at once, if `n` exceeds
        the arena) a fresh pinned block and no lease."""
        with self._lock:
            start = self._take(n)
            if start is None and n <= self.num_rows and wait_s > 0:
                self.num_waits += 1
                began = time.monotonic()
                deadline = began + wait_s
                while start is None and (left := deadline - time.monotonic()) > 0:
                    self._returned.wait(left)
                    start = self._take(n)
                self.wait_s += time.monotonic() - began
        if start is not None:
            return self._leased(start, n)
        if self.num_misses == 0:
            log.warning(
                "capture: %d host rows do not fit in the pinned reserve (%d of %d free); "
                "page-locking a block per step costs milliseconds each: raise "
                "EngineConfig.capture_host_rows",
                n,
                self.num_free,
                self.num_rows,
            )
        self.num_misses += 1
        return torch.empty((n, *self.row_shape), dtype=self.dtype, pin_memory=self.pin), None

    def try_take(self, n: int) -> tuple[torch.Tensor, Lease] | None:
        """A free run of `n` rows and its lease, or None (no waiting, no block of its own)."""
        with self._lock:
            start = self._take(n)
        return None if start is None else self._leased(start, n)

    def _leased(self, start: int, n: int) -> tuple[torch.Tensor, Lease]:
        """Rows `[start, start + n)`, taken, and the lease that gives them back."""
        lease = Lease()
        weakref.finalize(lease, self._give_back, start, n)
        return self._arena[start : start + n], lease

    def _take(self, n: int) -> int | None:
        """The start of the first free run of at least `n` rows, now taken, or None."""
        for i, length in enumerate(self._lengths):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                return start
        return None

    def _give_back(self, start: int, n: int) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._lengths.insert(i, n)
            # Merge with the run after, then with the run before.
            if i + 1 < len(self._starts) and start + self._lengths[i] == self._starts[i + 1]:
                self._lengths[i] += self._lengths.pop(i + 1)
                del self._starts[i + 1]
            if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
                self._lengths[i - 1] += self._lengths.pop(i)
                del self._starts[i]
            self._returned.notify_all()


class CaptureDrain:
    """A thread that takes landed capture blocks out of pinned memory.

    `submit(block, dtype)` queues a `CapturedBlock` whose copy into pinned rows is under way;
    the thread waits for the copy's event, copies the rows into pageable memory in `dtype`
    (one conversion of the whole block, which ATen spreads over its threads; the engine's
    thread only queues), swaps them in, drops the pinned lease, and marks the block
    drained. A block's reader waits for that (`CapturedBlock.rows`).

    It keeps time (seconds, all blocks told): `copy_wait_s` waiting for copies to land,
    `move_s` taking blocks out (the pageable memory's page faults and the conversion), and
    `lag_s` from each block's submission to its rows going back to the arena, which bounds
    how far behind the steps it runs (the arena holds a few steps' blocks)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, torch.dtype, float] | None] = queue.SimpleQueue()
        self.num_blocks = 0
        self.copy_wait_s = self.move_s = self.lag_s = 0.0
        self._thread = threading.Thread(target=self._run, name="capture-drain", daemon=True)
        self._thread.start()

    def submit(self, block: Any, dtype: torch.dtype) -> None:
        block.drained = threading.Event()
        self._queue.put((block, dtype, time.monotonic()))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            block, dtype, submitted = item
            try:
                began = time.monotonic()
                if block.done is not None:
                    block.done.synchronize()  # releases the GIL while it waits
                landed = time.monotonic()
                # pageable, on huge pages: 4 KiB page faults would cost ten times the copy
                host = host_empty(block.host.shape, dtype)
                host.copy_(block.host)
                block.host = host
                block.lease = None  # the pinned rows go back to the arena now
                done = time.monotonic()
                self.copy_wait_s += landed - began
                self.move_s += done - landed
                self.lag_s += done - submitted
                self.num_blocks += 1
            except Exception as exc:  # the block's reader raises it, the engine runs on
                log.exception("capture drain failed")
                block.error = exc
            finally:
                block.drained.set()

    def stop(self) -> None:
        """End the thread once the blocks queued before are drained."""
        self._queue.put(None)


class CaptureArena:
    """Host chunks that requests' per-token capture buffers are carved from, so the device
    writes each decode block's rows straight into them (`kernels.capture.scatter_rows`): on
    CUDA each chunk is page-locked (the device addresses it directly), `CHUNK_BYTES` at a
    time as requests need them, up to `max_bytes` in all. A buffer is a run of a chunk's
    rows (`PinnedRows`), which goes back when its lease is collected; one larger than a
    chunk, or one that finds no room under the cap, is not had here (`take` says None).

    Page-locking a chunk takes about 0.2 s (256 MiB), and holds up the engine's CUDA calls
    while it runs, on whichever thread it runs (tried: a thread page-locking the next chunk
    ahead of need left `profile_decode.py --capture` at 12.6 ms a step at batch 128 on an
    H200 host, its launches waiting on the page-locking): chunks are taken when requests
    first need them and kept, so an engine serving a steady load page-locks none after its
    first steps (`num_chunks` says how many)."""

    CHUNK_BYTES = 256 << 20

    def __init__(self, hidden: int, max_bytes: int, pin: bool):
        self.hidden, self.max_bytes, self.pin = hidden, max_bytes, pin
        self.chunks: dict[torch.dtype, list[PinnedRows]] = {}
        self.num_bytes = 0  # held by chunks, all dtypes
        self.num_refused = 0  # buffers not had: too large, or no room under the cap

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.chunks.values())

    def rows_per_chunk(self, dtype: torch.dtype) -> int:
        """Rows of `hidden` in `dtype` a chunk holds: the most one `take` can have."""
        return self.CHUNK_BYTES // (self.hidden * dtype.itemsize)

    def take(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, Lease] | None:
        """`rows` rows of `hidden` in `dtype`: a run of a chunk and the run's lease."""
        per_chunk = self.rows_per_chunk(dtype)
        if rows <= per_chunk:
            chunks = self.chunks.setdefault(dtype, [])
            for chunk in reversed(chunks):  # the newest has room most often
                if (got := chunk.try_take(rows)) is not None:
                    return got
            if self.num_bytes + self.CHUNK_BYTES <= self.max_bytes:
                chunk = PinnedRows(per_chunk, (self.hidden,), dtype, self.pin)
                chunks.append(chunk)
                self.num_bytes += self.CHUNK_BYTES
                got = chunk.try_take(rows)
                assert got is not None
                return got
        self.num_refused += 1
        return None
