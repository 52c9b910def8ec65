"""Kill each actor kind of a local cluster under load; print what failed and what survived.

The issue this answers: which failures does a user see when one part of the cluster dies,
for how long, and does anything they configured disappear? One local cluster (isolated Ray,
a Redis this script starts, the tiny model, two engine replicas, the Serve app of
`services.gateway.serve_app.build_app`) is put under a bounded streaming load, and in turn
an engine replica, the controller actor, the patch-store actor, the cluster-state actor and
then an engine replica again (does admin state outlive the state actor's death?) are killed
mid-load (`ray.kill`, as abrupt as a crash). Per kill it prints:

* requests in flight at the kill that failed, with their status codes and messages, and
  the requests that succeeded;
* seconds until the service answered again (the first request started after the kill that
  succeeded) and until the killed component's own function worked again (a probe: a
  completion, a controller status call, a store-backed capture, an admin write);
* whether the registered vector, global steering, the controller policy and a patch-store
  run seeded before the kill are still there afterwards.

Everything it starts (Ray, Serve, Redis, temp files) is stopped on exit, Ctrl-C included;
every loop is bounded. It is a measurement, never a pass/fail test.

    python3 benchmarks/chaos.py                       # 16 clients, 20 s per kill: ~6 min
    python3 benchmarks/chaos.py --clients 8 --load-s 10 --recover-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import json
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ADMIN_KEY = "chaos-admin-" + secrets.token_hex(16)
READ_KEY = "chaos-read-" + secrets.token_hex(16)
VECTOR = "chaos-v"
POLICY = "chaos-scale"
H = 64  # the tiny llama's hidden size
KINDS = ("engine replica", "controller", "patch store", "cluster state")


@dataclass
class Request:
    """One load request: when it ran, and how it ended."""

    start: float
    end: float = 0.0
    status: int = 0  # HTTP status; 0: the connection failed
    error: str = ""  # the error message (an SSE error event's, or the response body's)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class Row:
    """What one kill did."""

    kind: str
    killed: str = ""
    requests: list[Request] = field(default_factory=list)
    kill_at: float = 0.0
    answered_s: float | None = None
    component_s: float | None = None
    survived: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# -- the cluster ------------------------------------------------------------------------------


@contextlib.contextmanager
def local_cluster(replicas: int, workdir: Path) -> Iterator[dict[str, Any]]:
    """A cluster of this process's own (isolated Ray on free ports, a Redis it starts);
    its URLs. Stops everything it started on exit."""
    import ray
    from ray import serve

    from services.common.net import free_port
    from services.controller.redis_server import RedisServer
    from services.engine.model.tiny import make_tiny_checkpoint
    from services.gateway.serve_app import build_app

    model = make_tiny_checkpoint(workdir / "tiny-llama", "llama")
    keys = workdir / "api_keys"
    keys.write_text(f"admin:admin:{ADMIN_KEY}\nreader:read:{READ_KEY}\n")
    keys.chmod(0o600)
    takes_password = "password" in inspect.signature(RedisServer).parameters
    redis = RedisServer(password=secrets.token_hex(16)) if takes_password else RedisServer()
    redis.start()
    try:
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            namespace="coxswain",
            log_to_driver=False,
            logging_level="ERROR",
        )
        http_port, grpc_port, controller_port = free_port(), free_port(), free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = {
            "model": str(model),
            "api_keys_file": str(keys),
            "redis_url": redis.url,
            "grpc_port": grpc_port,
            "controller_grpc_port": controller_port,
            "patch_store_budget_gb": 0.0625,
            "device": "cpu",
            "dtype": "float32",
            "engine": {"max_model_len": 128},
            "engine_replicas": replicas,
        }
        serve.run(build_app(args), name="coxswain", route_prefix="/")
        yield {
            "http": f"http://127.0.0.1:{http_port}",
            "controller": f"127.0.0.1:{controller_port}",
            "replicas": replicas,
        }
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        redis.close()


# -- what a user configured, and whether it is still there -------------------------------------


def _admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def _vector() -> list[float]:
    return [0.02 * ((i % 7) - 3) for i in range(H)]


def _capture(c: httpx.Client, run: str) -> httpx.Response:
    capture = {"sites": {"post_block": [0, 1]}, "positions": "all_prompt"}
    capture |= {"sink": "patch_store", "run": run}
    return c.post(
        "/v1/completions", json={"prompt": "seed run", "max_tokens": 1, "capture": capture}
    )


def seed(cluster: dict, run: str) -> list[str]:
    """Register the vector, set global steering on it, add the controller policy and store
    a run; what could not be seeded."""
    from services.controller.client import ControllerClient

    failed = []
    with _admin(cluster["http"]) as c:
        r = c.put(f"/v1/vectors/{VECTOR}", json={"value": _vector(), "overwrite": True})
        if r.status_code != 200:
            failed.append(f"vectors: {r.status_code} {r.text[:120]}")
        steering = {"vectors": [{"layers": [1], "vector": VECTOR, "scale": 0.5}]}
        r = c.post("/v1/steering/set", json=steering)
        if r.status_code != 200:
            failed.append(f"global steering: {r.status_code} {r.text[:120]}")
        r = _capture(c, run)
        if r.status_code != 200:
            failed.append(f"patch-store run: {r.status_code} {r.text[:120]}")
    policy = {"kind": "scale", "name": POLICY, "readout": "chaos-r", "target": 0.0, "k": 1.0}
    deadline = time.monotonic() + 30  # the controller's gRPC port may still be opening
    while True:
        try:
            with ControllerClient(cluster["controller"], api_key=ADMIN_KEY) as ctl:
                ctl.wait_ready(5)
                ctl.set_policies([policy])
            break
        except Exception as e:
            if time.monotonic() > deadline:
                failed.append(f"controller policies: {type(e).__name__}: {str(e)[:120]}")
                break
            time.sleep(0.5)
    return failed


def survival(cluster: dict, run: str, replicas: int) -> dict[str, str]:
    """Whether each seeded item is still there, as a user would find out."""
    from services.controller.client import ControllerClient

    out: dict[str, str] = {}
    tries = 2 * replicas  # Serve spreads these over the replicas
    with _admin(cluster["http"]) as c:
        r = c.get("/v1/vectors")
        listed = r.status_code == 200 and VECTOR in {v["name"] for v in r.json()["data"]}
        used = 0
        for _ in range(tries):
            steer = {"vectors": [{"layers": [0], "vector": VECTOR}]}
            body = {"prompt": "x", "max_tokens": 1, "steering": steer}
            used += c.post("/v1/completions", json=body).status_code == 200
        out["vectors"] = _verdict(
            listed and used == tries, f"listed={listed} usable {used}/{tries}"
        )
        spec = 0
        for _ in range(tries):
            r = c.get("/v1/steering")
            spec += r.status_code == 200 and r.json().get("global_spec") is not None
        out["global steering"] = _verdict(spec == tries, f"{spec}/{tries} replicas")
        body = {
            "prompt": "patch me",
            "max_tokens": 1,
            "patch": [{"layer": 0, "position": 0, "source": {"run": run, "position": 0}}],
        }
        r = c.post("/v1/completions", json=body)
        out["patch-store run"] = _verdict(r.status_code == 200, f"{r.status_code}")
    try:
        with ControllerClient(cluster["controller"], api_key=ADMIN_KEY) as ctl:
            names = [p.name for p in ctl.list_policies()]
        out["controller policies"] = _verdict(POLICY in names, f"{len(names)} policies")
    except Exception as e:
        out["controller policies"] = f"no ({type(e).__name__}: {str(e)[:80]})"
    return out


def _verdict(ok: bool, detail: str) -> str:
    return f"{'yes' if ok else 'NO'} ({detail})"


# -- killing ----------------------------------------------------------------------------------


def _actor(name: str, namespace: str = "coxswain") -> Any:
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _engine_replicas() -> list[str]:
    """The live Engine replicas' actor names (Serve's naming: SERVE_REPLICA::app#Engine#id)."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "#Engine#" in a["name"]
    )


