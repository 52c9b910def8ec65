"""HTTP and gRPC refuse the same requests, with the same checks.

Each case is built once as an HTTP body and once as the gRPC message, and both go the way
their front takes them (the HTTP body model, then `sampling_params`; the gRPC message
through `grpc_convert`): both must refuse it as the caller's fault, naming the cause, and
the valid neighbour of each case must pass both. Identifiers (run ids, read-out names,
vector names) follow one rule (`spec.check_identifier`); a run id never holds the patch
store's version separator; a chat role is one of OpenAI's; an empty global steering spec is
refused rather than silently clearing global steering.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.errors import InvalidRequestError
from services.engine.interventions.spec import (
    check_identifier,
    check_run_id,
    check_run_ref,
    parse_global_steering,
)
from services.engine.interventions.vectors import check_vector_name
from services.gateway import grpc_convert as convert
from services.gateway.coxswain_api import SweepRequest
from services.gateway.openai_api import ChatCompletionRequest, CompletionRequest, sampling_params
from services.proto.coxswain.v1 import engine_pb2 as pb
from services.proto.coxswain.v1 import sweep_pb2 as sweep_pb

CAPTURE = {"sites": {"post_block": [0]}, "sink": "patch_store"}
VEC = [0.5] * 4


def _http(**extra) -> None:
    """A completions body as the HTTP front takes it."""
    try:
        sampling_params(CompletionRequest.model_validate({"prompt": "hi", **extra}))
    except ValidationError as exc:  # the app answers these with a 400 naming the field
        raise InvalidRequestError(str(exc)) from None


def _grpc(**params) -> None:
    """The same fields as the gRPC front takes them."""
    convert.sampling_params_from_proto(pb.SamplingParams(**params))


def _refused_by_both(http: dict, grpc: dict, cause: str) -> None:
    for front, call in (("HTTP", lambda: _http(**http)), ("gRPC", lambda: _grpc(**grpc))):
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert cause in str(err.value), f"{front}: {err.value}"


def _capture(run: str) -> tuple[dict, dict]:
    http = {"capture": {**CAPTURE, "run": run}}
    grpc = {
        "capture": pb.CaptureSpec(
            sites={"post_block": pb.CaptureLayers(layers=[0])}, sink="patch_store", run=run
        )
    }
    return http, grpc


def _readout(name: str) -> tuple[dict, dict]:
    http = {"readouts": [{"probe": "v", "layer": 0, "name": name}]}
    grpc = {"readouts": [pb.Readout(probe=pb.VectorValue(name="v"), layer=0, name=name)]}
    return http, grpc


def _steer_by_name(name: str) -> tuple[dict, dict]:
    http = {"steering": {"vectors": [{"layers": [0], "vector": name}]}}
    grpc = {
        "steering": pb.SteeringSpec(
            vectors=[pb.SteerVector(layers=[0], vector=pb.VectorValue(name=name))]
        )
    }
    return http, grpc


def _patch_from(run: str) -> tuple[dict, dict]:
    http = {"patch": [{"layer": 0, "position": 0, "source": {"run": run, "position": 0}}]}
    source = pb.PatchSource(run=pb.RunPosition(run=run, position=0))
    grpc = {"patch": [pb.PatchEntry(layer=0, position=0, source=source)]}
    return http, grpc


BAD_IDS = {
    "newline": "a\nb",
    "emoji": "run-\N{GRINNING FACE}",
    "10,000 emoji": "\N{GRINNING FACE}" * 10_000,
    "129 characters": "a" * 129,
    "space": "has space",
}


@pytest.mark.parametrize("label", BAD_IDS)
@pytest.mark.parametrize("field", [_capture, _readout, _steer_by_name])
def test_an_identifier_either_front_refuses_the_other_refuses_too(field, label):
    _refused_by_both(*field(BAD_IDS[label]), cause="use 1-128 letters, digits or _ . : / -")


def test_a_capture_run_id_holding_a_version_is_refused_up_front_by_both():
    """`x@125` names version 125 of run x: storing a run under it fails only after the
    request ran (a 200 with `capture_error`, nothing stored) unless refused up front."""
    _refused_by_both(*_capture("x@125"), cause="'@' names a version of a run")
    with pytest.raises(InvalidRequestError, match="'@' names a version"):
        check_run_id("x@125")


def test_a_patch_source_may_name_a_version_but_not_a_bad_id():
    http, grpc = _patch_from("clean-1@3")
    _http(**http)
    _grpc(**grpc)
    _refused_by_both(*_patch_from("a b@3"), cause="invalid run id 'a b'")
    _refused_by_both(*_patch_from("clean@x"), cause="with an integer version")


def test_good_identifiers_pass_both_fronts():
    for field, good in ((_capture, "clean-1"), (_readout, "p"), (_steer_by_name, "team/h.v1")):
        http, grpc = field(good)
        _http(**http)
        _grpc(**grpc)


def test_vector_names_registry_and_requests_share_the_rule():
    for name in (*BAD_IDS.values(), "", "x@1"):
        with pytest.raises(InvalidRequestError) as by_registry:
            check_vector_name(name)
        with pytest.raises(InvalidRequestError) as by_request:
            check_identifier(name, "vector name")
        assert str(by_registry.value) == str(by_request.value)


def test_a_sweep_source_run_is_checked_by_both_fronts():
    with pytest.raises(ValidationError, match="invalid run id"):
        SweepRequest.model_validate(
            {"corrupt_prompt": "a", "answer_token": 1, "source_run": "a\nb"}
        )
    msg = sweep_pb.SweepRequest(
        corrupt_prompt=pb.Prompt(text="a"), answer=sweep_pb.TokenRef(id=1), source_run="a\nb"
    )
    with pytest.raises(InvalidRequestError, match="invalid run id"):
        convert.sweep_spec_from_proto(msg, lambda messages: [1])
    assert check_run_ref("clean@2") == "clean@2"


def test_a_chat_role_is_one_set_on_both_fronts():
    with pytest.raises(ValidationError, match="role"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "root", "content": "x"}]})
    chat = pb.Prompt(chat=pb.Chat(messages=[pb.ChatMessage(role="root", content="x")]))
    with pytest.raises(InvalidRequestError, match="root"):
        convert.prompt_from_proto(chat, lambda messages: pytest.fail("rendered a bad chat"))
    ok = pb.Prompt(chat=pb.Chat(messages=[pb.ChatMessage(role="developer", content="x")]))
    assert convert.prompt_from_proto(ok, lambda messages: [len(messages)]) == [1]


def test_an_empty_global_spec_is_refused_with_how_to_clear():
    """HTTP's `POST /v1/steering/set {}` and gRPC's `SetGlobal` with an empty spec both go
    through `parse_global_steering` (see their handlers): an empty spec would clear global
    steering while looking like a set."""
    for empty in ({}, {"vectors": []}, convert.steering_from_proto(pb.SteeringSpec())):
        with pytest.raises(InvalidRequestError, match="/v1/steering/clear"):
            parse_global_steering(empty)
    spec = parse_global_steering({"vectors": [{"layers": [0], "vector": VEC}]})
    assert not spec.is_empty
