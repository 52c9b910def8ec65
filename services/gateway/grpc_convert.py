"""Conversions between the engine's gRPC messages and its Python values, one function per
pair and direction, used by the servers (`grpc_server.py`) and the client (`services.client`).

Requests go Python -> protobuf in the client (from an already validated `SamplingParams` or
`SweepSpec`) and protobuf -> Python in the server, where the engine's own schema checks them
again: the wire never decides what is valid. Vectors and captured activations travel as
`Tensor` messages (little-endian bytes + dtype + shape, `services.common.wire`'s convention).

Generate streams the engine's own deltas: one `RequestDelta` is one `GenerateResponse`
(`delta_to_proto` / `delta_from_proto`); a client that wants totals adds them up with the
engine's `OutputAccumulator`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from services.common.errors import CoxswainError, InvalidRequestError
from services.common.wire import decode_vector, unpack_tensor
from services.engine.interventions.spec import (
    CaptureSpec,
    Gate,
    PatchEntry,
    ProbeCondition,
    Readout,
    SteeringSpec,
    SteerVector,
    check_run_ref,
)
from services.engine.outputs import CompletionDelta, RequestDelta
from services.engine.sampling_params import SamplingParams
from services.engine.sweep import Cell, SweepResult, SweepSpec
from services.gateway.openai_api import check_chat_role
from services.patch_store.convert import tensor_from_proto, tensor_to_proto
from services.proto.coxswain.v1 import engine_pb2 as pb
from services.proto.coxswain.v1 import steering_pb2 as steering_pb
from services.proto.coxswain.v1 import sweep_pb2 as sweep_pb

EnginePrompt = str | list[int]  # what EngineService.generate takes
# The message size limit both ends default to: captures of many layers and positions are big.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
EncodeChat = Callable[[list[dict]], list[int]]


def _checked(build: Callable[[], Any], what: str) -> Any:
    """Run a message builder, turning protobuf's TypeError/ValueError for a value that does
    not fit its field (a string for an int, an int past int32) into InvalidRequestError."""
    try:
        return build()
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} does not fit the wire format: {e}") from None


# -- JSON objects (observability snapshots) ----------------------------------------------------


def json_to_proto(value: Mapping[str, Any]) -> pb.JsonObject:
    return pb.JsonObject(json=json.dumps(value, sort_keys=True, default=_json_default))


def _json_default(value: Any) -> Any:
    """Values a snapshot may hold that JSON lacks: tensors and arrays as (nested) lists,
    pydantic models as their dicts (a global spec echoed back as it was set)."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        return value.tolist()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def json_from_proto(msg: pb.JsonObject) -> dict[str, Any]:
    return json.loads(msg.json) if msg.json else {}


# -- prompts -----------------------------------------------------------------------------------


