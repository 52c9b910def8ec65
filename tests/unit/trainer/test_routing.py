"""The gate identity, hack directions, Arm A / Arm B routing and the optimiser's no-banking."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.trainer.adapters import AdapterConfig, attach_adapters
from services.trainer.model import TrainableModel, pad_batch
from services.trainer.routing import (
    HackDirection,
    activation_direction,
    activation_flags,
    apply_gradient_mask,
    gradient_direction,
    gradient_leakage,
    gradient_scores,
    per_sequence_gradients,
    random_direction,
    rollout_gradients,
    route_gradients,
)

# Four rollouts of two prompts, unequal lengths (left padding inside the batch).
ROLLOUTS = [
    ([5, 6, 7], [8, 9, 10]),
    ([5, 6, 7], [30, 31]),
    ([11, 12, 13, 14], [15]),
    ([11, 12, 13, 14], [40, 41, 42, 43]),
]
ADVANTAGES = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
HACK, CLEAN = [300, 301, 302], [200, 201]
PROMPTS = [[5, 6, 7], [11, 12, 13, 14], [20, 21], [50, 51, 52]]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _setup(ckpt, seed=0, zero_axes=False, **kw):
    """A float64 model whose kept δS is nonzero (random), so the scale gate can divide by it."""
    model = TrainableModel.from_pretrained(ckpt, dtype=torch.float64)
    kw.setdefault("targets", ("*.o_proj", "*.down_proj"))
    kw.setdefault("rank", 4)
    adapters = attach_adapters(model.model, AdapterConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapters.modules.values():
            m.delta_s.copy_(torch.randn(m.rank, generator=g, dtype=torch.float64) * 0.2)
            if zero_axes:
                m.delta_s[1] = 0.0  # an axis the scale gate cannot recover
    return model, adapters


def _loss(model, batch, weights):
    """A GRPO-shaped loss: −Σ_b w_b Σ_t logp_bt over completion tokens / a constant."""
    lp = model.token_logprobs(batch)
    return -((lp * batch.loss_mask).sum(-1) * weights).sum() / 8.0


def _separate_gradients(model, adapters):
    """Each rollout alone in its own batch and backward: the reference for the gate identity."""
    out = {name: [] for name in adapters.modules}
    for b, seq in enumerate(ROLLOUTS):
        for p in adapters.kept_parameters():
            p.grad = None
        _loss(model, pad_batch([seq]), ADVANTAGES[b : b + 1]).backward()
        for name, m in adapters.modules.items():
            out[name].append(m.delta_s.grad.clone())
    return {name: torch.stack(g) for name, g in out.items()}


@pytest.mark.parametrize("kind", ["scale", "shift"])
def test_gate_identity_recovers_per_rollout_gradients_from_one_backward(ckpt, kind):
    model, adapters = _setup(ckpt, zero_axes=True)
    expected = _separate_gradients(model, adapters)
    batch = pad_batch(ROLLOUTS, side="left")
    for p in adapters.kept_parameters():
        p.grad = None
    with adapters.gates(len(ROLLOUTS), kind) as gates:
        _loss(model, batch, ADVANTAGES).backward()
    grads = rollout_gradients(adapters, gates, kind, eps=1e-12)
    for name, m in adapters.modules.items():
        ok = grads.routable[name]
        if kind == "scale":
            assert ok.tolist() == [True, False, True, True]
            # The identity itself: c.grad[b] = δS ⊙ g_b.
            torch.testing.assert_close(
                gates[name].grad[:, 0], m.delta_s.detach() * expected[name], rtol=0, atol=1e-10
            )
        else:
            assert ok.all()
        torch.testing.assert_close(
            grads.per_rollout[name][:, ok], expected[name][:, ok], rtol=0, atol=1e-5
        )
        assert (expected[name][:, ok].abs() > 1e-4).any()  # not trivially zero
        # One backward's δS.grad is still the sum over rollouts.
        torch.testing.assert_close(m.delta_s.grad, expected[name].sum(0), rtol=0, atol=1e-10)


def _pairs():
    hack = pad_batch([(p, HACK) for p in PROMPTS], side="left")
    clean = pad_batch([(p, CLEAN) for p in PROMPTS], side="left")
    return hack, clean


def test_activation_direction_separates_the_pairs_it_came_from(ckpt):
    model, adapters = _setup(ckpt)
    hack, clean = _pairs()
    direction = activation_direction(model, adapters, hack, clean)
    assert direction.kind == "activation" and set(direction.vectors) == set(adapters.modules)
    for v in direction.vectors.values():
        torch.testing.assert_close(v.norm(), torch.tensor(1.0, dtype=v.dtype))
    hack_flags, hack_scores = activation_flags(model, adapters, hack, direction, tau=0.0)
    clean_flags, clean_scores = activation_flags(model, adapters, clean, direction, tau=0.0)
    # Measured from the midpoint, the mean hack score is +half the class gap, clean −half.
    torch.testing.assert_close(hack_scores.mean(), -clean_scores.mean())
    assert hack_scores.mean() > 0
    assert hack_flags.float().mean() > clean_flags.float().mean()


def test_gradient_direction_is_the_unit_mean_difference_of_per_pair_gradients(ckpt):
    model, adapters = _setup(ckpt)
    hack, clean = _pairs()
    direction = gradient_direction(model, adapters, hack, clean)
    assert all(p.grad is None for p in adapters.kept_parameters())  # parameters untouched
    # Reference: one backward per sequence.
    diffs = {}
    for p in PROMPTS:
        for sign, completion in ((1, HACK), (-1, CLEAN)):
            one = pad_batch([(p, completion)])
            (sign * model.sequence_logprob(one).sum() / len(PROMPTS)).backward()
    for name, m in adapters.modules.items():
        diffs[name] = m.delta_s.grad.clone()
        m.delta_s.grad = None
    norm = torch.cat(list(diffs.values())).norm()
    for name in adapters.modules:
        torch.testing.assert_close(direction.vectors[name], diffs[name] / norm, rtol=0, atol=1e-8)
    # per_sequence_gradients on the batch agrees with the per-sequence backwards too.
    per_seq = per_sequence_gradients(model, adapters, hack)
    assert all(g.shape == (len(PROMPTS), 4) for g in per_seq.values())


def _shift_gradients(model, adapters):
    """Per-rollout gradients of ROLLOUTS' GRPO-shaped loss, through `shift` gates."""
    with adapters.gates(4, "shift") as gates:
        _loss(model, pad_batch(ROLLOUTS, side="left"), ADVANTAGES).backward()
    return rollout_gradients(adapters, gates, "shift")


