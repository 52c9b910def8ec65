"""The gate's calibrated thresholds, the noisy oracle's flips and the flags' quality."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.gates import flag_quality, flip_flags, pair_midpoint, quantile_threshold


@pytest.mark.parametrize("q,k", [(0.25, 3), (0.5, 6), (0.2, 2), (0.05, 1), (0.01, 0), (0.99, 12)])
def test_the_quantile_threshold_flags_the_top_q_to_the_nearest_rollout(q, k):
    scores = torch.randn(12, generator=torch.Generator().manual_seed(1))
    tau = quantile_threshold(scores, q)
    flagged = scores > tau
    assert int(flagged.sum()) == k == round(q * 12)
    if 0 < k < 12:  # the flagged ones are the top k
        assert scores[flagged].min() > scores[~flagged].max()
    shifted = quantile_threshold(scores + 5.0, q)  # the policy moves, the rate does not
    assert int((scores + 5.0 > shifted).sum()) == k
    assert shifted == pytest.approx(tau + 5.0) or k in (0, 12)


def test_the_quantile_threshold_does_not_flag_ties_at_its_boundary():
    scores = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 2.0])  # Arm A: zero-advantage rollouts
    assert int((scores > quantile_threshold(scores, 0.5)).sum()) == 2


def test_pair_midpoint_is_the_midpoint_of_the_two_means():
    assert pair_midpoint(torch.tensor([1.0, 3.0]), torch.tensor([-2.0, 0.0, -1.0])) == 0.5


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.2, 0.4, 1.0])
def test_flip_flags_flips_the_asked_share(fraction):
    """Each draw flips floor(fraction·B + u) flags (within one rollout of the share), and
    over many draws on a fixed seed the share is the one asked, within sampling noise."""
    g = torch.Generator().manual_seed(0)
    n, draws, total = 12, 2000, 0
    for i in range(draws):
        flags = torch.arange(n) % (2 + i % 3) == 0
        flipped = flip_flags(flags, fraction, g)
        k = int((flipped != flags).sum())
        assert math.floor(fraction * n) <= k <= math.ceil(fraction * n)
        total += k
    # the share's standard error is below sqrt(0.25 / draws) / n per rollout ≈ 1e-3
    assert total / (n * draws) == pytest.approx(fraction, abs=0.005)


def test_flag_quality_against_known_labels():
    flags = [True, True, True, False, False, False, False, True]
    hacked = [True, False, True, True, False, False, False, False]
    assert flag_quality(flags, hacked) == {"flag_precision": 2 / 4, "flag_recall": 2 / 3}
    assert flag_quality([False] * 3, [True, False, False]) == {
        "flag_precision": None,
        "flag_recall": 0.0,
    }
    assert flag_quality([True, False], [False, False]) == {
        "flag_precision": 0.0,
        "flag_recall": None,
    }
