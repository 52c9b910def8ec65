"""A steering spec's resolution: the rows it gives, the digests rows are shared by, and the
errors a bad spec gets (the engine never meets a spec it cannot apply)."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine.interventions.resolve import Resolver
from services.engine.interventions.spec import SteeringSpec
from services.engine.interventions.vectors import VectorRegistry

L, H = 4, 8


@pytest.fixture
def resolver() -> Resolver:
    registry = VectorRegistry(hidden_size=H, num_layers=L)
    registry.register("calm", torch.arange(H, dtype=torch.float32))
    return Resolver(L, H, registry)


def spec(*vectors: dict) -> SteeringSpec:
    return SteeringSpec(vectors=list(vectors))


def test_an_inline_list_gives_scale_times_vector_at_each_listed_layer(resolver):
    v = [0.5 * i for i in range(H)]
    out = resolver.steering(spec({"layers": [0, 2], "vector": v, "scale": 3.0}))
    want = 3.0 * torch.tensor(v)
    assert set(out.decode.vectors) == {(0, "post_block"), (2, "post_block")}
    for got in out.decode.vectors.values():
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert out.prefill is out.decode  # phase "both": one content, digested once


def test_vectors_at_one_site_add_and_phases_split(resolver):
    a, b = [1.0] * H, [2.0] * H
    out = resolver.steering(
        spec(
            {"layers": [1], "vector": a},
            {"layers": [1, 3], "vector": b, "scale": 0.5, "phase": "decode"},
        )
    )
    assert torch.equal(out.prefill.vectors[(1, "post_block")], torch.ones(H))
    assert (3, "post_block") not in out.prefill.vectors
    assert torch.equal(out.decode.vectors[(1, "post_block")], torch.full((H,), 2.0))
    assert torch.equal(out.decode.vectors[(3, "post_block")], torch.ones(H))
    assert out.prefill.digest != out.decode.digest


def test_one_row_per_layer_matches_the_same_vector_given_for_all(resolver):
    """Rows are shared by content: a vector given once for two layers and the same values
    given row by row resolve to one digest."""
    v = [float(i) for i in range(H)]
    once = resolver.steering(spec({"layers": [0, 1], "vector": v}))
    rows = resolver.steering(spec({"layers": [0, 1], "vector": [v, v]}))
    assert once.decode.digest == rows.decode.digest
    other = resolver.steering(spec({"layers": [0, 1], "vector": [v, v[::-1]]}))
    assert other.decode.digest != once.decode.digest
    named = resolver.steering(spec({"layers": [0, 1], "vector": "calm"}))
    assert named.decode.digest == once.decode.digest


@pytest.mark.parametrize(
    ("vector", "kw", "message"),
    [
        ([1e39] + [0.0] * (H - 1), {}, r"steering.vectors\[0\]: vector contains NaN or Inf"),
        ([1e38] * H, {"scale": 10.0}, "scale × vector overflows at layer 0 post_block"),
        ([1.0] * (H - 1), {}, r"steering.vectors\[0\]: vector length 7 does not match"),
        ([1.0] * H, {"layers": [0, L]}, f"layer {L} is out of range"),
        ([[1.0] * H] * 3, {}, "3 vector rows for 2 layers"),
        ([[1.0] * H, [1.0] * (H - 1)], {}, "ragged"),
    ],
)
def test_a_bad_vector_is_refused_with_its_cause(resolver, vector, kw, message):
    entry = {"layers": [0, 1], "vector": vector, **kw}
    with pytest.raises(InvalidRequestError, match=message):
        resolver.steering(spec(entry))


def test_a_sum_that_overflows_is_refused(resolver):
    big = [3e38] * H
    with pytest.raises(InvalidRequestError, match="overflows at layer 2 post_block"):
        resolver.steering(spec({"layers": [2], "vector": big}, {"layers": [2], "vector": big}))
