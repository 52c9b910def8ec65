"""The processes `coxswain up` starts on this host, and how `down` stops exactly those.

- A `redis-server` of its own, on a free loopback port, with a generated password (from a
  0600 config file, so it never shows in `ps`); every component gets the password in its
  `redis://:PASSWORD@127.0.0.1:PORT/0` URL.
- A Ray head, run by this interpreter's Ray (`python -m ray.scripts.scripts start`, so a
  venv's `coxswain` works unactivated) in a session of its own: every Ray process of this
  cluster, workers included, carries that session id, which is how `down` finds them. (`ray
  stop` would stop every Ray on the host.)

Each is recorded in the cluster's state (`services/cluster/directory.py`) as soon as it
runs, by its pid or session id, and checked to be ours before it is stopped, so a reused
pid is never taken for it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.cluster.directory import read_state, save_state, write_private
from services.common.errors import CoxswainError, ServiceUnavailableError
from services.common.net import free_port

_STOP_GRACE_S = 5.0

# -- processes and ports -----------------------------------------------------------------------


def ray_psutil() -> Any:
    """psutil: Ray ships it (ray/thirdparty_files) and puts it on sys.path when imported."""
    import ray  # noqa: F401

    return importlib.import_module("psutil")


def alive(proc: Any) -> bool:
    psutil = ray_psutil()
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def terminate(procs: list[Any]) -> None:
    """SIGTERM, then SIGKILL whatever is still running after a grace period."""
    psutil = ray_psutil()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        time.sleep(0.1)
    for p in procs:
        if alive(p):
            with contextlib.suppress(psutil.Error):
                p.kill()


def listening(address: str) -> bool:
    """Whether something accepts connections at `address` (HOST:PORT)."""
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host.strip("[]"), int(port))) == 0


# -- Redis -------------------------------------------------------------------------------------


def redis_ping(url: str) -> str | None:
    """None when Redis at `url` answers PING (authenticated), else why not."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1)
        try:
            client.ping()
        finally:
            client.close()
        return None
    except redis.RedisError as e:
        return f"{type(e).__name__}: {e}"


def redacted(url: str) -> str:
    """A Redis URL with its password replaced (it stays in the 0600 state file)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def start_redis(directory: Path, state: dict[str, Any]) -> str:
    """Start a password-protected redis-server on a free loopback port; its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceUnavailableError(
            "redis-server is not installed (apt install redis-server, brew install redis), "
            "or pass --redis-url redis://:PASSWORD@HOST:PORT/0"
        )
    password = secrets.token_hex(24)  # hex: needs no quoting in a URL
    port = free_port()
    pidfile = directory / "redis.pid"
    pidfile.unlink(missing_ok=True)
    conf = directory / "redis.conf"
    write_private(
        conf,
        "\n".join(
            [
                f"port {port}",
                "bind 127.0.0.1",
                "protected-mode yes",
                f"requirepass {password}",
                'save ""',
                "appendonly no",
                "daemonize yes",
                f"pidfile {pidfile}",
                f"dir {directory}",
                f"logfile {directory / 'redis.log'}",
                "",
            ]
        ),
    )
    log = directory / "redis.log"
    if log.is_file():  # Redis appends to an old log, whatever mode it had
        log.chmod(0o600)
    # umask: the log and pid file it creates are the user's alone
    done = subprocess.run([exe, str(conf)], capture_output=True, text=True, umask=0o077)
    if done.returncode != 0:
        raise ServiceUnavailableError(f"redis-server failed to start: {done.stderr[-1000:]}")
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        if "redis_pid" not in state and pidfile.is_file():
            with contextlib.suppress(ValueError):
                state["redis_pid"] = int(pidfile.read_text().strip())
                save_state(state)
        why = redis_ping(url)
        if why is None and "redis_pid" in state:
            return url
        if time.monotonic() > deadline:
            tail = log.read_text()[-1000:] if log.is_file() else ""
            raise ServiceUnavailableError(f"redis-server on port {port} did not start: {tail}")
        time.sleep(0.05)


def _stop_redis(state: dict[str, Any]) -> bool:
    pid = state.get("redis_pid")
    if pid is None:
        return False
    psutil = ray_psutil()
    try:
        proc = psutil.Process(pid)
        if "redis" not in proc.name() or not alive(proc):  # the pid was reused
            return False
    except psutil.Error:
        return False
    terminate([proc])
    return True


# -- the Ray head ------------------------------------------------------------------------------


