"""Generate's outputs: one engine `RequestDelta` is one `GenerateResponse`, its samples'
tokens, text, logprobs, read-outs and stop reasons, its captures as tensors. A client that
wants totals adds the deltas up with the engine's `OutputAccumulator`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.common.errors import CoxswainError
from services.engine.outputs import CompletionDelta, RequestDelta
from services.patch_store.convert import tensor_from_proto, tensor_to_proto
from services.proto.coxswain.v1 import engine_pb2 as pb


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
