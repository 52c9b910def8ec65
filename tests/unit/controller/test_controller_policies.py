"""Policies as the controller runs them: read-out entries in, the actions a user would see out,
with their hysteresis, rates, latches and bounds; and configs refused with clear messages."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequestError
from services.controller.messages import ReadoutEntry
from services.controller.policies import Policy, build_policy, parse_policy
from services.engine.interventions.actions import (
    RequestSteeringOverride,
    SteeringMonitorUpdate,
    SteeringScaleUpdate,
    SteeringVectorUpdate,
)

STEER = {"vectors": [{"layers": [1], "vector": [1.0, 0.0, 0.0, 0.0], "phase": "decode"}]}


def entry(score=None, *, rid="r1", token=0, replica="rep", conv=None, finish=None, sample=0):
    scores = {} if score is None else {"p": score}
    return ReadoutEntry(replica, rid, sample, token, scores, conv, finish)


# -- scale --------------------------------------------------------------------------------


def scale(**kw):
    cfg = {"kind": "scale", "name": "s", "readout": "p", "target": 1.0, "k": -1.0, "offset": 1.0}
    return build_policy(cfg | kw)


def test_scale_sets_the_clipped_gain_of_the_request():
    p = scale(deadband=0.0, min_interval_tokens=1)
    assert p.process(entry(0.5, token=0)) == []  # 1 - (0.5 - 1) = 1.5 -> clipped 1.0: unchanged
    assert p.process(entry(1.25, token=1)) == [SteeringScaleUpdate(0.75, "request", "r1")]
    assert p.process(entry(9.0, token=2)) == [SteeringScaleUpdate(0.0, "request", "r1")]
    assert p.process(entry(9.0, token=3)) == []  # same gain: nothing to send
    assert p.status()["actions"] == 2


def test_scale_deadband_and_min_interval_keep_it_from_flooding():
    p = scale(deadband=0.2, min_interval_tokens=3)
    assert p.process(entry(1.1, token=0)) == []  # 0.9: moved by less than the deadband
    assert p.process(entry(1.5, token=1)) == [SteeringScaleUpdate(0.5, "request", "r1")]
    assert p.process(entry(2.0, token=2)) == []  # 0.0, but only 1 token since the last update
    assert p.process(entry(2.0, token=3)) == []
    assert p.process(entry(2.0, token=4)) == [SteeringScaleUpdate(0.0, "request", "r1")]


def test_scale_tracks_requests_apart_and_forgets_them_when_finished():
    p = scale(deadband=0.0, min_interval_tokens=1)
    assert p.process(entry(2.0, rid="a")) == [SteeringScaleUpdate(0.0, "request", "a")]
    assert p.process(entry(2.0, rid="b")) == [SteeringScaleUpdate(0.0, "request", "b")]
    assert p.status()["tracked"] == 2
    p.process(entry(None, rid="a", token=None, finish="length"))
    assert p.status()["tracked"] == 1
    assert p.process(entry(2.0, rid="b", sample=1)) == []  # one gain per request: sample 0's


def test_scale_on_the_replicas_dynamic_tier():
    p = scale(tier="dynamic", per_request=False, deadband=0.0, min_interval_tokens=2)
    assert p.process(entry(2.0, rid="a")) == [SteeringScaleUpdate(0.0, "dynamic", None)]
    assert p.process(entry(0.0, rid="b")) == []  # 1 tick (any request) since the update
    assert p.process(entry(0.0, rid="c")) == [SteeringScaleUpdate(1.0, "dynamic", None)]
    assert p.process(entry(2.0, rid="a", replica="other")) == [
        SteeringScaleUpdate(0.0, "dynamic", None)
    ]


def test_scale_ignores_entries_without_its_readout():
    p = scale()
    assert p.process(entry(None)) == []
    assert p.status()["entries"] == 0


# -- monitor ------------------------------------------------------------------------------


def monitor(**kw):
    cfg = {
        "kind": "monitor",
        "name": "m",
        "readout": "p",
        "fire_threshold": 0.0,
        "window": 4,
        "min_tokens": 4,
        "install_rate": 0.5,
        "clear_rate": 0.25,
        "monitor": {"layer": 1, "probe": "honesty", "threshold": 0.5, "sharpness": 4.0},
    }
    return build_policy(cfg | kw)


def test_monitor_installs_at_the_install_rate_and_clears_at_the_clear_rate():
    p = monitor()
    for s in (1.0, -1.0, -1.0):
        assert p.process(entry(s)) == []  # fewer than min_tokens
    assert p.process(entry(1.0)) == [SteeringMonitorUpdate("post_block", 1, "honesty", 0.5, 4.0)]
    # a fresh window after the change; a rate of 0.5 (above clear_rate) keeps it installed
    assert [p.process(entry(s)) for s in (1.0, -1.0, 1.0, -1.0)] == [[]] * 4
    # the window is now [F, T, F, F]: a rate of 0.25 <= clear_rate
    assert p.process(entry(-1.0)) == [SteeringMonitorUpdate("post_block", 1, None)]
    assert p.status()["installs"] == 1 and p.status()["clears"] == 1


def test_monitor_rates_are_per_replica_and_carry_the_dynamic_vector():
    p = monitor(dynamic={"layers": [1, 2], "vector": [0.5, 0.5], "scale": 2.0})
    for _ in range(4):
        out = p.process(entry(1.0, replica="a"))
    assert out == [
        SteeringVectorUpdate("post_block", [1, 2], [0.5, 0.5], 2.0),
        SteeringMonitorUpdate("post_block", 1, "honesty", 0.5, 4.0),
    ]
    assert p.status()["installed_on"] == ["a"]
    for _ in range(3):
        assert p.process(entry(1.0, replica="b")) == []  # b has its own window
    for _ in range(4):
        out = p.process(entry(-1.0, replica="a"))
    assert out == [
        SteeringMonitorUpdate("post_block", 1, None),
        SteeringVectorUpdate("post_block", [1, 2], None),
    ]


# -- latch --------------------------------------------------------------------------------


def latch(**kw):
    cfg = {"kind": "latch", "name": "l", "readout": "p", "threshold": 1.0, "steering": STEER}
    return build_policy(cfg | kw)


def test_latch_steers_the_firing_request_and_the_rest_of_its_conversation():
    p = latch()
    assert p.process(entry(0.5, rid="a", conv="c", token=0)) == []
    assert p.process(entry(2.0, rid="a", conv="c", token=1)) == [
        RequestSteeringOverride("a", p.config.steering)
    ]
    assert p.process(entry(0.0, rid="a", conv="c", token=2)) == []  # once per request
    # the conversation's next request, as soon as its first entry arrives (no score needed)
    assert p.process(entry(None, rid="b", conv="c", token=0)) == [
        RequestSteeringOverride("b", p.config.steering)
    ]
    assert p.process(entry(0.0, rid="x", conv="other", token=0)) == []
    assert p.status()["latched_conversations"] == 1 and p.status()["fired"] == 1


def test_latch_without_a_conversation_steers_only_the_firing_request():
    p = latch()
    assert p.process(entry(2.0, rid="a")) == [RequestSteeringOverride("a", p.config.steering)]
    assert p.process(entry(0.0, rid="b")) == []
    assert p.status()["latched_conversations"] == 0


def test_latch_fired_on_a_final_token_still_latches_the_conversation():
    p = latch()
    assert p.process(entry(2.0, rid="a", conv="c", finish="stop")) == []  # a is done
    assert p.process(entry(None, rid="b", conv="c")) == [
        RequestSteeringOverride("b", p.config.steering)
    ]


def test_latch_is_a_bounded_lru_with_counted_evictions():
    p = latch(max_conversations=2)
    for conv in ("c1", "c2"):
        p.process(entry(2.0, rid=conv, conv=conv))
    p.process(entry(None, rid="c1-next", conv="c1"))  # c1 used again: c2 is now the oldest
    p.process(entry(2.0, rid="c3", conv="c3"))
    assert p.status()["evictions"] == 1 and p.status()["latched_conversations"] == 2
    assert p.is_latched("c1") and p.is_latched("c3") and not p.is_latched("c2")
    assert p.process(entry(None, rid="c2-next", conv="c2")) == []


# -- configs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"kind": "nope", "name": "x", "readout": "p"}, "kind"),
        ({"kind": "scale", "name": "x", "readout": "p", "target": 0}, "k: Field required"),
        (
            {"kind": "scale", "name": "x", "readout": "p", "target": 0, "k": 1, "min_gain": 2},
            "min_gain must be <= max_gain",
        ),
        (
            {"kind": "scale", "name": "x", "readout": "p", "target": 0, "k": 1,
             "per_request": False},
            "per_request=false needs tier 'dynamic'",
        ),
        (
            {"kind": "scale", "name": "bad name", "readout": "p", "target": 0, "k": 1},
            "name",
        ),
        (
            {"kind": "scale", "name": "x", "readout": "p", "target": float("nan"), "k": 1},
            "target",
        ),
        (
            {"kind": "monitor", "name": "x", "readout": "p", "fire_threshold": 0,
             "install_rate": 0.2, "clear_rate": 0.3, "monitor": {"layer": 0, "probe": "v"}},
            "clear_rate must be below install_rate",
        ),
        (
            {"kind": "monitor", "name": "x", "readout": "p", "fire_threshold": 0,
             "monitor": {"layer": 0, "probe": "v", "site": "nowhere"}},
            "site",
        ),
        (
            {"kind": "monitor", "name": "x", "readout": "p", "fire_threshold": 0,
             "monitor": {"layer": 0, "probe": {"dtype": "float32", "shape": [2], "data": "!"}}},
            "monitor.probe",
        ),
        ({"kind": "latch", "name": "x", "readout": "p", "threshold": 0, "steering": {}},
         "steering is empty"),
        (
            {"kind": "latch", "name": "x", "readout": "p", "threshold": 0,
             "steering": {"vectors": [{"layers": [0], "vector": [1.0], "phase": "prefill"}]}},
            "phase='prefill' never applies",
        ),
        (
            {"kind": "latch", "name": "x", "readout": "p", "threshold": 0,
             "steering": {"abort_when": {"probe": [1.0], "layer": 0}}},
            "abort_when cannot be latched",
        ),
        ({"kind": "latch", "name": "x", "readout": "p", "threshold": 0, "steering": STEER,
          "extra": 1}, "extra"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_problem(cfg, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_policy(cfg)


class Exploding(Policy):
    """A user-written policy with a bug."""

    kind = "exploding"

    def on_readout(self, entry):
        raise RuntimeError("boom")


def test_a_policy_failure_is_counted_not_raised():
    p = Exploding(
        parse_policy(
            {"kind": "latch", "name": "x", "readout": "p", "threshold": 0, "steering": STEER}
        )
    )
    assert p.process(entry(2.0)) == []
    assert p.status()["errors"] == 1 and p.status()["last_error"] == "RuntimeError: boom"
