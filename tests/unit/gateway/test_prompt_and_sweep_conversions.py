"""Prompts and sweep specs survive the gRPC conversions both ways, with every sweep field set
apart from its default; what a wire field cannot mean (a bool as a token id, an empty grid
axis, a chat message without a role) is refused on the way out, never sent as something else.
"""

from __future__ import annotations

import dataclasses

import pytest

from services.common.errors import InvalidRequestError
from services.engine.sweep import SweepSpec
from services.gateway import grpc_convert as convert


def _no_chat(messages: list[dict]) -> list[int]:
    pytest.fail(f"rendered a chat for a prompt that was not one: {messages}")


@pytest.mark.parametrize("prompt", ["Where is the tower?", [5, 0, 17]])
def test_text_and_token_prompts_round_trip(prompt):
    assert convert.prompt_from_proto(convert.prompt_to_proto(prompt), _no_chat) == prompt


def test_a_chat_prompt_reaches_the_template_message_by_message():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}]
    rendered: list[list[dict]] = []

    def template(messages: list[dict]) -> list[int]:
        rendered.append(messages)
        return [1, 2]

    assert convert.prompt_from_proto(convert.prompt_to_proto(chat), template) == [1, 2]
    assert rendered == [chat]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([True, 3], "a prompt is a string"),  # a bool is an int to Python, never a token id
        ([1, "2"], "a prompt is a string"),
        (3, "a prompt is a string"),
        ([{"role": "user"}], "chat message 0"),
        ([{"role": "", "content": "x"}], "chat message 0"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], "chat message 1"),
    ],
)
def test_what_is_not_a_prompt_is_refused(prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        convert.prompt_to_proto(prompt)


# Between them, every field away from its default (a sweep has a clean prompt or a source run).
SWEEPS = [
    SweepSpec(
        corrupt_prompt="The capital of France is",
        answer_token="Paris",
        clean_prompt=[3, 4, 5, 6],
        layers=[0, 2],
        positions=[1, "capital"],
        sites=["pre_attn", "post_attn"],
        alpha=0.3,
        foil_token=42,
        metric="logit_diff",
    ),
    SweepSpec(
        corrupt_prompt=[7, 8, 9],
        answer_token=5,
        source_run="clean@2",
        foil_token="Rome",
        metric="recovered",
    ),
]


def test_every_sweep_field_round_trips():
    default = SweepSpec(corrupt_prompt="", answer_token=0)
    same = [
        f.name
        for f in dataclasses.fields(SweepSpec)
        if all(getattr(s, f.name) == getattr(default, f.name) for s in SWEEPS)
    ]
    assert not same, f"give these SweepSpec fields a non-default value in SWEEPS: {same}"
    for spec in SWEEPS:
        assert convert.sweep_spec_from_proto(convert.sweep_spec_to_proto(spec), _no_chat) == spec


def test_default_sweep_axes_round_trip_as_their_defaults():
    spec = SweepSpec(corrupt_prompt=[7, 8], answer_token=5, clean_prompt=[7, 9])
    assert convert.sweep_spec_from_proto(convert.sweep_spec_to_proto(spec), _no_chat) == spec


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"answer_token": True}, "answer_token must be a token id"),
        ({"foil_token": False}, "foil_token must be a token id"),
        ({"layers": []}, "layers must be 'all' or a non-empty list"),
        ({"positions": []}, "positions must be 'all_prompt' or a non-empty list"),
        ({"sites": []}, "sites must be 'post_block' or a non-empty list"),
    ],
)
def test_what_a_sweep_field_cannot_mean_is_refused(change, match):
    spec = dataclasses.replace(SWEEPS[0], **change)
    with pytest.raises(InvalidRequestError, match=match):
        convert.sweep_spec_to_proto(spec)
