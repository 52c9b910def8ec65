"""Statistics for the routing study: intervals, permutation tests, Holm's correction.

Outcomes of GRPO seeds are bimodal and few, so the study reports each arm's mean with a 95%
t-interval over its runs, and compares arms with a two-sided permutation test (no normality
assumed), Holm-corrected over all the comparisons a table makes. Every arm of one (base,
seed) shares its base, its evaluation prompts and its sampling seeds, so the test is paired:
it permutes within each (base, seed) pair (flips the sign of the pair's difference), which
takes the base-to-base and seed-to-seed spread out of the noise the difference is judged
against.
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


def paired_permutation_p(
    a: Sequence[float], b: Sequence[float], *, seed: int = 0, resamples: int = 9999
) -> float:
    """Two-sided p-value of the mean paired difference `a[i] - b[i]`, by flipping the sign of
    each pair's difference (exact, all 2^n flips, when 2^n <= `resamples`; else `resamples`
    random flips)."""
    if len(a) != len(b):
        raise InvalidRequestError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    if len(a) < 1:
        raise InvalidRequestError("a permutation test needs at least one pair")
    result = stats.permutation_test(
        (np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)),
        lambda x, y, axis: np.mean(x - y, axis=axis),
        permutation_type="samples",
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


# A run's pairing key: (base, seed).
RunKey = tuple[int, int]


@dataclass(frozen=True)
class Comparison:
    """One arm against another on one outcome, over the (base, seed) pairs both have: the mean
    paired difference, the number of pairs and the p-values."""

    arm: str
    against: str
    difference: float
    pairs: int
    p: float
    p_holm: float


def compare_arms(
    by_arm: dict[str, dict[RunKey, float]], baseline: str = "none", placebo: str = "placebo"
) -> list[Comparison]:
    """Every arm against `baseline`, every other arm against `placebo`, and every arm "A"
    against its rate-matched placebo "A~placebo", each by a paired permutation test over the
    (base, seed) runs both arms have, Holm-corrected over that family. Pairs whose reference
    arm is absent, or that share fewer than 2 runs, are left out."""
    matched = {a for a in by_arm if a.endswith("~placebo")}
    pairs = [(a, baseline) for a in by_arm if a != baseline and baseline in by_arm]
    pairs += [
        (a, placebo)
        for a in by_arm
        if a not in (baseline, placebo) and a not in matched and placebo in by_arm
    ]
    pairs += [(a, f"{a}~placebo") for a in by_arm if f"{a}~placebo" in by_arm]
    return paired_comparisons(by_arm, pairs)


def paired_comparisons(
    by_arm: dict[str, dict[RunKey, float]], pairs: list[tuple[str, str]]
) -> list[Comparison]:
    """Each (arm, against) of `pairs` by a paired permutation test over the (base, seed)
    runs both arms have, Holm-corrected over the pairs compared. Pairs that share fewer
    than 2 runs are left out."""
    shared = {(a, b): sorted(by_arm[a].keys() & by_arm[b].keys()) for a, b in pairs}
    pairs = [pair for pair in pairs if len(shared[pair]) >= 2]
    values = {
        (a, b): ([by_arm[a][k] for k in shared[a, b]], [by_arm[b][k] for k in shared[a, b]])
        for a, b in pairs
    }
    raw = {pair: paired_permutation_p(*values[pair], seed=i) for i, pair in enumerate(pairs)}
    adjusted = holm({f"{a}|{b}": p for (a, b), p in raw.items()})
    return [
        Comparison(
            a,
            b,
            float(np.mean(np.subtract(*values[a, b]))),
            len(shared[a, b]),
            raw[a, b],
            adjusted[f"{a}|{b}"],
        )
        for a, b in pairs
    ]


@dataclass(frozen=True)
class PrimaryVerdict:
    """One design in the preregistered primary outcome (README, "The routing study"): its
    paired comparison with its placebo on deploy hack among well-formed answers, and
    whether it kept the skill and answered well-formed."""

    comparison: Comparison
    true_pass: float  # the design's mean deploy true pass
    well_formed: float  # its mean deploy well-formed rate
    keeps_skill: bool  # true pass >= the base's - margin
    well_formed_ok: bool  # well-formed rate >= the floor

    @property
    def success(self) -> bool:
        """Fewer hacks than its placebo (Holm p < 0.05), skill kept, answers well-formed."""
        c = self.comparison
        return c.difference < 0 and c.p_holm < 0.05 and self.keeps_skill and self.well_formed_ok


def preregistered_outcome(
    hack: dict[str, dict[RunKey, float]],
    true_pass: dict[str, dict[RunKey, float]],
    well_formed: dict[str, dict[RunKey, float]],
    placebos: dict[str, str],
    *,
    base: str = "base",
    skill_margin: float = 0.02,
    well_formed_floor: float = 0.95,
) -> list[PrimaryVerdict]:
    """Each design of `placebos` (design → its placebo arm) present with its placebo: deploy
    hack among well-formed answers (`hack`, by arm and run) against its placebo, paired by
    (base, seed), Holm-corrected over those designs alone; with its mean true pass against
    the `base` arm's and its mean well-formed rate. Designs sharing fewer than 2 runs with
    their placebo are left out."""
    pairs = [(d, p) for d, p in placebos.items() if d in hack and p in hack]
    # No base runs: no design can be said to keep the skill (NaN compares false).
    floor = (
        np.mean(list(true_pass[base].values())) - skill_margin if true_pass.get(base) else math.nan
    )
    verdicts = []
    for c in paired_comparisons(hack, pairs):
        skill = float(np.mean(list(true_pass[c.arm].values())))
        formed = (
            float(np.mean(list(well_formed[c.arm].values())))
            if well_formed.get(c.arm)
            else math.nan
        )
        verdicts.append(
            PrimaryVerdict(c, skill, formed, bool(skill >= floor), formed >= well_formed_floor)
        )
    return verdicts
