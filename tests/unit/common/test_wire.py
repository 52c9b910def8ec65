from __future__ import annotations

import base64

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.wire import DTYPES, decode_vector, pack_tensor, unpack_tensor


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(7,), (3, 5), (0,), ()])
def test_pack_unpack_round_trip_is_exact(dtype, shape):
    t = (torch.randn(shape, dtype=torch.float64) * 100).to(dtype)
    packed = pack_tensor(t)
    assert packed["dtype"] == next(k for k, v in DTYPES.items() if v == dtype)
    assert packed["shape"] == list(shape)
    back = unpack_tensor(packed)
    assert back.dtype == dtype and back.shape == t.shape
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    assert torch.equal(back.view(bits), t.view(bits))  # bit-exact, -0.0 and all


def test_packed_bytes_are_little_endian_row_major():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    raw = base64.b64decode(pack_tensor(t)["data"])
    assert raw[:8] == b"\x00\x00\x80\x3f\x00\x00\x00\x40"  # 1.0 then 2.0, float32 LE
    bf = base64.b64decode(pack_tensor(torch.tensor([1.0], dtype=torch.bfloat16))["data"])
    assert bf == b"\x80\x3f"


def test_pack_takes_non_contiguous_views():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(unpack_tensor(pack_tensor(t)), t)


def test_pack_rejects_unsupported_dtype():
    with pytest.raises(InvalidRequestError, match="int64"):
        pack_tensor(torch.arange(3))


def _packed(**over):
    obj = pack_tensor(torch.ones(2, 3))
    obj.update(over)
    return obj


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        (_packed(data=base64.b64encode(b"\x00" * 20).decode()), "20 bytes.*needs 24"),
        (_packed(shape=[2, 4]), "needs 32"),
        (_packed(data="not base64!!"), "not valid base64"),
        (_packed(dtype="int8"), "unknown dtype 'int8'"),
        (_packed(dtype=None), "unknown dtype None"),
        (_packed(shape=[2, -3]), "non-negative integers"),
        (_packed(shape=[2, 1.5]), "non-negative integers"),
        (_packed(shape=[True, 6]), "non-negative integers"),
        (_packed(shape="2,3"), "non-negative integers"),
        (_packed(data=[1, 2]), "base64 string"),
        ({"dtype": "float32", "shape": [2, 3]}, "missing data"),
        (_packed(order="C"), "unexpected order"),
        ([1, 2], "object"),
    ],
)
def test_unpack_names_the_problem(obj, match):
    with pytest.raises(InvalidRequestError, match=match):
        unpack_tensor(obj)


def test_decode_vector_lists():
    v = decode_vector([1, 2.5, -3])
    assert v.dtype == torch.float32 and v.tolist() == [1.0, 2.5, -3.0]
    m = decode_vector([[1, 2], [3, 4]])
    assert m.shape == (2, 2) and m[1].tolist() == [3.0, 4.0]


def test_decode_vector_packed_converts_to_float32():
    t = torch.randn(4, 8, dtype=torch.float64)
    v = decode_vector(pack_tensor(t))
    assert v.dtype == torch.float32 and torch.equal(v, t.float())
    h = torch.randn(8).to(torch.bfloat16)
    assert torch.equal(decode_vector(pack_tensor(h)), h.float())


def test_decode_vector_copies_tensors():
    t = torch.ones(4)
    v = decode_vector(t)
    t.zero_()
    assert v.tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([], "vector is empty"),
        ([[]], "vector is empty"),
        ([1.0, "2"], "only numbers"),
        ([1.0, None], "only numbers"),
        ([1.0, True], "only numbers"),
        ([[1.0, 2.0], [3.0]], "ragged: row 1 has 1 values, row 0 has 2"),
        ([[1.0], 2.0], "mixes numbers and lists"),
        ([[[1.0]]], "more"),
        ([1.0, float("nan")], "vector contains NaN or Inf"),
        ([float("inf")], "vector contains NaN or Inf"),
        ([1e39], "vector contains NaN or Inf"),  # finite in float64, not in float32
        ([10**400], "vector contains NaN or Inf"),
        (pack_tensor(torch.tensor([1.0, float("nan")])), "vector contains NaN or Inf"),
        (pack_tensor(torch.ones(2, 2, 2)), "1 or 2 dims"),
        (pack_tensor(torch.tensor(1.0)), "1 or 2 dims"),
        (pack_tensor(torch.ones(0, 4)), "empty"),
        ("0.1,0.2", "must be a list"),
        (3.0, "must be a list"),
    ],
)
def test_decode_vector_rejects(value, match):
    with pytest.raises(InvalidRequestError, match=match):
        decode_vector(value)


def test_decode_vector_names_the_field():
    with pytest.raises(InvalidRequestError, match=r"^steer\.vector is empty"):
        decode_vector([], name="steer.vector")
