"""The patch store over real gRPC on a loopback port: round trips, streaming, errors as status
codes (and back as our exceptions), message limits, bearer-key auth on every method, a client
following a store that moved, health, and the CLI server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.auth import ApiKey, ApiKeys
from services.common.errors import (
    GRPC_ERROR_METADATA_KEY,
    InvalidRequestError,
    PermissionDeniedError,
    RunExistsError,
    RunNotFoundError,
    ServiceUnavailableError,
    TooLargeError,
    UnauthenticatedError,
)
from services.patch_store import convert
from services.patch_store.client import PatchStoreClient, PatchStoreEndpoint
from services.patch_store.server import SERVICE_NAME, serve
from services.patch_store.store import PatchStore
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

MAX_MESSAGE = 2 * 2**20  # the server's limit in these tests
H = 64
ADMIN, READ = "admin-secret-0123456789", "read-secret-0123456789"
KEYS = ApiKeys([ApiKey("ops", "admin", ADMIN), ApiKey("viewer", "read", READ)])
AUTH = (("authorization", f"Bearer {ADMIN}"),)


@pytest.fixture(scope="module")
def server():
    srv = serve(PatchStore(256 * 2**20), "127.0.0.1", 0, max_message_bytes=MAX_MESSAGE, keys=KEYS)
    yield srv
    srv.stop(grace_s=0)


@pytest.fixture()
def client(server):
    with PatchStoreClient(server.address, api_key=ADMIN, timeout_s=10) as c:
        yield c


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.PatchStoreStub(channel)


def still_serving(server) -> None:
    """The server answers a health check and a real read after whatever came before."""
    with PatchStoreClient(server.address, api_key=ADMIN, timeout_s=5) as c:
        assert c.health() == "SERVING"
        c.put_run("canary", {(0, "post_block"): torch.ones(1, 4)}, [0], overwrite=True)
        assert c.get_rows("canary", [(0, "post_block", 0)]).tolist() == [[1.0] * 4]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def header(run_id="r", dtype="float32", positions=(0, 1), hidden=H) -> pb.PutRunChunk:
    return pb.PutRunChunk(
        header=pb.RunHeader(run_id=run_id, positions=positions, hidden_size=hidden, dtype=dtype)
    )


def block(t: torch.Tensor, layer=0, site="post_block", offset=0, **override) -> pb.PutRunChunk:
    msg = convert.tensor_to_proto(t)
    for field, value in override.items():
        setattr(msg, field, value)
    return pb.PutRunChunk(rows=pb.RowBlock(layer=layer, site=site, row_offset=offset, rows=msg))


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_then_get_is_bit_exact(client, dtype):
    g = torch.Generator().manual_seed(0)
    rows = {
        (layer, site): (torch.randn(5, H, generator=g) * 10).to(dtype)
        for layer in (0, 2)
        for site in ("pre_attn", "post_block")
    }
    big = torch.finfo(dtype).max  # inf is refused: a patch-source run must be finite
    rows[(0, "pre_attn")][0, :4] = torch.tensor([-0.0, big, -big, 1e-40], dtype=dtype)
    positions = [10, 11, 12, 13, 14]
    m = client.put_run(
        f"clean-{dtype}", rows, positions, model="tiny@1", token_ids=list(range(15)), overwrite=True
    )
    assert m.dtype == str(dtype).removeprefix("torch.") and m.hidden_size == H
    assert m.keys == ((0, "post_block"), (0, "pre_attn"), (2, "post_block"), (2, "pre_attn"))
    assert m.positions == tuple(positions) and m.token_ids == tuple(range(15))
    keys = [(layer, site, p) for (layer, site) in rows for p in positions][::-1]
    out = client.get_rows(f"clean-{dtype}", keys)
    assert out.dtype == dtype and out.shape == (len(keys), H)
    expected = torch.stack([rows[(layer, site)][p - 10] for layer, site, p in keys])
    assert torch.equal(bits(out), bits(expected))


def test_a_big_run_streams_in_many_chunks(server, client):
    rows = {(layer, "post_block"): torch.randn(96, 512) for layer in range(6)}  # 1.2 MB
    chunks = list(
        convert.put_run_to_chunks(convert.PutRunArgs("big", rows, range(96), "", None, True), 2**15)
    )
    assert len(chunks) == 1 + 6 * 6  # header, then 16 rows (32 KiB) per chunk
    with PatchStoreClient(server.address, api_key=ADMIN, chunk_bytes=2**15) as small_chunks:
        m = small_chunks.put_run("big", rows, list(range(96)), overwrite=True)
    assert m.bytes == 6 * 96 * 512 * 4
    for layer in (0, 5):
        got = client.get_rows("big", [(layer, "post_block", p) for p in range(96)])
        assert torch.equal(got, rows[(layer, "post_block")])


def test_leases_manifests_drop_and_stats_over_the_wire(client):
    client.put_run("leased", {(1, "post_attn"): torch.zeros(3, 8)}, [0, 1, 2], overwrite=True)
    expiry = client.lease("leased", 30, "engine-0")
    assert 29 < expiry - time.monotonic() <= 30
    (m,) = client.manifests(["leased"])
    assert m.holders == ("engine-0",) and 29 < m.leased_until - time.monotonic() <= 30
    assert "leased" in {x.run_id for x in client.manifests()}
    assert client.manifests([]) == []
    assert client.release("leased", "engine-0") is True
    assert client.release("leased", "engine-0") is False
    with pytest.raises(RunExistsError):
        client.put_run("leased", {(1, "post_attn"): torch.zeros(3, 8)}, [0, 1, 2])
    assert client.drop_run("leased") == 3 * 8 * 4
    with pytest.raises(RunNotFoundError, match="dropped by its owner"):
        client.lease("leased", 30, "engine-0")
    s = client.stats()
    assert s["drops"] >= 1 and s["puts"] >= 1 and set(s) >= {"bytes", "budget_bytes", "evictions"}


def test_invalidate_all_over_the_wire():
    srv = serve(PatchStore(2**20), keys=KEYS)  # its own store: the module's runs stay put
    try:
        with PatchStoreClient(srv.address, api_key=ADMIN) as c:
            for name in "abc":
                c.put_run(name, {(0, "post_block"): torch.zeros(2, 4)}, [0, 1])
            c.lease("a", 60, "engine-0")
            assert c.invalidate_all("weights step 3") == 3
            assert c.manifests() == []
            with pytest.raises(RunNotFoundError, match="weights step 3"):
                c.get_rows("a", [(0, "post_block", 0)])
    finally:
        srv.stop(grace_s=0)


# -- errors ------------------------------------------------------------------------------------


def test_unknown_run_is_not_found_and_the_client_raises_run_not_found(server, client, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.GetRows(pb.GetRowsRequest(run_id="ghost"), timeout=5, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'ghost' is not in the patch store" in e.value.details()
    assert dict(e.value.trailing_metadata())[GRPC_ERROR_METADATA_KEY] == "RunNotFoundError"
    with pytest.raises(RunNotFoundError, match="ghost"):
        client.get_rows("ghost", [(0, "post_block", 0)])
    with pytest.raises(RunNotFoundError):
        client.drop_run("ghost")
    still_serving(server)


def test_missing_rows_are_invalid_argument_naming_the_key(server, client):
    client.put_run("partial", {(0, "post_block"): torch.zeros(2, 4)}, [0, 1], overwrite=True)
    with pytest.raises(InvalidRequestError, match=r"\(layer 0, site 'post_block', position 7\)"):
        client.get_rows("partial", [(0, "post_block", 7)])
    still_serving(server)


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([], "must start with a header"),
        ([block(torch.zeros(2, H))], "must start with a header"),
        ([header(), block(torch.zeros(2, H), data=b"\0" * 7)], "holds 7 bytes"),
        ([header(dtype="float8"), block(torch.zeros(2, H))], "unknown dtype 'float8'"),
        ([header(), block(torch.zeros(2, H), dtype="int4")], "rows are 'int4'"),
        ([header(), block(torch.zeros(2, H, dtype=torch.float16))], "rows are 'float16'"),
        ([header(), block(torch.zeros(2, 8))], "hidden_size=64"),
        ([header(), block(torch.zeros(1, H), offset=1)], "do not continue"),
        ([header(), block(torch.zeros(3, H))], "do not continue"),
        ([header(), block(torch.zeros(1, H))], "ended with 1 of 2 rows"),
        ([header()], "no row blocks"),
        ([header(), block(torch.zeros(2, H)), header()], "only the first chunk is a header"),
        ([header(positions=(0, 0)), block(torch.zeros(2, H))], "positions repeat"),
        ([header(run_id=""), block(torch.zeros(2, H))], "run id must be a non-empty string"),
    ],
    ids=[
        "empty",
        "no-header",
        "wrong-byte-count",
        "unknown-header-dtype",
        "unknown-block-dtype",
        "dtype-mismatch",
        "wrong-hidden",
        "gap",
        "too-many-rows",
        "too-few-rows",
        "header-only",
        "second-header",
        "repeated-positions",
        "no-run-id",
    ],
)
def test_malformed_put_streams_are_invalid_argument(server, stub, chunks, match):
    with pytest.raises(grpc.RpcError) as e:
        stub.PutRun(iter(chunks), timeout=5, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert match in e.value.details()
    still_serving(server)


def test_the_client_checks_a_run_before_streaming_it(client):
    with pytest.raises(InvalidRequestError, match="num_positions=3"):
        client.put_run("bad", {(0, "post_block"): torch.zeros(2, H)}, [0, 1, 2])
    with pytest.raises(InvalidRequestError, match="triple"):
        client.get_rows("bad", [(0, "post_block")])
    with pytest.raises(InvalidRequestError):
        client.lease("bad", "soon", "h")


def test_messages_over_the_limit_are_resource_exhausted(server, client):
    rows = {(0, "post_block"): torch.zeros(1024, 1024)}  # 4 MiB, over the 2 MiB limit
    one_chunk = PatchStoreClient(server.address, api_key=ADMIN, chunk_bytes=8 * 2**20)
    with one_chunk, pytest.raises(TooLargeError, match=r"RESOURCE_EXHAUSTED|larger than max"):
        one_chunk.put_run("huge", rows, list(range(1024)))
    with pytest.raises(RunNotFoundError):  # nothing half-stored
        client.get_rows("huge", [(0, "post_block", 0)])
    still_serving(server)
    client.put_run("huge", rows, list(range(1024)), overwrite=True)  # in 1 MiB chunks: fine
    with pytest.raises(TooLargeError):  # the response would be over the limit
        client.get_rows("huge", [(0, "post_block", p) for p in range(1024)])
    assert client.get_rows("huge", [(0, "post_block", 3)]).shape == (1, 1024)
    client.drop_run("huge")
    still_serving(server)


def test_a_run_larger_than_the_budget_is_refused_before_it_is_assembled():
    srv = serve(PatchStore(2**16), keys=KEYS)
    try:
        with PatchStoreClient(srv.address, api_key=ADMIN, chunk_bytes=2**12) as c:
            with pytest.raises(TooLargeError, match="whole budget"):
                c.put_run(
                    "big", {(i, "post_block"): torch.zeros(64, 128) for i in range(3)}, range(64)
                )
            assert c.stats()["runs"] == 0
    finally:
        srv.stop(grace_s=0)


def test_an_unreachable_server_is_service_unavailable():
    with PatchStoreClient("127.0.0.1:1", timeout_s=2) as c:
        with pytest.raises(ServiceUnavailableError, match=r"127\.0\.0\.1:1"):
            c.stats()
        with pytest.raises(ServiceUnavailableError):
            c.wait_ready(timeout_s=0.5)


# -- authentication, binding, a store that moves ----------------------------------------------

# One request per PatchStore method, with the scope it needs; the test below fails when a
# method is added without a line here.
METHOD_CALLS = {
    "PutRun": ("admin", lambda: iter([header(run_id="auth-probe"), block(torch.zeros(2, H))])),
    "DropRun": ("admin", lambda: pb.DropRunRequest(run_id="auth-probe")),
    "InvalidateAll": ("admin", lambda: pb.InvalidateAllRequest(reason="auth probe")),
    "GetRows": ("read", lambda: pb.GetRowsRequest(run_id="auth-probe")),
    "Lease": ("read", lambda: pb.LeaseRequest(run_id="auth-probe", ttl_s=1, holder="h")),
    "Release": ("read", lambda: pb.ReleaseRequest(run_id="auth-probe", holder="h")),
    "Manifests": ("read", lambda: pb.ManifestsRequest()),
    "Stats": ("read", lambda: pb.StatsRequest()),
}


@pytest.fixture()
def fresh_server():
    """A store of its own: InvalidateAll must not empty the module's store."""
    srv = serve(PatchStore(2**20), keys=KEYS)
    yield srv
    srv.stop(grace_s=0)


