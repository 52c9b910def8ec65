"""The Ray Serve application: a `Gateway` deployment (FastAPI ingress, plus the engine gRPC
front) over an `Engine` deployment whose every Serve replica is one engine replica.

Replicas of `Engine` scale by the Serve config's `autoscaling_config`. An engine replica
with `tp * pp > 1` is a group of rank actors (`services/engine/actors.py`) that the Serve
replica owns: when a rank dies, the replica's health check fails and Serve replaces the
replica, rank actors included. Admin changes (global steering, the vector registry) are
recorded in the cluster state actor and every replica reconciles against it
(`services/cluster/state.py`). Everything is configured by the Serve config's `args`
(`AppArgs`), never in code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from services.cluster.state import Reconciler, state_actor
from services.common.auth import ApiKeys
from services.common.errors import CoxswainError, ServiceUnavailableError

log = logging.getLogger(__name__)

PATCH_STORE_ACTOR = "coxswain-patch-store"
CONTROLLER_ACTOR = "coxswain-controller"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class AppArgs(BaseModel):
    """The `args` of the Serve config (`import_path: services.gateway.serve_app:build_app`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny", description='a local HF checkpoint directory, or "tiny"')
    model_id: str | None = None
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    device: str = "auto"
    dtype: str = "auto"
    engine: dict[str, Any] = Field(default_factory=dict, description="more EngineConfig fields")
    num_gpus_per_rank: float = Field(0, ge=0)
    api_keys_file: str | None = None
    redis_url: str | None = None
    patch_store_budget_gb: float = Field(1.0, gt=0)
    controller_grpc_port: int | None = Field(50071, description="controller gRPC; null: off")
    allow_no_auth: bool = Field(
        False, description="serve with no API keys configured (local development only)"
    )
    engine_replicas: int | None = Field(
        None, ge=1, description="fix the Engine replica count (else the Serve config's)"
    )
    grpc_port: int | None = Field(50051, description="engine gRPC front; null: off")


def resolve_model(model: str) -> Path:
    """A checkpoint directory; "tiny" generates the embedded tiny model once per host."""
    if model != "tiny":
        return Path(model)
    from services.cli import DEFAULT_HOME
    from services.engine.model.tiny import make_tiny_checkpoint

    out = DEFAULT_HOME / "tiny-llama"
    if not (out / "config.json").is_file():
        make_tiny_checkpoint(out, "llama")
    return out


def _patch_store_address() -> str | None:
    import ray

    try:
        return ray.get(ray.get_actor(PATCH_STORE_ACTOR, namespace="coxswain").address.remote())
    except ValueError:  # no store in this cluster
        return None


def _unwrap(exc: BaseException) -> BaseException:
    """Our error behind a Ray error, or 503 when a replica or actor died under the call."""
    import ray.exceptions as rex

    if isinstance(exc, CoxswainError):
        return exc
    cause = getattr(exc, "cause", None)
    if isinstance(exc, rex.RayTaskError) and isinstance(cause, CoxswainError):
        return cause
    if isinstance(exc, rex.RayError):
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else type(exc).__name__
        return ServiceUnavailableError(
            f"the engine replica failed during the call ({detail[:300]}); "
            "it is being replaced: retry shortly"
        )
    return exc


# -- functions run against a replica's EngineService (by `Engine.call`) ------------------------


def _check_global(service: Any, spec: Any, vectors: dict[str, Any]) -> None:
    """Check a global spec as every replica will see it: against the cluster's registry
    (`vectors`, which this replica may not have reconciled yet), not its own."""
    from services.engine.interventions.manager import resolve_global
    from services.engine.interventions.resolve import Resolver
    from services.engine.interventions.vectors import VectorRegistry

    card = service.model_card()
    registry = VectorRegistry(card["hidden_size"], card["num_layers"])
    for name, (_, value) in vectors.items():
        registry.register(name, value)
    resolve_global(Resolver(card["num_layers"], card["hidden_size"], registry), spec)


def _check_vector(service: Any, name: str, value: Any) -> dict:
    return service.engine.vectors._build_entry(name, value, "api").describe()


def _method(name: str, *args: Any, **kwargs: Any) -> Any:
    def run(service: Any) -> Any:
        return getattr(service, name)(*args, **kwargs)

    return run


def _tokenizer_files(service: Any) -> dict[str, bytes]:
    root = Path(service.engine.model_dir)
    return {n: (root / n).read_bytes() for n in TOKENIZER_FILES if (root / n).is_file()}


class EngineDeployment:
    """One engine replica per Serve replica (in-process when `tp * pp == 1`)."""

    def __init__(self, args: dict):
        a = AppArgs.model_validate(args)
        start_cluster_actors(a)  # idempotent: the first replica anywhere starts them
        model_dir = str(resolve_model(a.model))
        config = {"device": a.device, "dtype": a.dtype, **a.engine}
        store_address = _patch_store_address()
        self.service: Any = None
        self.replica: Any = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        model_id = a.model_id or Path(model_dir).name
        if a.tp * a.pp == 1:
            from services.engine.service import EngineService

            store = None
            if store_address:
                from services.patch_store.client import PatchStoreClient

                store = PatchStoreClient(store_address)
            self.service = EngineService.from_model(
                model_dir, model_id=model_id, patch_store=store, **config
            )
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
            )
        self.reconciler = Reconciler(state_actor(), self._apply)
        # Admin state applies before the first request, then follows in the background.
        _run_in_thread(self.reconciler.once())
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

    async def admin_version(self) -> dict:
        """Which cluster-state version this replica has applied (and the replica's id)."""
        r = self.reconciler
        return {
            "replica": self.replica_id,
            "applied_version": r.version,
            "last_error": r.last_error,
        }

    def check_health(self) -> None:
        """Serve calls this periodically: raising replaces the replica (and its ranks)."""
        if self.replica is not None:
            self.replica.check()
        elif not self.service.llm._thread.is_alive():
            raise ServiceUnavailableError("the engine thread stopped")


