"""The patch store's gRPC server: the `coxswain.v1.PatchStore` service over one `PatchStore`,
with the standard Health and reflection services beside it.

The port hands out captured activations and prompt token ids and can overwrite or drop every
run, so it authenticates like every other Coxswain port: bearer API keys
(`services.common.auth.ApiKeys`), read scope to read and lease, admin scope to write, drop
and invalidate. Health and reflection stay open, as on the engine and controller ports. It
binds loopback unless told otherwise. A read-only key leases as a *reader* named by its key,
so the store bounds the bytes each such key holds leased (`PatchStore.lease`).
"""

from __future__ import annotations

import functools
import logging

from services.common.auth import ApiKeys
from services.common.grpc_serving import GrpcServer, authenticated_rpc, start_grpc_server
from services.patch_store import convert
from services.patch_store.store import PatchStore
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PatchStore"].full_name  # coxswain.v1.PatchStore
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20

_rpc = functools.partial(authenticated_rpc, "patch store")


class PatchStoreServicer(pb_grpc.PatchStoreServicer):
    """The `coxswain.v1.PatchStore` service: each RPC checks the key, converts, calls the
    store, converts back. `keys` empty: auth off (local development only)."""

    def __init__(self, store: PatchStore, keys: ApiKeys) -> None:
        self.store = store
        self.keys = keys

    @_rpc("admin")
    def PutRun(self, request_iterator, context):
        args = convert.put_run_from_chunks(request_iterator, max_run_bytes=self.store.budget_bytes)
        manifest = self.store.put_run(
            args.run_id,
            args.rows,
            args.positions,
            model=args.model,
            token_ids=args.token_ids,
            overwrite=args.overwrite,
            copy=False,  # freshly assembled from the stream: the store may keep them
        )
        return convert.manifest_to_proto(manifest, self.store.clock())

    @_rpc("read")
    def GetRows(self, request, context):
        keys = convert.row_keys_from_proto(request.keys)
        rows = self.store.get_rows(request.run_id, keys)  # [K, H]
        return pb.GetRowsResponse(rows=convert.tensor_to_proto(rows))

    @_rpc("read")
    def Lease(self, request, context):
        reader = self._read_only_key(context)
        expiry = self.store.lease(request.run_id, request.ttl_s, request.holder, reader=reader)
        return pb.LeaseResponse(expires_in_s=max(0.0, expiry - self.store.clock()))

    def _read_only_key(self, context) -> str | None:
        """The name of the caller's key when it is read-only; None for an admin key, which may
        drop every run anyway, and when auth is off (then anyone may)."""
        key = self.keys.check(dict(context.invocation_metadata()).get("authorization"), "read")
        return key.name if key is not None and key.scope == "read" else None

    @_rpc("read")
    def Release(self, request, context):
        return pb.ReleaseResponse(released=self.store.release(request.run_id, request.holder))

    @_rpc("admin")
    def DropRun(self, request, context):
        return pb.DropRunResponse(bytes_freed=self.store.drop_run(request.run_id))

    @_rpc("admin")
    def InvalidateAll(self, request, context):
        return pb.InvalidateAllResponse(runs_dropped=self.store.invalidate_all(request.reason))

    @_rpc("read")
    def Manifests(self, request, context):
        manifests = self.store.manifests(list(request.run_ids) or None)
        now = self.store.clock()
        return pb.ManifestsResponse(
            manifests=[convert.manifest_to_proto(m, now) for m in manifests]
        )

    @_rpc("read")
    def Stats(self, request, context):
        return convert.stats_to_proto(self.store.stats())


PatchStoreServer = GrpcServer  # what `serve` returns: `address`, `stop()`, `wait()`


def serve(
    store: PatchStore,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    keys: ApiKeys | None = None,
    max_workers: int = 8,
) -> PatchStoreServer:
    """Start serving `store` on `host:port` (port 0: any free port; host "0.0.0.0" to listen on
    every interface) with Health and reflection. Every PatchStore call is checked against
    `keys` (None: the keys of `COXSWAIN_API_KEYS` / `COXSWAIN_API_KEYS_FILE`, like every
    Coxswain server; none configured: auth off, logged). Messages over `max_message_bytes`
    either way are refused with RESOURCE_EXHAUSTED."""
    keys = ApiKeys.from_env() if keys is None else keys
    if not keys.enabled:
        log.warning(
            "patch store on %s:%s serves with no API keys: anyone reaching it may "
            "read and overwrite every run",
            host,
            port,
        )
    return start_grpc_server(
        "patch store",
        SERVICE_NAME,
        lambda server: pb_grpc.add_PatchStoreServicer_to_server(
            PatchStoreServicer(store, keys), server
        ),
        host,
        port,
        max_workers=max_workers,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
