from services.proto.coxswain.v1 import engine_pb2 as _engine_pb2
from services.proto.coxswain.v1 import patch_store_pb2 as _patch_store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenRef(_message.Message):
    __slots__ = ("id", "text")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class SweepPosition(_message.Message):
    __slots__ = ("index", "span")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    index: int
    span: str
    def __init__(self, index: _Optional[int] = ..., span: _Optional[str] = ...) -> None: ...

class SweepRequest(_message.Message):
    __slots__ = ("corrupt_prompt", "clean_prompt", "source_run", "layers", "positions", "sites", "alpha", "answer", "foil", "metric")
    CORRUPT_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CLEAN_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RUN_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    FOIL_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    corrupt_prompt: _engine_pb2.Prompt
    clean_prompt: _engine_pb2.Prompt
    source_run: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedCompositeFieldContainer[SweepPosition]
    sites: _containers.RepeatedScalarFieldContainer[str]
    alpha: float
    answer: TokenRef
    foil: TokenRef
    metric: str
    def __init__(self, corrupt_prompt: _Optional[_Union[_engine_pb2.Prompt, _Mapping]] = ..., clean_prompt: _Optional[_Union[_engine_pb2.Prompt, _Mapping]] = ..., source_run: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[_Union[SweepPosition, _Mapping]]] = ..., sites: _Optional[_Iterable[str]] = ..., alpha: _Optional[float] = ..., answer: _Optional[_Union[TokenRef, _Mapping]] = ..., foil: _Optional[_Union[TokenRef, _Mapping]] = ..., metric: _Optional[str] = ...) -> None: ...

class SweepCell(_message.Message):
    __slots__ = ("layer", "site", "position", "value", "logprob_answer", "logprob_foil", "void")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ANSWER_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FOIL_FIELD_NUMBER: _ClassVar[int]
    VOID_FIELD_NUMBER: _ClassVar[int]
    layer: int
    site: str
    position: int
    value: float
    logprob_answer: float
    logprob_foil: float
    void: str
    def __init__(self, layer: _Optional[int] = ..., site: _Optional[str] = ..., position: _Optional[int] = ..., value: _Optional[float] = ..., logprob_answer: _Optional[float] = ..., logprob_foil: _Optional[float] = ..., void: _Optional[str] = ...) -> None: ...

class SweepAlignment(_message.Message):
    __slots__ = ("prefix_len", "suffix_len", "skipped", "offset")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    suffix_len: int
    skipped: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, prefix_len: _Optional[int] = ..., suffix_len: _Optional[int] = ..., skipped: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class SweepSummary(_message.Message):
    __slots__ = ("grid", "layers", "positions", "sites", "metric", "clean", "corrupt", "argmax", "skipped", "alignment", "noise_floor", "void", "tokens")
    GRID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    NOISE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    VOID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    grid: _patch_store_pb2.Tensor
    layers: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    sites: _containers.RepeatedScalarFieldContainer[str]
    metric: str
    clean: float
    corrupt: float
    argmax: SweepCell
    skipped: _containers.RepeatedScalarFieldContainer[int]
    alignment: SweepAlignment
    noise_floor: float
    void: _containers.RepeatedCompositeFieldContainer[SweepCell]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, grid: _Optional[_Union[_patch_store_pb2.Tensor, _Mapping]] = ..., layers: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., sites: _Optional[_Iterable[str]] = ..., metric: _Optional[str] = ..., clean: _Optional[float] = ..., corrupt: _Optional[float] = ..., argmax: _Optional[_Union[SweepCell, _Mapping]] = ..., skipped: _Optional[_Iterable[int]] = ..., alignment: _Optional[_Union[SweepAlignment, _Mapping]] = ..., noise_floor: _Optional[float] = ..., void: _Optional[_Iterable[_Union[SweepCell, _Mapping]]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class SweepEvent(_message.Message):
    __slots__ = ("cell", "summary")
    CELL_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    cell: SweepCell
    summary: SweepSummary
    def __init__(self, cell: _Optional[_Union[SweepCell, _Mapping]] = ..., summary: _Optional[_Union[SweepSummary, _Mapping]] = ...) -> None: ...