def prompt_to_proto(prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> pb.Prompt:
    """A text, a token-id list, or a chat (a list of `{role, content}` dicts)."""
    if isinstance(prompt, str):
        return pb.Prompt(text=prompt)
    items: list[Any] | None = list(prompt) if isinstance(prompt, Sequence) else None
    if items and all(isinstance(m, Mapping) for m in items):
        messages = []
        for i, m in enumerate(items):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role or not isinstance(content, str):
                raise InvalidRequestError(
                    f"chat message {i} needs a non-empty string `role` and a string `content`"
                )
            messages.append(pb.ChatMessage(role=role, content=content))
        return pb.Prompt(chat=pb.Chat(messages=messages))
    if items is not None and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return _checked(lambda: pb.Prompt(token_ids=pb.TokenIds(ids=items)), "prompt")
    raise InvalidRequestError(
        "a prompt is a string, a list of token ids, or a list of {role, content} messages; "
        f"got {type(prompt).__name__}"
    )


def prompt_from_proto(
    msg: pb.Prompt, encode_chat: EncodeChat, what: str = "prompt"
) -> EnginePrompt:
    """The engine's prompt: text, or token ids (a chat rendered with `encode_chat`)."""
    kind = msg.WhichOneof("kind")
    if kind == "text":
        return msg.text
    if kind == "token_ids":
        return list(msg.token_ids.ids)
    if kind == "chat":
        messages = msg.chat.messages
        for i, m in enumerate(messages):
            check_chat_role(m.role, f"{what}.chat.messages[{i}].role")
        return encode_chat([{"role": m.role, "content": m.content} for m in messages])
    raise InvalidRequestError(f"{what} is missing: give text, token_ids or chat")


# -- vectors -----------------------------------------------------------------------------------


def vector_to_proto(value: Any, what: str) -> pb.VectorValue:
    """A registered name, or a tensor. Tensors and packed objects keep their dtype; float
    lists become float32, exactly as the engine would decode them."""
    if isinstance(value, str):
        return pb.VectorValue(name=value)
    if isinstance(value, torch.Tensor):
        return pb.VectorValue(tensor=tensor_to_proto(value))
    if isinstance(value, Mapping):
        return pb.VectorValue(tensor=tensor_to_proto(unpack_tensor(dict(value))))
    return pb.VectorValue(tensor=tensor_to_proto(decode_vector(value, name=what)))


def vector_from_proto(msg: pb.VectorValue, what: str) -> str | torch.Tensor | None:
    """A registered name, a tensor, or None when the message holds neither (the caller's
    schema then names the missing field)."""
    kind = msg.WhichOneof("value")
    if kind == "name":
        return msg.name
    if kind == "tensor":
        return tensor_from_proto(msg.tensor, what=what)
    return None


# -- interventions: the spec.py models <-> messages -------------------------------------------


def _probe_to_proto(c: ProbeCondition, what: str) -> pb.ProbeCondition:
    return pb.ProbeCondition(
        probe=vector_to_proto(c.probe, f"{what}.probe"),
        site=c.site,
        layer=c.layer,
        threshold=c.threshold,
        sharpness=c.sharpness,
    )


def _probe_from_proto(msg: pb.ProbeCondition, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": msg.layer, "threshold": msg.threshold}
    _put(out, "probe", vector_from_proto(msg.probe, f"{what}.probe"))
    _put(out, "site", msg.site or None)
    if msg.HasField("sharpness"):
        out["sharpness"] = msg.sharpness
    return out


def _gate_to_proto(g: Gate, what: str) -> pb.Gate:
    gate = pb.Gate(when=_probe_to_proto(g.when, f"{what}.when"), scope=g.scope)
    if g.apply.add is not None:
        add = g.apply.add
        gate.add.CopyFrom(
            pb.GateAdd(vector=vector_to_proto(add.vector, f"{what}.add"), scale=add.scale)
        )
    else:
        att = g.apply.attenuate
        if isinstance(att, int | float):  # the shorthand: a scale along the gate's own probe
            gate.attenuate.CopyFrom(pb.GateAttenuate(scale=float(att)))
        else:
            assert att is not None  # GateApply holds exactly one of add and attenuate
            msg = pb.GateAttenuate(scale=att.scale)
            if att.vector is not None:
                msg.vector.CopyFrom(vector_to_proto(att.vector, f"{what}.attenuate"))
            gate.attenuate.CopyFrom(msg)
    return gate


def _gate_from_proto(msg: pb.Gate, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if msg.HasField("when"):
        out["when"] = _probe_from_proto(msg.when, f"{what}.when")
    _put(out, "scope", msg.scope or None)
    kind = msg.WhichOneof("apply")
    if kind is not None:
        part = getattr(msg, kind)
        apply: dict[str, Any] = {}
        _put(apply, "vector", vector_from_proto(part.vector, f"{what}.{kind}"))
        if part.HasField("scale"):
            apply["scale"] = part.scale
        out["apply"] = {kind: apply}
    return out


def _steer_vector_to_proto(v: SteerVector, what: str) -> pb.SteerVector:
    return pb.SteerVector(
        site=v.site,
        layers=v.layers or [],
        vector=vector_to_proto(v.vector, what),
        scale=v.scale,
        phase=v.phase,
    )


def _steer_vector_from_proto(msg: pb.SteerVector, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _put(out, "site", msg.site or None)
    _put(out, "layers", list(msg.layers) or None)
    _put(out, "vector", vector_from_proto(msg.vector, what))
    if msg.HasField("scale"):
        out["scale"] = msg.scale
    _put(out, "phase", msg.phase or None)
    return out


def steering_to_proto(spec: SteeringSpec) -> pb.SteeringSpec:
    """A parsed steering spec (see `parse_steering`) as its message."""

    def build() -> pb.SteeringSpec:
        return pb.SteeringSpec(
            vectors=[
                _steer_vector_to_proto(v, f"steering.vectors[{i}]")
                for i, v in enumerate(spec.vectors)
            ],
            gates=[_gate_to_proto(g, f"steering.gates[{i}]") for i, g in enumerate(spec.gates)],
            abort_when=[
                _probe_to_proto(c, f"steering.abort_when[{i}]")
                for i, c in enumerate(spec.abort_when)
            ],
        )

    return _checked(build, "steering")


def steering_from_proto(msg: pb.SteeringSpec) -> dict[str, Any]:
    """The steering spec's dict form (vectors as tensors), for `parse_steering` to check."""
    return {
        "vectors": [
            _steer_vector_from_proto(v, f"steering.vectors[{i}]") for i, v in enumerate(msg.vectors)
        ],
        "gates": [_gate_from_proto(g, f"steering.gates[{i}]") for i, g in enumerate(msg.gates)],
        "abort_when": [
            _probe_from_proto(c, f"steering.abort_when[{i}]") for i, c in enumerate(msg.abort_when)
        ],
    }


def _capture_to_proto(spec: CaptureSpec) -> pb.CaptureSpec:
    msg = pb.CaptureSpec(sink=spec.sink, run=spec.run or "", dtype=spec.dtype)
    for site, layers in spec.sites.items():
        if layers == "all":
            msg.sites[site].all = True
        else:
            msg.sites[site].layers.extend(layers)
    if isinstance(spec.positions, str):
        msg.named = spec.positions
    else:
        msg.list.positions.extend(spec.positions)
    return msg


def _capture_from_proto(msg: pb.CaptureSpec) -> dict[str, Any]:
    sites: dict[str, Any] = {}
    for site, layers in msg.sites.items():
        if layers.all and layers.layers:
            raise InvalidRequestError(
                f"invalid capture: sites.{site} sets both `all` and `layers`; give one"
            )
        sites[site] = "all" if layers.all else list(layers.layers)
    out: dict[str, Any] = {"sites": sites}
    kind = msg.WhichOneof("positions")
    if kind == "named":
        out["positions"] = msg.named
    elif kind == "list":
        out["positions"] = list(msg.list.positions)
    _put(out, "sink", msg.sink or None)
    _put(out, "run", msg.run or None)
    _put(out, "dtype", msg.dtype or None)
    return out


def _readout_to_proto(r: Readout, what: str) -> pb.Readout:
    return pb.Readout(
        probe=vector_to_proto(r.probe, f"{what}.probe"),
        site=r.site,
        layer=r.layer,
        name=r.name or "",
    )


def _readout_from_proto(msg: pb.Readout, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": msg.layer}
    _put(out, "probe", vector_from_proto(msg.probe, f"{what}.probe"))
    _put(out, "site", msg.site or None)
    _put(out, "name", msg.name or None)
    return out


def _patch_to_proto(p: PatchEntry, what: str) -> pb.PatchEntry:
    msg = pb.PatchEntry(layer=p.layer, site=p.site, position=p.position, alpha=p.alpha)
    src = p.source
    if src.run is not None:
        msg.source.run.CopyFrom(pb.RunPosition(run=src.run, position=src.position or 0))
    elif src.vector is not None:
        msg.source.vector.CopyFrom(vector_to_proto(src.vector, f"{what}.source.vector"))
    else:
        msg.source.zeros = True
    return msg


def _patch_from_proto(msg: pb.PatchEntry, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": msg.layer, "position": msg.position}
    _put(out, "site", msg.site or None)
    if msg.HasField("alpha"):
        out["alpha"] = msg.alpha
    kind = msg.source.WhichOneof("source")
    if kind == "run":
        out["source"] = {"run": msg.source.run.run, "position": msg.source.run.position}
    elif kind == "vector":
        out["source"] = {"vector": vector_from_proto(msg.source.vector, f"{what}.source")}
    elif kind == "zeros":
        out["source"] = {"zeros": msg.source.zeros}
    return out  # no source: the schema names the missing field


def _put(d: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` only when the message gave a value, so the schema's default applies."""
    if value is not None:
        d[key] = value


# -- SamplingParams ----------------------------------------------------------------------------


def sampling_params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    """Every field of a validated `SamplingParams`; None stays absent."""

    def build() -> pb.SamplingParams:
        msg = pb.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            stop=p.stop,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            include_stop_str_in_output=p.include_stop_str_in_output,
            logprob_token_ids=p.logprob_token_ids,
            skip_special_tokens=p.skip_special_tokens,
            readouts=[_readout_to_proto(r, f"readouts[{i}]") for i, r in enumerate(p.readouts)],
            patch=[_patch_to_proto(e, f"patch[{i}]") for i, e in enumerate(p.patch)],
        )
        for name in (
            "max_tokens",
            "seed",
            "logprobs",
            "prompt_logprobs",
            "conversation_id",
            "adapter",
        ):
            if getattr(p, name) is not None:
                setattr(msg, name, getattr(p, name))
        msg.adapter_variant = p.adapter_variant
        if p.steering is not None:
            msg.steering.CopyFrom(steering_to_proto(p.steering))
        if p.capture is not None:
            msg.capture.CopyFrom(_capture_to_proto(p.capture))
        return msg

    return _checked(build, "sampling params")


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """A `SamplingParams` (validated by its own constructor) from its message."""
    kw: dict[str, Any] = {
        "max_tokens": msg.max_tokens if msg.HasField("max_tokens") else None,
        "top_k": msg.top_k,
        "min_p": msg.min_p,
        "stop": list(msg.stop),
        "stop_token_ids": list(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
        "include_stop_str_in_output": msg.include_stop_str_in_output,
        "logprob_token_ids": list(msg.logprob_token_ids),
    }
    if msg.adapter_variant:
        kw["adapter_variant"] = msg.adapter_variant
    for name in (
        "n",
        "temperature",
        "top_p",
        "seed",
        "logprobs",
        "prompt_logprobs",
        "skip_special_tokens",
        "conversation_id",
        "adapter",
    ):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    if msg.HasField("steering"):
        kw["steering"] = steering_from_proto(msg.steering)
    if msg.HasField("capture"):
        kw["capture"] = _capture_from_proto(msg.capture)
    if msg.readouts:
        kw["readouts"] = [
            _readout_from_proto(r, f"readouts[{i}]") for i, r in enumerate(msg.readouts)
        ]
    if msg.patch:
        kw["patch"] = [_patch_from_proto(e, f"patch[{i}]") for i, e in enumerate(msg.patch)]
    return SamplingParams(**kw)


# -- Generate outputs: RequestDelta <-> GenerateResponse -------------------------------------


def _logprobs_to_proto(entries: Sequence[Mapping[int, float] | None]) -> pb.LogprobsList:
    return pb.LogprobsList(
        entries=[
            pb.Logprobs(token_ids=list(e or ()), logprobs=list((e or {}).values())) for e in entries
        ]
    )


def _logprobs_from_proto(msg: pb.Logprobs) -> dict[int, float]:
    if len(msg.token_ids) != len(msg.logprobs):
        raise CoxswainError(
            f"malformed Logprobs: {len(msg.token_ids)} token ids, {len(msg.logprobs)} logprobs"
        )
    return dict(zip(msg.token_ids, msg.logprobs, strict=True))


def _sample_to_proto(d: CompletionDelta) -> pb.CompletionDelta:
    msg = pb.CompletionDelta(
        index=d.index, token_offset=d.token_offset, token_ids=d.token_ids, text=d.text
    )
    if d.logprobs is not None:  # present, even empty, iff the request asked for them
        msg.logprobs.SetInParent()
        msg.logprobs.CopyFrom(_logprobs_to_proto(d.logprobs))
    if d.readouts is not None:
        msg.readouts.SetInParent()
        msg.readouts.entries.extend(pb.Readouts(scores=r) for r in d.readouts)
    if d.finish_reason is not None:
        msg.finish_reason = d.finish_reason
        if isinstance(d.stop_reason, int):
            msg.stop_token_id = d.stop_reason
        elif isinstance(d.stop_reason, str):
            msg.stop_string = d.stop_reason
    return msg


def _sample_from_proto(msg: pb.CompletionDelta) -> CompletionDelta:
    kind = msg.WhichOneof("stop_reason")
    return CompletionDelta(
        index=msg.index,
        token_offset=msg.token_offset,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[_logprobs_from_proto(e) for e in msg.logprobs.entries]
        if msg.HasField("logprobs")
        else None,
        readouts=[dict(e.scores) for e in msg.readouts.entries]
        if msg.HasField("readouts")
        else None,
        finish_reason=msg.finish_reason or None,
        stop_reason=None if kind is None else getattr(msg, kind),
    )


def delta_to_proto(delta: RequestDelta) -> pb.GenerateResponse:
    """One engine delta as one message of a Generate stream."""
    msg = pb.GenerateResponse(
        request_id=delta.request_id,
        finished=delta.finished,
        num_cached_tokens=delta.num_cached_tokens,
        outputs=[_sample_to_proto(d) for d in delta.samples],
    )
    if delta.prompt is not None:
        msg.prompt = delta.prompt
    if delta.prompt_token_ids is not None:  # never empty: the engine refuses empty prompts
        msg.prompt_token_ids.extend(delta.prompt_token_ids)
    if delta.prompt_logprobs is not None:
        msg.prompt_logprobs.SetInParent()
        msg.prompt_logprobs.CopyFrom(_logprobs_to_proto(delta.prompt_logprobs))
    if delta.captures is not None:
        msg.captures.SetInParent()
        for key, t in delta.captures.items():
            msg.captures.tensors[key].CopyFrom(tensor_to_proto(t))
        msg.captures.positions.extend(delta.capture_positions or [])
    for name in ("capture_run", "capture_error", "conversation_id"):
        if getattr(delta, name) is not None:
            setattr(msg, name, getattr(delta, name))
    return msg


def delta_from_proto(msg: pb.GenerateResponse) -> RequestDelta:
    """The engine delta a Generate stream's message carries (the inverse of `delta_to_proto`)."""
    captures = positions = None
    if msg.HasField("captures"):
        captures = {
            key: tensor_from_proto(t, what=f"capture {key}")
            for key, t in msg.captures.tensors.items()
        }
        positions = list(msg.captures.positions)
    return RequestDelta(
        request_id=msg.request_id,
        samples=[_sample_from_proto(d) for d in msg.outputs],
        finished=msg.finished,
        num_cached_tokens=msg.num_cached_tokens,
        prompt=msg.prompt if msg.HasField("prompt") else None,
        prompt_token_ids=list(msg.prompt_token_ids) if msg.prompt_token_ids else None,
        prompt_logprobs=[
            _logprobs_from_proto(e) if e.token_ids else None for e in msg.prompt_logprobs.entries
        ]
        if msg.HasField("prompt_logprobs")
        else None,
        captures=captures,
        capture_positions=positions,
        capture_run=msg.capture_run if msg.HasField("capture_run") else None,
        capture_error=msg.capture_error if msg.HasField("capture_error") else None,
        conversation_id=msg.conversation_id if msg.HasField("conversation_id") else None,
    )


# -- sweeps ------------------------------------------------------------------------------------


def _token_to_proto(value: int | str, what: str) -> sweep_pb.TokenRef:
    if isinstance(value, str):
        return sweep_pb.TokenRef(text=value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _checked(lambda: sweep_pb.TokenRef(id=value), what)
    raise InvalidRequestError(f"{what} must be a token id or its text, got {value!r}")


def _token_from_proto(msg: sweep_pb.TokenRef, what: str) -> int | str:
    kind = msg.WhichOneof("token")
    if kind is None:
        raise InvalidRequestError(f"{what} is missing: give its id or text")
    return getattr(msg, kind)


def _nonempty(value: Any, what: str, every: str) -> list:
    """A grid axis for the wire, where an empty list means `every`: an empty list given on
    purpose is an error here, as it is for the engine, never a silent "all"."""
    if not isinstance(value, list | tuple) or not value:
        raise InvalidRequestError(f"{what} must be {every!r} or a non-empty list")
    return list(value)


def sweep_spec_to_proto(spec: SweepSpec) -> sweep_pb.SweepRequest:
    def build() -> sweep_pb.SweepRequest:
        msg = sweep_pb.SweepRequest(
            corrupt_prompt=prompt_to_proto(spec.corrupt_prompt),
            sites=_nonempty(spec.sites, "sites", "post_block"),
            alpha=spec.alpha,
            answer=_token_to_proto(spec.answer_token, "answer_token"),
            metric=spec.metric,
        )
        if spec.clean_prompt is not None:
            msg.clean_prompt.CopyFrom(prompt_to_proto(spec.clean_prompt))
        if spec.source_run is not None:
            msg.source_run = spec.source_run
        if spec.layers != "all":
            msg.layers.extend(_nonempty(spec.layers, "layers", "all"))
        if spec.positions != "all_prompt":
            for p in _nonempty(spec.positions, "positions", "all_prompt"):
                msg.positions.append(
                    sweep_pb.SweepPosition(span=p)
                    if isinstance(p, str)
                    else sweep_pb.SweepPosition(index=p)
                )
        if spec.foil_token is not None:
            msg.foil.CopyFrom(_token_to_proto(spec.foil_token, "foil_token"))
        return msg

    return _checked(build, "sweep spec")


def sweep_spec_from_proto(msg: sweep_pb.SweepRequest, encode_chat: EncodeChat) -> SweepSpec:
    """A `SweepSpec`; the engine's `Sweep` checks it against the model."""
    clean = msg.WhichOneof("clean")
    return SweepSpec(
        corrupt_prompt=prompt_from_proto(msg.corrupt_prompt, encode_chat, "corrupt_prompt"),
        answer_token=_token_from_proto(msg.answer, "answer"),
        clean_prompt=prompt_from_proto(msg.clean_prompt, encode_chat, "clean_prompt")
        if clean == "clean_prompt"
        else None,
        source_run=check_run_ref(msg.source_run) if clean == "source_run" else None,
        layers=list(msg.layers) or "all",
        positions=[_position_from_proto(p, i) for i, p in enumerate(msg.positions)] or "all_prompt",
        sites=list(msg.sites) or ["post_block"],
        alpha=msg.alpha if msg.HasField("alpha") else 1.0,
        foil_token=_token_from_proto(msg.foil, "foil") if msg.HasField("foil") else None,
        metric=msg.metric or "logprob",  # type: ignore[arg-type]
    )


def _position_from_proto(msg: sweep_pb.SweepPosition, i: int) -> int | str:
    kind = msg.WhichOneof("position")
    if kind is None:
        raise InvalidRequestError(f"positions[{i}] is empty: give an index or a text span")
    return getattr(msg, kind)


def _cell_to_proto(cell: Mapping[str, Any]) -> sweep_pb.SweepCell:
    msg = sweep_pb.SweepCell(layer=cell["layer"], site=cell["site"], position=cell["position"])
    for name in ("value", "logprob_answer", "logprob_foil", "void"):
        if cell.get(name) is not None:
            setattr(msg, name, cell[name])
    return msg


def sweep_cell_from_proto(msg: sweep_pb.SweepCell) -> Cell:
    def opt(name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    return Cell(
        layer=msg.layer,
        site=msg.site,
        position=msg.position,
        value=opt("value"),
        logprob_answer=opt("logprob_answer"),
        logprob_foil=opt("logprob_foil"),
        void=opt("void"),
    )


def sweep_event_to_proto(event: Mapping[str, Any]) -> sweep_pb.SweepEvent:
    """One event of `EngineService.patch_sweep` (a cell or the summary, JSON-able with NaN as
    None) as its message."""
    if event["event"] == "cell":
        return sweep_pb.SweepEvent(cell=_cell_to_proto(event))
    grid = np.array(event["grid"], dtype=np.float64)  # None -> NaN
    grid = grid.reshape(len(event["sites"]), len(event["layers"]), len(event["positions"]))
    align = event["alignment"]
    summary = sweep_pb.SweepSummary(
        grid=tensor_to_proto(torch.from_numpy(grid)),
        layers=event["layers"],
        positions=event["positions"],
        sites=event["sites"],
        metric=event["metric"],
        skipped=event["skipped"],
        alignment=sweep_pb.SweepAlignment(
            prefix_len=align["prefix_len"],
            suffix_len=align["suffix_len"],
            skipped=align["skipped"],
            offset=align["offset"],
        ),
        void=[_cell_to_proto(c) for c in event["void"]],
        tokens=event["tokens"],
    )
    for name in ("clean", "corrupt", "noise_floor"):
        if event.get(name) is not None:
            setattr(summary, name, event[name])
    if event.get("argmax") is not None:
        summary.argmax.CopyFrom(_cell_to_proto(event["argmax"]))
    return sweep_pb.SweepEvent(summary=summary)


def sweep_result_from_proto(msg: sweep_pb.SweepSummary, cells: list[Cell]) -> SweepResult:
    """The `SweepResult` a summary and the cells streamed before it make up."""

    def opt(name: str) -> float | None:
        return getattr(msg, name) if msg.HasField(name) else None

    a = msg.alignment
    return SweepResult(
        grid=tensor_from_proto(msg.grid, what="sweep grid").numpy(),
        layers=list(msg.layers),
        positions=list(msg.positions),
        sites=list(msg.sites),
        metric=msg.metric,
        clean=opt("clean"),
        corrupt=math.nan if opt("corrupt") is None else msg.corrupt,
        argmax=sweep_cell_from_proto(msg.argmax) if msg.HasField("argmax") else None,
        skipped=list(msg.skipped),
        alignment={
            "prefix_len": a.prefix_len,
            "suffix_len": a.suffix_len,
            "skipped": list(a.skipped),
            "offset": a.offset,
        },
        noise_floor=math.nan if opt("noise_floor") is None else msg.noise_floor,
        void=[sweep_cell_from_proto(c) for c in msg.void],
        tokens=list(msg.tokens),
        cells=cells,
    )


# -- model card and the vector registry --------------------------------------------------------


_MODEL_CARD_FIELDS = tuple(pb.ModelCard.DESCRIPTOR.fields_by_name)


def model_card_to_proto(card: Mapping[str, Any]) -> pb.ModelCard:
    """`EngineService.model_card()` as its message (keys the message lacks are left out)."""
    return pb.ModelCard(**{k: card[k] for k in _MODEL_CARD_FIELDS if k in card})


def model_card_from_proto(msg: pb.ModelCard) -> dict[str, Any]:
    return {
        k: list(v) if k == "sites" else v
        for k, v in ((k, getattr(msg, k)) for k in _MODEL_CARD_FIELDS)
    }


def vector_info_to_proto(info: Mapping[str, Any]) -> steering_pb.VectorInfo:
    """A registry entry's metadata (`NamedVector.describe()`)."""
    return steering_pb.VectorInfo(
        name=info["name"],
        hidden_size=info.get("hidden_size") or 0,  # a cluster's unregister knows only the name
        layers=info.get("layers") or [],
        source=info.get("source") or "",
    )


def vector_info_from_proto(msg: steering_pb.VectorInfo) -> dict[str, Any]:
    """`NamedVector.describe()`'s dict: `layers` None for one direction at every layer."""
    return {
        "name": msg.name,
        "hidden_size": msg.hidden_size,
        "layers": list(msg.layers) or None,
        "source": msg.source,
    }


def register_vector_to_proto(
    name: str, value: Any, overwrite: bool
) -> steering_pb.RegisterVectorRequest:
    """`value`: `[H]` or `[num_layers, H]` (a tensor, float lists or a packed object), or a
    `{layer: [H]}` mapping."""

    def build() -> steering_pb.RegisterVectorRequest:
        msg = steering_pb.RegisterVectorRequest(name=name, overwrite=overwrite)
        if isinstance(value, Mapping) and not {"dtype", "shape", "data"} & set(value):
            for layer, v in value.items():
                if not isinstance(layer, int) or isinstance(layer, bool):
                    raise InvalidRequestError(
                        f"vector {name!r}: per-layer keys must be layer numbers, got {layer!r}"
                    )
                t = v if isinstance(v, torch.Tensor) else decode_vector(v, name=f"layer {layer}")
                msg.per_layer.layers[layer].CopyFrom(tensor_to_proto(t))
        else:
            msg.vector.CopyFrom(vector_to_proto(value, f"vector {name!r}").tensor)
        return msg

    if isinstance(value, str):
        raise InvalidRequestError(
            "register_vector takes a vector's values; import_vector takes a file path"
        )
    return _checked(build, f"vector {name!r}")


def register_vector_from_proto(msg: steering_pb.RegisterVectorRequest) -> tuple[str, Any]:
    """("vector", value) for register_vector, or ("path", path) for import_vector."""
    kind = msg.WhichOneof("value")
    what = f"vector {msg.name!r}"
    if kind == "vector":
        return "vector", tensor_from_proto(msg.vector, what=what)
    if kind == "per_layer":
        return "vector", {
            layer: tensor_from_proto(t, what=f"{what} layer {layer}")
            for layer, t in sorted(msg.per_layer.layers.items())
        }
    if kind == "path":
        return "path", msg.path
    raise InvalidRequestError(f"{what}: give its vector, per_layer vectors, or a file path")


def named_vector_to_proto(entry: Mapping[str, Any]) -> steering_pb.NamedVector:
    """`EngineService.get_vector`'s dict (metadata plus the packed value)."""
    return steering_pb.NamedVector(
        info=vector_info_to_proto(entry), value=tensor_to_proto(unpack_tensor(entry["value"]))
    )


def named_vector_from_proto(msg: steering_pb.NamedVector) -> dict[str, Any]:
    """Metadata plus `value`, a tensor: `[H]`, or `[len(layers), H]` in `layers` order."""
    return {
        **vector_info_from_proto(msg.info),
        "value": tensor_from_proto(msg.value, what=f"vector {msg.info.name!r}"),
    }
