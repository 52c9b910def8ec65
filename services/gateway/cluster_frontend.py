"""One HTTP front-end process of a cluster's Gateway replica (`serve_app._start_http_frontend`).

It joins the Ray cluster as a driver, builds the same HTTP app as the Gateway replica
(`serve_app.gateway_http_app`: generation over direct links to every engine replica, admin
writes through the cluster state, the rest through Serve's handle) and serves it under
uvicorn on the listening socket its parent passed down, beside its sibling processes. Its
parent writes `{"args", "app", "fd", "parent", "ray"}` as JSON on its stdin; it prints `ready` once
uvicorn serves, and exits when its parent is gone.

    python -m services.gateway.cluster_frontend      (started by the Gateway replica)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time


def _exit_with(parent: int) -> None:
    """Leave when the Gateway replica that started this process is gone (a killed replica
    runs no exit handlers): its replacement starts front ends of its own."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    spec = json.loads(sys.stdin.read())
    threading.Thread(target=_exit_with, args=(spec["parent"],), daemon=True).start()
    sock = socket.socket(fileno=spec["fd"])

    import ray
    import uvicorn

    from services.gateway.process_backend import report_started
    from services.gateway.serve_app import AppArgs, gateway_http_app

    ray.init(
        address=spec["ray"], namespace="coxswain", logging_level="WARNING", log_to_driver=False
    )
    app, _, _ = gateway_http_app(AppArgs.model_validate(spec["args"]), spec["app"])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    report_started(server, lambda: print("ready", flush=True))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
