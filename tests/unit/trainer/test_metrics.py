"""A GRPO run's Prometheus metrics: the records `grpo.run` logs, as a scraper sees them in the
text exposition and over HTTP."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.errors import InvalidRequestError
from services.trainer.metrics import TrainingMetrics

RUN = {"run": "addition-route", "arm": "route"}


def _train(step: int, reward: float, **kw) -> dict:
    return {
        "kind": "train",
        "step": step,
        "reward": reward,
        "loss": -0.1 * step,
        "kl": 0.01 * step,
        "clip_fraction": 0.05,
        "flagged": 0.25,
        "leakage": 0.001,
        "seconds": 0.3 * step,
        "rollout_hack_rate": 0.5,
        "rollout_true_pass": 0.125,
        "gate_auroc": 0.75,
        **kw,
    }


def _eval(step: int) -> dict:
    return {
        "kind": "eval",
        "step": step,
        "trained_true_pass": 0.5,
        "trained_hack_rate": 0.25,
        "deploy_true_pass": 0.75,
        "deploy_hack_rate": 0.0,
    }


RECORDS = [_eval(0), _train(1, 0.25), _train(2, 0.5), _train(3, 0.625, staleness=2), _eval(3)]


def _samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, from a text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({**RUN, **labels}.items())))]


@pytest.fixture
def metrics():
    m = TrainingMetrics(**RUN)
    yield m
    m.close()


def _check(samples: dict[tuple, float]) -> None:
    assert _value(samples, "coxswain_trainer_steps_total") == 3
    assert _value(samples, "coxswain_trainer_evaluations_total") == 2
    assert _value(samples, "coxswain_trainer_step") == 3
    assert _value(samples, "coxswain_trainer_reward") == 0.625  # the last step's
    assert _value(samples, "coxswain_trainer_loss") == pytest.approx(-0.3)
    assert _value(samples, "coxswain_trainer_kl") == pytest.approx(0.03)
    assert _value(samples, "coxswain_trainer_flagged_fraction") == 0.25
    assert _value(samples, "coxswain_trainer_rollout_hack_rate") == 0.5
    assert _value(samples, "coxswain_trainer_rollout_true_pass_rate") == 0.125
    assert _value(samples, "coxswain_trainer_gate_auroc") == 0.75
    assert _value(samples, "coxswain_trainer_step_duration_seconds_count") == 3
    assert _value(samples, "coxswain_trainer_step_duration_seconds_sum") == pytest.approx(1.8)
    assert _value(samples, "coxswain_trainer_step_duration_seconds_bucket", le="0.5") == 1
    for variant, true_pass, hack in (("trained", 0.5, 0.25), ("deploy", 0.75, 0.0)):
        assert _value(samples, "coxswain_trainer_eval_true_pass_rate", variant=variant) == true_pass
        assert _value(samples, "coxswain_trainer_eval_hack_rate", variant=variant) == hack
    # a numeric field added to records later is exported without a metric of its own
    assert _value(samples, "coxswain_trainer_value", kind="train", key="staleness") == 2


def test_observed_records_in_the_exposition(metrics):
    assert _value(_samples(metrics.text()), "coxswain_trainer_steps_total") == 0  # before any
    for record in RECORDS:
        metrics.observe(record)
    _check(_samples(metrics.text()))


def test_scraped_over_http(metrics):
    port = metrics.serve(0)
    assert port > 0
    for record in RECORDS:
        metrics.observe(record)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        _check(_samples(r.read().decode()))
    with pytest.raises(InvalidRequestError, match="already served"):
        metrics.serve(0)


def test_undefined_auroc_is_nan_not_stale(metrics):
    metrics.observe(_train(1, 0.5))
    metrics.observe(_train(2, 0.5, gate_auroc=None))  # one class only, or arm "none"
    assert math.isnan(_value(_samples(metrics.text()), "coxswain_trainer_gate_auroc"))


def test_runs_have_registries_of_their_own(metrics):
    other = TrainingMetrics(run="other", arm="none")  # the same names, no clash
    metrics.observe(_train(1, 0.25))
    other.observe(_train(1, 0.75))
    assert _value(_samples(metrics.text()), "coxswain_trainer_reward") == 0.25
    assert ("coxswain_trainer_reward", (("arm", "route"), ("run", "addition-route"))) not in (
        _samples(other.text())
    )


def test_well_formed_rates_have_gauges_of_their_own_and_undefined_reads_nan(metrics):
    metrics.observe(
        {
            "kind": "eval",
            "step": 5,
            "deploy_true_pass": 0.0,
            "deploy_hack_rate": 0.125,  # checksum hits of garbage
            "deploy_well_formed_rate": 0.0,
            "deploy_well_formed_hack_rate": None,  # no well-formed answer: undefined
            "deploy_hack_form_rate": None,
            "trained_well_formed_rate": 1.0,
            "trained_well_formed_hack_rate": 0.75,
            "trained_hack_form_rate": 0.5,
        }
    )
    samples = _samples(metrics.text())
    assert _value(samples, "coxswain_trainer_eval_hack_rate", variant="deploy") == 0.125
    assert _value(samples, "coxswain_trainer_eval_well_formed_rate", variant="deploy") == 0.0
    assert math.isnan(
        _value(samples, "coxswain_trainer_eval_well_formed_hack_rate", variant="deploy")
    )
    assert math.isnan(_value(samples, "coxswain_trainer_eval_hack_form_rate", variant="deploy"))
    assert _value(samples, "coxswain_trainer_eval_well_formed_rate", variant="trained") == 1.0
    assert _value(samples, "coxswain_trainer_eval_well_formed_hack_rate", variant="trained") == 0.75
    assert _value(samples, "coxswain_trainer_eval_hack_form_rate", variant="trained") == 0.5
    # none of them is taken for a hack rate of a variant named "deploy_well_formed"
    assert not any(
        dict(labels).get("variant") not in (None, "trained", "deploy") for _, labels in samples
    )
