"""What the service reports about itself: its model card, and the JSON objects that carry
observability snapshots (stats, steering state)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from services.proto.coxswain.v1 import engine_pb2 as pb

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


# -- model card --------------------------------------------------------------------------------


_MODEL_CARD_FIELDS = tuple(pb.ModelCard.DESCRIPTOR.fields_by_name)


def model_card_to_proto(card: Mapping[str, Any]) -> pb.ModelCard:
    """`EngineService.model_card()` as its message (keys the message lacks are left out)."""
    return pb.ModelCard(**{k: card[k] for k in _MODEL_CARD_FIELDS if k in card})


def model_card_from_proto(msg: pb.ModelCard) -> dict[str, Any]:
    return {
        k: list(v) if k == "sites" else v
        for k, v in ((k, getattr(msg, k)) for k in _MODEL_CARD_FIELDS)
    }
