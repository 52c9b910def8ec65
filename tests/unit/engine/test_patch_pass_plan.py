"""Splitting a sweep's cells into layered patching passes (pure planning, no model)."""

from __future__ import annotations

import random

from services.engine.model.patch_pass import (
    PAD_ROWS_PER_TOKEN,
    PassCell,
    PassJob,
    join_point,
    plan_passes,
)

T, T_CLEAN = 12, 14


def _cells(seed: int, n: int) -> list[PassCell]:
    rng = random.Random(seed)
    sites = ["pre_attn", "post_attn", "post_block"]
    return [PassCell(rng.randrange(4), rng.choice(sites), rng.randrange(T), 0) for _ in range(n)]


def test_join_points_follow_the_forward():
    order = [join_point(L, s) for L in range(3) for s in ("pre_attn", "post_attn", "post_block")]
    assert order == sorted(order) and len(set(order)) == len(order)


def test_every_cell_runs_once_in_join_order_within_the_budget():
    cells = _cells(0, 200)
    budget = 120
    passes = plan_passes(cells, T, T_CLEAN, budget)
    assert sorted(i for p in passes for i in p) == list(range(len(cells)))
    flat = [cells[i].join for p in passes for i in p]
    assert flat == sorted(flat)  # early joiners first: later passes skip more layers
    for k, chunk in enumerate(passes):
        job = PassJob([0] * T, [cells[i] for i in chunk], [1], clean_ids=[0] * T_CLEAN)
        job.with_control = k == 0
        assert job.num_tokens <= budget
        members = len(chunk) + (3 if k == 0 else 2)
        assert members * T_CLEAN <= PAD_ROWS_PER_TOKEN * budget
    assert len(passes) > 1


def test_a_budget_below_one_cell_still_runs_each_cell_in_its_own_pass():
    cells = [PassCell(0, "post_block", 0, 0) for _ in range(5)]  # whole-prompt cells
    passes = plan_passes(cells, T, 0, T + T // 2)
    assert passes == [[0], [1], [2], [3], [4]]


def test_padded_attention_bounds_a_pass_of_short_cells():
    cells = [PassCell(0, "post_block", T - 1, 0) for _ in range(100)]  # one row each
    passes = plan_passes(cells, T, T, 10 * T)
    for k, chunk in enumerate(passes):
        members = len(chunk) + (3 if k == 0 else 2)  # + corrupt, clean (and the control)
        assert members * T <= PAD_ROWS_PER_TOKEN * 10 * T
    assert sum(len(p) for p in passes) == 100 and len(passes) == 6
