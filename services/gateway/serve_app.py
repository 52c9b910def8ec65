"""The Ray Serve application: a `Gateway` deployment (FastAPI ingress, plus the engine gRPC
front) over an `Engine` deployment whose every Serve replica is one engine replica.

Replicas of `Engine` scale by the Serve config's `autoscaling_config`. An engine replica
with `tp * pp > 1` is a group of rank actors (`services/engine/actors.py`) that the Serve
replica owns: when a rank dies, the replica's health check fails and Serve replaces the
replica, rank actors included. Each Serve replica holds its engine replica's GPUs
(`engine_resources`): its own GPU with one rank, else a placement group of one GPU bundle per
rank packed on one node, so that Ray gives every rank a GPU of its own. Admin changes
(global steering, the vector registry) are checked here, recorded in the cluster state
(Redis, or without it a restartable actor), and every replica reconciles against it; a
write returns once every live replica applied it (`services/cluster/state.py`). Everything
is configured by the Serve config's `args` (`AppArgs`), never in code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve

from services.cluster.state import (
    ClusterStore,
    Reconciler,
    cluster_store,
    json_data,
    wait_applied,
)
from services.common.auth import ApiKeys
from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    ServiceUnavailableError,
    unwrap_ray_error,
)
from services.common.paths import resolve_model
from services.gateway.engine_links import EngineLinks
from services.gateway.http_auth import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from services.gateway.process_backend import ProcessBackend, listening_socket

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
    num_gpus_per_rank: float = Field(
        0,
        ge=0,
        description="GPUs Ray gives each rank of an engine replica (the Serve replica itself "
        "when tp * pp == 1); see engine_resources",
    )
    api_keys_file: str | None = Field(
        None,
        description="name:scope:secret lines, read by each replica as it starts (a mounted "
        "Secret: restarting the replicas picks up an edited one)",
    )
    api_keys: str | None = Field(
        None,
        description="the keys themselves, as name:scope:secret lines, instead of a file: "
        "`coxswain up` passes its cluster's, so that a restarted replica needs no file",
        repr=False,
    )
    redis_url: str | None = Field(
        None,
        validate_default=True,
        description="redis://:PASSWORD@host:port/db; unset: $COXSWAIN_REDIS_URL (a Secret)",
    )
    patch_store_budget_gb: float = Field(1.0, gt=0)
    admin_apply_timeout_s: float = Field(
        10.0,
        gt=0,
        description="how long an admin write waits for every live engine replica to apply "
        "it before answering 503 with the replicas' versions",
    )
    controller_grpc_port: int | None = Field(50071, description="controller gRPC; null: off")
    allow_no_auth: bool = Field(
        False, description="serve with no API keys configured (local development only)"
    )
    engine_replicas: int | None = Field(
        None, ge=1, description="fix the Engine replica count (else the Serve config's)"
    )
    grpc_port: int | None = Field(50051, description="engine gRPC front; null: off")
    bind_host: str = Field(
        "127.0.0.1",
        description="interface of the engine, controller and patch-store gRPC servers",
    )
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES,
        ge=0,
        description="largest HTTP request body (413 beyond, before reading)",
    )
    body_timeout_s: float = Field(
        DEFAULT_BODY_TIMEOUT_S,
        gt=0,
        description="how long after its headers an HTTP request's body may take to arrive "
        "(408 beyond, and the connection closed)",
    )
    http_port: int | None = Field(
        None,
        description="serve HTTP on this port from front-end processes of the Gateway replica, "
        "each linked to every engine replica, instead of through Serve's proxy (coxswain up "
        "does); null: Serve's proxy only",
    )
    http_workers: int = Field(2, ge=1, description="front-end processes with http_port")
    backend_secret: str | None = Field(
        None,
        description="hex key of the links between the gateway and the engine replicas' delta "
        "servers (build_app draws one when unset)",
        repr=False,
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url_from_env(cls, value: str | None) -> str | None:
        # A password belongs in a Secret, not in the Serve config: deployments put the URL
        # in each pod's environment, which every replica reads when it validates its args.
        return value or os.environ.get("COXSWAIN_REDIS_URL") or None

    @model_validator(mode="after")
    def _gpus_from_ray(self) -> AppArgs:
        # Ray shows a rank only the GPUs it gave it, as cuda:0...: a rank left without one
        # would share whatever GPU it sees with every other such rank.
        if self.num_gpus_per_rank and self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device}: Ray gives each rank its own GPU, which it sees as "
                "cuda:0; use device cuda"
            )
        if self.tp * self.pp > 1 and self.device.startswith("cuda") and not self.num_gpus_per_rank:
            raise ValueError(
                "tp * pp > 1 on cuda needs num_gpus_per_rank: 1, so that Ray gives each rank "
                "actor a GPU of its own"
            )
        return self

    def keys(self) -> ApiKeys:
        """The keys every front end and shared actor of the application checks."""
        if self.api_keys is not None:
            return ApiKeys.parse(self.api_keys)
        return ApiKeys.from_env(self.api_keys_file)

    def device_type(self) -> str:
        """The engine replicas' device type, "cuda" or "cpu", as far as the application can
        tell without seeing their hosts: device cuda, or auto with GPUs asked of Ray."""
        if self.device.startswith("cuda") or (self.device == "auto" and self.num_gpus_per_rank):
            return "cuda"
        return "cpu"


def _patch_store_address() -> str | None:
    """The target of the cluster's patch store for `PatchStoreClient`: the actor, resolved
    (address and service key) again whenever it restarts. None when the cluster has none."""
    import ray

    from services.patch_store.actor import actor_target

    try:
        ray.get_actor(PATCH_STORE_ACTOR, namespace="coxswain")
    except ValueError:  # no store in this cluster
        return None
    return actor_target(PATCH_STORE_ACTOR, "coxswain")


def _unwrap(exc: BaseException) -> BaseException:
    """Our error behind a Ray error, or 503 when a replica or actor died under the call."""
    return unwrap_ray_error(exc, "the engine replica")


# -- functions run against a replica's EngineService (by `Engine.call`) ------------------------


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

            _check_holds_gpu(a)
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
                backend=(a.bind_host, _backend_key(a)),
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
            self.backend = BackendServer(self.service, hosts, _backend_key(a)).start()
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
        stats = await self._apply(_method("stats"))
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


def _backend_key(a: AppArgs) -> bytes:
    if not a.backend_secret:
        raise CoxswainError("backend_secret is unset: build the application with build_app")
    return bytes.fromhex(a.backend_secret)


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
    ):
        """`links`: direct links to the replicas for generation (`engine_links.py`); without
        one linked, generations stream through the handle."""
        self.handle = handle
        self.links = links
        self.store, self.apply_timeout_s = store, apply_timeout_s
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
        try:
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
        state = await self._await(self.handle.call.remote(_method("steering_state")))
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
        return {**state, "cluster": self._cluster(admin)}

    def dynamic_state(self) -> dict:
        return self._call(_method("dynamic_state"))

    def stats(self) -> dict:
        return self._sync(self.handle.stats.remote())

    def health(self) -> dict:
        """One replica's health, and how many replicas the gateway streams from directly.
        Asked over a direct link where there is one: through the handle it would wait for
        one of the replica's `max_ongoing_requests` slots, behind sweeps and state calls."""
        link = self.links.pick() if self.links is not None else None
        replica = link.health() if link is not None else self._call(_method("health"))
        return {**replica, "engine_links": len(self.links) if self.links is not None else 0}

    async def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
        if self.links is not None:
            self.links.close()