def _ray_command() -> list[str]:
    """This interpreter's Ray CLI: works from a venv that is not activated."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


def use_ray_token_auth() -> None:
    """Ray's own token authentication for the head's ports (GCS, raylet), unless the user
    chose otherwise with RAY_AUTH_MODE. The token is Ray's per-user one (~/.ray/auth_token),
    generated if missing, so `ray.init()` elsewhere on this host (`train grpo --ray`)
    connects with it. Set here, in this process's environment, because `ray start` and
    `ray.init(address=...)` must agree: Ray turns it on for `ray start` whenever a token
    file exists, and never for a client given an explicit address."""
    if "ray" in sys.modules and "RAY_AUTH_MODE" not in os.environ:
        raise CoxswainError("set RAY_AUTH_MODE (token or disabled) before importing ray")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"].lower() != "token":
        return
    done = subprocess.run(
        [*_ray_command(), "get-auth-token", "--generate"],
        capture_output=True,
        text=True,
        umask=0o077,  # a new token (and ~/.ray) is the user's alone
    )
    if done.returncode != 0:
        raise ServiceUnavailableError(f"no Ray auth token: {done.stderr[-1000:]}")
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if token.is_file():  # RAY_AUTH_TOKEN may hold it instead
        try:
            token.chmod(0o600)  # one Ray made earlier may be world-readable
        except OSError as e:
            raise CoxswainError(f"Ray's auth token {token} must be private: {e.strerror}") from e


# Ray swaps 127.0.0.1 for the machine's outside address (in `ray start` and in every client
# that connects) unless told the cluster has one node, the switch it uses on macOS. Read
# once, when Ray is imported.
SINGLE_NODE_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_client_env() -> dict[str, str]:
    """What a Ray client on this host (`train grpo --ray`) needs in its environment, before
    it imports Ray, to connect to the running local cluster: its address and
    `SINGLE_NODE_RAY`. Empty when none runs, or RAY_ADDRESS names another cluster."""
    state = read_state()
    address = (state or {}).get("ray_address")
    if address is None or os.environ.get("RAY_ADDRESS", address) != address:
        return {}
    if not listening(address):  # no psutil here: it would import Ray
        return {}
    return {**SINGLE_NODE_RAY, "RAY_ADDRESS": address}


def start_ray_head(state: dict[str, Any], num_cpus: int | None) -> str:
    """`ray start --head` in a new session; the GCS address. Its node address is loopback,
    so that Ray's Prometheus exporters (the metrics agent's, the autoscaler's and the
    dashboard's), which take no token, listen on loopback, not on every interface (its gRPC
    servers take Ray's token)."""
    port = free_port()
    cmd = [
        *_ray_command(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        "--disable-usage-stats", "--include-dashboard=false",
        # Ports Ray otherwise fixes (10001, 52365): another Ray on this host may hold them.
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]  # fmt: skip
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # SINGLE_NODE_RAY too
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # every process of this head inherits its session id
    )
    # Recorded before it runs: a failure halfway still stops what did start.
    state.update(ray_session_id=proc.pid, ray_gcs_port=port)
    save_state(state)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise ServiceUnavailableError("`ray start --head` did not finish in 180 s") from None
    if proc.returncode != 0:
        raise ServiceUnavailableError(f"`ray start --head` failed:\n{out[-2000:]}")
    return f"127.0.0.1:{port}"


def ray_processes(state: dict[str, Any]) -> list[Any]:
    """The live processes of the Ray head `up` started: those in its session, provided one
    of them is this head's (names its GCS port or session directory), so that a session id
    reused by an unrelated process is never taken for ours."""
    sid = state.get("ray_session_id")
    if sid is None:
        return []
    psutil = ray_psutil()
    members = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid and p.pid != os.getpid() and alive(p):
                members.append(p)
    port, session_dir = state.get("ray_gcs_port"), state.get("ray_session_dir")

    def names_this_head(arg: str) -> bool:  # --gcs-address=IP:PORT, --gcs_server_port=PORT
        return arg.endswith((f"={port}", f":{port}")) or bool(session_dir and session_dir in arg)

    ours = any(names_this_head(a) for p in members for a in p.info.get("cmdline") or [])
    return members if ours else []


def _stop_ray(state: dict[str, Any]) -> bool:
    procs = ray_processes(state)
    terminate(procs)
    return bool(procs)


# -- what `up` recorded ------------------------------------------------------------------------


def stop_recorded(state: dict[str, Any]) -> list[str]:
    """Stop the Ray head and the Redis that `state` records `up` started; what was stopped."""
    stopped = []
    if _stop_ray(state):
        stopped.append("ray head")
    if state.get("redis_started") and _stop_redis(state):
        stopped.append("redis")
    return stopped
