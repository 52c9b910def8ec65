"""Calibrated gates, per-step flag quality and the noisy oracle, in GRPO runs on a tiny
checkpoint: the flag rate follows the quantile as the policy moves (and without calibration
does not), the midpoint is the hack pairs' under the current policy, precision and recall
are the flags' against the labels, and the noisy oracle flips the share asked."""

from __future__ import annotations

import pydantic
import pytest
import torch

from services.trainer.grpo import GRPOConfig, GRPOTrainer, run
from services.trainer.routing import capture_pooled, per_sequence_gradients
from tests.parity_env import parity_config, parity_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("parity_env")


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _config(path, tmp_path, **kw) -> GRPOConfig:
    return parity_config(path, tmp_path, **{"eval_every": 100, **kw})


def _train(cfg: GRPOConfig) -> list[dict]:
    return [r for r in run(cfg) if r["kind"] == "train"]


@pytest.mark.parametrize("arm", ["activation", "route"])
def test_a_quantile_gate_flags_the_quantile_as_the_policy_moves(path, tmp_path, arm):
    """With `gate_calibration: quantile` every step flags round(q·B) of its rollouts, at a τ
    that moves with the policy's scores; the same run with τ fixed at the calibrated run's
    first τ flags the same share at step 0 (same rollouts, same scores) and then drifts."""
    kw = dict(arm=arm, lr=0.5, steps=5)
    calibrated = _train(
        _config(path, tmp_path / "q", gate_calibration="quantile", gate_quantile=0.25, **kw)
    )
    assert [r["flagged"] for r in calibrated] == [0.25] * 5  # 3 of 12, every step
    taus = [r["tau"] for r in calibrated]
    assert len(set(taus)) == 5
    fixed = _train(_config(path, tmp_path / "fixed", tau=taus[0], **kw))
    assert fixed[0]["flagged"] == 0.25 and fixed[0]["tau"] == taus[0]
    assert all(r["tau"] == taus[0] for r in fixed)
    assert max(abs(r["flagged"] - 0.25) for r in fixed) >= 0.15


def test_calibrate_every_holds_tau_between_re_estimates(path, tmp_path):
    cfg = _config(
        path, tmp_path, arm="activation", lr=0.5, steps=4, gate_calibration="quantile",
        gate_quantile=0.5, calibrate_every=2,
    )  # fmt: skip
    taus = [r["tau"] for r in _train(cfg)]
    assert taus[0] == taus[1] != taus[2] == taus[3]
    trainer = GRPOTrainer(cfg.model_copy(update={"steps": 5}))
    trainer.load(tmp_path / "checkpoint.pt")  # a resumed run keeps the last estimate
    assert trainer.router.tau == taus[3]


def _cosines(grads: dict[str, torch.Tensor], direction) -> torch.Tensor:
    """`[P]`: by hand, cos(∇δS log p(completion), v) over all modules together."""
    g = torch.cat([grads[n] for n in sorted(grads)], dim=1)
    v = torch.cat([direction.vectors[n] for n in sorted(grads)]).to(g)
    return (g @ v) / (g.norm(dim=1) * v.norm())


@pytest.mark.parametrize("arm", ["activation", "route"])
def test_a_midpoint_gate_is_the_hack_pairs_midpoint_under_the_current_policy(path, tmp_path, arm):
    """`gate_calibration: midpoint`: each step's τ is the midpoint of the hacking and clean
    pairs' mean scores, recomputed by hand here under the adapters the step starts from.
    For Arm B it starts at 0 (its offsets are the base's midpoints) and moves with the
    policy."""
    trainer = GRPOTrainer(_config(path, tmp_path, arm=arm, lr=0.5, gate_calibration="midpoint"))
    hack, clean = trainer.router.pairs
    model, adapters, direction = trainer.model, trainer.adapters, trainer.direction
    taus, wanted = [], []
    for _ in range(3):
        if arm == "activation":
            means = []
            for batch in (hack, clean):
                pooled = capture_pooled(model, adapters, batch)
                per_module = [
                    pooled[n] @ direction.vectors[n] - direction.offsets[n] for n in pooled
                ]
                means.append(torch.stack(per_module).mean(0).mean())
        else:
            grads = [per_sequence_gradients(model, adapters, b) for b in (hack, clean)]
            means = [_cosines(g, direction).mean() for g in grads]
        wanted.append(float(sum(means) / 2))
        taus.append(trainer.step()[0].tau)
    assert taus == pytest.approx(wanted, abs=1e-4)
    if arm == "activation":
        assert taus[0] == pytest.approx(0.0, abs=1e-4)
    assert abs(taus[-1] - taus[0]) > 1e-3  # the policy moved, and τ with it