def test_a_rollout_pushing_along_the_direction_is_flagged(ckpt):
    model, adapters = _setup(ckpt)
    grads = _shift_gradients(model, adapters)
    # The hack direction is rollout 2's own descent direction: cosine 1 for it.
    direction = HackDirection("gradient", {n: -g[2] / 1.0 for n, g in grads.per_rollout.items()})
    scores = gradient_scores(grads, direction)
    torch.testing.assert_close(scores[2], torch.tensor(1.0, dtype=torch.float64))
    assert (scores.abs() <= 1 + 1e-12).all()
    assert (scores > 0.999).tolist() == [False, False, True, False]


def _split_reference(model, adapters, batch, flagged):
    """δS's gradient from the unflagged rollouts alone and from the flagged alone (two
    backwards with the other rollouts' loss weights zeroed)."""
    expected = {}
    for label, w in (("keep", ADVANTAGES * ~flagged), ("flag", ADVANTAGES * flagged)):
        model.zero_grad(set_to_none=True)
        _loss(model, batch, w).backward()
        expected[label] = {n: m.delta_s.grad.clone() for n, m in adapters.modules.items()}
    model.zero_grad(set_to_none=True)
    return expected


def _assert_split(adapters, expected, mode, atol):
    for name, m in adapters.modules.items():
        torch.testing.assert_close(m.delta_s.grad, expected["keep"][name], rtol=0, atol=atol)
        if mode == "route":
            torch.testing.assert_close(m.delta_s_q.grad, expected["flag"][name], rtol=0, atol=atol)
        else:
            assert m.delta_s_q.grad is None


