"""The patch store's gRPC server: the `coxswain.v1.PatchStore` service over one `PatchStore`,
with the standard Health and reflection services beside it."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from services.common.errors import (
    GRPC_ERROR_METADATA_KEY,
    CoxswainError,
    grpc_status,
)
from services.common.grpc_serving import GrpcServer, start_grpc_server
from services.patch_store import convert
from services.patch_store.store import PatchStore
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PatchStore"].full_name  # coxswain.v1.PatchStore
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _rpc(method: _Method) -> _Method:
    """Turn our exceptions into gRPC statuses (the class name in trailing metadata); anything
    else is INTERNAL and logged. The server keeps serving either way."""

    @functools.wraps(method)
    def wrapper(self: PatchStoreServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except CoxswainError as e:
            context.set_trailing_metadata(((GRPC_ERROR_METADATA_KEY, type(e).__name__),))
            context.abort(grpc_status(e), str(e))
        except Exception as e:
            if not context.is_active():  # the client went away mid-stream
                return None
            log.exception("patch store %s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper  # type: ignore[return-value]


class PatchStoreServicer(pb_grpc.PatchStoreServicer):
    """The `coxswain.v1.PatchStore` service: each RPC converts, calls the store, converts back."""

    def __init__(self, store: PatchStore) -> None:
        self.store = store

    @_rpc
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

    @_rpc
    def GetRows(self, request, context):
        keys = convert.row_keys_from_proto(request.keys)
        rows = self.store.get_rows(request.run_id, keys)  # [K, H]
        return pb.GetRowsResponse(rows=convert.tensor_to_proto(rows))

    @_rpc
    def Lease(self, request, context):
        expiry = self.store.lease(request.run_id, request.ttl_s, request.holder)
        return pb.LeaseResponse(expires_in_s=max(0.0, expiry - self.store.clock()))

    @_rpc
    def Release(self, request, context):
        return pb.ReleaseResponse(released=self.store.release(request.run_id, request.holder))

    @_rpc
    def DropRun(self, request, context):
        return pb.DropRunResponse(bytes_freed=self.store.drop_run(request.run_id))

    @_rpc
    def InvalidateAll(self, request, context):
        return pb.InvalidateAllResponse(runs_dropped=self.store.invalidate_all(request.reason))

    @_rpc
    def Manifests(self, request, context):
        manifests = self.store.manifests(list(request.run_ids) or None)
        now = self.store.clock()
        return pb.ManifestsResponse(
            manifests=[convert.manifest_to_proto(m, now) for m in manifests]
        )

    @_rpc
    def Stats(self, request, context):
        return convert.stats_to_proto(self.store.stats())


PatchStoreServer = GrpcServer  # what `serve` returns: `address`, `stop()`, `wait()`


def serve(
    store: PatchStore,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    max_workers: int = 8,
) -> PatchStoreServer:
    """Start serving `store` on `host:port` (port 0: any free port) with Health and reflection.
    Messages over `max_message_bytes` either way are refused with RESOURCE_EXHAUSTED."""
    return start_grpc_server(
        "patch store",
        SERVICE_NAME,
        lambda server: pb_grpc.add_PatchStoreServicer_to_server(PatchStoreServicer(store), server),
        host,
        port,
        max_workers=max_workers,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
