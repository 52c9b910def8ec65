"""A gRPC client of the patch store with the Python API of `PatchStore`.

Errors come back as the exceptions the store raised (`RunNotFoundError`, `InvalidRequestError`,
...); an unreachable or slow server raises `ServiceUnavailableError`. Lease expiries are given
in this process's `time.monotonic()` clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from services.common.errors import InvalidRequestError
from services.common.grpc_client import GrpcClient
from services.patch_store import convert
from services.patch_store.server import DEFAULT_MAX_MESSAGE_BYTES
from services.patch_store.store import LayerSite, Manifest, RowKey
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

DEFAULT_CHUNK_BYTES = 2**20


class PatchStoreClient(GrpcClient):
    """Talks to a patch store server at `address` (`host:port`). Every call waits at most
    `timeout_s`; `put_run` streams rows in chunks of about `chunk_bytes`."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(
            address,
            service="patch store",
            timeout_s=timeout_s,
            max_message_bytes=max_message_bytes,
            limit_hint="raise the server's max message size, lower the client's chunk_bytes, "
            "or ask for fewer rows per get_rows",
        )
        self.chunk_bytes = chunk_bytes
        self._stub = pb_grpc.PatchStoreStub(self._channel)

    def put_run(
        self,
        run_id: str,
        rows: Mapping[LayerSite, torch.Tensor],
        positions: Sequence[int],
        *,
        model: str = "",
        token_ids: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> Manifest:
        """Store a run (see `PatchStore.put_run`); the run is checked here before it streams."""
        args = convert.PutRunArgs(
            run_id=run_id,
            rows=rows,
            positions=positions,
            model=model,
            token_ids=token_ids,
            overwrite=overwrite,
        )
        chunks = convert.put_run_to_chunks(args, self.chunk_bytes)
        return convert.manifest_from_proto(self._call(self._stub.PutRun, chunks), time.monotonic())

    def get_rows(self, run_id: str, keys: Sequence[RowKey]) -> torch.Tensor:
        """`[len(keys), H]` rows in the run's dtype (see `PatchStore.get_rows`)."""
        request = pb.GetRowsRequest(run_id=run_id, keys=convert.row_keys_to_proto(keys))
        response = self._call(self._stub.GetRows, request)
        return convert.tensor_from_proto(response.rows, what=f"rows of run {run_id!r}")

    def lease(self, run_id: str, ttl_s: float, holder: str) -> float:
        """Take or refresh a lease; its expiry in this process's `time.monotonic()`."""
        request = _message(pb.LeaseRequest, run_id=run_id, ttl_s=ttl_s, holder=holder)
        return time.monotonic() + self._call(self._stub.Lease, request).expires_in_s

    def release(self, run_id: str, holder: str) -> bool:
        """Give up a lease; False when `holder` held none on `run_id`."""
        request = _message(pb.ReleaseRequest, run_id=run_id, holder=holder)
        return self._call(self._stub.Release, request).released

    def drop_run(self, run_id: str) -> int:
        """Remove a run, leased or not; the bytes freed."""
        request = _message(pb.DropRunRequest, run_id=run_id)
        return self._call(self._stub.DropRun, request).bytes_freed

    def invalidate_all(self, reason: str = "") -> int:
        """Drop every run (the weights changed); how many were dropped."""
        request = _message(pb.InvalidateAllRequest, reason=reason)
        return self._call(self._stub.InvalidateAll, request).runs_dropped

    def manifests(self, run_ids: Iterable[str] | None = None) -> list[Manifest]:
        """Metadata of the runs named (all runs when None)."""
        if isinstance(run_ids, str):
            raise InvalidRequestError("run_ids must be a list of run ids, not one string")
        if run_ids is not None:
            run_ids = list(run_ids)
            if not run_ids:  # the wire's empty list means "all runs"
                return []
        request = _message(pb.ManifestsRequest, run_ids=run_ids or [])
        response = self._call(self._stub.Manifests, request)
        now = time.monotonic()
        return [convert.manifest_from_proto(m, now) for m in response.manifests]

    def stats(self) -> dict[str, int]:
        """The server store's `stats()`."""
        return convert.stats_from_proto(self._call(self._stub.Stats, pb.StatsRequest()))


def _message(cls: Callable[..., Any], **fields: Any) -> Any:
    """A request message, with protobuf's TypeError/ValueError for a wrongly typed field
    turned into InvalidRequestError."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"bad {cls.__name__}: {e}") from None