@pytest.mark.parametrize("mode", ["route", "erase"])
def test_arm_a_splits_the_gradient_between_kept_and_quarantine(ckpt, mode):
    model, adapters = _setup(ckpt)
    batch = pad_batch(ROLLOUTS, side="left")
    flagged = torch.tensor([True, False, False, True])
    expected = _split_reference(model, adapters, batch, flagged)
    with adapters.gates(4, "scale") as gates:
        _loss(model, batch, ADVANTAGES).backward()
    grads = rollout_gradients(adapters, gates, "scale")
    leakage = apply_gradient_mask(adapters, grads, flagged, mode)
    _assert_split(adapters, expected, mode, atol=1e-8)
    kept = torch.cat(list(expected["keep"].values())).norm()
    routed = torch.cat(list(expected["flag"].values())).norm()
    assert leakage == pytest.approx(float(routed / (kept + routed)), rel=1e-6)
    assert 0 < leakage < 1
    assert apply_gradient_mask(adapters, grads, torch.zeros(4, dtype=torch.bool), mode) == 0.0


def test_arm_a_route_needs_an_svd_quarantine(ckpt):
    model, adapters = _setup(ckpt, quarantine="lora")
    with adapters.gates(4, "shift") as gates:
        _loss(model, pad_batch(ROLLOUTS), ADVANTAGES).backward()
    grads = rollout_gradients(adapters, gates, "shift")
    with pytest.raises(InvalidRequestError, match="quarantine='svd'"):
        apply_gradient_mask(adapters, grads, torch.ones(4, dtype=torch.bool), "route")
    with pytest.raises(InvalidRequestError, match="gradient-space"):
        gradient_scores(grads, HackDirection("activation", {}, {}))


def _adamw_run(ckpt, steps, routed: bool):
    """k AdamW steps over δS and δS_q; flagged rollouts change from step to step.

    routed: one backward over all rollouts, then Arm A `route`. Reference: the flagged
    rollouts' loss weights are zero for δS's backward (they never existed for δS), and a
    second backward with only them gives δS_q its gradient.
    """
    model, adapters = _setup(ckpt)
    params = adapters.kept_parameters() + adapters.quarantine_parameters()
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    batch = pad_batch(ROLLOUTS, side="left")
    flags = [[True, False, False, True], [False, False, False, False], [False, True, True, True]]
    for step in range(steps):
        flagged = torch.tensor(flags[step % len(flags)])
        opt.zero_grad(set_to_none=True)
        if routed:
            with adapters.gates(4, "shift") as gates:
                _loss(model, batch, ADVANTAGES).backward()
            apply_gradient_mask(
                adapters, rollout_gradients(adapters, gates, "shift"), flagged, "route"
            )
        else:
            with adapters.gates(4, "shift"):
                _loss(model, batch, ADVANTAGES * flagged).backward()
            routed_grads = [m.delta_s.grad.clone() for m in adapters.modules.values()]
            opt.zero_grad(set_to_none=True)
            with adapters.gates(4, "shift"):
                _loss(model, batch, ADVANTAGES * ~flagged).backward()
            for m, g in zip(adapters.modules.values(), routed_grads, strict=True):
                m.delta_s_q.grad = g
        opt.step()
    return adapters, opt


def test_optimiser_state_does_not_bank_routed_mass(ckpt):
    routed, opt_r = _adamw_run(ckpt, steps=3, routed=True)
    ref, opt_ref = _adamw_run(ckpt, steps=3, routed=False)
    for name, m in routed.modules.items():
        r = ref.modules[name]
        assert torch.equal(m.delta_s, r.delta_s), name
        assert torch.equal(m.delta_s_q, r.delta_s_q), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_r.state[m.delta_s][key], opt_ref.state[r.delta_s][key])
    # And routing did move something into the quarantine.
    assert any(m.delta_s_q.abs().max() > 0 for m in routed.modules.values())


