"""Row pools (shared rows for identical configs) and the bounded action queue."""

from __future__ import annotations

import pytest
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
    t.flush()  # what the next step's plan does first
    assert torch.equal(t.site_args(1, "post_attn")["vec"][3], torch.ones(4))
    t.clear_row(3, content)
    assert t.active_sites() == set()
    t.flush()
    assert not t.vec["post_attn"].any()


def test_the_queue_drops_the_newest_and_counts_by_source():
    q = ActionQueue(capacity=1)
    a = SteeringScaleUpdate(1.0, tier="dynamic")
    assert q.put(a, "x") and not q.put(a, "y")
    assert q.dropped == {"y": 1} and q.enqueued == {"x": 1}
    assert q.drain() == [("x", a)] and len(q) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_between_steps_reach_the_tables_together_at_the_flush(dtype):
    """`write_row` queues; `flush` writes every queued row at once: each row's vectors at
    every layer of each of its sites (zero where it has none), its gates' probe, vector and
    parameters; a row cleared before the flush never reaches the tables, one cleared after
    it is zero again. Float32 vectors go into bf16 tables too (the model's dtype; the
    values here are exact in both)."""
    from services.engine.interventions.resolve import GateRow

    L, H = 4, 4
    t = SteeringTables(L, H, torch.device("cpu"), dtype, per_request_rows=4, dynamic_rows=0)
    shared = torch.arange(H, dtype=torch.float32)
    gate = GateRow(torch.ones(H), -torch.ones(H), 0.5, 3.0, 2.0, True, False, 4)
    a = row_content({(0, "post_block"): shared, (2, "post_block"): shared,
                     (3, "post_block"): shared, (1, "pre_attn"): shared + 10}, {})  # fmt: skip
    b = row_content({(1, "post_block"): -shared}, {(2, "post_attn"): gate})
    gone = row_content({(0, "post_block"): shared * 7}, {})
    for row, content in ((3, a), (4, b), (5, gone)):
        t.write_row(row, content)
    assert not t.vec["post_block"].any()  # queued, not yet written
    t.clear_row(5, gone)
    t.flush()
    want = torch.zeros(L, t.num_rows, H, dtype=dtype)
    want[0, 3] = want[2, 3] = want[3, 3] = shared  # one vector, two runs of layers
    want[1, 4] = -shared
    torch.testing.assert_close(t.vec["post_block"], want, rtol=0, atol=0)
    assert torch.equal(t.vec["pre_attn"][1, 3], (shared + 10).to(dtype))
    assert t.vec["pre_attn"].count_nonzero() == H  # that row alone
    assert torch.equal(t.gate_probe["post_attn"][2, 4], torch.ones(H, dtype=dtype))
    assert torch.equal(t.gate_vec["post_attn"][2, 4], -torch.ones(H, dtype=dtype))
    params = t.gate_params["post_attn"][2, 4].tolist()
    assert params == [1.0, 0.5, 3.0, 2.0, 1.0, 4.0, 0.0]
    assert not t.gate_params["post_attn"][:2].any() and t.site_use[(2, "post_attn")] == 1
    t.clear_row(3, a)
    assert t.vec["post_block"][:, 3].any()  # zeroed at the next flush, with the others
    t.flush()
    assert not t.vec["post_block"][:, 3].any() and not t.vec["pre_attn"].any()


def test_a_row_cleared_and_written_again_before_a_flush_holds_the_new_content_alone():
    """Between two steps a finished request's row may go back to the pool and be handed to
    the next request: the flush zeroes what the old content had, then writes the new (and
    the scales set since, the last one for each row)."""
    L, H = 3, 4
    t = SteeringTables(L, H, torch.device("cpu"), torch.float32, per_request_rows=2, dynamic_rows=0)
    old = row_content({(0, "post_block"): torch.ones(H), (2, "pre_attn"): torch.ones(H)}, {})
    new = row_content({(1, "post_block"): torch.full((H,), 2.0)}, {})
    t.write_row(3, old)
    t.flush()
    t.set_row_scale(3, 0.5)
    t.set_row_scale(4, 3.0)
    t.flush()
    assert t.row_scale[3:5].tolist() == [0.5, 3.0] and t.scale_of(3) == 0.5
    t.clear_row(3, old)
    t.write_row(3, new)
    t.set_row_scale(4, 0.25)
    assert t.scale_of(3) == 1.0 and t.row_scale[3] == 0.5  # the device is told at the flush
    t.flush()
    want = torch.zeros(L, t.num_rows, H)
    want[1, 3] = 2.0
    assert torch.equal(t.vec["post_block"], want) and not t.vec["pre_attn"].any()
    assert t.row_scale[3:5].tolist() == [1.0, 0.25]
    assert t.active_sites() == {(1, "post_block")}
