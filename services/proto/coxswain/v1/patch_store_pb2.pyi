from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RunHeader(_message.Message):
    __slots__ = ("run_id", "model", "positions", "token_ids", "overwrite", "hidden_size", "dtype")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    overwrite: bool
    hidden_size: int
    dtype: str
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., overwrite: bool = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("layer", "site", "row_offset", "rows")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    site: str
    row_offset: int
    rows: Tensor
    def __init__(self, layer: _Optional[int] = ..., site: _Optional[str] = ..., row_offset: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PutRunChunk(_message.Message):
    __slots__ = ("header", "rows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: RunHeader
    rows: RowBlock
    def __init__(self, header: _Optional[_Union[RunHeader, _Mapping]] = ..., rows: _Optional[_Union[RowBlock, _Mapping]] = ...) -> None: ...

class LayerSite(_message.Message):
    __slots__ = ("layer", "site")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    site: str
    def __init__(self, layer: _Optional[int] = ..., site: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("run_id", "model", "hidden_size", "dtype", "keys", "positions", "token_ids", "created_at", "bytes", "lease_remaining_s", "holders", "version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: str
    hidden_size: int
    dtype: str
    keys: _containers.RepeatedCompositeFieldContainer[LayerSite]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    created_at: float
    bytes: int
    lease_remaining_s: float
    holders: _containers.RepeatedScalarFieldContainer[str]
    version: int
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[str] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[LayerSite, _Mapping]]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., created_at: _Optional[float] = ..., bytes: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., holders: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ...) -> None: ...

class RowKey(_message.Message):
    __slots__ = ("layer", "site", "position")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    layer: int
    site: str
    position: int
    def __init__(self, layer: _Optional[int] = ..., site: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class GetRowsRequest(_message.Message):
    __slots__ = ("run_id", "keys")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    keys: _containers.RepeatedCompositeFieldContainer[RowKey]
    def __init__(self, run_id: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[RowKey, _Mapping]]] = ...) -> None: ...

class GetRowsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Tensor
    def __init__(self, rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("run_id", "ttl_s", "holder")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    ttl_s: float
    holder: str
    def __init__(self, run_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., holder: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("expires_in_s",)
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    expires_in_s: float
    def __init__(self, expires_in_s: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("run_id", "holder")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    holder: str
    def __init__(self, run_id: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class DropRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DropRunResponse(_message.Message):
    __slots__ = ("bytes_freed",)
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    def __init__(self, bytes_freed: _Optional[int] = ...) -> None: ...

class InvalidateAllRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class InvalidateAllResponse(_message.Message):
    __slots__ = ("runs_dropped",)
    RUNS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    runs_dropped: int
    def __init__(self, runs_dropped: _Optional[int] = ...) -> None: ...

class ManifestsRequest(_message.Message):
    __slots__ = ("run_ids",)
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ManifestsResponse(_message.Message):
    __slots__ = ("manifests",)
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    manifests: _containers.RepeatedCompositeFieldContainer[Manifest]
    def __init__(self, manifests: _Optional[_Iterable[_Union[Manifest, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stats",)
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.ScalarMap[str, int]
    def __init__(self, stats: _Optional[_Mapping[str, int]] = ...) -> None: ...
