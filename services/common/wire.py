"""Tensors on the wire (HTTP JSON bodies), and their decoding into vectors.

A vector travels either as a JSON float list (`[H]`, or a list of equal-length lists for
`[n, H]`), or packed: `{"dtype": "float32", "shape": [n, H], "data": "<base64>"}`, where
`data` is the tensor's little-endian, row-major bytes. Packed dtypes: float32, float16,
bfloat16, float64.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np
import torch

from services.common.errors import InvalidRequestError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Little-endian numpy views of the bytes; numpy has no bfloat16, so it travels as int16 bits.
_NUMPY_LE: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype("<f4"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<i2"),
    torch.float64: np.dtype("<f8"),
}
_PACKED_KEYS = frozenset({"dtype", "shape", "data"})


def pack_tensor(t: torch.Tensor) -> dict[str, Any]:
    """The packed wire form of a tensor: dtype name, shape, base64 little-endian bytes."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise InvalidRequestError(f"cannot pack dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    t = t.detach().to("cpu").contiguous()
    bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    raw = bits.numpy().astype(_NUMPY_LE[t.dtype], copy=False).tobytes()
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def unpack_tensor(obj: Any) -> torch.Tensor:
    """The tensor a packed `{dtype, shape, data}` object holds, validated field by field."""
    if not isinstance(obj, dict):
        raise InvalidRequestError(
            f"packed tensor must be an object {{dtype, shape, data}}, got {type(obj).__name__}"
        )
    keys = set(obj)
    if keys != _PACKED_KEYS:
        problems = []
        if missing := sorted(_PACKED_KEYS - keys):
            problems.append(f"missing {', '.join(missing)}")
        if extra := sorted(map(str, keys - _PACKED_KEYS)):
            problems.append(f"unexpected {', '.join(extra)}")
        raise InvalidRequestError(
            f"packed tensor must have exactly the keys data, dtype, shape: {'; '.join(problems)}"
        )
    dtype = DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise InvalidRequestError(
            f"packed tensor has unknown dtype {obj['dtype']!r}; supported: {', '.join(DTYPES)}"
        )
    shape = obj["shape"]
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidRequestError(
            f"packed tensor shape must be a list of non-negative integers, got {shape!r}"
        )
    if not isinstance(obj["data"], str):
        raise InvalidRequestError("packed tensor data must be a base64 string")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"packed tensor data is not valid base64: {e}") from None
    np_dtype = _NUMPY_LE[dtype]
    expected = math.prod(shape) * np_dtype.itemsize
    if len(raw) != expected:
        raise InvalidRequestError(
            f"packed tensor data holds {len(raw)} bytes; shape {list(shape)} of {obj['dtype']} "
            f"needs {expected}"
        )
    arr = np.frombuffer(raw, dtype=np_dtype).astype(np_dtype.newbyteorder("="))  # owned copy
    t = torch.from_numpy(arr)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(shape)


def decode_vector(value: Any, *, name: str = "vector") -> torch.Tensor:
    """A float32 CPU tensor, `[H]` or `[n, H]`, from a float list, nested lists, or a packed
    object (a tensor is accepted too and copied). `name` prefixes every error message."""
    if isinstance(value, dict):
        t = unpack_tensor(value)
    elif isinstance(value, torch.Tensor):
        t = value.detach()
    elif isinstance(value, list | tuple):
        t = _tensor_from_lists(value, name)
    else:
        raise InvalidRequestError(
            f"{name} must be a list of numbers, a list of lists, or a packed "
            f"{{dtype, shape, data}} object; got {type(value).__name__}"
        )
    if t.dim() not in (1, 2):
        raise InvalidRequestError(f"{name} must have 1 or 2 dims, got shape {list(t.shape)}")
    if t.numel() == 0:
        raise InvalidRequestError(f"{name} is empty (shape {list(t.shape)})")
    if not t.is_floating_point():
        raise InvalidRequestError(f"{name} must hold floats, got {t.dtype}")
    t = t.to(device="cpu", dtype=torch.float32, copy=True)
    if not bool(torch.isfinite(t).all()):
        raise InvalidRequestError(f"{name} contains NaN or Inf")
    return t


def _tensor_from_lists(value: list | tuple, name: str) -> torch.Tensor:
    """`[H]` or `[n, H]` float64 from JSON lists, rejecting bools, strings and ragged rows."""
    if len(value) == 0:
        raise InvalidRequestError(f"{name} is empty")
    nested = isinstance(value[0], list | tuple)
    rows = value if nested else [value]
    width = len(rows[0])
    for i, row in enumerate(rows):
        if nested and not isinstance(row, list | tuple):
            raise InvalidRequestError(f"{name} mixes numbers and lists")
        if len(row) != width:
            raise InvalidRequestError(
                f"{name} is ragged: row {i} has {len(row)} values, row 0 has {width}"
            )
        if set(map(type, row)) <= {float, int}:  # the common case, checked at C speed
            continue
        for x in row:
            if isinstance(x, list | tuple):
                if not nested:
                    raise InvalidRequestError(f"{name} mixes numbers and lists")
                raise InvalidRequestError(f"{name} must have 1 or 2 dims, got more")
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise InvalidRequestError(f"{name} must hold only numbers, got {x!r}")
    try:  # numpy reads a list of floats about 4x faster than torch.tensor does
        t = torch.from_numpy(np.array(rows, dtype=np.float64))
    except (OverflowError, ValueError):
        raise InvalidRequestError(f"{name} contains NaN or Inf") from None  # ints past float range
    return t if nested else t[0]
