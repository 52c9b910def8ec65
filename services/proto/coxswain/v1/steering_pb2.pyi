from services.proto.coxswain.v1 import engine_pb2 as _engine_pb2
from services.proto.coxswain.v1 import patch_store_pb2 as _patch_store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClearGlobalRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSteeringStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDynamicStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PerLayerVectors(_message.Message):
    __slots__ = ("layers",)
    class LayersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _patch_store_pb2.Tensor
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_patch_store_pb2.Tensor, _Mapping]] = ...) -> None: ...
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.MessageMap[int, _patch_store_pb2.Tensor]
    def __init__(self, layers: _Optional[_Mapping[int, _patch_store_pb2.Tensor]] = ...) -> None: ...

class RegisterVectorRequest(_message.Message):
    __slots__ = ("name", "vector", "per_layer", "path", "overwrite")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    name: str
    vector: _patch_store_pb2.Tensor
    per_layer: PerLayerVectors
    path: str
    overwrite: bool
    def __init__(self, name: _Optional[str] = ..., vector: _Optional[_Union[_patch_store_pb2.Tensor, _Mapping]] = ..., per_layer: _Optional[_Union[PerLayerVectors, _Mapping]] = ..., path: _Optional[str] = ..., overwrite: bool = ...) -> None: ...

class VectorInfo(_message.Message):
    __slots__ = ("name", "hidden_size", "layers", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    hidden_size: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    source: str
    def __init__(self, name: _Optional[str] = ..., hidden_size: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., source: _Optional[str] = ...) -> None: ...

class ListVectorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVectorsResponse(_message.Message):
    __slots__ = ("vectors",)
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    vectors: _containers.RepeatedCompositeFieldContainer[VectorInfo]
    def __init__(self, vectors: _Optional[_Iterable[_Union[VectorInfo, _Mapping]]] = ...) -> None: ...

class GetVectorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class NamedVector(_message.Message):
    __slots__ = ("info", "value")
    INFO_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    info: VectorInfo
    value: _patch_store_pb2.Tensor
    def __init__(self, info: _Optional[_Union[VectorInfo, _Mapping]] = ..., value: _Optional[_Union[_patch_store_pb2.Tensor, _Mapping]] = ...) -> None: ...

class UnregisterVectorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropPatchSourceRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class DropPatchSourceResponse(_message.Message):
    __slots__ = ("run", "bytes_freed")
    RUN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    run: str
    bytes_freed: int
    def __init__(self, run: _Optional[str] = ..., bytes_freed: _Optional[int] = ...) -> None: ...