def _run_in_thread(coro: Any) -> Any:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class RemoteEngine:
    """`EngineService`'s interface for the gateway, over the Engine deployment's replicas.

    Generation and sweeps go to one replica each (Serve picks it); admin writes are checked
    on a replica, then recorded in the cluster state that every replica reconciles to (so
    they reach all replicas within a second, and replicas started later too).
    """

    def __init__(self, handle: Any, state: Any):
        self.handle = handle
        self.state = state
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="remote-engine")
        self._card = self._sync(self.handle.call.remote(_method("model_card")))
        self.model_id = self._card["id"]
        from services.engine.model.tokenizer import Tokenizer

        files = self._sync(self.handle.call.remote(_tokenizer_files))
        self._tokdir = tempfile.TemporaryDirectory(prefix="coxswain-tokenizer-")
        for name, data in files.items():
            (Path(self._tokdir.name) / name).write_bytes(data)
        self.engine = SimpleNamespace(tokenizer=Tokenizer(self._tokdir.name))
        self._streams: dict[str, Any] = {}

    # Routes run sync methods in a thread pool; the gRPC front may call them on its loop,
    # where Serve forbids blocking on a response, so those wait in a pool thread instead.
    def _sync(self, response: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._result(response)
        return self._pool.submit(self._result, response).result()

    @staticmethod
    def _result(response: Any) -> Any:
        import ray

        try:
            if isinstance(response, ray.ObjectRef):  # an actor call (the cluster state)
                return ray.get(response, timeout=60)
            return response.result()
        except BaseException as exc:
            raise _unwrap(exc) from None

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
        return self._call(_method("encode_chat", messages))

    async def generate(
        self, prompt: Any, params: Any, request_id: str | None = None
    ) -> AsyncIterator:
        rid = request_id or f"req-{uuid.uuid4().hex}"
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
        if stream is not None:
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

    # -- admin: checked on a replica, recorded for all -----------------------------------------

    async def set_global_steering(self, spec: Any) -> dict:
        desired = await self._await(self.state.desired.remote())
        await self._await(self.handle.call.remote(_check_global, spec, desired["vectors"]))
        version = await self._await(self.state.set_global.remote(spec))
        return {**await self._state(), "cluster_version": version, "global_spec": spec}

    async def clear_global_steering(self) -> dict:
        version = await self._await(self.state.set_global.remote(None))
        return {**await self._state(), "cluster_version": version, "global_spec": None}

    async def _state(self) -> dict:  # never block the loop on a response: Serve needs it
        state = await self._await(self.handle.call.remote(_method("steering_state")))
        return {**state, "cluster": await self._await(self.handle.admin_version.remote())}

    def register_vector(self, name: str, value: Any, *, overwrite: bool = False) -> dict:
        info = self._call(_check_vector, name, value)
        version = self._sync(self.state.put_vector.remote(name, value, overwrite))
        return {**info, "cluster_version": version}

    def import_vector(self, name: str, path: str, *, overwrite: bool = False) -> dict:
        """Read a .gguf/.safetensors file on the gateway's host; register its values."""
        from services.engine.interventions.vectors import VectorRegistry

        card = self._card
        entry = VectorRegistry(card["hidden_size"], card["num_layers"]).import_file(name, path)
        value = entry.per_layer if entry.per_layer is not None else entry.vector
        return self.register_vector(name, value, overwrite=overwrite)

    def unregister_vector(self, name: str) -> dict:
        self._sync(self.state.drop_vector.remote(name))
        return {"name": name, "unregistered": True}

    def list_vectors(self) -> list[dict]:
        return self._call(_method("list_vectors"))

    def get_vector(self, name: str) -> dict:
        return self._call(_method("get_vector", name))

    def drop_patch_source(self, run: str) -> dict:
        return self._call(_method("drop_patch_source", run))

    def submit_action(self, action: Any, source: str = "api") -> bool:
        return self._call(_method("submit_action", action, source))

    # -- observability (one replica's view) ----------------------------------------------------

    def steering_state(self) -> dict:
        state = self._call(_method("steering_state"))
        admin = self._sync(self.handle.admin_version.remote())
        return {**state, "cluster": admin}

    def dynamic_state(self) -> dict:
        return self._call(_method("dynamic_state"))

    def stats(self) -> dict:
        return self._call(_method("stats"))

    def health(self) -> dict:
        return self._call(_method("health"))

    async def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def _gateway_asgi(args: dict) -> Any:
    """The FastAPI app of one Gateway replica (built on the replica, where handles work)."""

    def build() -> Any:
        from services.gateway.http_app import build_app as build_http_app

        a = AppArgs.model_validate(args)
        app_name = serve.get_replica_context().app_name
        engine = serve.get_deployment_handle("Engine", app_name=app_name)
        backend = RemoteEngine(engine, state_actor())
        keys = ApiKeys.from_env(a.api_keys_file)
        if not keys.enabled and not a.allow_no_auth:
            raise CoxswainError(
                "no API keys are configured (api_keys_file or COXSWAIN_API_KEYS): refusing "
                "to serve unauthenticated; set allow_no_auth: true for local development"
            )
        store = None
        address = _patch_store_address()
        if address:
            from services.patch_store.client import PatchStoreClient

            store = PatchStoreClient(address)
        app = build_http_app(backend, keys, patch_store=store)
        if a.grpc_port is not None:
            _start_grpc(backend, keys, a.grpc_port)
        return app

    return build


def _start_grpc(backend: Any, keys: ApiKeys, port: int) -> None:
    """The engine gRPC front, on its own event loop in a daemon thread of the gateway."""
    from services.gateway.grpc_server import serve_engine_grpc

    started = concurrent.futures.Future()

    async def main() -> None:
        try:
            server, bound = await serve_engine_grpc(backend, keys, port, host="0.0.0.0")
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(bound)
        await server.server.wait_for_termination()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True, name="grpc").start()
    try:
        log.info("engine gRPC front on port %d", started.result(timeout=30))
    except Exception:
        log.exception("the engine gRPC front did not start (HTTP serves on)")


