"""Conversions between the engine's gRPC messages and its Python values, one function per
pair and direction, used by the servers (`grpc_server.py`) and the client (`services.client`).

Requests go Python -> protobuf in the client (from an already validated `SamplingParams` or
`SweepSpec`) and protobuf -> Python in the server, where the engine's own schema checks them
again: the wire never decides what is valid. Vectors and captured activations travel as
`Tensor` messages (little-endian bytes + dtype + shape, `services.common.wire`'s convention).

One module per message family, all re-exported here (callers use `grpc_convert.<name>`):
`prompts`, `sampling` (sampling params and the interventions they carry), `outputs` (the
deltas a Generate stream carries), `sweeps`, `vectors` (vector values and the registry's
admin messages) and `service_info` (model card, JSON snapshots); `fields` holds what they
all do with fields.
"""

from __future__ import annotations

from services.gateway.grpc_convert.outputs import delta_from_proto, delta_to_proto
from services.gateway.grpc_convert.prompts import (
    EncodeChat,
    EnginePrompt,
    prompt_from_proto,
    prompt_to_proto,
)
from services.gateway.grpc_convert.sampling import (
    sampling_params_from_proto,
    sampling_params_to_proto,
    steering_from_proto,
    steering_to_proto,
)
from services.gateway.grpc_convert.service_info import (
    json_from_proto,
    json_to_proto,
    model_card_from_proto,
    model_card_to_proto,
)
from services.gateway.grpc_convert.sweeps import (
    sweep_cell_from_proto,
    sweep_event_to_proto,
    sweep_result_from_proto,
    sweep_spec_from_proto,
    sweep_spec_to_proto,
)
from services.gateway.grpc_convert.vectors import (
    named_vector_from_proto,
    named_vector_to_proto,
    register_vector_from_proto,
    register_vector_to_proto,
    vector_from_proto,
    vector_info_from_proto,
    vector_info_to_proto,
    vector_to_proto,
)
from services.patch_store.convert import tensor_from_proto, tensor_to_proto

# The message size limit both ends default to: captures of many layers and positions are big.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "EncodeChat",
    "EnginePrompt",
    "delta_from_proto",
    "delta_to_proto",
    "json_from_proto",
    "json_to_proto",
    "model_card_from_proto",
    "model_card_to_proto",
    "named_vector_from_proto",
    "named_vector_to_proto",
    "prompt_from_proto",
    "prompt_to_proto",
    "register_vector_from_proto",
    "register_vector_to_proto",
    "sampling_params_from_proto",
    "sampling_params_to_proto",
    "steering_from_proto",
    "steering_to_proto",
    "sweep_cell_from_proto",
    "sweep_event_to_proto",
    "sweep_result_from_proto",
    "sweep_spec_from_proto",
    "sweep_spec_to_proto",
    "tensor_from_proto",
    "tensor_to_proto",
    "vector_from_proto",
    "vector_info_from_proto",
    "vector_info_to_proto",
    "vector_to_proto",
]
