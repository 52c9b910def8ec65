"""The pinned host rows capture blocks copy into: runs handed out, given back when their
lease is collected, merged, waited for when the arena is full, a miss when a block is larger
than the arena, and the drain that moves landed rows out (pin=False: no CUDA here)."""

from __future__ import annotations

import gc
import threading

import torch

from services.engine.interventions.host_rows import CaptureDrain, PinnedRows
from services.engine.interventions.planner import CapturedBlock


def _rows(n: int = 10) -> PinnedRows:
    return PinnedRows(n, (3, 4), torch.float32, pin=False)


def test_runs_are_disjoint_views_of_the_arena_and_come_back_with_their_lease():
    pool = _rows()
    a, lease_a = pool.take(4)
    b, lease_b = pool.take(6)
    assert a.shape == (4, 3, 4) and b.shape == (6, 3, 4)
    a.fill_(1.0)
    b.fill_(2.0)
    assert (a == 1).all() and (b == 2).all()  # b's rows did not overlap a's
    assert pool.num_free == 0 and lease_a is not None and lease_b is not None
    del lease_a
    gc.collect()
    assert pool.num_free == 4
    c, lease_c = pool.take(4)  # a's rows again
    assert c.data_ptr() == a.data_ptr() and lease_c is not None
    assert pool.num_misses == 0


def test_freed_neighbours_merge_so_a_larger_run_fits_again():
    pool = _rows()
    taken = [pool.take(n) for n in (3, 3, 4)]
    leases = [lease for _, lease in taken]
    del taken
    leases.pop(1)  # the middle run first: two free runs of 3 that are not neighbours yet
    leases.pop(0)
    gc.collect()
    _, lease = pool.take(6)  # fits only if the first two runs merged
    assert lease is not None and pool.num_misses == 0
    assert pool.num_free == 0


def test_a_block_that_does_not_fit_is_fresh_memory_and_counted():
    pool = _rows(4)
    held, lease = pool.take(3)
    other, none = pool.take(2)
    assert none is None and pool.num_misses == 1
    assert other.shape == (2, 3, 4)
    other.fill_(5.0)
    held.fill_(7.0)
    assert (other == 5).all()  # not a view of the arena
    del lease
    gc.collect()
    assert pool.num_free == 4


def test_a_take_that_does_not_fit_waits_for_rows_to_come_back():
    """Back-pressure: with the arena full, a take waits for a lease dropped by another thread
    (the drain's) and gets the arena's rows, not a fresh block."""
    pool = _rows(4)
    held, lease = pool.take(4)
    ptr = held.data_ptr()
    del held
    holder = {"lease": lease}  # the drain's: it lets go from its own thread, a little later
    del lease
    threading.Timer(0.2, holder.clear).start()
    got, again = pool.take(3, wait_s=10.0)
    assert again is not None and got.data_ptr() == ptr
    assert pool.num_waits == 1 and pool.num_misses == 0
    assert pool.wait_s > 0  # the wait is counted


def test_a_take_larger_than_the_arena_does_not_wait():
    pool = _rows(4)
    got, lease = pool.take(5, wait_s=10.0)
    assert lease is None and got.shape[0] == 5
    assert pool.num_waits == 0 and pool.num_misses == 1


def test_the_drain_moves_a_block_to_pageable_rows_in_its_dtype_and_frees_the_run():
    pool = _rows(4)
    run, lease = pool.take(2)
    run.copy_(torch.arange(24, dtype=torch.float32).view(2, 3, 4) / 3)
    block = CapturedBlock(run, (0, 1, 2), None, lease)
    del run, lease
    drain = CaptureDrain()
    try:
        drain.submit(block, torch.bfloat16)
        rows = block.rows()  # waits for the drain
        assert rows.dtype == torch.bfloat16 and rows.data_ptr() != pool._arena.data_ptr()
        want = (torch.arange(24, dtype=torch.float32).view(2, 3, 4) / 3).bfloat16()
        assert torch.equal(rows, want)
        gc.collect()
        assert pool.num_free == 4 and block.lease is None  # the run is back in the arena
        assert drain.num_blocks == 1 and drain.move_s > 0 and drain.lag_s >= drain.move_s
    finally:
        drain.stop()
