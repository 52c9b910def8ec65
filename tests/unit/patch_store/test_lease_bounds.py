"""Leases cannot grow the patch store past its budget: a TTL is at most `max_lease_s` (longer
is refused with the cap named), a read-only key's leased runs hold at most its byte share,
and a put that would fit only by evicting leased runs is refused, so stored and leased bytes
stay within the budget whatever a read key asks for."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import InvalidRequestError, TooLargeError
from services.patch_store.client import PatchStoreClient
from services.patch_store.server import serve
from services.patch_store.store import PatchStore
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

H = 16
POSITIONS = [0, 1, 2, 3]
RUN_BYTES = len(POSITIONS) * H * 4  # one (layer, site) of float32
ADMIN, READ, READ_2 = "admin-secret-0123456789", "read-secret-0123456789", "read2-secret-012345678"
KEYS = ApiKeys(
    [ApiKey("ops", "admin", ADMIN), ApiKey("viewer", "read", READ), ApiKey("other", "read", READ_2)]
)


def rows(seed: int = 0) -> dict:
    return {
        (0, "post_block"): torch.randn(
            len(POSITIONS), H, generator=torch.Generator().manual_seed(seed)
        )
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def served():
    """A served store of 8 runs' budget (a reader may lease 4), with a client per key."""
    store = PatchStore(8 * RUN_BYTES)
    srv = serve(store, "127.0.0.1", 0, keys=KEYS)
    clients = {
        k.name: PatchStoreClient(srv.address, api_key=k.secret, timeout_s=10) for k in KEYS.keys
    }
    yield store, srv.address, clients
    for c in clients.values():
        c.close()
    srv.stop(grace_s=0)


def test_a_lease_longer_than_max_lease_s_is_refused_naming_the_cap():
    store = PatchStore(4 * RUN_BYTES, max_lease_s=600, clock=Clock())
    store.put_run("r", rows(), POSITIONS)
    with pytest.raises(InvalidRequestError) as e:
        store.lease("r", 1e18, "h")
    assert str(e.value) == (
        "lease ttl_s 1e+18 is longer than the patch store's maximum of 600 s (max_lease_s): "
        "lease for at most that, and lease again before it ends to keep the run longer"
    )
    assert store.manifests(["r"])[0].holders == ()
    assert store.lease("r", 600, "h") == 1600.0  # the cap itself is allowed
    assert PatchStore(RUN_BYTES).max_lease_s == 3600.0  # the default: an hour


@pytest.mark.parametrize(
    "options",
    [{"max_lease_s": 0}, {"max_lease_s": float("inf")}, {"max_lease_bytes_per_reader": -1}],
)
def test_lease_bounds_must_be_sensible(options):
    with pytest.raises(InvalidRequestError, match=next(iter(options))):
        PatchStore(RUN_BYTES, **options)


def test_a_read_key_leases_at_most_its_share_and_a_second_lease_of_its_own_counts_once():
    store = PatchStore(8 * RUN_BYTES, clock=Clock())
    assert store.max_lease_bytes_per_reader == 4 * RUN_BYTES  # half the budget by default
    for i in range(8):
        store.put_run(f"r{i}", rows(i), POSITIONS)
    for i in range(4):
        store.lease(f"r{i}", 60, "sweep", reader="viewer")
    store.lease("r0", 60, "other-holder", reader="viewer")  # a run it holds: no more bytes
    store.lease("r3", 60, "sweep", reader="viewer")  # a refresh
    with pytest.raises(TooLargeError) as e:
        store.lease("r4", 60, "sweep", reader="viewer")
    assert str(e.value) == (
        f"API key 'viewer' may not lease run 'r4' ({RUN_BYTES} bytes): the runs it leases hold "
        f"{4 * RUN_BYTES} bytes, and a read-only key may lease at most {4 * RUN_BYTES} of the "
        f"patch store's {8 * RUN_BYTES} (max_lease_bytes_per_reader); release leases it no "
        "longer needs"
    )
    assert store.manifests(["r4"])[0].holders == ()
    store.lease("r4", 60, "sweep", reader="other")  # another key has its own share
    store.lease("r5", 60, "engine-0")  # a caller that may write is bounded by the budget only
    store.release("r0", "sweep")
    with pytest.raises(TooLargeError):  # it still holds r0 under "other-holder"
        store.lease("r4", 60, "sweep", reader="viewer")
    store.release("r0", "other-holder")
    store.lease("r4", 60, "sweep", reader="viewer")
    s = store.stats()
    assert s["leases_refused"] == 2 and s["leased_bytes"] == 5 * RUN_BYTES  # r1-r5


def test_a_read_key_over_grpc_cannot_grow_the_store_past_its_budget(served):
    """The report's attack, scaled down: a read key leases every capture it sees with a huge
    TTL while the admin keeps storing. Leases are refused or bounded; stored and leased bytes
    stay within the budget, and the admin's runs keep fitting."""
    store, _, clients = served
    viewer, ops = clients["viewer"], clients["ops"]
    refused = {"ttl": 0, "share": 0}
    for i in range(24):
        ops.put_run(f"capture-{i}", rows(i), POSITIONS)
        with pytest.raises(InvalidRequestError, match=r"maximum of 3600 s \(max_lease_s\)"):
            viewer.lease(f"capture-{i}", 1e18, f"h{i}")
        refused["ttl"] += 1
        try:
            viewer.lease(f"capture-{i}", 3600, f"h{i}")
        except TooLargeError as e:
            assert "API key 'viewer' may not lease" in str(e)
            refused["share"] += 1
        s = ops.stats()
        assert s["bytes"] <= s["budget_bytes"] and s["leased_bytes"] <= 4 * RUN_BYTES
    assert refused == {"ttl": 24, "share": 20}
    assert store.stats()["runs"] == 8 and ops.stats()["evictions"] == 16


def test_grpc_statuses_of_refused_leases_and_puts(served):
    store, address, clients = served
    ops, viewer, other = clients["ops"], clients["viewer"], clients["other"]
    for i in range(8):
        ops.put_run(f"r{i}", rows(i), POSITIONS)
    for i, client in enumerate([viewer] * 4 + [other] * 4):
        client.lease(f"r{i}", 60, "h")
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PatchStoreStub(channel)
        auth = (("authorization", f"Bearer {READ}"),)
        with pytest.raises(grpc.RpcError) as e:
            stub.Lease(pb.LeaseRequest(run_id="r5", ttl_s=1e18, holder="h"), metadata=auth)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_lease_s" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Lease(pb.LeaseRequest(run_id="r5", ttl_s=60, holder="h"), metadata=auth)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_lease_bytes_per_reader" in e.value.details()
    with pytest.raises(TooLargeError, match="leased runs hold"):  # everything is leased
        ops.put_run("new", rows(), POSITIONS)
    assert store.stats()["bytes"] == store.budget_bytes == store.stats()["leased_bytes"]
