"""Activation-patching sweeps: the `SweepSpec` request, and the stream of cells and the
summary that `EngineService.patch_sweep` answers with (and the `SweepResult` they make up
again on the client)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from services.common.errors import InvalidRequestError
from services.engine.interventions.spec import check_run_ref
from services.engine.sweep import Cell, SweepResult, SweepSpec
from services.gateway.grpc_convert.fields import checked
from services.gateway.grpc_convert.prompts import EncodeChat, prompt_from_proto, prompt_to_proto
from services.patch_store.convert import tensor_from_proto, tensor_to_proto
from services.proto.coxswain.v1 import sweep_pb2 as sweep_pb


def _token_to_proto(value: int | str, what: str) -> sweep_pb.TokenRef:
    if isinstance(value, str):
        return sweep_pb.TokenRef(text=value)
    if isinstance(value, int) and not isinstance(value, bool):
        return checked(lambda: sweep_pb.TokenRef(id=value), what)
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

    return checked(build, "sweep spec")


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
