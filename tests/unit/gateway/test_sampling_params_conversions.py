"""Every `SamplingParams` field survives each conversion a request goes through: Python ->
protobuf -> Python (the gRPC front and client) and OpenAI body -> Python (the HTTP API).

The fields come from `dataclasses.fields`, so a field added to `SamplingParams` and not
carried fails here (first for want of a non-default value below, then for being dropped).
A field an OpenAI body cannot express is listed in `NOT_IN_OPENAI_BODIES` with the reason.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.engine.sampling_params import SamplingParams
from services.gateway import grpc_convert as convert
from services.gateway.openai_api import CompletionRequest, sampling_params

# A value other than the default for every field, in the JSON form both an OpenAI body and
# SamplingParams take (vectors by registered name, so parsed specs compare with ==).
NON_DEFAULT: dict[str, object] = {
    "n": 2,
    "max_tokens": 7,
    "temperature": 0.5,
    "top_k": 5,
    "top_p": 0.9,
    "min_p": 0.1,
    "seed": 42,
    "stop": ["END"],
    "stop_token_ids": [3],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "logprobs": 3,
    "logprob_token_ids": [5, 6],
    "prompt_logprobs": 2,
    "skip_special_tokens": False,
    "steering": {
        "vectors": [{"site": "post_attn", "layers": [1], "vector": "v", "scale": 2.0}],
        "gates": [
            {
                "when": {"probe": "p", "layer": 1, "threshold": 0.5, "sharpness": 3.0},
                "scope": "rest_of_request",
                "apply": {"attenuate": {"vector": "v", "scale": 0.5}},
            }
        ],
        "abort_when": [{"probe": "p", "layer": 0, "threshold": 1.5}],
    },
    "capture": {"sites": {"post_block": [0, 1]}, "positions": "all_prompt"},
    "readouts": [{"probe": "p", "site": "pre_attn", "layer": 1, "name": "r"}],
    "patch": [{"layer": 0, "position": 1, "alpha": 0.5, "source": {"zeros": True}}],
    "conversation_id": "conv-1",
    "adapter": "tuned",
    "adapter_variant": "deploy",
}

# Fields an OpenAI request body cannot carry, and why.
NOT_IN_OPENAI_BODIES = {
    "prompt_logprobs": "an OpenAI response has no place for prompt logprobs; use gRPC or Python",
}


def _every_field_set() -> SamplingParams:
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    missing = [name for name in fields if name not in NON_DEFAULT]
    assert not missing, f"give these new SamplingParams fields a non-default value: {missing}"
    params = SamplingParams(**{name: NON_DEFAULT[name] for name in fields})
    default = SamplingParams()
    same = [name for name in fields if getattr(params, name) == getattr(default, name)]
    assert not same, f"these values are the defaults, so they prove nothing: {same}"
    return params


def test_every_field_round_trips_through_protobuf():
    params = _every_field_set()
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(params))
    for f in dataclasses.fields(SamplingParams):
        assert getattr(back, f.name) == getattr(params, f.name), f.name


def test_defaults_round_trip_through_protobuf():
    # Absent optional fields must come back as SamplingParams' defaults, not as zeros.
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(SamplingParams()))
    assert back == SamplingParams()


def test_every_field_an_openai_body_can_express_is_carried():
    params = _every_field_set()
    body = {
        f.name: NON_DEFAULT[f.name]
        for f in dataclasses.fields(SamplingParams)
        if f.name not in NOT_IN_OPENAI_BODIES
    }
    # as the HTTP app reads it: JSON text
    got = sampling_params(
        CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **body}))
    )
    for f in dataclasses.fields(SamplingParams):
        if f.name not in NOT_IN_OPENAI_BODIES:
            assert getattr(got, f.name) == getattr(params, f.name), f.name


@pytest.mark.parametrize("name", sorted(NOT_IN_OPENAI_BODIES))
def test_a_field_openai_bodies_cannot_express_is_refused_not_ignored(name):
    with pytest.raises(ValueError, match=name):
        CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", name: NON_DEFAULT[name]}))