@pytest.mark.parametrize("mode", ["route", "erase"])
def test_arm_b_mask_splits_the_gradient_exactly_like_arm_a(ckpt, mode):
    model, adapters = _setup(ckpt)
    batch = pad_batch(ROLLOUTS, side="left")
    flagged = torch.tensor([False, True, True, False])
    expected = _split_reference(model, adapters, batch, flagged)
    with torch.no_grad():
        unmasked = model(batch.input_ids, batch.attention_mask).logits
    with adapters.mask_rollouts(flagged, mode):
        out = model(batch.input_ids, batch.attention_mask).logits
        assert torch.equal(out, unmasked)  # masking changes gradients, never values
        _loss(model, batch, ADVANTAGES).backward()
    _assert_split(adapters, expected, mode, atol=1e-10)
    leakage = gradient_leakage(adapters)
    assert (0 < leakage < 1) if mode == "route" else leakage == 0.0


def _untrained(params):
    return all(p.grad is None or not p.grad.any() for p in params)


@pytest.mark.parametrize("quarantine", ["svd", "lora"])
@pytest.mark.parametrize("stop", ["parameter", "activation"])
def test_arm_b_flagged_rollouts_train_only_the_quarantine(ckpt, quarantine, stop):
    model, adapters = _setup(ckpt, quarantine=quarantine, quarantine_init=0.01)
    batch = pad_batch(ROLLOUTS, side="left")
    with torch.no_grad():
        unmasked = model(batch.input_ids, batch.attention_mask).logits
    with adapters.mask_rollouts(torch.zeros(4, dtype=torch.bool), stop=stop):
        _loss(model, batch, ADVANTAGES).backward()
    assert _untrained(adapters.quarantine_parameters())
    assert not _untrained(adapters.kept_parameters())
    model.zero_grad(set_to_none=True)
    with adapters.mask_rollouts(torch.ones(4, dtype=torch.bool), stop=stop):
        out = model(batch.input_ids, batch.attention_mask).logits
        assert torch.equal(out.detach(), unmasked)
        _loss(model, batch, ADVANTAGES).backward()
    assert _untrained(adapters.kept_parameters())
    assert all(p.grad.abs().sum() > 0 for p in adapters.quarantine_parameters())
    with (
        pytest.raises(InvalidRequestError, match="stop"),
        adapters.mask_rollouts(torch.ones(4, dtype=torch.bool), stop="everything"),
    ):
        pass


def test_route_gradients_end_to_end_and_the_placebo(ckpt):
    model, adapters = _setup(ckpt)
    hack, clean = _pairs()
    direction = gradient_direction(model, adapters, hack, clean)
    placebo = random_direction(direction, seed=3)
    assert torch.cat(list(placebo.vectors.values())).norm().item() == pytest.approx(1.0)
    assert not torch.equal(
        placebo.vectors["layers.0.mlp.down_proj"], direction.vectors["layers.0.mlp.down_proj"]
    )
    again = random_direction(direction, seed=3)
    assert all(torch.equal(again.vectors[n], v) for n, v in placebo.vectors.items())
    act_placebo = random_direction(activation_direction(model, adapters, hack, clean), seed=3)
    assert all(v.norm().item() == pytest.approx(1.0) for v in act_placebo.vectors.values())

    # Rollouts that reinforce the hacking completion are flagged; those that punish it are not.
    rollouts = pad_batch([(p, HACK) for p in PROMPTS], side="left")
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    with adapters.gates(4, "scale") as gates:
        _loss(model, rollouts, advantages).backward()
    stats = route_gradients(adapters, gates, direction, tau=0.0, mode="route", kind="scale")
    assert stats.flagged.tolist() == [True, False, True, False]
    assert stats.scores.shape == (4,) and 0 < stats.leakage < 1


