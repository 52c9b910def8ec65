"""`coxswain up` / `down`: the whole cluster on this machine.

`up` checks the model and the GPUs first, then starts what the cluster needs and records each
thing in the cluster's state as soon as it runs (`directory.py`), so that a failure at any
later step (and `down`) stops exactly what this `up` started and nothing else on the host:

- a `redis-server` of its own (`processes.py`). A Redis of the user's is used only when
  named with `--redis-url`: an unauthenticated Redis on 6379 is never picked up silently.
- a Ray head in a session of its own (`processes.py`).
- the Serve application (gateway, engine replicas, patch store, controller). HTTP, the
  engine gRPC front and the controller's gRPC bind `--host` (loopback unless widened). On
  CUDA every engine rank holds a GPU of its own (`--replicas` × `--tp` × `--pp` in all), which
  `up` counts before it starts anything.

API keys are kept in the cluster directory across `up` runs unless `--new-keys`; the
replicas get them in the application's arguments, so that one restarted later needs no
file. One `up` at a time holds the directory, and `up` refuses a directory whose cluster is
running: two clusters would fight over the same ports. `coxswain status` is `status.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cluster.directory import (
    clear_state,
    cluster_dir,
    hold_directory,
    read_state,
    save_state,
    unwritable,
    write_private,
)
from services.cluster.processes import (
    SINGLE_NODE_RAY,
    redacted,
    redis_ping,
    start_ray_head,
    start_redis,
    stop_recorded,
    use_ray_token_auth,
)
from services.cluster.status import running_cluster
from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from services.common.net import free_port
from services.common.paths import check_model_dir, resolve_model

APP_NAME = "coxswain"
_ANY_HOST = ("0.0.0.0", "::", "")


@dataclass
class UpOptions:
    """What `coxswain up` is asked for: its flags, as `up` takes them."""

    model: str = "tiny"
    tp: int = 1
    pp: int = 1
    replicas: int = 1
    device: str = "auto"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    controller_grpc_port: int = 50071
    redis_url: str | None = None
    api_keys_file: str | None = None
    num_cpus: int | None = None
    patch_store_budget_gb: float = 1.0
    new_keys: bool = False
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # more EngineConfig fields


def check_engine_settings(engine: dict[str, Any]) -> None:
    """Refuse `--engine` settings no engine replica could take, before anything starts."""
    from services.engine.config import check_settings

    check_settings(engine, "--engine", {"device": "--device", "dtype": "--dtype"})


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's API keys as `up` read them once: the replicas get `text` in the
    application's arguments (no replica reads `file`, which may be gone by the time one
    restarts); `printed` is what `up` shows (empty for a file the user gave)."""

    file: str
    text: str = dataclasses.field(repr=False)
    printed: dict[str, str] = dataclasses.field(repr=False)