def gateway_http_app(a: AppArgs, app_name: str) -> tuple[Any, Any, ApiKeys]:
    """The gateway's HTTP app over application `app_name`'s engines, with its backend and
    keys: built in a Gateway replica, and in each of its HTTP front-end processes."""
    from services.gateway.http_app import build_app as build_http_app

    engine = serve.get_deployment_handle("Engine", app_name=app_name)
    cluster = cluster_store(a.redis_url)
    links = EngineLinks(cluster, _backend_key(a), app_name)
    backend = RemoteEngine(engine, cluster, a.admin_apply_timeout_s, links)
    keys = a.keys()
    if not keys.enabled and not a.allow_no_auth:
        raise CoxswainError(
            "no API keys are configured (api_keys, api_keys_file or COXSWAIN_API_KEYS): refusing "
            "to serve unauthenticated; set allow_no_auth: true for local development"
        )
    store = None
    address = _patch_store_address()
    if address:
        from services.patch_store.client import PatchStoreClient

        store = PatchStoreClient(address)
    app = build_http_app(
        backend,
        keys,
        patch_store=store,
        max_body_bytes=a.max_body_bytes,
        body_timeout_s=a.body_timeout_s,
    )
    return app, backend, keys


def _gateway_asgi(args: dict) -> Any:
    """The FastAPI app of one Gateway replica (built on the replica, where handles work)."""

    def build() -> Any:
        a = AppArgs.model_validate(args)
        app_name = serve.get_replica_context().app_name
        app, backend, keys = gateway_http_app(a, app_name)
        if a.grpc_port is not None:
            _start_grpc(backend, keys, a.grpc_port, a.bind_host)
        if a.http_port is not None:
            _start_http_frontend(args, app_name, a)
        return app

    return build


