"""An engine replica as a group of Ray actors, one per tensor/pipeline-parallel rank.

Rank 0 hosts the `EngineService` callers talk to; the other ranks step in lock-step with it
(`services/engine/distributed.py`). The group starts in two phases so ranks may sit on
different nodes: rank 0 names a free port on its own node, then every rank joins the
process group there. Any rank dying breaks the replica; `EngineReplica.check()` raises then,
and whoever owns the replica (the Serve deployment) replaces the whole group.

Built inside a placement group (a Serve replica's: its own bundle first, then one per rank),
rank r takes bundle r + 1, so the group sits where the placement group was reserved (one
node under STRICT_PACK) and each rank holds the GPU of its bundle; Ray then shows each rank
only that GPU, its `cuda:0`. Built outside one, the ranks ask Ray for `num_gpus_per_rank`
each, wherever it has them.

Ray is imported only when a replica is built.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import InvalidRequestError, ServiceUnavailableError
from services.common.net import free_port
from services.engine.heap import freeze_startup_heap


def process_placement() -> dict[str, Any]:
    """Where this Ray worker runs: its node, its process id, the GPU ids Ray gave it, the
    CUDA_VISIBLE_DEVICES Ray set from them (physical indices) and its placement group."""
    import ray

    pg = ray.util.get_current_placement_group()
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "placement_group": pg.id.hex() if pg is not None else None,
    }


class EngineRank:
    """One rank's process: its shard of the model and its copy of the engine state."""

    def __init__(self, rank: int, tp_size: int, pp_size: int):
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.service: Any = None
        self._worker: threading.Thread | None = None

    def address(self) -> str:
        """A `tcp://ip:port` on this rank's node for the replica's process group."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"

    def start(
        self,
        init_method: str,
        model: str,
        engine_config: dict,
        model_id: str,
        patch_store_address: str | None = None,
        redis_url: str | None = None,
        backend: tuple[str, bytes] | None = None,
    ) -> Any:
        """Join the replica and build this rank's engine (blocks until every rank joined).
        `backend`: (bind host, key) of a delta server the driver starts for the gateway
        (`process_backend.BackendServer`, `tcp_hosts`); the driver returns its address."""
        from services.engine.async_llm import AsyncLLM
        from services.engine.config import EngineConfig
        from services.engine.device import resolve_device_dtype
        from services.engine.distributed import init_replica, run_worker
        from services.engine.llm_engine import LLMEngine
        from services.engine.service import EngineService

        config = EngineConfig(**engine_config)
        device, _ = resolve_device_dtype(config.device, config.dtype)
        ctx, sync = init_replica(
            self.rank,
            self.tp_size,
            self.pp_size,
            init_method,
            device.type,
            config.fused_all_reduce_norm,
            config.pipeline_microbatches,
        )
        store = None
        if patch_store_address and sync.is_driver:  # only the driver resolves sources
            from services.patch_store.client import PatchStoreClient

            store = PatchStoreClient(patch_store_address)
        engine = LLMEngine(model, config, ctx=ctx, patch_store=store, sync=sync)
        freeze_startup_heap()  # a rank actor's process serves this engine for its life
        if sync.is_driver:
            self.service = EngineService(AsyncLLM(engine=engine), model_id=model_id)
            if redis_url:  # the async controller's read-outs and actions
                import ray

                from services.controller.engine_link import EngineLink

                replica_id = ray.get_runtime_context().get_actor_id()
                self.link = EngineLink(self.service.llm, redis_url, replica_id)
            if backend is not None:
                from services.gateway.process_backend import BackendServer, tcp_hosts

                bind_host, key = backend
                self.backend = BackendServer(self.service, tcp_hosts(bind_host), key)
                return self.backend.start()
        else:
            self._worker = threading.Thread(target=run_worker, args=(engine,), daemon=True)
            self._worker.start()
        return None

    def alive(self) -> bool:
        return self._worker is None or self._worker.is_alive()

    def placement(self) -> dict[str, Any]:
        return {"rank": self.rank, **process_placement()}

    # -- rank 0: the EngineService, method by method ----------------------------------------

    async def generate(self, prompt: Any, params: Any, request_id: str | None = None):
        async for out in self.service.generate(prompt, params, request_id):
            yield out

    async def patch_sweep(self, spec: Any):
        async for item in self.service.patch_sweep(spec):
            yield item

    async def apply(self, fn: Any, *args: Any) -> Any:
        """`fn(service, *args)` on this rank's EngineService (awaited if a coroutine)."""
        result = fn(self.service, *args)
        if hasattr(result, "__await__"):
            result = await result
        return result