def start_cluster_actors(a: AppArgs) -> None:
    """The actors the application shares across its replicas, started once (named,
    detached, reused when they already run): the patch store, and with `redis_url` the
    async controller."""
    from services.patch_store.actor import start_patch_store_actor

    start_patch_store_actor(
        int(a.patch_store_budget_gb * 2**30),
        name=PATCH_STORE_ACTOR,
        namespace="coxswain",
        lifetime="detached",
        get_if_exists=True,
    )
    if a.redis_url:
        from services.controller.actor import start_controller_actor

        start_controller_actor(
            a.redis_url,
            name=CONTROLLER_ACTOR,
            actor_options={
                "namespace": "coxswain",
                "lifetime": "detached",
                "max_restarts": -1,
                "get_if_exists": True,  # replicas start concurrently
            },
            grpc_port=a.controller_grpc_port,
            keys=ApiKeys.from_env(a.api_keys_file),
        )


def build_app(args: dict) -> Any:
    """Serve application builder (`import_path: services.gateway.serve_app:build_app`):
    `Gateway` (ingress) over `Engine`. Replica counts and autoscaling come from the Serve
    config (or `engine_replicas`). The builder has no side effects: the first Engine replica
    starts the shared actors (`start_cluster_actors`)."""
    a = AppArgs.model_validate(args)
    plain = a.model_dump()
    engine = serve.deployment(name="Engine", health_check_period_s=5)(EngineDeployment)
    if a.engine_replicas is not None:
        engine = engine.options(num_replicas=a.engine_replicas)

    class Gateway:
        def __init__(self, engine_handle: Any):
            self.engine = engine_handle  # binds Engine into this application

    gateway = serve.deployment(name="Gateway")(serve.ingress(_gateway_asgi(plain))(Gateway))
    return gateway.bind(engine.bind(plain))
