"""The routing study's statistics: t-intervals, paired permutation tests and Holm's
correction, against hand-computed values (exact enumeration of the sign flips) and a coverage
check."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.errors import InvalidRequestError
from services.trainer.study_stats import (
    compare_arms,
    holm,
    mean_interval,
    paired_permutation_p,
    preregistered_outcome,
)


def test_the_interval_is_students_t_around_the_mean():
    got = mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # t(0.975, 3) · s / √n
    assert got.mean == 2.5 and got.n == 4
    assert got.low == pytest.approx(2.5 - half) and got.high == pytest.approx(2.5 + half)
    one = mean_interval([0.3])
    assert one.mean == 0.3 and math.isnan(one.low) and str(one) == "0.30"
    with pytest.raises(InvalidRequestError):
        mean_interval([])


def test_the_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        i = mean_interval(rng.normal(0.0, 1.0, 10).tolist())
        hits += i.low <= 0.0 <= i.high
    assert 0.93 <= hits / 2000 <= 0.97


def test_paired_p_values_by_exact_enumeration_of_sign_flips():
    # differences 1, 2, 3: of the 8 sign flips only +++ and --- reach |sum| 6
    assert paired_permutation_p([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == pytest.approx(2 / 8)
    # differences 0.4, -0.1, 0.5, 0.1 (sum 0.9): |sum| >= 0.9 when the flipped ones sum to
    # <= 0.1 or >= 1.0 in magnitude: {}, {0.1}, {0.1'} and their complements, 6 of 16
    a, b = [0.5, 0.2, 0.9, 0.1], [0.1, 0.3, 0.4, 0.0]
    assert paired_permutation_p(a, b) == pytest.approx(6 / 16)
    assert paired_permutation_p(b, a) == pytest.approx(6 / 16)  # two-sided
    assert paired_permutation_p([0.5] * 5, [0.5] * 5) == 1.0
    # five pairs all one way: 2 of 2^5 flips as extreme
    assert paired_permutation_p([1.0] * 5, [0.0] * 5) == pytest.approx(2 / 32)
    with pytest.raises(InvalidRequestError):
        paired_permutation_p([], [])
    with pytest.raises(InvalidRequestError):
        paired_permutation_p([1.0, 2.0], [1.0])


def test_pairing_takes_the_shared_spread_out():
    """Each pair shares a large offset (its base and seed); the arm adds a small constant.
    Unpaired, the offsets swamp the shift; paired, every difference is the same sign."""
    offsets = [0.0, 0.3, 0.6, 0.1, 0.8, 0.4, 0.2, 0.7]
    a = [o + 0.05 for o in offsets]
    assert paired_permutation_p(a, offsets) == pytest.approx(2 / 256)


def test_holm_steps_down_and_stays_monotone():
    got = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert got == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"x": 0.6, "y": 0.5}) == {"y": 1.0, "x": 1.0}
    assert holm({}) == {}


def _runs(*values: float) -> dict[tuple[int, int], float]:
    """One value per (base, seed): bases 0 and 1 alternate, seeds count up."""
    return {(i % 2, i // 2): v for i, v in enumerate(values)}


def test_arms_are_compared_with_vanilla_and_the_placebo_under_one_holm_family():
    by_arm = {
        "none": _runs(0.9, 0.8, 1.0, 0.9, 0.85),
        "route": _runs(0.0, 0.1, 0.0, 0.05, 0.0),
        "activation": _runs(0.9, 0.85, 0.95, 0.8, 0.9),
        "placebo": _runs(0.85, 0.9, 0.8, 0.95, 0.9),
    }
    got = {(c.arm, c.against): c for c in compare_arms(by_arm)}
    assert set(got) == {
        ("route", "none"), ("activation", "none"), ("placebo", "none"),
        ("route", "placebo"), ("activation", "placebo"),
    }  # fmt: skip
    route = got["route", "none"]
    assert route.difference == pytest.approx(0.03 - 0.89) and route.pairs == 5
    assert route.p == pytest.approx(2 / 32)  # every pair one way: 2 of the 2^5 sign flips
    raw = {f"{a}|{b}": c.p for (a, b), c in got.items()}
    assert {k: c.p_holm for k, c in zip(raw, got.values(), strict=True)} == holm(raw)
    assert got["activation", "none"].p > 0.3
    assert compare_arms({"route": _runs(0.1)}) == []  # nothing to compare against


def test_runs_pair_by_base_and_seed_and_unpaired_runs_are_left_out():
    by_arm = {
        "none": {(0, 0): 0.9, (0, 1): 0.7, (1, 0): 0.8, (1, 1): 0.6},
        "route": {(0, 1): 0.2, (1, 0): 0.5, (1, 1): 0.5, (2, 0): 0.0},  # (2, 0): no partner
    }
    (c,) = compare_arms(by_arm)
    assert (c.arm, c.against, c.pairs) == ("route", "none", 3)
    assert c.difference == pytest.approx(((0.2 - 0.7) + (0.5 - 0.8) + (0.5 - 0.6)) / 3)
    assert c.p == pytest.approx(2 / 8)
    lonely = {"none": {(0, 0): 0.9, (0, 1): 0.8}, "route": {(0, 1): 0.1, (1, 0): 0.2}}
    assert compare_arms(lonely) == []  # one shared run is no test


def test_each_arm_is_also_compared_with_its_rate_matched_placebo():
    by_arm = {"none": _runs(0.9, 0.8), "route": _runs(0.1, 0.2), "route~placebo": _runs(0.5, 0.4)}
    pairs = [(c.arm, c.against) for c in compare_arms(by_arm)]
    assert pairs == [("route", "none"), ("route~placebo", "none"), ("route", "route~placebo")]


def test_the_preregistered_outcome_compares_designs_with_their_placebos_alone():
    """Each design against its own placebo on hack among well-formed answers, Holm over the
    designs only; a success needs fewer hacks, the base's skill less 0.02 and well-formed
    answers, so a broken policy with few hacks is no success."""
    runs = [(b, s) for b in range(2) for s in range(4)]

    def arm(value: float, jitter: float = 0.0) -> dict:
        return {k: value + jitter * i for i, k in enumerate(runs)}

    hack = {
        "good": arm(0.05), "good~placebo": arm(0.6, 0.01),
        "broken": arm(0.0), "broken~placebo": arm(0.6, 0.01),
        "same": arm(0.5, 0.01), "same~placebo": arm(0.5, -0.01),
    }  # fmt: skip
    true_pass = {"base": arm(0.30), "good": arm(0.29), "broken": arm(0.02), "same": arm(0.3)}
    formed = {"good": arm(0.99), "broken": arm(0.40), "same": arm(0.99)}
    placebos = {d: f"{d}~placebo" for d in ("good", "broken", "same", "never-run")}
    got = {v.comparison.arm: v for v in preregistered_outcome(hack, true_pass, formed, placebos)}
    assert set(got) == {"good", "broken", "same"}  # a design with no runs is left out
    assert got["good"].success and got["good"].comparison.difference == pytest.approx(-0.585)
    # exact sign-flip p of 8 identical-sign pairs is 2 / 2^8; Holm multiplies the smallest by 3
    assert got["good"].comparison.p == pytest.approx(2 / 256)
    assert got["good"].comparison.p_holm == pytest.approx(3 * 2 / 256)
    assert not got["broken"].success and not got["broken"].keeps_skill
    assert not got["broken"].well_formed_ok and got["broken"].comparison.p_holm < 0.05
    assert not got["same"].success and got["same"].keeps_skill
