"""Policies and status through their gRPC messages: the same configs come back, unset
optional fields take the Python defaults, and malformed messages are refused."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.wire import pack_tensor
from services.controller import convert
from services.controller.policies import parse_policy
from services.engine.interventions.spec import parse_steering
from services.proto.coxswain.v1 import controller_pb2 as pb


def packed(seed: int, n: int = 8) -> dict:
    return pack_tensor(torch.randn(n, generator=torch.Generator().manual_seed(seed)))


CONFIGS = [
    {"kind": "scale", "name": "s", "readout": "p", "target": 0.5, "k": -2.0, "tier": "dynamic",
     "per_request": False, "deadband": 0.0, "min_interval_tokens": 2},
    {"kind": "monitor", "name": "m", "readout": "p", "fire_threshold": 1.0, "window": 8,
     "min_tokens": 4, "install_rate": 0.5, "clear_rate": 0.1,
     "monitor": {"site": "post_attn", "layer": 1, "probe": packed(1), "threshold": 0.2,
                 "sharpness": 5.0, "gate_rows": True},
     "dynamic": {"layers": [1, 2], "vector": "honesty", "scale": 3.0}},
    {"kind": "monitor", "name": "m2", "readout": "p", "fire_threshold": 1.0,
     "monitor": {"layer": 0, "probe": "honesty"}},
    {"kind": "latch", "name": "l", "readout": "p", "threshold": 2.0, "max_conversations": 5,
     "steering": {
         "vectors": [{"site": "post_block", "layers": [1], "vector": packed(2), "scale": 2.0,
                      "phase": "decode"}],
         "gates": [{"when": {"probe": packed(3), "layer": 1, "threshold": 0.5},
                    "scope": "rest_of_request", "apply": {"attenuate": 1.0}}],
     }},
]  # fmt: skip


@pytest.mark.parametrize("raw", CONFIGS, ids=lambda c: c["name"])
def test_policy_round_trips_through_its_message(raw):
    cfg = parse_policy(raw)
    msg = convert.policy_to_proto(cfg)
    back = convert.policy_from_proto(msg)
    assert convert.policy_to_proto(back) == msg
    if cfg.kind == "latch":  # the same spec, in the gateway's canonical form
        assert (
            parse_steering(back.steering).model_dump()
            == parse_steering(
                {
                    **cfg.steering,
                    "gates": [
                        {**g, "apply": {"attenuate": {"scale": 1.0}}} for g in cfg.steering["gates"]
                    ],
                }
            ).model_dump()
        )
    else:
        assert back == cfg


def test_unset_optional_fields_take_the_python_defaults():
    msg = pb.Policy(name="s", readout="p", scale=pb.ScalePolicy(target=1.0, k=2.0))
    cfg = convert.policy_from_proto(msg)
    assert cfg == parse_policy({"kind": "scale", "name": "s", "readout": "p", "target": 1, "k": 2})
    assert (cfg.max_gain, cfg.deadband, cfg.min_interval_tokens) == (1.0, 0.05, 4)


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (pb.Policy(name="x", readout="p"), "give one of scale, monitor or latch"),
        (pb.Policy(name="x", readout="p", monitor=pb.MonitorPolicy()), "monitor.monitor"),
        (
            pb.Policy(
                name="x",
                readout="p",
                monitor=pb.MonitorPolicy(monitor=pb.MonitorSpec(layer=0)),
            ),
            "monitor.probe is missing",
        ),
        (pb.Policy(name="", readout="p", latch=pb.LatchPolicy()), "name"),
    ],
)
def test_malformed_policy_messages_are_refused(msg, message):
    with pytest.raises(InvalidRequestError, match=message):
        convert.policy_from_proto(msg)


def test_status_round_trips_through_its_message():
    status = {
        "running": True,
        "ready": True,
        "connected": False,
        "stream": "coxswain:readouts",
        "group": "g",
        "consumer": "c",
        "lag": None,
        "pending": 3,
        "processed": 10,
        "reclaimed": 2,
        "malformed": 1,
        "actions_written": {"r0": 4},
        "actions_dropped": {"r0": 1},
        "redis_errors": 5,
        "reconnects": 1,
        "stream_resets": 1,
        "lost_entries": 0,
        "latched_conversations": 2,
        "last_error": "ConnectionError: gone",
        "last_rejection": "entry 1-0 has no replica",
        "policies_loaded": True,
        "policies": [
            {"name": "l", "kind": "latch", "entries": 9, "actions": 2, "errors": 0,
             "last_error": None, "fired": 3, "latched_conversations": 2, "evictions": 0},
            {"name": "m", "kind": "monitor", "entries": 9, "actions": 1, "errors": 1,
             "last_error": "boom", "installs": 1, "clears": 0, "installed_on": ["r0"]},
        ],
    }  # fmt: skip
    assert convert.status_from_proto(convert.status_to_proto(status)) == status
