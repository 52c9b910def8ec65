"""`coxswain up` / `coxswain down`: the whole cluster on this machine.

`up` reuses a reachable Redis or starts one, starts a Ray head (`ray start`), the patch
store and controller actors, and the Serve application (gateway + engine replicas), then
prints the URLs and API keys and returns; everything keeps running until `down`. State
(the Redis it started, generated API keys) lives in `~/.cache/coxswain/cluster/`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError, ServiceUnavailableError
from services.common.net import free_port

CLUSTER_DIR = Path.home() / ".cache" / "coxswain" / "cluster"
APP_NAME = "coxswain"


@dataclass
class UpOptions:
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


def _redis_reachable(url: str) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        client.ping()
        client.close()
        return True
    except Exception:
        return False


def _start_redis(state: dict) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceUnavailableError("no Redis is reachable and redis-server is not installed")
    port = 6379 if not _port_taken(6379) else free_port()
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    pidfile = CLUSTER_DIR / "redis.pid"
    subprocess.run(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "yes",
         "--pidfile", str(pidfile), "--dir", str(CLUSTER_DIR), "--save", "",
         "--logfile", str(CLUSTER_DIR / "redis.log")],
        check=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _redis_reachable(url):
        if time.monotonic() > deadline:
            raise ServiceUnavailableError(f"redis-server on port {port} did not start")
        time.sleep(0.05)
    state["redis_pidfile"] = str(pidfile)
    return url


def _port_taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _api_keys(opts: UpOptions, state: dict) -> tuple[str, dict[str, str]]:
    """The keys file to use; generated (admin + read-only, mode 0600) unless one is given."""
    if opts.api_keys_file:
        return opts.api_keys_file, {}
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    path = CLUSTER_DIR / "api_keys"
    keys = {
        "admin": "cx-admin-" + secrets.token_hex(16),
        "read": "cx-read-" + secrets.token_hex(16),
    }
    path.write_text("".join(f"{scope}:{scope}:{key}\n" for scope, key in keys.items()))
    path.chmod(0o600)
    state["generated_keys"] = True
    return str(path), keys


def up(opts: UpOptions) -> dict[str, Any]:
    """Start the local cluster; returns what `coxswain up` prints (URLs, keys)."""
    import ray
    from ray import serve

    from services.gateway.serve_app import resolve_model

    if opts.tp < 1 or opts.pp < 1 or opts.replicas < 1:
        raise InvalidRequestError("--tp, --pp and --replicas must be >= 1")
    running = running_cluster()
    if running is not None:
        return {**running, "already_running": True}
    state: dict[str, Any] = {}
    redis_url = opts.redis_url or "redis://127.0.0.1:6379/0"
    if not _redis_reachable(redis_url):
        if opts.redis_url:
            raise ServiceUnavailableError(f"Redis at {opts.redis_url} is not reachable")
        redis_url = _start_redis(state)
    keys_file, keys = _api_keys(opts, state)
    model = str(resolve_model(opts.model))  # build the tiny model once, before replicas race

    # Ray's GCS defaults to 6379, Redis's port: give it its own.
    cmd = ["ray", "start", "--head", f"--port={free_port()}", "--disable-usage-stats"]
    cmd.append("--include-dashboard=false")
    if opts.num_cpus is not None:
        cmd.append(f"--num-cpus={opts.num_cpus}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ServiceUnavailableError(f"`ray start` failed:\n{done.stderr[-2000:]}")
    ray.init(address="auto", namespace="coxswain", logging_level="WARNING", log_to_driver=False)

    serve.start(http_options={"host": opts.host, "port": opts.http_port})
    from services.gateway.serve_app import build_app

    args = {
        "model": model,
        "tp": opts.tp,
        "pp": opts.pp,
        "device": opts.device,
        "dtype": opts.dtype,
        "api_keys_file": keys_file,
        "redis_url": redis_url,
        "grpc_port": opts.grpc_port,
        "controller_grpc_port": opts.controller_grpc_port,
        "patch_store_budget_gb": opts.patch_store_budget_gb,
        "engine_replicas": opts.replicas,
        "num_gpus_per_rank": 1 if opts.device.startswith("cuda") else 0,
    }
    app = build_app(args)  # also starts the patch store and controller actors
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    _wait_healthy(f"http://{opts.host}:{opts.http_port}/health")
    info = {
        "http": f"http://{opts.host}:{opts.http_port}",
        "openapi": f"http://{opts.host}:{opts.http_port}/docs",
        "dashboard": f"http://{opts.host}:{opts.http_port}/dashboard"
        + (f"?key={keys['read']}" if keys else ""),
        "metrics": f"http://{opts.host}:{opts.http_port}/metrics",
        "grpc": f"{opts.host}:{opts.grpc_port}",
        "redis": redis_url,
        "model": model,
        "controller": f"{opts.host}:{opts.controller_grpc_port} (gRPC)",
        "api_keys_file": keys_file,
        "api_keys": keys,
    }
    (CLUSTER_DIR / "state.json").write_text(json.dumps({**state, **info}, indent=2))
    return info


def _wait_healthy(url: str, timeout_s: float = 300) -> None:
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


def running_cluster() -> dict[str, Any] | None:
    """What `up` printed, if the cluster it started still answers its health check."""
    import httpx

    path = CLUSTER_DIR / "state.json"
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    try:
        if httpx.get(info["http"] + "/health", timeout=2).status_code == 200:
            return info
    except httpx.HTTPError:
        pass
    return None


def down() -> list[str]:
    """Stop what `up` started; returns what was stopped."""
    stopped = []
    path = CLUSTER_DIR / "state.json"
    state = json.loads(path.read_text()) if path.is_file() else {}
    try:
        import ray
        from ray import serve

        ray.init(address="auto", namespace="coxswain", logging_level="ERROR")
        serve.shutdown()
        ray.shutdown()
        stopped.append("serve")
    except Exception:
        pass
    if subprocess.run(["ray", "stop", "--force"], capture_output=True).returncode == 0:
        stopped.append("ray")
    pidfile = state.get("redis_pidfile")
    if pidfile and Path(pidfile).is_file():
        try:
            os.kill(int(Path(pidfile).read_text().strip()), 15)
            stopped.append("redis")
        except (ProcessLookupError, ValueError):
            pass
    path.unlink(missing_ok=True)
    return stopped