def kill(kind: str) -> str:
    """Kill one actor of `kind` (SIGKILL-like); its name, or why nothing was killed."""
    import ray

    from services.cluster import stores
    from services.gateway import serve_app

    if kind == "engine replica":
        names = _engine_replicas()
        if not names:
            return "no such actor: no Engine replica found"
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        return names[0]
    name = {
        "controller": getattr(serve_app, "CONTROLLER_ACTOR", "coxswain-controller"),
        "patch store": getattr(serve_app, "PATCH_STORE_ACTOR", "coxswain-patch-store"),
        "cluster state": getattr(stores, "STATE_ACTOR", "coxswain-cluster-state"),
    }[kind]
    handle = _actor(name)
    if handle is None:
        return f"no such actor: {name}"
    ray.kill(handle, no_restart=False)  # a crash: the actor restarts if it may
    return name


def probe(kind: str, cluster: dict, n: int, killed: str) -> Callable[[], bool]:
    """A call that works only when `kind`'s function is back (`killed`: the actor's name)."""
    from services.controller.client import ControllerClient

    def engine() -> bool:  # Serve replaced the replica, and requests are served
        replicas = _engine_replicas()
        if killed in replicas or len(replicas) < cluster["replicas"]:
            return False
        if _running_replicas("Engine") < cluster["replicas"]:
            return False
        with _admin(cluster["http"]) as c:
            body = {"prompt": "probe", "max_tokens": 1}
            return all(
                c.post("/v1/completions", json=body).status_code == 200
                for _ in range(cluster["replicas"])
            )

    def controller() -> bool:
        with ControllerClient(cluster["controller"], api_key=ADMIN_KEY, timeout_s=5) as ctl:
            ctl.status()
        return True

    def patch_store() -> bool:
        with _admin(cluster["http"]) as c:
            stats = c.get("/v1/stats").status_code == 200
            return stats and _capture(c, f"chaos-probe-{n}-{time.monotonic_ns()}").is_success

    def cluster_state() -> bool:
        with _admin(cluster["http"]) as c:
            body = {"value": _vector(), "overwrite": True}
            return c.put("/v1/vectors/chaos-probe", json=body).status_code == 200

    return {
        "engine replica": engine,
        "controller": controller,
        "patch store": patch_store,
        "cluster state": cluster_state,
    }[kind]


