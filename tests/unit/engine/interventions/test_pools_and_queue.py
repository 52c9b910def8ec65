"""Row pools (shared rows for identical configs) and the bounded action queue."""

from __future__ import annotations

import torch

from services.engine.interventions.actions import ActionQueue, SteeringScaleUpdate
from services.engine.interventions.resolve import row_content
from services.engine.interventions.tables import RowPool, SteeringTables


def test_identical_contents_share_a_row_until_the_last_release():
    pool = RowPool(start=3, size=2, share=True)
    r = pool.acquire(b"x")
    assert pool.lookup(b"x") == r == 3
    pool.ref(r)
    assert not pool.release(r)  # one holder left
    assert pool.release(r)  # freed: its content must be cleared
    assert pool.lookup(b"x") is None and pool.used == 0


def test_a_full_pool_hands_out_nothing():
    pool = RowPool(start=3, size=1, share=False)
    assert pool.acquire(b"") == 3
    assert pool.acquire(b"") is None


def test_tables_track_which_sites_need_the_kernel():
    t = SteeringTables(2, 4, torch.device("cpu"), torch.float32, per_request_rows=2, dynamic_rows=1)
    content = row_content({(1, "post_attn"): torch.ones(4)}, {})
    t.write_row(3, content)
    assert t.active_sites() == {(1, "post_attn")}
    assert torch.equal(t.site_args(1, "post_attn")["vec"][3], torch.ones(4))
    t.clear_row(3, content)
    assert t.active_sites() == set()
    assert not t.vec["post_attn"].any()


def test_the_queue_drops_the_newest_and_counts_by_source():
    q = ActionQueue(capacity=1)
    a = SteeringScaleUpdate(1.0, tier="dynamic")
    assert q.put(a, "x") and not q.put(a, "y")
    assert q.dropped == {"y": 1} and q.enqueued == {"x": 1}
    assert q.drain() == [("x", a)] and len(q) == 0
