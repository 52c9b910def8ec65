"""`SamplingParams` and the interventions it carries (steering, capture, read-outs,
patches: the `spec.py` models) as messages. Going in, the messages become the dict form
the engine's schema parses, so the schema, not the wire, decides what is valid."""

from __future__ import annotations

from typing import Any

from services.common.errors import InvalidRequestError
from services.engine.interventions.spec import (
    CaptureSpec,
    Gate,
    PatchEntry,
    ProbeCondition,
    Readout,
    SteeringSpec,
    SteerVector,
)
from services.engine.sampling_params import SamplingParams
from services.gateway.grpc_convert.fields import checked, put_given
from services.gateway.grpc_convert.vectors import vector_from_proto, vector_to_proto
from services.proto.coxswain.v1 import engine_pb2 as pb

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
    put_given(out, "probe", vector_from_proto(msg.probe, f"{what}.probe"))
    put_given(out, "site", msg.site or None)
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
    put_given(out, "scope", msg.scope or None)
    kind = msg.WhichOneof("apply")
    if kind is not None:
        part = getattr(msg, kind)
        apply: dict[str, Any] = {}
        put_given(apply, "vector", vector_from_proto(part.vector, f"{what}.{kind}"))
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
    put_given(out, "site", msg.site or None)
    put_given(out, "layers", list(msg.layers) or None)
    put_given(out, "vector", vector_from_proto(msg.vector, what))
    if msg.HasField("scale"):
        out["scale"] = msg.scale
    put_given(out, "phase", msg.phase or None)
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

    return checked(build, "steering")


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
    put_given(out, "sink", msg.sink or None)
    put_given(out, "run", msg.run or None)
    put_given(out, "dtype", msg.dtype or None)
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
    put_given(out, "probe", vector_from_proto(msg.probe, f"{what}.probe"))
    put_given(out, "site", msg.site or None)
    put_given(out, "name", msg.name or None)
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
    put_given(out, "site", msg.site or None)
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
            detokenize=p.detokenize,
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

    return checked(build, "sampling params")


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
        "detokenize",
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
