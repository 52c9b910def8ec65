"""`coxswain status`: what `up` started, from the cluster's state, and whether each part of it
answers (the gateway's health check, Redis's PING, the gRPC ports, the Ray head's processes).
"""

from __future__ import annotations

from typing import Any

from services.cluster.directory import cluster_dir, read_state
from services.cluster.processes import listening, ray_processes, redacted, redis_ping


def running_cluster() -> dict[str, Any] | None:
    """What `up` printed, if the cluster it started still answers its health check."""
    import httpx

    info = read_state()
    if info is None or "http" not in info:
        return None
    try:
        if httpx.get(info["http"] + "/health", timeout=2).status_code == 200:
            return info
    except httpx.HTTPError:
        pass
    return None


def status() -> dict[str, Any]:
    """What `up` started and whether each part answers. `running`: the gateway is healthy;
    `degraded`: the parts that do not answer (Redis carries admin state, the controller's
    queues and the engine links, so a cluster whose Redis is gone is not up); `state`: "up"
    when running with nothing degraded, else "degraded" or "not running"."""
    import httpx

    state = read_state()
    if state is None:
        reason = f"no cluster state in {cluster_dir()}"
        return {"state": "not running", "running": False, "degraded": [], "reason": reason}
    keep = ("bind", "model", "api_keys_file", "ray_address")
    report: dict[str, Any] = {k: state[k] for k in keep if k in state}
    report["ray_head_processes"] = len(ray_processes(state))
    degraded = []
    if state.get("redis_url"):
        why = redis_ping(state["redis_url"])
        report["redis"] = f"{redacted(state['redis_url'])}: " + ("ok" if why is None else why)
        if why is not None:
            degraded.append("redis")
    if "http" not in state:
        reason = "`coxswain up` did not finish"
        report.update(state="not running", running=False, degraded=degraded, reason=reason)
        return report
    try:
        r = httpx.get(state["http"] + "/health", timeout=5)
        health = r.json() if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
    except (httpx.HTTPError, ValueError) as e:
        health = f"unreachable: {e}"
    report["http"] = f"{state['http']}: " + ("ok" if isinstance(health, dict) else str(health))
    report["health"] = health
    for name in ("grpc", "controller"):
        address = state[name].split(" ")[0]
        answers = listening(address)
        report[name] = f"{address}: " + ("listening" if answers else "not listening")
        if not answers:
            degraded.append(name)
    running = isinstance(health, dict)
    report.update(running=running, degraded=degraded)
    report["state"] = "not running" if not running else "degraded" if degraded else "up"
    return report
