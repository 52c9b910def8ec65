"""GRPO loss math against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.trainer.grpo_loss import (
    GRPOLossConfig,
    aggregate,
    clipped_policy_loss,
    completion_mask,
    group_advantages,
    grpo_loss,
    k3_kl,
    subset_advantages,
)

D = torch.float64


def test_group_advantages_std_normalised_per_group():
    # Group 1: [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3). Group 2 all equal -> zeros.
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=D)
    adv = group_advantages(r, 4, eps=0.0)
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=D))


def test_group_advantages_eps_and_dr_grpo():
    r = torch.tensor([3.0, 1.0], dtype=D)  # mean 2, sample std sqrt(2)
    torch.testing.assert_close(
        group_advantages(r, 2, eps=0.1), torch.tensor([1, -1], dtype=D) / (math.sqrt(2) + 0.1)
    )
    # Dr.GRPO: centred only, so reward scale survives.
    torch.testing.assert_close(
        group_advantages(torch.tensor([3.0, 1.0, 10.0, 0.0], dtype=D), 2, scale="none"),
        torch.tensor([1.0, -1.0, 5.0, -5.0], dtype=D),
    )


def test_group_advantages_rejects_bad_groups():
    with pytest.raises(InvalidRequestError, match="does not divide"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(InvalidRequestError, match="group_size >= 2"):
        group_advantages(torch.zeros(3), 1)
    with pytest.raises(InvalidRequestError, match="unknown advantage scale"):
        group_advantages(torch.zeros(4), 2, scale="max")  # type: ignore[arg-type]


def test_completion_mask():
    m = completion_mask(torch.tensor([2, 0, 3]), 3)
    assert m.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    with pytest.raises(InvalidRequestError, match="lengths must lie"):
        completion_mask(torch.tensor([4]), 3)


def test_clipped_loss_separate_low_and_high_bounds():
    # Ratios 1.5 (A>0: clipped at 1+eps_high=1.3), 0.5 (A<0: clipped at 1-eps_low=0.9),
    # 1.1 (A>0: inside), 0.5 (A>0: below the low bound, but min() keeps the unclipped value).
    # One token per rollout, so each has its own advantage.
    logp = torch.tensor(
        [[math.log(1.5)], [math.log(0.5)], [math.log(1.1)], [math.log(0.5)]], dtype=D
    )
    adv = torch.tensor([2.0, -1.0, 1.0, 3.0], dtype=D)
    old = torch.zeros(4, 1, dtype=D)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, clipped = clipped_policy_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.3)
    expected = [-(1.3 * 2.0), -(0.9 * -1.0), -(1.1 * 1.0), -(0.5 * 3.0)]
    torch.testing.assert_close(loss[:, 0], torch.tensor(expected, dtype=D))
    assert clipped[:, 0].tolist() == [True, True, False, False]


def test_clipped_loss_gradient_vanishes_where_clipped():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=D, requires_grad=True)
    loss, _ = clipped_policy_loss(
        logp, torch.zeros(1, 2, dtype=D), torch.tensor([1.0], dtype=D),
        torch.ones(1, 2, dtype=torch.bool), eps_low=0.2, eps_high=0.2,
    )  # fmt: skip
    loss.sum().backward()
    # d(-ρ·A)/dlogp = -ρ·A where unclipped; 0 where the clip holds.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1]], dtype=D))


def test_k3_kl_matches_formula_and_is_zero_on_padding():
    logp = torch.tensor([[-1.0, -2.0, float("-inf")]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=D)
    mask = torch.tensor([[True, True, False]])
    kl = k3_kl(logp, ref, mask)
    d0, d1 = -0.5, 1.0
    expected = [math.exp(d0) - d0 - 1, math.exp(d1) - d1 - 1, 0.0]
    torch.testing.assert_close(kl, torch.tensor([expected], dtype=D))
    assert (kl >= 0).all()


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]], dtype=D)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # token_mean: (1+2+3+4)/4 ; seq_mean: (2 + 4)/2 ; seq_sum_const: 10/(2*5)
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(2.5)
    assert aggregate(per_token, mask, "seq_mean").item() == pytest.approx(3.0)
    assert aggregate(per_token, mask, "seq_sum_const", const_len=5).item() == pytest.approx(1.0)
    with pytest.raises(InvalidRequestError, match="const_len"):
        aggregate(per_token, mask, "seq_sum_const")
    with pytest.raises(InvalidRequestError, match="unknown aggregation"):
        aggregate(per_token, mask, "sum")  # type: ignore[arg-type]


def test_seq_sum_const_weight_per_token_is_length_independent():
    # Under seq_sum_const each real token's gradient weight is 1/(B·L) whatever its rollout's
    # length; under seq_mean a token of a short rollout weighs more.
    x = torch.ones(2, 4, dtype=D, requires_grad=True)
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    aggregate(x, mask, "seq_sum_const", const_len=4).backward()
    torch.testing.assert_close(x.grad, mask.to(D) / 8)
    x.grad = None
    aggregate(x, mask, "seq_mean").backward()
    torch.testing.assert_close(x.grad[:, 0], torch.tensor([1 / 8, 1 / 2], dtype=D))


def test_grpo_loss_combines_policy_and_kl_and_ignores_padding():
    # One rollout of two real tokens and one pad holding -inf (must not poison anything).
    logp = torch.tensor([[math.log(0.5), math.log(0.25), float("-inf")]], dtype=D)
    logp.requires_grad_(True)
    old = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]], dtype=D)
    ref = torch.tensor([[math.log(0.25), math.log(0.25), 0.0]], dtype=D)
    mask = torch.tensor([[True, True, False]])
    adv = torch.tensor([2.0], dtype=D)
    out = grpo_loss(logp, old, adv, mask, GRPOLossConfig(kl_coef=0.1), ref_logp=ref)
    # ratio 1 on both tokens: policy loss -2 per token; k3 at d=ln(0.5): 0.5 + ln 2 - 1.
    k = 0.5 + math.log(2) - 1
    assert out.policy_loss.item() == pytest.approx(-2.0)
    assert out.kl.item() == pytest.approx(k / 2)
    assert out.loss.item() == pytest.approx((-2.0 * 2 + 0.1 * k) / 2)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 2].item() == 0.0
    # d/dlogp of (-ρA + β(e^{ref-logp} - (ref-logp) - 1))/2 at ρ=1: (-A + β(1 - e^{d}))/2
    torch.testing.assert_close(
        logp.grad[0, :2], torch.tensor([(-2 + 0.1 * (1 - 0.5)) / 2, -1.0], dtype=D)
    )


def test_grpo_loss_needs_reference_for_kl():
    z = torch.zeros(1, 2)
    with pytest.raises(InvalidRequestError, match="ref_logp"):
        grpo_loss(
            z, z, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), GRPOLossConfig(kl_coef=0.1)
        )


def test_shape_errors_name_the_tensor():
    z = torch.zeros(2, 3)
    with pytest.raises(InvalidRequestError, match="advantages"):
        clipped_policy_loss(z, z, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(InvalidRequestError, match="mask must be a bool"):
        k3_kl(z, z, torch.ones(2, 3))


def test_subset_advantages_centre_each_group_over_its_included_rollouts():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    include = torch.tensor([True, True, False, True, True, True, True, True])
    adv = subset_advantages(rewards, 4, include)
    # Group 1 without its third rollout is [1, 0, 1]: mean 2/3, Bessel std 1/sqrt(3).
    std = (1 / 3) ** 0.5
    expected = [
        (1 - 2 / 3) / (std + 1e-4),
        (0 - 2 / 3) / (std + 1e-4),
        0.0,
        (1 - 2 / 3) / (std + 1e-4),
    ]
    torch.testing.assert_close(adv[:4], torch.tensor(expected))
    torch.testing.assert_close(adv[4:], group_advantages(rewards[4:], 4))  # all included
    assert torch.equal(subset_advantages(rewards, 4, torch.ones(8, dtype=torch.bool)),
                       group_advantages(rewards, 4))  # fmt: skip
    one = torch.tensor([True, False, False, False, True, True, True, True])
    assert torch.equal(subset_advantages(rewards, 4, one)[:4], torch.zeros(4))  # no baseline
    assert subset_advantages(rewards, 4, include, scale="none")[0] == pytest.approx(1 / 3)
    with pytest.raises(InvalidRequestError, match="include"):
        subset_advantages(rewards, 4, include[:4])
