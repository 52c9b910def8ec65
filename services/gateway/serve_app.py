"""The Ray Serve application: a `Gateway` deployment (FastAPI ingress, plus the engine gRPC
front) over an `Engine` deployment whose every Serve replica is one engine replica.

Replicas of `Engine` scale by the Serve config's `autoscaling_config`; each holds its engine
replica's GPUs (`engine_resources`): its own GPU with one rank, else a placement group of one
GPU bundle per rank packed on one node, so that Ray gives every rank a GPU of its own. Admin
changes (global steering, the vector registry) are checked in the gateway, recorded in the
cluster state (Redis, or without it a restartable actor), and every replica reconciles
against it; a write returns once every live replica applied it (`services/cluster/state.py`).
Everything is configured by the Serve config's `args` (`AppArgs`), never in code.

The application's parts: its configuration (`app_args.py`), the actors its replicas share
(`cluster_actors.py`), the Engine deployment (`engine_deployment.py`) and the gateway's
client of it (`remote_engine.py`). This module builds the application (`build_app`, sizing
both deployments) and the Gateway's front ends: the HTTP app, the HTTP front-end processes
and the engine gRPC front.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from typing import Any

from ray import serve

from services.cluster.stores import cluster_store
from services.common.auth import ApiKeys
from services.common.errors import CoxswainError, ServiceUnavailableError
from services.gateway.app_args import AppArgs
from services.gateway.cluster_actors import (
    CONTROLLER_ACTOR,
    PATCH_STORE_ACTOR,
    patch_store_address,
)
from services.gateway.engine_deployment import EngineDeployment
from services.gateway.engine_links import EngineLinks
from services.gateway.process_backend import listening_socket
from services.gateway.remote_engine import RemoteEngine, gateway_tokenizer

# This module's names, and the ones read from here that live elsewhere: `AppArgs` (the
# front-end processes, the Serve config's comments) and the actor names (the chaos benchmark).
__all__ = [
    "CONTROLLER_ACTOR",
    "ENGINE_CONTROL_CALLS",
    "ENGINE_REPLICA_CPUS",
    "GATEWAY_MIN_ONGOING",
    "PATCH_STORE_ACTOR",
    "AppArgs",
    "build_app",
    "check_http_frontend",
    "engine_resources",
    "gateway_http_app",
    "max_ongoing_requests",
]

log = logging.getLogger(__name__)


def gateway_http_app(a: AppArgs, app_name: str) -> tuple[Any, Any, ApiKeys]:
    """The gateway's HTTP app over application `app_name`'s engines, with its backend and
    keys: built in a Gateway replica, and in each of its HTTP front-end processes."""
    from services.gateway.http_app import build_app as build_http_app

    engine = serve.get_deployment_handle("Engine", app_name=app_name)
    cluster = cluster_store(a.redis_url)
    tokenizer = gateway_tokenizer(engine)
    links = EngineLinks(cluster, a.backend_key(), app_name, tokenizer=tokenizer)
    backend = RemoteEngine(engine, cluster, a.admin_apply_timeout_s, links, tokenizer)
    keys = a.keys()
    if not keys.enabled and not a.allow_no_auth:
        raise CoxswainError(
            "no API keys are configured (api_keys, api_keys_file or COXSWAIN_API_KEYS): refusing "
            "to serve unauthenticated; set allow_no_auth: true for local development"
        )
    store = None
    address = patch_store_address()
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
