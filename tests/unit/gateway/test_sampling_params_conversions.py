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
from pydantic import BaseModel

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
    "detokenize": False,  # with stop strings refused: see APART
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
    "detokenize": "an OpenAI response is its text; token ids alone come over gRPC or Python",
}
# `detokenize=False` refuses stop strings (they are matched in the text), so it is set in a
# request of its own, whose stop strings keep their default.
APART = {"detokenize": NON_DEFAULT["detokenize"], "stop": []}


# Every field of every nested model (steering, gates, capture, read-outs, patches) away from
# its default, over requests that together take each branch where a model's fields exclude one
# another: a gate adds or attenuates, a patch source is a run, a vector or zeros, capture
# positions are listed or named.
NESTED: list[dict[str, object]] = [
    {
        "steering": {
            "vectors": [
                {"site": "post_attn", "layers": [1], "vector": "v", "scale": 2.0, "phase": "decode"}
            ],
            "gates": [
                {
                    "when": {
                        "probe": "p",
                        "site": "pre_attn",
                        "layer": 1,
                        "threshold": 0.5,
                        "sharpness": 3.0,
                    },
                    "scope": "rest_of_request",
                    "apply": {"attenuate": {"vector": "v", "scale": 0.5}},
                },
                {
                    "when": {"probe": "q", "layer": 2, "threshold": -1.0, "sharpness": 2.0},
                    "apply": {"add": {"vector": "w", "scale": 1.5}},
                },
            ],
            "abort_when": [
                {"probe": "p", "site": "post_attn", "layer": 1, "threshold": 1.5, "sharpness": 4.0}
            ],
        },
        "capture": {
            "sites": {"post_block": [1, 2], "pre_attn": "all"},
            "positions": [1, 3],
            "sink": "patch_store",
            "run": "clean",
            "dtype": "bfloat16",
        },
        "readouts": [{"probe": "p", "site": "pre_attn", "layer": 1, "name": "r"}],
        "patch": [
            {
                "layer": 1,
                "site": "post_attn",
                "position": 2,
                "alpha": 0.3,
                "source": {"run": "clean", "position": 3},
            },
            {"layer": 2, "site": "pre_attn", "position": 1, "source": {"vector": "v"}},
            {"layer": 1, "position": 4, "source": {"zeros": True}},
        ],
    },
    {"capture": {"sites": {"post_attn": [2]}, "positions": "all_generated"}},
]


def _nested_fields_left_at_default(values: list[object]) -> list[str]:
    """`Model.field` for each field of each pydantic model reachable from `values` that no
    instance sets to a value other than its default and the wire's zero (0, "", [], None)."""
    moved: dict[str, bool] = {}

    def walk(value: object) -> None:
        if isinstance(value, BaseModel):
            for name, field in type(value).model_fields.items():
                v = getattr(value, name)
                key = f"{type(value).__name__}.{name}"
                set_apart = bool(v) and (field.is_required() or v != field.default)
                moved[key] = moved.get(key, False) or set_apart
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    for value in values:
        walk(value)
    return sorted(key for key, was_moved in moved.items() if not was_moved)


def _every_field_set() -> SamplingParams:
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    missing = [name for name in fields if name not in NON_DEFAULT]
    assert not missing, f"give these new SamplingParams fields a non-default value: {missing}"
    params = SamplingParams(**{name: NON_DEFAULT[name] for name in fields if name != "detokenize"})
    default = SamplingParams()
    same = [name for name in fields if getattr(params, name) == getattr(default, name)]
    assert same == ["detokenize"], f"these values are the defaults, so they prove nothing: {same}"
    return params


@pytest.mark.parametrize("apart", [False, True])
def test_every_field_round_trips_through_protobuf(apart):
    params = _every_field_set()
    if apart:
        params = dataclasses.replace(params, **APART)
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(params))
    for f in dataclasses.fields(SamplingParams):
        assert getattr(back, f.name) == getattr(params, f.name), f.name


def test_every_nested_field_round_trips_through_protobuf():
    together = {k: v for k, v in NON_DEFAULT.items() if k != "detokenize"}  # see APART
    requests = [SamplingParams(**{**together, **nested}) for nested in NESTED]
    values = [getattr(p, f.name) for p in requests for f in dataclasses.fields(p)]
    left = _nested_fields_left_at_default(values)
    assert not left, f"set these nested fields apart from their defaults in NESTED: {left}"
    for params in requests:
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
