"""`coxswain up`, `down` and `status`: the local cluster (`services/cluster/local.py`), started,
stopped and reported as lines a person reads (`status --json` for a program).
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_up(args: argparse.Namespace) -> int:
    """Start the local cluster and print where everything is."""
    import signal

    from services.cli.engine import engine_settings
    from services.cluster.local import UpOptions, up

    # Killed halfway, `up` still stops what it started (SystemExit unwinds like Ctrl-C).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    model = "tiny" if args.tiny or not args.model else args.model
    info = up(
        UpOptions(
            model=model,
            tp=args.tp,
            pp=args.pp,
            replicas=args.replicas,
            device=args.device,
            dtype=args.dtype,
            host=args.host,
            http_port=args.port,
            grpc_port=args.grpc_port,
            controller_grpc_port=args.controller_grpc_port,
            redis_url=args.redis_url,
            api_keys_file=args.api_keys_file,
            num_cpus=args.num_cpus,
            new_keys=args.new_keys,
            engine=engine_settings(args.engine),
        )
    )
    print(f"coxswain is up: model {info['model']}")
    print(f"  {'listening':10s} {_bind_text(info.get('bind', '127.0.0.1'))}")
    for name in ("http", "openapi", "dashboard", "metrics", "grpc", "redis"):
        print(f"  {name:10s} {info[name]}")
    print(f"  {'controller':10s} {info['controller']}")
    if info["api_keys"]:
        print(f"  API keys (also in {info['api_keys_file']}):")
        for scope, key in info["api_keys"].items():
            print(f"    {scope:6s} {key}")
    print("stop it with: coxswain down")
    return 0


def _bind_text(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return f"{host or '0.0.0.0'} (HTTP and gRPC on every interface: other machines can connect)"
    return f"{host} (HTTP and gRPC; --host 0.0.0.0 to serve other machines)"


def cmd_down(args: argparse.Namespace) -> int:
    from services.cluster.local import down

    stopped, left = down()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    for e in left:  # the cluster is down all the same; the next `up` names the file again
        print(f"coxswain: warning: could not remove {e.filename}: {e.strerror}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """What `coxswain up` started and whether it answers; exit status 1 when it is not up
    (not running, or degraded: a part of it does not answer)."""
    from services.cluster.status import status

    report = status()
    if args.json:
        print(json.dumps(report))
        return 0 if report["state"] == "up" else 1
    print(
        f"coxswain is {report['state']}"
        + (f": {', '.join(report['degraded'])} not answering" if report["degraded"] else "")
    )
    if "reason" in report:
        print(f"  {report['reason']}")
    for name in ("model", "bind", "http", "grpc", "controller", "redis", "api_keys_file"):
        if name in report:
            print(f"  {name:14s} {report[name]}")
    if "ray_head_processes" in report:
        print(f"  {'ray head':14s} {report['ray_head_processes']} processes")
    health = report.get("health")
    if isinstance(health, dict):
        print(f"  {'health':14s} {json.dumps(health)}")
    return 0 if report["state"] == "up" else 1
