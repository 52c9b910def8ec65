"""The routing study's statistics: t-intervals, permutation tests and Holm's correction,
against hand-computed values and a coverage check."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.errors import InvalidRequestError
from services.trainer.study_stats import compare_arms, holm, mean_interval, permutation_p


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


def test_permutation_p_values():
    assert permutation_p([0.5] * 5, [0.5] * 5) == 1.0
    # all 0s against all 1s: 2 of the C(10, 5) = 252 splits are as extreme
    assert permutation_p([0.0] * 5, [1.0] * 5) == pytest.approx(2 / 252)
    assert permutation_p([0.1, 0.2, 0.3], [0.2, 0.1, 0.3]) == 1.0
    with pytest.raises(InvalidRequestError):
        permutation_p([], [1.0])


def test_holm_steps_down_and_stays_monotone():
    got = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert got == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"x": 0.6, "y": 0.5}) == {"y": 1.0, "x": 1.0}
    assert holm({}) == {}


def test_arms_are_compared_with_vanilla_and_the_placebo_under_one_holm_family():
    by_arm = {
        "none": [0.9, 0.8, 1.0, 0.9, 0.85],
        "route": [0.0, 0.1, 0.0, 0.05, 0.0],
        "activation": [0.9, 0.85, 0.95, 0.8, 0.9],
        "placebo": [0.85, 0.9, 0.8, 0.95, 0.9],
    }
    got = {(c.arm, c.against): c for c in compare_arms(by_arm)}
    assert set(got) == {
        ("route", "none"), ("activation", "none"), ("placebo", "none"),
        ("route", "placebo"), ("activation", "placebo"),
    }  # fmt: skip
    route = got["route", "none"]
    assert route.difference == pytest.approx(0.03 - 0.89)
    assert route.p == pytest.approx(2 / 252)  # fully separated: 2 of C(10, 5) splits
    raw = {f"{a}|{b}": c.p for (a, b), c in got.items()}
    assert {k: c.p_holm for k, c in zip(raw, got.values(), strict=True)} == holm(raw)
    assert got["activation", "none"].p > 0.3
    assert compare_arms({"route": [0.1]}) == []  # nothing to compare against


def test_each_arm_is_also_compared_with_its_rate_matched_placebo():
    by_arm = {"none": [0.9, 0.8], "route": [0.1, 0.2], "route~placebo": [0.5, 0.4]}
    pairs = [(c.arm, c.against) for c in compare_arms(by_arm)]
    assert pairs == [("route", "none"), ("route~placebo", "none"), ("route", "route~placebo")]
