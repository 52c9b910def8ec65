"""The admin state's pieces that need no cluster: one name check for the API and the
engine, values that survive JSON exactly, and the in-memory store's write rules (the same
outcomes as the Redis script, tested against a real redis-server in
tests/integration/test_cluster_state.py)."""

from __future__ import annotations

import json

import pytest
import torch

from services.cluster.state import json_data
from services.cluster.stores import ClusterState, _outcome
from services.common.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from services.engine.interventions.vectors import VectorRegistry, check_vector_name

H = 8


@pytest.mark.parametrize(
    "name",
    ["a" * 128, "a" * 129, "", "two words", "semi;colon", "ü", "x\n", "ok_.:/-9", 5, None],
)
def test_the_api_check_refuses_exactly_what_the_registry_refuses(name):
    def refused(fn) -> str | None:
        try:
            fn()
        except InvalidRequestError as exc:
            return str(exc)
        return None

    by_check = refused(lambda: check_vector_name(name))
    by_registry = refused(lambda: VectorRegistry(H, 2).register(name, [1.0] * H))
    assert by_check == by_registry
    assert (by_check is None) == (isinstance(name, str) and name in ("a" * 128, "ok_.:/-9"))


def test_a_long_name_is_named_briefly_in_the_error():
    with pytest.raises(InvalidRequestError, match=r"\(1000 characters\)") as info:
        check_vector_name("a" * 1000)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("per_layer", [False, True])
def test_vector_values_survive_json_exactly(per_layer):
    g = torch.Generator().manual_seed(0)
    value = {1: torch.randn(H, generator=g)} if per_layer else torch.randn(H, generator=g)
    entry = VectorRegistry(H, 2).register("v", value)
    stored = json.loads(json.dumps(json_data(entry.per_layer if per_layer else entry.vector)))
    again = VectorRegistry(H, 2).register("v", stored)
    if per_layer:
        assert again.per_layer.keys() == {1}
        assert torch.equal(again.per_layer[1], entry.per_layer[1])
    else:
        assert torch.equal(again.vector, entry.vector)


def test_the_in_memory_store_takes_writes_only_once_seeded():
    state = ClusterState()
    with pytest.raises(ServiceUnavailableError, match="retry shortly"):
        _outcome(state.change("put", "v", [1.0], False), "v")
    assert state.seed(None, {"v": [1.0]}) and not state.seed(None, {})
    epoch = state.epoch
    with pytest.raises(InvalidRequestError, match="overwrite"):
        _outcome(state.change("put", "v", [2.0], False), "v")
    assert _outcome(state.change("put", "v", [2.0], True), "v") == (epoch, 1)
    with pytest.raises(NotFoundError):
        _outcome(state.change("drop", "w", None, False), "w")
    assert _outcome(state.change("global", "", {"vectors": []}, True), "") == (epoch, 2)
    assert state.desired().vectors == {"v": [2.0]} and state.desired().head == (epoch, 2)
