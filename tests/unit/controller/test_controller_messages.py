"""The Redis wire format: read-out entries and actions survive the round trip, and malformed
ones are refused with a message naming the problem."""

from __future__ import annotations

import json
import math

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.wire import unpack_tensor
from services.controller.messages import (
    ReadoutEntry,
    action_queue_key,
    decode_action,
    decode_entry,
    encode_action,
    encode_entry,
)
from services.engine.interventions.actions import (
    GlobalSteeringUpdate,
    RequestSteeringOverride,
    SteeringMonitorUpdate,
    SteeringScaleUpdate,
    SteeringVectorUpdate,
)


def test_entry_round_trip_keeps_every_field():
    e = ReadoutEntry("r0", "req-1", 1, 7, {"honesty": 2.5, "x": -1.0}, "conv-9", "length")
    fields = encode_entry(e)
    assert all(isinstance(v, str) for v in fields.values())  # a Redis stream entry
    back = decode_entry("1-0", fields)
    assert back == ReadoutEntry(
        "r0", "req-1", 1, 7, {"honesty": 2.5, "x": -1.0}, "conv-9", "length", stream_id="1-0"
    )
    assert back.finished


def test_finish_only_entry_and_absent_fields():
    e = ReadoutEntry("r0", "req-1", 0, None, finish_reason="probe")
    fields = encode_entry(e)
    assert "token" not in fields and "conversation" not in fields
    back = decode_entry("2-0", fields)
    assert (back.token, back.conversation_id, back.scores, back.finish_reason) == (
        None,
        None,
        {},
        "probe",
    )


def test_non_finite_scores_travel_as_null_and_are_dropped():
    fields = encode_entry(ReadoutEntry("r", "q", 0, 0, {"a": math.nan, "b": 1.0}))
    assert json.loads(fields["scores"]) == {"a": None, "b": 1.0}
    assert decode_entry("1-0", fields).scores == {"b": 1.0}


@pytest.mark.parametrize(
    "fields",
    [{"request": "q", "sample": "0"}, {"replica": "r", "request": "q", "token": "x"}],
)
def test_malformed_entry_is_refused(fields):
    with pytest.raises(InvalidRequestError, match="malformed read-out entry 5-0"):
        decode_entry("5-0", fields)


@pytest.mark.parametrize(
    "action",
    [
        SteeringVectorUpdate("post_block", [1, 2], [0.5, -1.0], scale=2.0),
        SteeringVectorUpdate("pre_attn", [0], None),
        RequestSteeringOverride("r1", {"vectors": [{"layers": [1], "vector": [1.0, 2.0]}]}),
        RequestSteeringOverride("r1", None),
        SteeringScaleUpdate(0.25, tier="dynamic", request_id="r1"),
        SteeringScaleUpdate(0.0),
        SteeringMonitorUpdate("post_attn", 1, "honesty", threshold=0.5, sharpness=3.0),
        GlobalSteeringUpdate(None),
    ],
)
def test_every_action_round_trips(action):
    text = encode_action(action, "latch-1")
    assert json.loads(text)["type"] == type(action).__name__
    assert decode_action(text) == (action, "latch-1")


def test_tensors_travel_packed_with_their_dtype():
    v = torch.randn(8, dtype=torch.float32)
    action, _ = decode_action(encode_action(SteeringVectorUpdate("post_block", [0], v), "p"))
    assert isinstance(action.vector, dict)
    assert torch.equal(unpack_tensor(action.vector), v)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"type": "Explode"}', "unknown action type 'Explode'"),
        ('{"type": "SteeringScaleUpdate"}', "missing fields scale"),
        ('{"type": "SteeringScaleUpdate", "scale": 1, "gain": 2}', "unknown fields gain"),
        ('{"type": "SteeringScaleUpdate", "scale": 1, "source": 3}', "'source' must be"),
    ],
)
def test_malformed_actions_are_refused(text, message):
    with pytest.raises(InvalidRequestError, match=message):
        decode_action(text)


def test_non_finite_action_values_cannot_be_encoded():
    with pytest.raises(ValueError):
        encode_action(SteeringScaleUpdate(math.inf), "p")


def test_queue_key_names_the_replica():
    assert action_queue_key("replica-3") == "coxswain:actions:replica-3"
