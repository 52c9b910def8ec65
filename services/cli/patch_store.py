"""`coxswain patch-store serve`: a patch store over gRPC in this process, without a cluster."""

from __future__ import annotations

import argparse


def cmd_patch_store_serve(args: argparse.Namespace) -> int:
    """Serve a patch store over gRPC until SIGINT or SIGTERM, then stop gracefully."""
    import signal
    import threading

    from services.patch_store.server import serve
    from services.patch_store.store import PatchStore

    store = PatchStore(int(args.budget_gb * 2**30))
    server = serve(store, args.host, args.port, int(args.max_message_mb * 2**20))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"patch store serving on {server.address} (budget {args.budget_gb:g} GiB, "
        f"messages up to {args.max_message_mb:g} MiB)",
        flush=True,
    )
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        http, _ = start_http_server(args.metrics_port, args.host, registry=store.registry)
        print(f"metrics on http://{args.host}:{http.server_port}/metrics", flush=True)
    while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
        pass
    print("patch store stopping", flush=True)
    server.stop(grace_s=5.0)
    return 0