# The HTTP front-end processes of this Gateway replica (kept referenced while it lives).
_FRONTEND: list[subprocess.Popen] = []


def check_http_frontend() -> None:
    """Raise if a front-end process of this Gateway replica exited: Serve then replaces the
    replica, and with it every front end (the others serve meanwhile). A module function,
    so the replica's `Gateway` (pickled by value) reads this module's `_FRONTEND`."""
    gone = [proc.pid for proc in _FRONTEND if proc.poll() is not None]
    if gone:
        raise ServiceUnavailableError(f"HTTP front-end processes {gone} exited")


def _start_http_frontend(args: dict, app_name: str, a: AppArgs) -> None:
    """Serve the HTTP app on `a.http_port` from `a.http_workers` processes of their own
    (`services/gateway/cluster_frontend.py`), as `coxswain serve` does: one Gateway process
    and Serve's proxy forward every token of every stream, and bound the cluster well below
    what its engines generate. The processes share one listening socket (several Gateway
    replicas of a node share the port), link to every engine replica, and exit with this
    replica. Raises when they do not start (Serve then retries the replica)."""
    sock = listening_socket(a.bind_host, a.http_port, reuse_port=True)
    import ray

    spec = json.dumps(
        {
            "args": args,
            "app": app_name,
            "fd": sock.fileno(),
            "parent": os.getpid(),
            "ray": ray.get_runtime_context().gcs_address,  # this cluster, not another's
        }
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.gateway.cluster_frontend"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(sock.fileno(),),
            text=True,
            # what this replica imports from (a runtime_env's working_dir, a checkout on
            # PYTHONPATH), the child imports from too
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        for _ in range(a.http_workers)
    ]
    try:
        for proc in procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(spec)
            proc.stdin.close()
        for proc in procs:
            line = proc.stdout.readline().strip()  # "ready", or nothing when it failed
            if line != "ready":
                proc.wait(timeout=10)
                err = proc.stderr.read()[-2000:] if proc.stderr else ""
                raise CoxswainError(f"the HTTP front end did not start: {line or err}")
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    finally:
        sock.close()  # the workers hold their copies
    _FRONTEND.extend(procs)
    log.info("HTTP on %s:%d from %d front-end processes", a.bind_host, a.http_port, len(procs))


