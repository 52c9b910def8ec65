"""Pinned host rows for capture blocks, reserved once.

A decode step that captures copies its block of rows to pinned host memory, and the rows
stay there until every request holding some of them has been delivered. Page-locking a
fresh block for each step costs milliseconds per megabyte-scale block (38-40 ms of host
time for the 96 MB block of 128 Llama-3-8B tokens), so a long capture job would pay it on
every step until PyTorch's pinned cache held its working set.

`PinnedRows` page-locks an arena of rows at start and hands out contiguous runs of them
(first fit over a sorted free list, neighbours merged on release). A run goes back when its
`Lease`, held by the step's `CapturedBlock`, is garbage-collected: when the last sink
holding the block lets go. A step whose rows do not fit gets a fresh pinned block, as
before, and is counted.
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref

import torch

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
        # Free runs as parallel sorted lists: starts and their lengths.
        self._starts: list[int] = [0] if num_rows else []
        self._lengths: list[int] = [num_rows] if num_rows else []
        self.num_misses = 0  # blocks that did not fit and were page-locked on their own

    @property
    def num_free(self) -> int:
        with self._lock:
            return sum(self._lengths)

    def take(self, n: int) -> tuple[torch.Tensor, Lease | None]:
        """A pinned `[n, *row_shape]` host tensor and its lease: a run of the arena, given
        back when the lease is garbage-collected (so whoever reads the rows holds the
        lease, and keeps no view of them past it); or, if no free run holds `n` rows, a
        fresh pinned block and no lease."""
        with self._lock:
            start = self._take(n)
        if start is not None:
            lease = Lease()
            weakref.finalize(lease, self._give_back, start, n)
            return self._arena[start : start + n], lease
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
