"""Serving helpers for tests: an ASGI app under a real uvicorn server, and the whole Serve
application on an isolated local cluster."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.local_ray import start_local_ray


@contextmanager
def serve_asgi(app, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` until the block exits; yields its base URL (`http://127.0.0.1:<port>`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
        sock.close()


@contextmanager
def serve_app_cluster(
    model: str,
    keys_file: str,
    *,
    num_cpus: int = 4,
    redis_password: str | None = None,
    **args: Any,
) -> Iterator[dict[str, Any]]:
    """Coxswain's Serve application on a local Ray of its own (`address="local"`: never a
    `coxswain up` cluster running beside the tests), with its own redis-server and free
    loopback ports for HTTP, the engine gRPC front and the controller. `args` override the
    app's (`services.gateway.serve_app.AppArgs`). Yields `http` (base URL), `grpc`
    (host:port), `redis` (the RedisServer) and `args` (for more apps on the same cluster);
    everything is stopped when the block exits."""
    import ray
    from ray import serve

    from services.common.net import free_port
    from services.controller.redis_server import RedisServer
    from services.gateway.serve_app import build_app

    with RedisServer(password=redis_password) as redis:
        start_local_ray(num_cpus=num_cpus, namespace="coxswain")
        try:
            http_port, grpc_port = free_port(), free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            app_args = {
                "model": model,
                "api_keys_file": keys_file,
                "redis_url": redis.url,
                "grpc_port": grpc_port,
                "controller_grpc_port": free_port(),
                "patch_store_budget_gb": 0.0625,
                "device": "cpu",
                "dtype": "float32",
                "engine_replicas": 1,
                **args,
            }
            serve.run(build_app(app_args), name="coxswain", route_prefix="/")
            yield {
                "http": f"http://127.0.0.1:{http_port}",
                "grpc": f"127.0.0.1:{app_args['grpc_port']}",
                "redis": redis,
                "args": app_args,
            }
        finally:
            serve.shutdown()
            ray.shutdown()