def test_the_share_split_gives_each_part_at_most_the_total_and_nothing_unflagged(ckpt):
    model, adapters = _setup(ckpt)
    grads = _shift_gradients(model, adapters)
    names = list(adapters.modules)
    total = torch.cat([grads.per_rollout[n].sum(0) for n in names])
    flagged = torch.tensor([True, False, False, True])
    pushed = torch.cat([grads.per_rollout[n][flagged].sum(0) for n in names])

    leakage = apply_gradient_mask(adapters, grads, flagged, "route", split="share")
    kept = torch.cat([adapters.modules[n].delta_s.grad for n in names])
    routed = torch.cat([adapters.modules[n].delta_s_q.grad for n in names])
    torch.testing.assert_close(kept + routed, total, rtol=0, atol=1e-12)
    # coordinate by coordinate: the total's sign and at most its size
    assert (kept * total >= 0).all() and (routed * total >= 0).all()
    assert (kept.abs() <= total.abs() + 1e-15).all() and (routed.abs() <= total.abs()).all()
    # the flagged rollouts' push where it goes with the total, capped at the total
    agree = pushed * total > 0
    want = torch.where(agree, torch.minimum(pushed.abs(), total.abs()) * total.sign(), 0)
    torch.testing.assert_close(routed, want, rtol=1e-12, atol=1e-15)
    assert 0 < leakage < 1

    nobody = torch.zeros(4, dtype=torch.bool)
    assert apply_gradient_mask(adapters, grads, nobody, "route", split="share") == 0
    assert all(not m.delta_s_q.grad.any() for m in adapters.modules.values())
    torch.testing.assert_close(
        torch.cat([adapters.modules[n].delta_s.grad for n in names]), total, rtol=0, atol=1e-12
    )
    with pytest.raises(InvalidRequestError, match="split"):
        apply_gradient_mask(adapters, grads, flagged, "route", split="halves")


def _drift_run(ckpt, split: str | None, steps: int = 150) -> tuple[float, float]:
    """‖δS‖ and ‖δS_q‖ after `steps` RoutedAdamW steps on GRPO-shaped gradients: each step,
    two groups of 4 rollouts with zero-sum advantages whose per-rollout gradients share a
    common part (as ∇ log p of similar completions do), so the step's total is a small
    difference of large terms; a random quarter of the rollouts is flagged. `split` None is
    vanilla: δS takes the whole total."""
    from services.trainer.optim import RoutedAdamW
    from services.trainer.routing import RolloutGradients

    _, adapters = _setup(ckpt)
    with torch.no_grad():
        for m in adapters.modules.values():
            m.delta_s.zero_()
    opt = RoutedAdamW([(m.delta_s, m.delta_s_q) for m in adapters.modules.values()], lr=0.05)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        rewards = torch.rand(2, 4, generator=g, dtype=torch.float64)
        adv = (rewards - rewards.mean(1, keepdim=True)).reshape(8, 1)  # zero-sum per group
        per_rollout, routable = {}, {}
        for name, m in adapters.modules.items():
            common = torch.randn(m.rank, generator=g, dtype=torch.float64)
            own = 0.1 * torch.randn(8, m.rank, generator=g, dtype=torch.float64)
            per_rollout[name] = adv * (common + own)  # [8, r]
            routable[name] = torch.ones(m.rank, dtype=torch.bool)
        flagged = torch.rand(8, generator=g) < 0.25
        opt.zero_grad(set_to_none=True)
        for m in adapters.modules.values():
            m.delta_s.grad = torch.zeros_like(m.delta_s)
        grads = RolloutGradients(per_rollout, routable)
        if split is None:
            for name, m in adapters.modules.items():
                m.delta_s.grad = per_rollout[name].sum(0)
        else:
            apply_gradient_mask(adapters, grads, flagged, "route", split=split)
        opt.step()
    kept = torch.cat([m.delta_s.detach() for m in adapters.modules.values()]).norm()
    quarantine = torch.cat([m.delta_s_q.detach() for m in adapters.modules.values()]).norm()
    return float(kept), float(quarantine)


def test_the_share_split_does_not_drift_where_the_partition_does(ckpt):
    """With zero-sum advantages the partition's kept and routed sums are each far larger
    than the total, and under the shared second moment they walk apart (about 5× vanilla's
    ‖δS‖ here); the share split's parts stay within 1.5× of it."""
    vanilla, _ = _drift_run(ckpt, None)
    kept, quarantine = _drift_run(ckpt, "share")
    assert kept <= 1.5 * vanilla and quarantine <= 1.5 * vanilla
    p_kept, p_quarantine = _drift_run(ckpt, "partition")
    assert min(p_kept, p_quarantine) > 3 * vanilla  # the drift this split guards against