def call_as(server, method: str, key: str | None) -> grpc.StatusCode:
    """The status one raw call of `method` ends with, sent with `key` (None: no key)."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.PatchStoreStub(channel)
        try:
            getattr(stub, method)(METHOD_CALLS[method][1](), timeout=5, metadata=metadata)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_every_method_needs_a_key_of_its_scope(fresh_server):
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["PatchStore"].methods}
    assert methods == set(METHOD_CALLS)
    for method, (scope, _) in METHOD_CALLS.items():
        assert call_as(fresh_server, method, None) == grpc.StatusCode.UNAUTHENTICATED, method
        wrong = "not-a-key-0123456789abc"
        assert call_as(fresh_server, method, wrong) == grpc.StatusCode.UNAUTHENTICATED, method
        with_read = call_as(fresh_server, method, READ)
        if scope == "admin":
            assert with_read == grpc.StatusCode.PERMISSION_DENIED, method
        else:  # the key is accepted; what is left is the store's own answer
            assert with_read in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), method
    # Nothing a refused call sent was stored, and the admin key writes.
    assert call_as(fresh_server, "PutRun", ADMIN) == grpc.StatusCode.OK
    assert call_as(fresh_server, "DropRun", ADMIN) == grpc.StatusCode.OK


def test_the_client_raises_our_auth_errors_and_health_stays_open(server):
    with PatchStoreClient(server.address, timeout_s=5) as anonymous:
        assert anonymous.health() == "SERVING"
        with pytest.raises(UnauthenticatedError, match="missing bearer API key"):
            anonymous.stats()
    wrong = PatchStoreClient(server.address, api_key="wrong-secret-0123456789", timeout_s=5)
    with wrong, pytest.raises(UnauthenticatedError, match="unknown API key"):
        wrong.manifests()
    with PatchStoreClient(server.address, api_key=READ, timeout_s=5) as reader:
        assert reader.stats()["budget_bytes"] == 256 * 2**20
        with pytest.raises(PermissionDeniedError, match="'viewer' is read-only"):
            reader.put_run("nope", {(0, "post_block"): torch.zeros(1, 4)}, [0])
        with pytest.raises(PermissionDeniedError):
            reader.drop_run("nope")
        with pytest.raises(PermissionDeniedError):
            reader.invalidate_all()


def test_the_server_binds_loopback_unless_told_otherwise():
    srv = serve(PatchStore(2**16), keys=KEYS)
    try:
        assert srv.host == "127.0.0.1"
    finally:
        srv.stop(grace_s=0)


def test_a_client_with_a_resolver_follows_the_store_to_its_new_address():
    """The store moves (a restarted actor: new port, new key): the resolver names the new
    endpoint, the client reconnects on UNAVAILABLE, and a run the old store held is an
    explicit not-found that says the store restarted."""
    old_key, new_key = "first-secret-0123456789", "second-secret-0123456789"
    first = serve(PatchStore(2**20), keys=ApiKeys([ApiKey("svc", "admin", old_key)]))
    where = {"now": PatchStoreEndpoint(first.address, old_key)}
    client = PatchStoreClient(resolver=lambda: where["now"], timeout_s=5)
    m = client.put_run("r", {(0, "post_block"): torch.ones(2, 4)}, [0, 1])
    first.stop(grace_s=0)
    second = serve(
        PatchStore(2**20, restarted=True), keys=ApiKeys([ApiKey("svc", "admin", new_key)])
    )
    try:
        where["now"] = PatchStoreEndpoint(second.address, new_key)
        assert client.stats()["runs"] == 0  # reconnected, with the new key
        with pytest.raises(RunNotFoundError, match="patch store restarted at") as e:
            client.get_rows("r", [(0, "post_block", 0)])
        assert "every run stored before that is gone" in str(e.value)
        with pytest.raises(RunNotFoundError, match=r"restarted at .* and lost it"):
            client.get_rows(m.ref, [(0, "post_block", 0)])
        client.put_run("r", {(0, "post_block"): torch.zeros(2, 4)}, [0, 1])
        assert client.get_rows("r", [(0, "post_block", 0)]).tolist() == [[0.0] * 4]
        # Without a resolver a client cannot follow: the dead address stays an error.
        stuck = PatchStoreClient(first.address, api_key=old_key, timeout_s=2)
        with stuck, pytest.raises(ServiceUnavailableError):
            stuck.stats()
    finally:
        client.close()
        second.stop(grace_s=0)


# -- health, reflection, the command line ------------------------------------------------------


def test_health_is_serving_and_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_cli_serves_until_sigterm():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "patch-store",
            "serve",
            "--port",
            "0",
            "--budget-gb",
            "0.01",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COXSWAIN_API_KEYS": f"ops:admin:{ADMIN}", "COXSWAIN_API_KEYS_FILE": ""},
    )
    try:
        line = proc.stdout.readline()
        assert "patch store serving on 127.0.0.1:" in line, line + proc.stderr.read()
        address = line.split(" on ")[1].split()[0]
        anonymous = PatchStoreClient(address, timeout_s=5)
        with anonymous, pytest.raises(UnauthenticatedError):  # the CLI's store: the env's keys
            anonymous.stats()
        with PatchStoreClient(address, api_key=ADMIN, timeout_s=5) as c:
            assert c.health() == "SERVING"
            c.put_run("r", {(0, "post_block"): torch.ones(2, 4)}, [0, 1])
            assert c.stats()["budget_bytes"] == int(0.01 * 2**30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "stopping" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
