"""The pinned host rows capture blocks copy into: runs handed out, given back when their
lease is collected, merged, and a miss when nothing fits (pin=False: no CUDA here)."""

from __future__ import annotations

import gc

import torch

from services.engine.interventions.host_rows import PinnedRows


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
