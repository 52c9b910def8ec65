"""Vectors and the vector registry's messages: a `VectorValue` (a registered name or a
tensor, as requests and registrations name a direction), registry entries' metadata, and
the register/get admin calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from services.common.errors import InvalidRequestError
from services.common.wire import decode_vector, unpack_tensor
from services.gateway.grpc_convert.fields import checked
from services.patch_store.convert import tensor_from_proto, tensor_to_proto
from services.proto.coxswain.v1 import engine_pb2 as pb
from services.proto.coxswain.v1 import steering_pb2 as steering_pb


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
    return checked(build, f"vector {name!r}")


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
