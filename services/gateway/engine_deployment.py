"""The `Engine` deployment: one engine replica per Serve replica.

An engine replica with `tp * pp > 1` is a group of rank actors (`services/engine/actors.py`)
that the Serve replica owns: when a rank dies, the replica's health check fails and Serve
replaces the replica, rank actors included. Each replica reconciles against the cluster state
(admin changes: global steering, the vector registry) and serves generations over a direct
link to the gateway (`process_backend.BackendServer`). What the gateway runs against a
replica's `EngineService` through `Engine.call` is built here too (`service_method`,
`tokenizer_files`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve

from services.cluster.reconciler import Reconciler
from services.cluster.stores import cluster_store
from services.common.errors import InvalidRequestError, ServiceUnavailableError
from services.common.paths import resolve_model
from services.gateway.app_args import AppArgs
from services.gateway.cluster_actors import patch_store_address, start_cluster_actors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# -- functions run against a replica's EngineService (by `Engine.call`) ------------------------


def service_method(name: str, *args: Any, **kwargs: Any) -> Any:
    """A function calling `service.<name>(*args, **kwargs)`, for `Engine.call`."""

    def run(service: Any) -> Any:
        return getattr(service, name)(*args, **kwargs)

    return run


def tokenizer_files(service: Any) -> dict[str, bytes]:
    """The tokenizer's files of the replica's model, by name (for the gateway's copy)."""
    root = Path(service.engine.model_dir)
    return {n: (root / n).read_bytes() for n in TOKENIZER_FILES if (root / n).is_file()}


class EngineDeployment:
    """One engine replica per Serve replica (in-process when `tp * pp == 1`)."""

    def __init__(self, args: dict):
        a = AppArgs.model_validate(args)
        start_cluster_actors(a)  # idempotent: the first replica anywhere starts them
        model_dir = str(resolve_model(a.model))
        config = {"device": a.device, "dtype": a.dtype, **a.engine}
        store_address = patch_store_address()
        self.service: Any = None
        self.replica: Any = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        model_id = a.model_id or Path(model_dir).name
        if a.tp * a.pp == 1:
            from services.engine.heap import freeze_startup_heap
            from services.engine.service import EngineService

            _check_holds_gpu(a)
            store = None
            if store_address:
                from services.patch_store.client import PatchStoreClient

                store = PatchStoreClient(store_address)
            self.service = EngineService.from_model(
                model_dir, model_id=model_id, patch_store=store, **config
            )
            freeze_startup_heap()  # this replica's process serves the engine for its life
            self._link(a.redis_url)
        else:
            from services.engine.actors import EngineReplica

            self.replica = EngineReplica(
                model_dir,
                config,
                tp_size=a.tp,
                pp_size=a.pp,
                model_id=model_id,
                patch_store_address=store_address,
                redis_url=a.redis_url,
                num_gpus_per_rank=a.num_gpus_per_rank,
                backend=(a.bind_host, a.backend_key()),
            )
        # Generations take a direct link from the gateway to the engine's process, one
        # message per engine step however many streams it advanced; the replica's report
        # tells the gateway where (Serve's handle stream costs a Ray call per token, in the
        # process that steps the engine).
        if self.replica is not None:
            self.backend = self.replica.backend
        else:
            from services.gateway.process_backend import BackendServer, tcp_hosts

            hosts = tcp_hosts(a.bind_host)
            self.backend = BackendServer(self.service, hosts, a.backend_key()).start()
        self.reconciler = Reconciler(
            cluster_store(a.redis_url),
            self._apply,
            self.replica_id,
            extra={
                "backend": list(self.backend.path),
                "app": serve.get_replica_context().app_name,
            },
        )
        # Admin state applies before the first request, then follows every change. A failure
        # (an entry this engine refuses, the store unreachable) is reported, never fatal.
        _run_in_thread(self.reconciler.step())
        threading.Thread(
            target=asyncio.run, args=(self.reconciler.run(),), daemon=True, name="reconcile"
        ).start()

    def _link(self, redis_url: str | None) -> None:
        """Publish read-outs to / drain actions from the async controller's Redis."""
        self.link = None
        if redis_url:
            from services.controller.engine_link import EngineLink

            self.link = EngineLink(self.service.llm, redis_url, self.replica_id)

    async def _apply(self, fn: Any, *args: Any) -> Any:
        if self.replica is not None:
            return await self.replica.apply(fn, *args)
        result = fn(self.service, *args)
        if hasattr(result, "__await__"):
            result = await result
        return result

    async def generate(self, prompt: Any, params: Any, request_id: str | None) -> AsyncIterator:
        source = self.replica if self.replica is not None else self.service
        async for out in source.generate(prompt, params, request_id):
            yield out

    async def patch_sweep(self, spec: Any) -> AsyncIterator:
        source = self.replica if self.replica is not None else self.service
        async for item in source.patch_sweep(spec):
            yield item

    async def call(self, fn: Any, *args: Any) -> Any:
        return await self._apply(fn, *args)

    def placement(self) -> dict:
        """Where this engine replica runs: the Serve replica's id and, per rank, its node,
        the GPUs Ray gave it and their CUDA_VISIBLE_DEVICES, and its placement group."""
        from services.engine.actors import process_placement

        if self.replica is not None:
            ranks = self.replica.placement()
        else:
            ranks = [{"rank": 0, **process_placement()}]
        return {"replica": self.replica_id, "ranks": ranks}

    async def stats(self) -> dict:
        """The engine's statistics, with where it runs (`placement`)."""
        stats = await self._apply(service_method("stats"))
        return {**stats, "placement": await asyncio.to_thread(self.placement)}

    async def admin_version(self) -> dict:
        """Which cluster-state version this replica has applied, the entries it refused
        (`rejected`: `vector:<name>` or `global`, with the reason) and its id."""
        r = self.reconciler
        return {
            "replica": self.replica_id,
            "applied_version": r.version,
            "epoch": r.epoch,
            "rejected": r.rejected,
            "last_error": r.last_error,
        }

    def check_health(self) -> None:
        """Serve calls this periodically: raising replaces the replica (and its ranks)."""
        if self.replica is not None:
            self.replica.check()
        elif not self.service.llm._thread.is_alive():
            raise ServiceUnavailableError("the engine thread stopped")


def _check_holds_gpu(a: AppArgs) -> None:
    """Refuse to build a one-rank engine replica on CUDA without a GPU of Ray's: every such
    replica would use the same cuda:0. (A Serve config's Engine `ray_actor_options` replace
    the application's, so they must ask for the GPU themselves.)"""
    import ray

    if (a.num_gpus_per_rank or a.device.startswith("cuda")) and not ray.get_gpu_ids():
        raise InvalidRequestError(
            f"this Engine replica holds no GPU (device {a.device}, num_gpus_per_rank "
            f"{a.num_gpus_per_rank:g}): set num_gpus_per_rank: 1, and num_gpus: 1 in the "
            "Engine's ray_actor_options if the Serve config sets them"
        )


def _run_in_thread(coro: Any) -> Any:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