def _start_grpc(backend: Any, keys: ApiKeys, port: int, host: str) -> None:
    """The engine gRPC front, on its own event loop in a daemon thread of the gateway."""
    from services.gateway.grpc_server import serve_engine_grpc

    started = concurrent.futures.Future()

    async def main() -> None:
        try:
            server, bound = await serve_engine_grpc(backend, keys, port, host=host)
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
    async controller. Scheduled by Ray's default strategy, never into the placement group of
    the engine replica that happens to start them: removing it would kill them."""
    from services.patch_store.actor import start_patch_store_actor

    start_patch_store_actor(
        int(a.patch_store_budget_gb * 2**30),
        keys=a.keys(),  # beside the actor's own service key
        host=a.bind_host,
        name=PATCH_STORE_ACTOR,
        namespace="coxswain",
        lifetime="detached",
        max_restarts=-1,  # restarted empty; clients re-resolve it (services/patch_store/actor.py)
        get_if_exists=True,
        scheduling_strategy="DEFAULT",
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
                "scheduling_strategy": "DEFAULT",
            },
            grpc_host=a.bind_host,
            grpc_port=a.controller_grpc_port,
            keys=a.keys(),
        )


# Serve's default `max_ongoing_requests` (5) would cap an engine's batch at 5 requests and
# queue `/health` behind generation. An Engine replica takes its running batch plus as many
# waiting (so the next batch is ready as sequences finish), plus room for control calls
# (state, stats, health); the Gateway holds every client's stream, so it takes many more,
# and requests beyond the engines' capacity wait in its handle, not at the HTTP proxy.
ENGINE_CONTROL_CALLS = 16
GATEWAY_MIN_ONGOING = 1024


def max_ongoing_requests(a: AppArgs) -> tuple[int, int]:
    """(Engine, Gateway) `max_ongoing_requests`, sized from the engine's `max_num_seqs`, as
    the engines resolve it for their device (a Serve config's deployment options still
    override them)."""
    from services.engine.config import EngineConfig

    seqs = EngineConfig(**a.engine).resolved_for(a.device_type()).max_num_seqs
    engine = 2 * seqs + ENGINE_CONTROL_CALLS
    return engine, max(GATEWAY_MIN_ONGOING, 2 * engine * (a.engine_replicas or 1))


# The Serve replica's own CPU (scheduling, tokenizing, streaming) when the app sizes it.
ENGINE_REPLICA_CPUS = 1


def engine_resources(a: AppArgs) -> dict[str, Any]:
    """The Engine deployment's resource options: each Serve replica holds the `tp * pp`
    GPUs of its engine replica, `num_gpus_per_rank` each. One rank: the replica's own actor
    asks for it, so Ray sets a different CUDA_VISIBLE_DEVICES in each replica. Several: a
    placement group per replica, the replica's CPU bundle first and one GPU bundle per rank
    actor (`services/engine/actors.py` schedules rank r into bundle r + 1), STRICT_PACK so
    that the ranks share a node and TP's all-reduces stay on its links. Pipeline stages on
    different nodes are not done yet. A Serve config's `ray_actor_options` and
    `placement_group_bundles` for Engine replace these."""
    actor: dict[str, Any] = {"num_cpus": ENGINE_REPLICA_CPUS}
    world = a.tp * a.pp
    if not a.num_gpus_per_rank:
        return {"ray_actor_options": actor}
    if world == 1:
        return {"ray_actor_options": {**actor, "num_gpus": a.num_gpus_per_rank}}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [{"CPU": ENGINE_REPLICA_CPUS}]
        + [{"GPU": a.num_gpus_per_rank} for _ in range(world)],
        "placement_group_strategy": "STRICT_PACK",
    }


def build_app(args: dict) -> Any:
    """Serve application builder (`import_path: services.gateway.serve_app:build_app`):
    `Gateway` (ingress) over `Engine`. Replica counts and autoscaling come from the Serve
    config (or `engine_replicas`). The builder has no side effects: the first Engine replica
    starts the shared actors (`start_cluster_actors`)."""
    a = AppArgs.model_validate(args)
    if a.backend_secret is None:  # bound into both deployments: their replicas share it
        a = a.model_copy(update={"backend_secret": secrets.token_hex(32)})
    plain = a.model_dump()
    engine_ongoing, gateway_ongoing = max_ongoing_requests(a)
    engine = serve.deployment(
        name="Engine",
        health_check_period_s=5,
        max_ongoing_requests=engine_ongoing,
        **engine_resources(a),
    )(EngineDeployment)
    if a.engine_replicas is not None:
        engine = engine.options(num_replicas=a.engine_replicas)

    class Gateway:
        def __init__(self, engine_handle: Any):
            self.engine = engine_handle  # binds Engine into this application

        def check_health(self) -> None:
            """Serve calls this periodically (see `check_http_frontend`)."""
            check_http_frontend()

    gateway = serve.deployment(name="Gateway", max_ongoing_requests=gateway_ongoing)(
        serve.ingress(_gateway_asgi(plain))(Gateway)
    )
    return gateway.bind(engine.bind(plain))
