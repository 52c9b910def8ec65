from services.proto.coxswain.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScalePolicy(_message.Message):
    __slots__ = ("target", "k", "offset", "min_gain", "max_gain", "tier", "per_request", "initial_gain", "deadband", "min_interval_tokens", "max_tracked")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_GAIN_FIELD_NUMBER: _ClassVar[int]
    MAX_GAIN_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    INITIAL_GAIN_FIELD_NUMBER: _ClassVar[int]
    DEADBAND_FIELD_NUMBER: _ClassVar[int]
    MIN_INTERVAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRACKED_FIELD_NUMBER: _ClassVar[int]
    target: float
    k: float
    offset: float
    min_gain: float
    max_gain: float
    tier: str
    per_request: bool
    initial_gain: float
    deadband: float
    min_interval_tokens: int
    max_tracked: int
    def __init__(self, target: _Optional[float] = ..., k: _Optional[float] = ..., offset: _Optional[float] = ..., min_gain: _Optional[float] = ..., max_gain: _Optional[float] = ..., tier: _Optional[str] = ..., per_request: bool = ..., initial_gain: _Optional[float] = ..., deadband: _Optional[float] = ..., min_interval_tokens: _Optional[int] = ..., max_tracked: _Optional[int] = ...) -> None: ...

class MonitorSpec(_message.Message):
    __slots__ = ("site", "layer", "probe", "threshold", "sharpness", "gate_rows")
    SITE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SHARPNESS_FIELD_NUMBER: _ClassVar[int]
    GATE_ROWS_FIELD_NUMBER: _ClassVar[int]
    site: str
    layer: int
    probe: _engine_pb2.VectorValue
    threshold: float
    sharpness: float
    gate_rows: bool
    def __init__(self, site: _Optional[str] = ..., layer: _Optional[int] = ..., probe: _Optional[_Union[_engine_pb2.VectorValue, _Mapping]] = ..., threshold: _Optional[float] = ..., sharpness: _Optional[float] = ..., gate_rows: bool = ...) -> None: ...

class DynamicSpec(_message.Message):
    __slots__ = ("site", "layers", "vector", "scale")
    SITE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    site: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    vector: _engine_pb2.VectorValue
    scale: float
    def __init__(self, site: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., vector: _Optional[_Union[_engine_pb2.VectorValue, _Mapping]] = ..., scale: _Optional[float] = ...) -> None: ...

class MonitorPolicy(_message.Message):
    __slots__ = ("fire_threshold", "window", "min_tokens", "install_rate", "clear_rate", "monitor", "dynamic")
    FIRE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTALL_RATE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_RATE_FIELD_NUMBER: _ClassVar[int]
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    fire_threshold: float
    window: int
    min_tokens: int
    install_rate: float
    clear_rate: float
    monitor: MonitorSpec
    dynamic: DynamicSpec
    def __init__(self, fire_threshold: _Optional[float] = ..., window: _Optional[int] = ..., min_tokens: _Optional[int] = ..., install_rate: _Optional[float] = ..., clear_rate: _Optional[float] = ..., monitor: _Optional[_Union[MonitorSpec, _Mapping]] = ..., dynamic: _Optional[_Union[DynamicSpec, _Mapping]] = ...) -> None: ...

class LatchPolicy(_message.Message):
    __slots__ = ("threshold", "steering", "max_conversations", "max_requests")
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    threshold: float
    steering: _engine_pb2.SteeringSpec
    max_conversations: int
    max_requests: int
    def __init__(self, threshold: _Optional[float] = ..., steering: _Optional[_Union[_engine_pb2.SteeringSpec, _Mapping]] = ..., max_conversations: _Optional[int] = ..., max_requests: _Optional[int] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("name", "readout", "scale", "monitor", "latch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    READOUT_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    LATCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    readout: str
    scale: ScalePolicy
    monitor: MonitorPolicy
    latch: LatchPolicy
    def __init__(self, name: _Optional[str] = ..., readout: _Optional[str] = ..., scale: _Optional[_Union[ScalePolicy, _Mapping]] = ..., monitor: _Optional[_Union[MonitorPolicy, _Mapping]] = ..., latch: _Optional[_Union[LatchPolicy, _Mapping]] = ...) -> None: ...

class SetPoliciesRequest(_message.Message):
    __slots__ = ("policies", "replace_all")
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_ALL_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[Policy]
    replace_all: bool
    def __init__(self, policies: _Optional[_Iterable[_Union[Policy, _Mapping]]] = ..., replace_all: bool = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemovePolicyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PolicyList(_message.Message):
    __slots__ = ("policies",)
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[Policy]
    def __init__(self, policies: _Optional[_Iterable[_Union[Policy, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyStatus(_message.Message):
    __slots__ = ("name", "kind", "entries", "actions", "errors", "last_error", "counters", "installed_on")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_ON_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    entries: int
    actions: int
    errors: int
    last_error: str
    counters: _containers.ScalarMap[str, int]
    installed_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., entries: _Optional[int] = ..., actions: _Optional[int] = ..., errors: _Optional[int] = ..., last_error: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., installed_on: _Optional[_Iterable[str]] = ...) -> None: ...

class ControllerStatus(_message.Message):
    __slots__ = ("running", "ready", "connected", "stream", "group", "consumer", "lag", "pending", "processed", "reclaimed", "malformed", "actions_written", "actions_dropped", "redis_errors", "reconnects", "stream_resets", "lost_entries", "latched_conversations", "last_error", "policies", "last_rejection", "policies_loaded")
    class ActionsWrittenEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ActionsDroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    REDIS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_RESETS_FIELD_NUMBER: _ClassVar[int]
    LOST_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LATCHED_CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    LAST_REJECTION_FIELD_NUMBER: _ClassVar[int]
    POLICIES_LOADED_FIELD_NUMBER: _ClassVar[int]
    running: bool
    ready: bool
    connected: bool
    stream: str
    group: str
    consumer: str
    lag: int
    pending: int
    processed: int
    reclaimed: int
    malformed: int
    actions_written: _containers.ScalarMap[str, int]
    actions_dropped: _containers.ScalarMap[str, int]
    redis_errors: int
    reconnects: int
    stream_resets: int
    lost_entries: int
    latched_conversations: int
    last_error: str
    policies: _containers.RepeatedCompositeFieldContainer[PolicyStatus]
    last_rejection: str
    policies_loaded: bool
    def __init__(self, running: bool = ..., ready: bool = ..., connected: bool = ..., stream: _Optional[str] = ..., group: _Optional[str] = ..., consumer: _Optional[str] = ..., lag: _Optional[int] = ..., pending: _Optional[int] = ..., processed: _Optional[int] = ..., reclaimed: _Optional[int] = ..., malformed: _Optional[int] = ..., actions_written: _Optional[_Mapping[str, int]] = ..., actions_dropped: _Optional[_Mapping[str, int]] = ..., redis_errors: _Optional[int] = ..., reconnects: _Optional[int] = ..., stream_resets: _Optional[int] = ..., lost_entries: _Optional[int] = ..., latched_conversations: _Optional[int] = ..., last_error: _Optional[str] = ..., policies: _Optional[_Iterable[_Union[PolicyStatus, _Mapping]]] = ..., last_rejection: _Optional[str] = ..., policies_loaded: bool = ...) -> None: ...
