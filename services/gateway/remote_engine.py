"""`RemoteEngine`: `EngineService`'s interface for the gateway, over the Engine deployment's
replicas. Generations go over direct links to the replicas (`engine_links.py`) or Serve's
handle; admin writes are checked here, recorded in the cluster state (Redis, or without it a
restartable actor) that every replica reconciles against, and answered once every live
replica applied them (`services/cluster/state.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from services.cluster.state import ClusterStore, json_data, wait_applied
from services.common.errors import (
    InvalidRequestError,
    ServiceUnavailableError,
    unwrap_ray_error,
)
from services.gateway.engine_deployment import service_method, tokenizer_files
from services.gateway.engine_links import EngineLinks
from services.gateway.process_backend import ProcessBackend


def _unwrap(exc: BaseException) -> BaseException:
    """Our error behind a Ray error, or 503 when a replica or actor died under the call."""
    return unwrap_ray_error(exc, "the engine replica")


def _wait(response: Any, pool: concurrent.futures.Executor) -> Any:
    """A Serve response's result (our error behind a Ray one). Routes run sync methods in a
    thread pool; the gRPC front may call them on its loop, where Serve forbids blocking on
    a response, so there it waits in a thread of `pool` instead."""

    def result() -> Any:
        try:
            return response.result()
        except BaseException as exc:
            raise _unwrap(exc) from None

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return result()
    return pool.submit(result).result()


def gateway_tokenizer(handle: Any) -> Any:
    """The model's tokenizer in this process, from the files of an Engine replica (the
    gateway renders prompts and token texts, and decodes the text of linked generations)."""
    from services.engine.model.tokenizer import Tokenizer

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        files = _wait(handle.call.remote(tokenizer_files), pool)
    with tempfile.TemporaryDirectory(prefix="coxswain-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return Tokenizer(tmp)


class RemoteEngine:
    """`EngineService`'s interface for the gateway, over the Engine deployment's replicas.

    Generation and sweeps go to one replica each (Serve picks it); admin writes are checked
    here with the engine's own checks (vector names included), recorded in the cluster
    `store` that every replica reconciles to (replicas started later too), and return once
    every live replica applied them, or after `apply_timeout_s` with a 503 naming the
    replicas behind: the next request sees the change, whichever replica serves it.
    """

    def __init__(
        self,
        handle: Any,
        store: ClusterStore,
        apply_timeout_s: float = 10.0,
        links: EngineLinks | None = None,
        tokenizer: Any = None,
    ):
        """`links`: direct links to the replicas for generation (`engine_links.py`); without
        one linked, generations stream through the handle. `tokenizer`: the model's, as
        `gateway_tokenizer` gives it (fetched here when None)."""
        self.handle = handle
        self.links = links
        self.store, self.apply_timeout_s = store, apply_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="remote-engine")
        self._card = self._sync(self.handle.call.remote(service_method("model_card")))
        self.model_id = self._card["id"]
        self.engine = SimpleNamespace(tokenizer=tokenizer or gateway_tokenizer(handle))
        self._streams: dict[str, Any] = {}

    def _sync(self, response: Any) -> Any:
        return _wait(response, self._pool)

    async def _await(self, response: Any) -> Any:
        try:
            return await response
        except BaseException as exc:
            raise _unwrap(exc) from None

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._sync(self.handle.call.remote(fn, *args))

    # -- model and generation ----------------------------------------------------------------

    def model_card(self) -> dict:
        return dict(self._card)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self._call(service_method("encode_chat", messages))

    async def generate(
        self, prompt: Any, params: Any, request_id: str | None = None
    ) -> AsyncIterator:
        rid = request_id or f"req-{uuid.uuid4().hex}"
        link = self.links.pick() if self.links is not None else None
        if link is not None:  # closing the generator early aborts the request there
            self._streams[rid] = link
            try:
                async for out in link.generate(prompt, params, rid):
                    yield out
            finally:
                self._streams.pop(rid, None)
            return
        stream = self.handle.options(stream=True).generate.remote(prompt, params, rid)
        self._streams[rid] = stream
        try:
            async for out in stream:
                yield out
        except BaseException as exc:
            raise _unwrap(exc) from None
        finally:
            self._streams.pop(rid, None)
            stream.cancel()  # a no-op once finished; aborts the request if we stopped early

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if isinstance(stream, ProcessBackend):
            await stream.abort(request_id)
        elif stream is not None:
            stream.cancel()

    async def patch_sweep(self, spec: Any) -> AsyncIterator[dict]:
        stream = self.handle.options(stream=True).patch_sweep.remote(spec)
        try:
            async for item in stream:
                yield item
        except BaseException as exc:
            raise _unwrap(exc) from None
        finally:
            stream.cancel()

    # -- admin: checked here, recorded for all, applied everywhere before answering ----------

    async def set_global_steering(self, spec: Any) -> dict:
        applied = await asyncio.to_thread(self._set_global, spec)
        state = await self._state(applied["replicas"])
        return {**state, "cluster_version": applied["cluster_version"], "global_spec": spec}

    async def clear_global_steering(self) -> dict:
        return await self.set_global_steering(None)

    def _set_global(self, spec: Any) -> dict:
        """Check `spec` as every replica will resolve it (against the cluster's registry, not
        one replica's), record it, wait until every live replica applied it."""
        from services.engine.interventions.manager import resolve_global
        from services.engine.interventions.resolve import Resolver
        from services.engine.interventions.spec import parse_steering

        parsed = parse_steering(spec)
        if parsed is not None:
            card = self._card
            registry = self._registry(self.store.desired().vectors)
            resolve_global(Resolver(card["num_layers"], card["hidden_size"], registry), spec)
        return self._applied(self.store.set_global(None if parsed is None else json_data(parsed)))

    def _registry(self, vectors: dict[str, Any] | None = None) -> Any:
        """A registry checking what every engine's does (model shape, names), holding the
        recorded `vectors` minus any it refuses (the replicas skip those too)."""
        from services.engine.interventions.vectors import VectorRegistry

        registry = VectorRegistry(self._card["hidden_size"], self._card["num_layers"])
        for name, value in (vectors or {}).items():
            with contextlib.suppress(InvalidRequestError):
                registry.register(name, value)
        return registry

    def _applied(self, head: tuple[str, int]) -> dict:
        """Wait until every live replica applied `head`: the write's `cluster_version` and
        the replicas' reports (ServiceUnavailableError naming the ones behind on timeout)."""
        reports = wait_applied(self.store, head, self.apply_timeout_s)
        return {"cluster_version": head[1], "replicas": reports}

    async def _state(self, reports: dict | None = None) -> dict:
        # never block the loop on a response: Serve needs it
        state = await self._await(self.handle.call.remote(service_method("steering_state")))
        admin = await self._await(self.handle.admin_version.remote())
        return {**state, "cluster": await asyncio.to_thread(self._cluster, admin, reports)}

    def _cluster(self, replica: dict, reports: dict | None = None) -> dict:
        """One replica's admin view (`replica`, `applied_version`, `rejected`, `last_error`)
        plus the cluster's: the recorded `version` and every live replica's report, both
        null with a `store_error` saying why while the cluster store does not answer."""
        view = {**replica, "version": None, "replicas": None}
        try:
            view["version"] = self.store.head()[1]
            view["replicas"] = self.store.reports() if reports is None else reports
        except ServiceUnavailableError as exc:  # the engine's state is still worth showing
            view["store_error"] = str(exc)
        return view

    def register_vector(self, name: str, value: Any, *, overwrite: bool = False) -> dict:
        return self._record(self._registry().register(name, value), overwrite)

    def import_vector(self, name: str, path: str, *, overwrite: bool = False) -> dict:
        """Read a .gguf/.safetensors file on the gateway's host; register its values."""
        return self._record(self._registry().import_file(name, path), overwrite)

    def _record(self, entry: Any, overwrite: bool) -> dict:
        """Record a checked `NamedVector` (tensors packed: exact) and wait until every live
        replica registered it."""
        value = entry.vector if entry.per_layer is None else entry.per_layer
        head = self.store.put_vector(entry.name, json_data(value), overwrite)
        return {**entry.describe(), **self._applied(head)}

    def unregister_vector(self, name: str) -> dict:
        # No name check: an entry recorded before names were checked must stay removable.
        return {"name": name, "unregistered": True, **self._applied(self.store.drop_vector(name))}

    def list_vectors(self) -> list[dict]:
        return self._call(service_method("list_vectors"))

    def get_vector(self, name: str) -> dict:
        return self._call(service_method("get_vector", name))

    def drop_patch_source(self, run: str) -> dict:
        return self._call(service_method("drop_patch_source", run))

    def submit_action(self, action: Any, source: str = "api") -> bool:
        return self._call(service_method("submit_action", action, source))

    # -- observability (one replica's view) ----------------------------------------------------

    def steering_state(self) -> dict:
        state = self._call(service_method("steering_state"))
        admin = self._sync(self.handle.admin_version.remote())
        return {**state, "cluster": self._cluster(admin)}

    def dynamic_state(self) -> dict:
        return self._call(service_method("dynamic_state"))

    def stats(self) -> dict:
        return self._sync(self.handle.stats.remote())

    def health(self) -> dict:
        """One replica's health, and how many replicas the gateway streams from directly.
        Asked over a direct link where there is one: through the handle it would wait for
        one of the replica's `max_ongoing_requests` slots, behind sweeps and state calls."""
        link = self.links.pick() if self.links is not None else None
        replica = link.health() if link is not None else self._call(service_method("health"))
        return {**replica, "engine_links": len(self.links) if self.links is not None else 0}

    async def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
        if self.links is not None:
            self.links.close()
