"""What travels through Redis between engines and the controller, and the Redis keys it uses.

Engines publish read-outs to one stream, `coxswain:readouts`, shared by every replica: a
conversation's next request may land on another replica, so the latch policy needs one view
of all of them, and one consumer group then serves the whole cluster. Each entry names its
replica; the controller writes that replica's actions to the list `coxswain:actions:<id>`.

A stream entry is a flat string map (readable with `redis-cli XRANGE`): `replica`,
`request`, `sample`, optional `conversation`, optional `token` (absent on an entry that
only reports a finish), `scores` (a JSON object `{read-out name: h·probe}`) and optional
`finish`. An action is a JSON object whose `type` names the action class
(`services.engine.interventions.actions`) beside that class's fields; vectors are JSON float
lists or packed tensors (`services.common.wire`), which the engine accepts as they are.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import InvalidRequestError
from services.common.wire import pack_tensor
from services.engine.interventions.actions import ACTION_TYPES, Action

READOUT_STREAM = "coxswain:readouts"
ACTION_QUEUE_PREFIX = "coxswain:actions:"
# Engine-side source of every action that came through Redis, so the engine's steering
# snapshot counts them apart from the API and the sync consumers: "controller/<policy>".
ACTION_SOURCE_PREFIX = "controller/"


def action_queue_key(replica_id: str) -> str:
    """The Redis list holding `replica_id`'s pending actions (LPUSH by the controller, RPOP
    by the engine: first in, first out)."""
    return ACTION_QUEUE_PREFIX + replica_id


@dataclass(frozen=True)
class ReadoutEntry:
    """One generated token's read-outs (or, with `token=None`, a sample's finish)."""

    replica: str
    request_id: str
    sample: int
    token: int | None  # index of the generated token the scores belong to
    scores: dict[str, float] = field(default_factory=dict)
    conversation_id: str | None = None
    finish_reason: str | None = None
    stream_id: str | None = None  # the entry's id in the stream, once read from Redis

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def encode_entry(entry: ReadoutEntry) -> dict[str, str]:
    """The stream fields of a read-out entry."""
    fields = {
        "replica": entry.replica,
        "request": entry.request_id,
        "sample": str(entry.sample),
        # NaN/Inf would not survive strict JSON readers; a non-finite score is reported null
        "scores": json.dumps(
            {k: (v if math.isfinite(v) else None) for k, v in entry.scores.items()},
            separators=(",", ":"),
        ),
    }
    if entry.token is not None:
        fields["token"] = str(entry.token)
    if entry.conversation_id is not None:
        fields["conversation"] = entry.conversation_id
    if entry.finish_reason is not None:
        fields["finish"] = entry.finish_reason
    return fields


def decode_entry(stream_id: str, fields: dict[str, str]) -> ReadoutEntry:
    """The entry behind stream fields; InvalidRequestError names what is malformed."""
    try:
        scores = json.loads(fields.get("scores", "{}"))
        if not isinstance(scores, dict):
            raise ValueError("scores is not an object")
        return ReadoutEntry(
            replica=fields["replica"],
            request_id=fields["request"],
            sample=int(fields.get("sample", "0")),
            token=int(fields["token"]) if "token" in fields else None,
            scores={str(k): float(v) for k, v in scores.items() if v is not None},
            conversation_id=fields.get("conversation"),
            finish_reason=fields.get("finish"),
            stream_id=stream_id,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"malformed read-out entry {stream_id}: {e!r}") from None


_ACTION_CLASSES: dict[str, Any] = {cls.__name__: cls for cls in ACTION_TYPES}
_FIELDS: dict[Any, Any] = {cls: dataclasses.fields(cls) for cls in ACTION_TYPES}
_ALL_FIELDS = {cls: {f.name for f in fs} for cls, fs in _FIELDS.items()}
_REQUIRED_FIELDS = {
    cls: {f.name for f in fs if f.default is dataclasses.MISSING} for cls, fs in _FIELDS.items()
}


def jsonable(value: Any) -> Any:
    """`value` with tensors packed and pydantic specs as dicts: plain JSON for the wire."""
    if isinstance(value, torch.Tensor):
        return pack_tensor(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "model_dump"):  # a pydantic spec (SteeringSpec) given from Python
        return jsonable(value.model_dump(exclude_defaults=True))
    return value


def encode_action(action: Action, source: str) -> str:
    """The JSON of an action on the wire; `source` (a policy name) is how the engine counts it."""
    if not isinstance(action, ACTION_TYPES):
        raise InvalidRequestError(f"not a steering action: {type(action).__name__}")
    body = {f.name: jsonable(getattr(action, f.name)) for f in dataclasses.fields(action)}
    return json.dumps(
        {"type": type(action).__name__, "source": source, **body},
        separators=(",", ":"),
        allow_nan=False,
    )


def decode_action(text: str | bytes) -> tuple[Action, str]:
    """`(action, source)` from the wire; InvalidRequestError names what is malformed. Values
    (layers, vector sizes, finiteness) are checked by the engine when the action applies."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"action is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("an action must be a JSON object with a 'type'")
    obj = dict(obj)
    name = obj.pop("type", None)
    source = obj.pop("source", "")
    cls = _ACTION_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidRequestError(
            f"unknown action type {name!r}; expected one of {', '.join(_ACTION_CLASSES)}"
        )
    if not isinstance(source, str):
        raise InvalidRequestError("an action's 'source' must be a string")
    if unknown := sorted(set(obj) - _ALL_FIELDS[cls]):
        raise InvalidRequestError(f"{name}: unknown fields {', '.join(unknown)}")
    if missing := sorted(_REQUIRED_FIELDS[cls] - set(obj)):
        raise InvalidRequestError(f"{name}: missing fields {', '.join(missing)}")
    return cls(**obj), source
