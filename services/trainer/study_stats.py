"""Statistics for the routing study: intervals, permutation tests, Holm's correction.

Outcomes of GRPO seeds are bimodal and few, so the study reports each arm's mean with a 95%
t-interval over its runs, and compares arms with a two-sided permutation test of the
difference in means (no normality assumed), Holm-corrected over all the comparisons a table
makes. The primary outcome is fixed before any run (README, "Routing study"): the deploy
hack rate, among arms whose deploy true pass is at least vanilla's − 0.02.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from services.common.errors import InvalidRequestError


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided confidence interval (NaN bounds for a single value)."""

    mean: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:.2f}"
        return f"{self.mean:.2f} [{self.low:.2f}, {self.high:.2f}]"


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of `values` with its Student-t interval at `level`."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise InvalidRequestError("an interval needs at least one value")
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, math.nan, math.nan, 1)
    half = float(stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return Interval(mean, mean - half, mean + half, int(x.size))


def permutation_p(
    a: Sequence[float], b: Sequence[float], *, seed: int = 0, resamples: int = 9999
) -> float:
    """Two-sided p-value of the difference in means of `a` and `b`, by permuting the pooled
    values (exact when there are fewer arrangements than `resamples`)."""
    if len(a) < 1 or len(b) < 1:
        raise InvalidRequestError("a permutation test needs values on both sides")
    result = stats.permutation_test(
        (np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)),
        lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
        permutation_type="independent",
        alternative="two-sided",
        n_resamples=resamples,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return float(result.pvalue)


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values (same keys)."""
    order = sorted(pvalues, key=pvalues.__getitem__)
    m, running, adjusted = len(order), 0.0, {}
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[key]))
        adjusted[key] = running
    return adjusted


@dataclass(frozen=True)
class Comparison:
    """One arm against another on one outcome: the difference in means and its p-values."""

    arm: str
    against: str
    difference: float
    p: float
    p_holm: float


def compare_arms(
    by_arm: dict[str, Sequence[float]], baseline: str = "none", placebo: str = "placebo"
) -> list[Comparison]:
    """Every arm against `baseline`, every other arm against `placebo`, and every arm "A"
    against its rate-matched placebo "A~placebo", by permutation test, Holm-corrected over
    that family (pairs whose reference arm is absent are left out)."""
    matched = {a for a in by_arm if a.endswith("~placebo")}
    pairs = [(a, baseline) for a in by_arm if a != baseline and baseline in by_arm]
    pairs += [
        (a, placebo)
        for a in by_arm
        if a not in (baseline, placebo) and a not in matched and placebo in by_arm
    ]
    pairs += [(a, f"{a}~placebo") for a in by_arm if f"{a}~placebo" in by_arm]
    raw = {pair: permutation_p(by_arm[pair[0]], by_arm[pair[1]], seed=i) for i, pair in
           enumerate(pairs)}  # fmt: skip
    adjusted = holm({f"{a}|{b}": p for (a, b), p in raw.items()})
    return [
        Comparison(
            a,
            b,
            float(np.mean(by_arm[a]) - np.mean(by_arm[b])),
            raw[a, b],
            adjusted[f"{a}|{b}"],
        )
        for a, b in pairs
    ]