def _running_replicas(deployment: str) -> int:
    from ray import serve

    app = serve.status().applications["coxswain"]
    states = app.deployments[deployment].replica_states
    return sum(n for state, n in states.items() if getattr(state, "value", state) == "RUNNING")


# -- the load ---------------------------------------------------------------------------------


async def _client(
    http: httpx.AsyncClient, deadline: float, max_requests: int, out: list[Request]
) -> None:
    body = {"prompt": "the chaos load", "max_tokens": 24, "stream": True, "ignore_eos": True}
    for _ in range(max_requests):
        if time.monotonic() >= deadline:
            return
        req = Request(start=time.monotonic())
        out.append(req)
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                req.status = r.status_code
                if r.status_code != 200:
                    req.error = _message((await r.aread()).decode(errors="replace"))
                else:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and '"error"' in line:
                            req.error = _message(line[5:])
        except httpx.HTTPError as e:
            req.error = f"{type(e).__name__}: {e}"
        req.end = time.monotonic()
        if not req.ok:
            await asyncio.sleep(0.1)  # a failing service is not hammered


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()


async def run_kill(args: argparse.Namespace, cluster: dict, kind: str, n: int) -> Row:
    """Load the cluster, kill `kind` a third of the way in, and time the recovery."""
    row = Row(kind)
    start = time.monotonic()
    deadline = start + args.load_s
    limits = httpx.Limits(max_connections=args.clients + 4)
    headers = {"Authorization": f"Bearer {READ_KEY}"}
    async with httpx.AsyncClient(
        base_url=cluster["http"], headers=headers, timeout=60, limits=limits
    ) as http:
        clients = [
            asyncio.create_task(_client(http, deadline, args.max_requests, row.requests))
            for _ in range(args.clients)
        ]
        await asyncio.sleep(args.load_s / 3)
        row.kill_at = time.monotonic()
        row.killed = await asyncio.to_thread(kill, kind)
        check = probe(kind, cluster, n, row.killed)
        until = row.kill_at + args.recover_s
        while time.monotonic() < until:
            try:
                if await asyncio.to_thread(check):
                    row.component_s = time.monotonic() - row.kill_at
                    break
            except Exception as e:
                if not row.notes or row.notes[-1] != str(e)[:160]:
                    row.notes.append(str(e)[:160])
            await asyncio.sleep(0.25)
        await asyncio.gather(*clients)
    after = [r for r in row.requests if r.start >= row.kill_at and r.ok]
    if after:
        row.answered_s = min(r.end for r in after) - row.kill_at
    return row


