"""A gRPC client of the patch store with the Python API of `PatchStore`.

Errors come back as the exceptions the store raised (`RunNotFoundError`, `InvalidRequestError`,
...); an unreachable or slow server raises `ServiceUnavailableError`. Lease expiries are given
in this process's `time.monotonic()` clock.

A store can move: the cluster's patch-store actor is restarted when it dies, on a new port
with a new service key. A client built with a `resolver` (or the target
`ray-actor://<namespace>/<name>`, which resolves that actor) asks it for the store's endpoint
again when a call fails as UNAVAILABLE or UNAUTHENTICATED, and retries the call once on the
new store instead of pointing at a dead address forever. Runs do not survive a restart; the
new store answers a run it lost with RunNotFoundError saying so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from services.common.errors import (
    InvalidRequestError,
    ServiceUnavailableError,
    UnauthenticatedError,
)
from services.common.grpc_client import GrpcClient
from services.patch_store import convert
from services.patch_store.endpoint import (
    ACTOR_SCHEME,
    PatchStoreEndpoint,
    Resolver,
    actor_resolver,
)
from services.patch_store.server import DEFAULT_MAX_MESSAGE_BYTES
from services.patch_store.store import LayerSite, Manifest, RowKey
from services.proto.coxswain.v1 import patch_store_pb2 as pb
from services.proto.coxswain.v1 import patch_store_pb2_grpc as pb_grpc

DEFAULT_CHUNK_BYTES = 2**20


class PatchStoreClient(GrpcClient):
    """Talks to a patch store server at `address` (`host:port`) with bearer key `api_key`, or
    wherever `resolver` says it is now (see the module docstring); `address` may also be
    `ray-actor://<namespace>/<name>`, a resolver of that Ray actor. Every call waits at most
    `timeout_s`; `put_run` streams rows in chunks of about `chunk_bytes`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        api_key: str | None = None,
        resolver: Resolver | None = None,
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if address is not None and address.startswith(ACTOR_SCHEME):
            resolver, address = actor_resolver(address, timeout_s=max(timeout_s, 60.0)), None
        if (address is None) == (resolver is None):
            raise InvalidRequestError("a patch store client needs an address or a resolver")
        self.chunk_bytes = chunk_bytes
        self._resolver = resolver
        self._max_message_bytes = max_message_bytes
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._generation = 0
        if resolver is None:
            assert address is not None  # checked above
            self._open(PatchStoreEndpoint(address, api_key))
        else:
            self._open(resolver())

    def _open(self, endpoint: PatchStoreEndpoint) -> None:
        """(Re)connect to `endpoint`. The channel replaced is left to the garbage collector,
        not closed: another thread may still be finishing a call on it."""
        super().__init__(
            endpoint.address,
            service="patch store",
            api_key=endpoint.api_key,
            timeout_s=self._timeout_s,
            max_message_bytes=self._max_message_bytes,
            limit_hint="raise the server's max message size, lower the client's chunk_bytes, "
            "or ask for fewer rows per get_rows",
        )
        self._stub = pb_grpc.PatchStoreStub(self._channel)
        self._endpoint = endpoint
        self._generation += 1

    def _reconnect(self, generation: int) -> bool:
        """After a call on connection `generation` failed: whether to retry, because someone
        reconnected meanwhile or the resolver now names another endpoint."""
        with self._lock:
            if self._generation != generation:
                return True
            if self._resolver is None:
                return False
            endpoint = self._resolver()
            if endpoint == self._endpoint:
                return False
            self._open(endpoint)
            return True

    def _invoke(self, rpc: str, request: Callable[[], Any]) -> Any:
        """Call `rpc` with a fresh `request()`; once more on the store's new endpoint when it
        moved (UNAVAILABLE or UNAUTHENTICATED from the old one)."""
        for attempt in range(3):
            generation = self._generation
            try:
                return self._call(getattr(self._stub, rpc), request())
            except (ServiceUnavailableError, UnauthenticatedError):
                if attempt == 2 or not self._reconnect(generation):
                    raise
        raise AssertionError("unreachable")

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
        # put_run_to_chunks checks the run before the stream starts (and again for a retry)
        response = self._invoke("PutRun", lambda: convert.put_run_to_chunks(args, self.chunk_bytes))
        return convert.manifest_from_proto(response, time.monotonic())

    def get_rows(self, run_id: str, keys: Sequence[RowKey]) -> torch.Tensor:
        """`[len(keys), H]` rows in the run's dtype (see `PatchStore.get_rows`)."""
        request = pb.GetRowsRequest(run_id=run_id, keys=convert.row_keys_to_proto(keys))
        response = self._invoke("GetRows", lambda: request)
        return convert.tensor_from_proto(response.rows, what=f"rows of run {run_id!r}")

    def lease(self, run_id: str, ttl_s: float, holder: str) -> float:
        """Take or refresh a lease; its expiry in this process's `time.monotonic()`."""
        request = _message(pb.LeaseRequest, run_id=run_id, ttl_s=ttl_s, holder=holder)
        return time.monotonic() + self._invoke("Lease", lambda: request).expires_in_s

    def release(self, run_id: str, holder: str) -> bool:
        """Give up a lease; False when `holder` held none on `run_id`."""
        request = _message(pb.ReleaseRequest, run_id=run_id, holder=holder)
        return self._invoke("Release", lambda: request).released

    def drop_run(self, run_id: str) -> int:
        """Remove a run, leased or not; the bytes freed."""
        request = _message(pb.DropRunRequest, run_id=run_id)
        return self._invoke("DropRun", lambda: request).bytes_freed

    def invalidate_all(self, reason: str = "") -> int:
        """Drop every run (the weights changed); how many were dropped."""
        request = _message(pb.InvalidateAllRequest, reason=reason)
        return self._invoke("InvalidateAll", lambda: request).runs_dropped

    def manifests(self, run_ids: Iterable[str] | None = None) -> list[Manifest]:
        """Metadata of the runs named (all runs when None)."""
        if isinstance(run_ids, str):
            raise InvalidRequestError("run_ids must be a list of run ids, not one string")
        if run_ids is not None:
            run_ids = list(run_ids)
            if not run_ids:  # the wire's empty list means "all runs"
                return []
        request = _message(pb.ManifestsRequest, run_ids=run_ids or [])
        response = self._invoke("Manifests", lambda: request)
        now = time.monotonic()
        return [convert.manifest_from_proto(m, now) for m in response.manifests]

    def stats(self) -> dict[str, int]:
        """The server store's `stats()`."""
        return convert.stats_from_proto(self._invoke("Stats", pb.StatsRequest))


def _message(cls: Callable[..., Any], **fields: Any) -> Any:
    """A request message, with protobuf's TypeError/ValueError for a wrongly typed field
    turned into InvalidRequestError."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"bad {cls.__name__}: {e}") from None