def _api_keys(opts: UpOptions, directory: Path) -> ClusterKeys:
    """A given keys file as is; else the cluster's own (admin + read-only), generated once
    and kept until `--new-keys`."""
    from services.common.auth import ApiKeys

    if opts.api_keys_file:
        try:
            text = Path(opts.api_keys_file).read_text()
            ApiKeys.parse(text)
        except (OSError, CoxswainError) as e:
            why = e.strerror if isinstance(e, OSError) else e
            raise InvalidRequestError(f"--api-keys-file {opts.api_keys_file}: {why}") from None
        return ClusterKeys(opts.api_keys_file, text, {})
    path = directory / "api_keys"
    if path.is_file() and not opts.new_keys:
        path.chmod(0o600)
        text = path.read_text()
        try:
            keys = {k.name: k.secret for k in ApiKeys.parse(text).keys}
        except CoxswainError as e:
            raise InvalidRequestError(f"{path}: {e} (start with --new-keys to replace it)") from e
        if {"admin", "read"} <= keys.keys():
            return ClusterKeys(str(path), text, {"admin": keys["admin"], "read": keys["read"]})
    keys = {
        "admin": "cx-admin-" + secrets.token_hex(16),
        "read": "cx-read-" + secrets.token_hex(16),
    }
    text = "".join(f"{scope}:{scope}:{key}\n" for scope, key in keys.items())
    write_private(path, text)
    return ClusterKeys(str(path), text, keys)


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in _ANY_HOST:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def visible_gpus() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies): the ones the Ray head
    that `up` starts here will find."""
    import torch

    return torch.cuda.device_count()


def resolve_device(opts: UpOptions, gpus: int) -> str:
    """The device of the engine replicas, "cpu" or "cuda" ("auto": cuda when this machine
    has `gpus` > 0), once it is sure the GPUs they need are there: one per rank."""
    if opts.device == "cpu":
        return "cpu"
    if opts.device.startswith("cuda:"):
        raise InvalidRequestError(
            f"--device {opts.device}: Ray gives each engine rank a GPU of its own; use "
            "--device cuda (CUDA_VISIBLE_DEVICES chooses which GPUs the cluster may use)"
        )
    if opts.device not in ("cuda", "auto"):
        raise InvalidRequestError(f"--device must be cpu, cuda or auto, got {opts.device!r}")
    if gpus == 0:
        if opts.device == "auto":
            return "cpu"
        raise InvalidRequestError(
            "--device cuda: no CUDA device is visible on this machine "
            "(torch.cuda.device_count() is 0)"
        )
    need = opts.replicas * opts.tp * opts.pp
    if need > gpus:
        chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise InvalidRequestError(
            f"--replicas {opts.replicas} × --tp {opts.tp} × --pp {opts.pp} needs {need} GPUs; "
            f"this machine has {gpus}"
            + (f" (CUDA_VISIBLE_DEVICES={chosen})" if chosen is not None else "")
            + ("; --device cpu runs without them" if opts.device == "auto" else "")
        )
    return "cuda"


def up(opts: UpOptions) -> dict[str, Any]:
    """Start the local cluster; returns what `coxswain up` prints (URLs, keys)."""
    if opts.tp < 1 or opts.pp < 1 or opts.replicas < 1:
        raise InvalidRequestError("--tp, --pp and --replicas must be >= 1")
    check_engine_settings(opts.engine)
    gpus = 0 if opts.device == "cpu" else visible_gpus()
    opts = dataclasses.replace(opts, device=resolve_device(opts, gpus))
    if opts.model != "tiny":
        check_model_dir(opts.model)  # seconds, not a Ray error after the replicas start
    directory = cluster_dir()
    with hold_directory(directory):
        use_ray_token_auth()  # before Ray is imported: it reads RAY_AUTH_MODE once
        os.environ.update(SINGLE_NODE_RAY)  # likewise; the Ray head inherits it
        running = running_cluster()
        if running is not None:
            raise CoxswainError(
                f"the cluster from {directory} is already running ({running['http']}): "
                "`coxswain status` shows it; `coxswain down` stops it"
                + (", and then `up --new-keys` starts one with new keys" if opts.new_keys else "")
            )
        if opts.redis_url and (why := redis_ping(opts.redis_url)) is not None:
            raise ServiceUnavailableError(f"Redis at --redis-url is not usable: {why}")
        leftover = read_state()
        if leftover is not None:  # a cluster that died or an `up` that was killed halfway
            stop_recorded(leftover)
        state: dict[str, Any] = {"bind": opts.host}
        try:  # before anything starts: a directory `up` cannot write fails here
            if left := clear_state():
                raise left[0]
            save_state(state)
        except OSError as e:
            raise unwritable(directory, e) from None
        try:
            return _start(opts, directory, state)
        except BaseException:
            stop_recorded(state)
            clear_state()
            raise


def _start(opts: UpOptions, directory: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Start Redis, the Ray head and the application, recording each in `state`."""
    import ray
    from ray import serve

    from services.gateway.serve_app import build_app

    if opts.redis_url:
        redis_url = opts.redis_url
    else:
        state["redis_started"] = True
        redis_url = start_redis(directory, state)
    state["redis_url"] = redis_url
    save_state(state)
    keys = _api_keys(opts, directory)
    model = str(resolve_model(opts.model))  # build the tiny model once, before replicas race

    gcs = start_ray_head(state, opts.num_cpus)
    ray.init(address=gcs, namespace="coxswain", logging_level="WARNING", log_to_driver=False)
    try:
        state["ray_session_dir"] = ray._private.worker.global_worker.node.get_session_dir_path()
        state["ray_address"] = ray.get_runtime_context().gcs_address
        save_state(state)
        # HTTP comes from the Gateway's front-end processes on the public port (`http_port`
        # below); Serve's own proxy, which would forward every token once more, listens on a
        # loopback port nobody is told about (and Serve's INFO lines, which name it and
        # speak of an "existing" app on a fresh cluster, stay quiet).
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        args = {
            "model": model,
            "tp": opts.tp,
            "pp": opts.pp,
            "device": opts.device,
            "dtype": opts.dtype,
            "api_keys": keys.text,  # not the file: a replica that restarts later needs none
            "redis_url": redis_url,
            "grpc_port": opts.grpc_port,
            "controller_grpc_port": opts.controller_grpc_port,
            "bind_host": opts.host,
            "patch_store_budget_gb": opts.patch_store_budget_gb,
            "engine_replicas": opts.replicas,
            "http_port": opts.http_port,
            # one event loop renders about 10k tokens/s: two per engine replica
            "http_workers": max(2, 2 * opts.replicas),
            "num_gpus_per_rank": 1 if opts.device == "cuda" else 0,
            "engine": opts.engine,
        }
        app = build_app(args)  # the first engine replica starts the store and controller
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        host = _client_host(opts.host)
        _wait_healthy(f"http://{host}:{opts.http_port}/health")
    finally:
        ray.shutdown()
    info = {
        "bind": opts.host,
        "http": f"http://{host}:{opts.http_port}",
        "openapi": f"http://{host}:{opts.http_port}/docs",
        "dashboard": f"http://{host}:{opts.http_port}/dashboard"
        + (f"?key={keys.printed['read']}" if keys.printed else ""),
        "metrics": f"http://{host}:{opts.http_port}/metrics",
        "grpc": f"{host}:{opts.grpc_port}",
        "redis": redacted(redis_url),
        "model": model,
        "controller": f"{host}:{opts.controller_grpc_port} (gRPC)",
        "api_keys_file": keys.file,
        "api_keys": keys.printed,
    }
    state.update(info)
    save_state(state)
    return info


def _wait_healthy(url: str, timeout_s: float = 300) -> None:
    """Until the gateway answers /health (public: no key needed) or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise ServiceUnavailableError(f"the gateway did not become healthy at {url}: {last}")


def down() -> tuple[list[str], list[OSError]]:
    """Stop what `up` started, and only that; returns what was stopped, and why each state
    file that could not be removed stays (a read-only directory: the cluster is down all
    the same, and the next `up` names the file)."""
    state = read_state()
    if state is None:
        return [], []
    stopped = stop_recorded(state)
    return stopped, clear_state()  # the API keys stay for the next `up`