# -- the report -------------------------------------------------------------------------------


def report(rows: list[Row]) -> str:
    lines = []
    for row in rows:
        inflight = [r for r in row.requests if r.start < row.kill_at < (r.end or 1e18)]
        failed = [r for r in inflight if not r.ok]
        total_ok = sum(r.ok for r in row.requests)
        total_failed = len(row.requests) - total_ok
        causes = collections.Counter((r.status, r.error[:140]) for r in failed)
        later = collections.Counter(
            (r.status, r.error[:140]) for r in row.requests if r.start >= row.kill_at and not r.ok
        )
        lines += [
            f"== kill {row.kind}: {row.killed}",
            f"   in flight at the kill: {len(inflight)}, failed {len(failed)}",
            *(f"      {k}x  status {s}: {m!r}" for (s, m), k in causes.most_common(4)),
            f"   all requests: {total_ok} ok, {total_failed} failed "
            f"({sum(later.values())} of them started after the kill)",
            *(f"      {k}x  status {s}: {m!r}" for (s, m), k in later.most_common(3)),
            f"   service answered again after: {_secs(row.answered_s)}; "
            f"the {row.kind}'s function back after: {_secs(row.component_s)}",
            *(f"   probe error: {note}" for note in row.notes[-2:]),
            "   survived: " + "; ".join(f"{k}: {v}" for k, v in row.survived.items()),
        ]
    head = f"{'kill':<15} {'in flight':>9} {'failed':>6} {'ok':>5} {'answer s':>8} {'back s':>7}"
    table = [head]
    for row in rows:
        inflight = [r for r in row.requests if r.start < row.kill_at < (r.end or 1e18)]
        table.append(
            f"{row.kind:<15} {len(inflight):>9} {sum(not r.ok for r in inflight):>6} "
            f"{sum(r.ok for r in row.requests):>5} {_secs(row.answered_s):>8} "
            f"{_secs(row.component_s):>7}  "
            + " ".join(f"{k.split()[0]}={v.split()[0]}" for k, v in row.survived.items())
        )
    return "\n".join([*lines, "", *table])


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    ap.add_argument("--load-s", type=float, default=20.0, help="seconds of load per kill")
    ap.add_argument("--recover-s", type=float, default=60.0, help="longest wait for recovery")
    ap.add_argument("--max-requests", type=int, default=400, help="per client per kill")
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas")
    ap.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        # the last engine kill shows whether admin state outlives the cluster-state kill
        default=[*KINDS, "engine replica"],
        metavar="KIND",
        help=f"what to kill, in order (of: {', '.join(KINDS)})",
    )
    args = ap.parse_args(argv)
    # `timeout` and `kill` send SIGTERM: exit through the cleanup, never around it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="coxswain-chaos-") as tmp:
        t0 = time.monotonic()
        with local_cluster(args.replicas, Path(tmp)) as cluster:
            print(f"cluster up in {time.monotonic() - t0:.0f}s at {cluster['http']}", flush=True)
            for n, kind in enumerate(args.kinds):
                run = f"chaos-run-{n}"
                failed = seed(cluster, run)
                for f in failed:
                    print(f"   (before killing {kind}, could not seed {f})", flush=True)
                row = asyncio.run(run_kill(args, cluster, kind, n))
                time.sleep(2)  # restarted actors re-register before the survival check
                row.survived = survival(cluster, run, args.replicas)
                for item in failed:  # not there before the kill: nothing to survive
                    what = item.split(":")[0]
                    row.survived[what] = f"n/a (not seeded) {row.survived.get(what, '')}"
                rows.append(row)
                print(report([row]).split("\n\n")[0], flush=True)
            print("\n" + report(rows).split("\n\n")[1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
