"""A patch-source run holds finite rows only: every path that stores rows refuses NaN and inf
(naming the run, the (layer, site) and the positions), and the engine's patch resolution
refuses a non-finite stored row rather than patch NaN in silently."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import InvalidRequestError
from services.engine.interventions.resolve import Resolver
from services.engine.interventions.spec import PatchEntry
from services.engine.interventions.vectors import VectorRegistry
from services.patch_store import convert
from services.patch_store.client import PatchStoreClient
from services.patch_store.server import serve
from services.patch_store.store import PatchStore
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

H = 8
POSITIONS = [0, 1, 2, 3]
ADMIN = "admin-secret-0123456789"
KEYS = ApiKeys([ApiKey("ops", "admin", ADMIN)])


def nonfinite_rows(value: float, dtype: torch.dtype = torch.float32) -> dict:
    """Two (layer, site) blocks; the second holds `value` at positions 1 and 3."""
    bad = torch.ones(len(POSITIONS), H, dtype=dtype)
    bad[1, 2] = bad[3, 0] = value
    return {(0, "post_block"): torch.ones(len(POSITIONS), H, dtype=dtype), (2, "pre_attn"): bad}


@pytest.fixture(scope="module")
def server():
    srv = serve(PatchStore(2**20), "127.0.0.1", 0, keys=KEYS)
    yield srv
    srv.stop(grace_s=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_refuses_nonfinite_rows_naming_the_run_and_key(value, dtype):
    store = PatchStore(2**20)
    with pytest.raises(InvalidRequestError) as e:
        store.put_run("clean", nonfinite_rows(value, dtype), POSITIONS)
    message = str(e.value)
    assert "'clean'" in message and "layer 2, site 'pre_attn'" in message
    assert "NaN or inf at positions [1, 3]" in message
    assert store.stats()["runs"] == 0 and store.stats()["puts"] == 0


def test_the_client_refuses_nonfinite_rows_before_it_streams(server):
    with PatchStoreClient(server.address, api_key=ADMIN, timeout_s=10) as client:
        with pytest.raises(InvalidRequestError, match="NaN or inf at positions"):
            client.put_run("clean-client", nonfinite_rows(float("nan")), POSITIONS)
        assert client.stats()["puts"] == 0


def test_a_putrun_stream_with_nonfinite_rows_is_invalid_argument(server):
    """A stream written by hand (not through the client's check) meets the server's."""
    rows = nonfinite_rows(float("nan"))
    header = pb.RunHeader(run_id="clean-raw", positions=POSITIONS, hidden_size=H, dtype="float32")
    chunks = [pb.PutRunChunk(header=header)] + [
        pb.PutRunChunk(rows=pb.RowBlock(layer=layer, site=site, rows=convert.tensor_to_proto(t)))
        for (layer, site), t in rows.items()
    ]
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.PatchStoreStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.PutRun(iter(chunks), metadata=(("authorization", f"Bearer {ADMIN}"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'clean-raw'" in e.value.details() and "site 'pre_attn'" in e.value.details()
    assert "NaN or inf" in e.value.details()


def test_patch_resolution_refuses_a_nonfinite_stored_row():
    """Rows the store holds are finite, but resolution does not rely on it: a row that turned
    NaN after the put (here: a tensor handed over with copy=False, then written) is refused."""
    store = PatchStore(2**20)
    block = torch.ones(len(POSITIONS), H)
    store.put_run("clean", {(1, "post_block"): block}, POSITIONS, copy=False)
    block[2, 5] = float("nan")
    resolver = Resolver(num_layers=4, hidden_size=H, registry=VectorRegistry(H, 4))
    fine = PatchEntry(layer=1, position=0, source={"run": "clean", "position": 1})
    assert resolver.patches([fine], 4, store).by_site[(1, "post_block")][0][1].tolist() == [1] * H
    nan = PatchEntry(layer=1, position=3, source={"run": "clean", "position": 2})
    with pytest.raises(InvalidRequestError) as e:
        resolver.patches([fine, nan], 4, store)
    assert str(e.value) == (
        "patch[1].source: run 'clean' holds NaN or inf at (layer 1, site 'post_block', "
        "position 2); a patch from it would be NaN"
    )