class EngineReplica:
    """Starts and watches the rank actors of one replica; `driver` is rank 0's handle."""

    def __init__(
        self,
        model: str,
        engine_config: dict,
        *,
        tp_size: int = 1,
        pp_size: int = 1,
        model_id: str | None = None,
        patch_store_address: str | None = None,
        redis_url: str | None = None,
        num_gpus_per_rank: float = 0,
        num_cpus_per_rank: float = 0,
        backend: tuple[str, bytes] | None = None,
    ):
        """`backend`: (bind host, key) of the delta server the driver rank starts for the
        gateway; its address is then `self.backend`."""
        import ray

        world = tp_size * pp_size
        cls = ray.remote(EngineRank)
        # Named, so operators (and tests) can find a replica's ranks: engine-<id>-rank<r>.
        self.name = f"engine-{uuid.uuid4().hex[:8]}"
        self.ranks = [
            cls.options(
                name=f"{self.name}-rank{rank}",
                namespace="coxswain",
                num_gpus=num_gpus_per_rank,
                num_cpus=num_cpus_per_rank,
                scheduling_strategy=strategy,
            ).remote(rank, tp_size, pp_size)
            for rank, strategy in enumerate(_rank_strategies(world))
        ]
        init_method = ray.get(self.ranks[0].address.remote())
        started = ray.get(
            [
                r.start.remote(
                    init_method,
                    model,
                    engine_config,
                    model_id or model,
                    patch_store_address,
                    redis_url,
                    backend,
                )
                for r in self.ranks
            ]
        )
        self.driver = self.ranks[0]
        self.backend = started[0]  # the driver's delta server (None: none asked for)

    def placement(self) -> list[dict[str, Any]]:
        """Where each rank runs (`process_placement`, with its `rank`)."""
        import ray

        return ray.get([r.placement.remote() for r in self.ranks], timeout=30)

    def check(self) -> None:
        """Raise ServiceUnavailableError unless every rank is alive and stepping."""
        import ray

        try:
            alive = ray.get([r.alive.remote() for r in self.ranks], timeout=30)
        except Exception as exc:
            raise ServiceUnavailableError(f"an engine rank is gone: {exc}") from exc
        if not all(alive):
            dead = [i for i, a in enumerate(alive) if not a]
            raise ServiceUnavailableError(f"engine ranks {dead} stopped stepping")

    async def generate(self, prompt: Any, params: Any, request_id: str | None) -> AsyncIterator:
        async for ref in self.driver.generate.options(num_returns="streaming").remote(
            prompt, params, request_id
        ):
            yield await ref

    async def patch_sweep(self, spec: Any) -> AsyncIterator:
        async for ref in self.driver.patch_sweep.options(num_returns="streaming").remote(spec):
            yield await ref

    async def apply(self, fn: Any, *args: Any) -> Any:
        """`fn(service, *args)` on the driver's EngineService."""
        return await self.driver.apply.remote(fn, *args)

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)


def _rank_strategies(world: int) -> list[Any]:
    """Each rank's scheduling strategy: bundle r + 1 of the placement group this replica is
    built in (bundle 0 holds its owner, the Serve replica), else Ray's default."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    if pg is None:
        return ["DEFAULT"] * world
    if pg.bundle_count != world + 1:
        raise InvalidRequestError(
            f"an engine replica of {world} ranks needs a placement group of {world + 1} "
            f"bundles (its own, then one per rank), got {pg.bundle_count}: give the "
            "Engine deployment's placement_group_bundles one bundle per rank after its own"
        )
    return [
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r + 1)
        for r in range(world)
    ]