def test_calibration_is_refused_where_it_has_no_own_decision(path, tmp_path):
    for bad in (
        {"arm": "none", "gate_calibration": "midpoint"},
        {"arm": "route", "gate_calibration": "midpoint", "random_flags": 0.3},
        {"arm": "route", "gate_calibration": "midpoint", "oracle_flags": True},
        {"arm": "activation", "gate_calibration": "midpoint", "activation_granularity": "token"},
    ):
        with pytest.raises(pydantic.ValidationError, match="gate_calibration re-estimates"):
            _config(path, tmp_path, **bad)
    with pytest.raises(pydantic.ValidationError, match="gate_quantile"):
        _config(path, tmp_path, arm="route", gate_calibration="quantile")
    with pytest.raises(pydantic.ValidationError, match="gate_quantile"):
        _config(path, tmp_path, arm="route", gate_quantile=0.2)
    with pytest.raises(pydantic.ValidationError, match="oracle_flip"):
        _config(path, tmp_path, arm="route", oracle_flip=0.2)


def test_flag_quality_is_logged_against_the_labels(path, tmp_path):
    """Precision and recall of each step's flags against its rollouts' hack labels: the
    oracle's flags score 1 and 1; flagging every rollout gives precision = the hack rate
    and recall 1; flagging none, no precision and recall 0. Vanilla has no flags to score."""
    steps = dict(steps=3, arm="route")
    oracle = _train(_config(path, tmp_path / "o", oracle_flags=True, **steps))
    assert any(0 < r["rollout_hack_rate"] < 1 for r in oracle)
    for r in oracle:
        assert r["flag_precision"] == (1.0 if r["rollout_hack_rate"] > 0 else None)
        assert r["flag_recall"] == (1.0 if r["rollout_hack_rate"] > 0 else None)
    every = _train(_config(path, tmp_path / "all", random_flags=1.0, **steps))
    for r in every:
        assert r["flag_precision"] == pytest.approx(r["rollout_hack_rate"])
        assert r["flag_recall"] == (1.0 if r["rollout_hack_rate"] > 0 else None)
    none = _train(_config(path, tmp_path / "none", random_flags=0.0, **steps))
    for r in none:
        assert r["flag_precision"] is None
        assert r["flag_recall"] == (0.0 if r["rollout_hack_rate"] > 0 else None)
    vanilla = _train(_config(path, tmp_path / "vanilla"))
    assert "flag_precision" not in vanilla[0] and "flag_recall" not in vanilla[0]


@pytest.mark.parametrize("flip", [0.1, 0.2, 0.4])
def test_a_noisy_oracle_flips_the_share_asked(path, tmp_path, flip):
    """`oracle_flip`: each step's flags differ from the labels on floor(flip·B + u) of its
    B rollouts, that share is logged as `oracle_flipped`, and over the steps it is the share
    asked (expected exactly; here within the noise of u over a few steps)."""
    cfg = _config(path, tmp_path, arm="route", oracle_flags=True, oracle_flip=flip, lr=0.01)
    trainer = GRPOTrainer(cfg)
    shares = []
    for _ in range(6):
        metrics, grades, decision = trainer.step()
        hacked = torch.tensor([g.eval_only.hacked for g in grades])
        n = len(hacked)
        share = int((decision.flags != hacked).sum()) / n
        assert share == metrics.oracle_flipped
        assert abs(share - flip) < 1 / n
        shares.append(share)
    assert sum(shares) / len(shares) == pytest.approx(flip, abs=0.5 / 12)
