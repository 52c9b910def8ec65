from services.proto.coxswain.v1 import patch_store_pb2 as _patch_store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JsonObject(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: Chat
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class VectorValue(_message.Message):
    __slots__ = ("tensor", "name")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    tensor: _patch_store_pb2.Tensor
    name: str
    def __init__(self, tensor: _Optional[_Union[_patch_store_pb2.Tensor, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class SteerVector(_message.Message):
    __slots__ = ("site", "layers", "vector", "scale", "phase")
    SITE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    site: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    vector: VectorValue
    scale: float
    phase: str
    def __init__(self, site: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., vector: _Optional[_Union[VectorValue, _Mapping]] = ..., scale: _Optional[float] = ..., phase: _Optional[str] = ...) -> None: ...

class ProbeCondition(_message.Message):
    __slots__ = ("probe", "site", "layer", "threshold", "sharpness")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SHARPNESS_FIELD_NUMBER: _ClassVar[int]
    probe: VectorValue
    site: str
    layer: int
    threshold: float
    sharpness: float
    def __init__(self, probe: _Optional[_Union[VectorValue, _Mapping]] = ..., site: _Optional[str] = ..., layer: _Optional[int] = ..., threshold: _Optional[float] = ..., sharpness: _Optional[float] = ...) -> None: ...

class GateAdd(_message.Message):
    __slots__ = ("vector", "scale")
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    vector: VectorValue
    scale: float
    def __init__(self, vector: _Optional[_Union[VectorValue, _Mapping]] = ..., scale: _Optional[float] = ...) -> None: ...

class GateAttenuate(_message.Message):
    __slots__ = ("vector", "scale")
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    vector: VectorValue
    scale: float
    def __init__(self, vector: _Optional[_Union[VectorValue, _Mapping]] = ..., scale: _Optional[float] = ...) -> None: ...

class Gate(_message.Message):
    __slots__ = ("when", "scope", "add", "attenuate")
    WHEN_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    ATTENUATE_FIELD_NUMBER: _ClassVar[int]
    when: ProbeCondition
    scope: str
    add: GateAdd
    attenuate: GateAttenuate
    def __init__(self, when: _Optional[_Union[ProbeCondition, _Mapping]] = ..., scope: _Optional[str] = ..., add: _Optional[_Union[GateAdd, _Mapping]] = ..., attenuate: _Optional[_Union[GateAttenuate, _Mapping]] = ...) -> None: ...

class SteeringSpec(_message.Message):
    __slots__ = ("vectors", "gates", "abort_when")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    GATES_FIELD_NUMBER: _ClassVar[int]
    ABORT_WHEN_FIELD_NUMBER: _ClassVar[int]
    vectors: _containers.RepeatedCompositeFieldContainer[SteerVector]
    gates: _containers.RepeatedCompositeFieldContainer[Gate]
    abort_when: _containers.RepeatedCompositeFieldContainer[ProbeCondition]
    def __init__(self, vectors: _Optional[_Iterable[_Union[SteerVector, _Mapping]]] = ..., gates: _Optional[_Iterable[_Union[Gate, _Mapping]]] = ..., abort_when: _Optional[_Iterable[_Union[ProbeCondition, _Mapping]]] = ...) -> None: ...

class Readout(_message.Message):
    __slots__ = ("probe", "site", "layer", "name")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    probe: VectorValue
    site: str
    layer: int
    name: str
    def __init__(self, probe: _Optional[_Union[VectorValue, _Mapping]] = ..., site: _Optional[str] = ..., layer: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class CaptureLayers(_message.Message):
    __slots__ = ("all", "layers")
    ALL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    all: bool
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, all: bool = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class Positions(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, positions: _Optional[_Iterable[int]] = ...) -> None: ...

class CaptureSpec(_message.Message):
    __slots__ = ("sites", "named", "list", "sink", "run", "dtype")
    class SitesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CaptureLayers
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CaptureLayers, _Mapping]] = ...) -> None: ...
    SITES_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.MessageMap[str, CaptureLayers]
    named: str
    list: Positions
    sink: str
    run: str
    dtype: str
    def __init__(self, sites: _Optional[_Mapping[str, CaptureLayers]] = ..., named: _Optional[str] = ..., list: _Optional[_Union[Positions, _Mapping]] = ..., sink: _Optional[str] = ..., run: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class RunPosition(_message.Message):
    __slots__ = ("run", "position")
    RUN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    run: str
    position: int
    def __init__(self, run: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class PatchSource(_message.Message):
    __slots__ = ("run", "vector", "zeros")
    RUN_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    ZEROS_FIELD_NUMBER: _ClassVar[int]
    run: RunPosition
    vector: VectorValue
    zeros: bool
    def __init__(self, run: _Optional[_Union[RunPosition, _Mapping]] = ..., vector: _Optional[_Union[VectorValue, _Mapping]] = ..., zeros: bool = ...) -> None: ...

class PatchEntry(_message.Message):
    __slots__ = ("layer", "site", "position", "alpha", "source")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    site: str
    position: int
    alpha: float
    source: PatchSource
    def __init__(self, layer: _Optional[int] = ..., site: _Optional[str] = ..., position: _Optional[int] = ..., alpha: _Optional[float] = ..., source: _Optional[_Union[PatchSource, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "logprob_token_ids", "prompt_logprobs", "skip_special_tokens", "steering", "capture", "readouts", "patch", "conversation_id", "adapter", "adapter_variant", "detokenize")
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    READOUTS_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VARIANT_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    n: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    skip_special_tokens: bool
    steering: SteeringSpec
    capture: CaptureSpec
    readouts: _containers.RepeatedCompositeFieldContainer[Readout]
    patch: _containers.RepeatedCompositeFieldContainer[PatchEntry]
    conversation_id: str
    adapter: str
    adapter_variant: str
    detokenize: bool
    def __init__(self, n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., include_stop_str_in_output: bool = ..., logprobs: _Optional[int] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: bool = ..., steering: _Optional[_Union[SteeringSpec, _Mapping]] = ..., capture: _Optional[_Union[CaptureSpec, _Mapping]] = ..., readouts: _Optional[_Iterable[_Union[Readout, _Mapping]]] = ..., patch: _Optional[_Iterable[_Union[PatchEntry, _Mapping]]] = ..., conversation_id: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_variant: _Optional[str] = ..., detokenize: bool = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "params", "request_id")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    params: SamplingParams
    request_id: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogprobsList(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, entries: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class Readouts(_message.Message):
    __slots__ = ("scores",)
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.ScalarMap[str, float]
    def __init__(self, scores: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReadoutsList(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Readouts]
    def __init__(self, entries: _Optional[_Iterable[_Union[Readouts, _Mapping]]] = ...) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = ("index", "token_ids", "token_offset", "text", "logprobs", "readouts", "finish_reason", "stop_token_id", "stop_string")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    READOUTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_offset: int
    text: str
    logprobs: LogprobsList
    readouts: ReadoutsList
    finish_reason: str
    stop_token_id: int
    stop_string: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_offset: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Union[LogprobsList, _Mapping]] = ..., readouts: _Optional[_Union[ReadoutsList, _Mapping]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class Captures(_message.Message):
    __slots__ = ("tensors", "positions")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _patch_store_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_patch_store_pb2.Tensor, _Mapping]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.MessageMap[str, _patch_store_pb2.Tensor]
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensors: _Optional[_Mapping[str, _patch_store_pb2.Tensor]] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "finished", "outputs", "prompt", "prompt_token_ids", "num_cached_tokens", "prompt_logprobs", "captures", "capture_run", "capture_error", "conversation_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CAPTURES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_RUN_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_ERROR_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finished: bool
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    prompt_logprobs: LogprobsList
    captures: Captures
    capture_run: str
    capture_error: str
    conversation_id: str
    def __init__(self, request_id: _Optional[str] = ..., finished: bool = ..., outputs: _Optional[_Iterable[_Union[CompletionDelta, _Mapping]]] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[LogprobsList, _Mapping]] = ..., captures: _Optional[_Union[Captures, _Mapping]] = ..., capture_run: _Optional[str] = ..., capture_error: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "max_model_len", "num_layers", "hidden_size", "vocab_size", "sites", "dtype", "device")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    sites: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    device: str
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., sites: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
