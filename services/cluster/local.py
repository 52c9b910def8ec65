"""`coxswain up` / `down` / `status`: the whole cluster on this machine.

`up` checks the model first, then starts what the cluster needs and records each thing in
the state file as soon as it runs, so that a failure at any later step (and `down`) stops
exactly what this `up` started and nothing else on the host:

- a `redis-server` of its own, on a free loopback port, with a generated password (from a
  0600 config file, so it never shows in `ps`); every component gets the password in its
  `redis://:PASSWORD@127.0.0.1:PORT/0` URL. A Redis of the user's is used only when named
  with `--redis-url`: an unauthenticated Redis on 6379 is never picked up silently.
- a Ray head, run by this interpreter's Ray (`python -m ray.scripts.scripts start`, so a
  venv's `coxswain` works unactivated) in a session of its own: every Ray process of this
  cluster, workers included, carries that session id, which is how `down` finds them. (`ray
  stop` would stop every Ray on the host.)
- the Serve application (gateway, engine replicas, patch store, controller). HTTP, the
  engine gRPC front and the controller's gRPC bind `--host` (loopback unless widened). On
  CUDA every engine rank holds a GPU of its own (`--replicas` × `--tp` × `--pp` in all), which
  `up` counts before it starts anything.

Everything lives in the cluster directory (`$COXSWAIN_HOME/cluster`, default
`~/.cache/coxswain/cluster`, mode 0700). Files holding secrets (state.json, api_keys,
redis.conf, and what Redis writes there) are created 0600. API keys are kept across `up`
runs unless `--new-keys`; the replicas get them in the application's arguments, so that one
restarted later needs no file. One `up` at a time holds the directory (`up.lock`), and `up`
refuses a directory whose cluster is running: two clusters would fight over the same ports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from services.common.net import free_port
from services.common.paths import check_model_dir, coxswain_home, resolve_model

APP_NAME = "coxswain"
_ANY_HOST = ("0.0.0.0", "::", "")
_STOP_GRACE_S = 5.0


def cluster_dir() -> Path:
    return coxswain_home() / "cluster"


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
    new_keys: bool = False


# -- files that hold secrets -------------------------------------------------------------------


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)  # an older directory may have been created with the umask's mode
    return path


def _unwritable(directory: Path, e: OSError) -> CoxswainError:
    """One line for a cluster directory `up` cannot keep its state in."""
    return CoxswainError(
        f"cannot keep the cluster's state in {directory} ({e.filename or directory}: "
        f"{e.strerror or e}): make it writable, or set COXSWAIN_HOME to another directory"
    )


@contextlib.contextmanager
def _holding(directory: Path) -> Iterator[None]:
    """Hold the cluster directory (made private) for one `up`'s start-up, so that a second
    `up` from it fails at once, naming this one, instead of starting a second Redis and a
    second Serve on the same ports. The lock is an flock: it goes with the process, however
    that ends."""
    import fcntl

    try:
        _private_dir(directory)
        fd = os.open(directory / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise _unwritable(directory, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CoxswainError(
                f"another `coxswain up` (pid {holder}) is starting a cluster from {directory}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 from the first byte: a new file is opened 0600
    and renamed over the old one, so no reader ever sees it with wider permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _state_path() -> Path:
    return cluster_dir() / "state.json"


def read_state() -> dict[str, Any] | None:
    path = _state_path()
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _save_state(state: dict[str, Any]) -> None:
    write_private(_state_path(), json.dumps(state, indent=2))


# -- processes ---------------------------------------------------------------------------------


def ray_psutil() -> Any:
    """psutil: Ray ships it (ray/thirdparty_files) and puts it on sys.path when imported."""
    import ray  # noqa: F401

    return importlib.import_module("psutil")


def _alive(proc: Any) -> bool:
    psutil = ray_psutil()
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _terminate(procs: list[Any]) -> None:
    """SIGTERM, then SIGKILL whatever is still running after a grace period."""
    psutil = ray_psutil()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.1)
    for p in procs:
        if _alive(p):
            with contextlib.suppress(psutil.Error):
                p.kill()


# -- Redis -------------------------------------------------------------------------------------


def _redis_ping(url: str) -> str | None:
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


def _start_redis(directory: Path, state: dict[str, Any]) -> str:
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
                _save_state(state)
        why = _redis_ping(url)
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
        if "redis" not in proc.name() or not _alive(proc):  # the pid was reused
            return False
    except psutil.Error:
        return False
    _terminate([proc])
    return True


# -- the Ray head ------------------------------------------------------------------------------


def _ray_command() -> list[str]:
    """This interpreter's Ray CLI: works from a venv that is not activated."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _use_ray_token_auth() -> None:
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
    if not _listening(address):  # no psutil here: it would import Ray
        return {}
    return {**SINGLE_NODE_RAY, "RAY_ADDRESS": address}


def _start_ray_head(opts: UpOptions, state: dict[str, Any]) -> str:
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
    if opts.num_cpus is not None:
        cmd.append(f"--num-cpus={opts.num_cpus}")
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
    _save_state(state)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise ServiceUnavailableError("`ray start --head` did not finish in 180 s") from None
    if proc.returncode != 0:
        raise ServiceUnavailableError(f"`ray start --head` failed:\n{out[-2000:]}")
    return f"127.0.0.1:{port}"


def _ray_processes(state: dict[str, Any]) -> list[Any]:
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
            if os.getsid(p.pid) == sid and p.pid != os.getpid() and _alive(p):
                members.append(p)
    port, session_dir = state.get("ray_gcs_port"), state.get("ray_session_dir")

    def names_this_head(arg: str) -> bool:  # --gcs-address=IP:PORT, --gcs_server_port=PORT
        return arg.endswith((f"={port}", f":{port}")) or bool(session_dir and session_dir in arg)

    ours = any(names_this_head(a) for p in members for a in p.info.get("cmdline") or [])
    return members if ours else []


def _stop_ray(state: dict[str, Any]) -> bool:
    procs = _ray_processes(state)
    _terminate(procs)
    return bool(procs)


# -- up / down / status ------------------------------------------------------------------------


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


def _stop_recorded(state: dict[str, Any]) -> list[str]:
    stopped = []
    if _stop_ray(state):
        stopped.append("ray head")
    if state.get("redis_started") and _stop_redis(state):
        stopped.append("redis")
    return stopped


def _clear_state() -> list[OSError]:
    """Remove what only a running cluster needs (the keys stay); why each file that could
    not be removed stays."""
    left = []
    for name in ("state.json", "redis.conf", "redis.pid"):
        try:
            (cluster_dir() / name).unlink(missing_ok=True)
        except OSError as e:
            left.append(e)
    return left


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
    gpus = 0 if opts.device == "cpu" else visible_gpus()
    opts = dataclasses.replace(opts, device=resolve_device(opts, gpus))
    if opts.model != "tiny":
        check_model_dir(opts.model)  # seconds, not a Ray error after the replicas start
    directory = cluster_dir()
    with _holding(directory):
        _use_ray_token_auth()  # before Ray is imported: it reads RAY_AUTH_MODE once
        os.environ.update(SINGLE_NODE_RAY)  # likewise; the Ray head inherits it
        running = running_cluster()
        if running is not None:
            raise CoxswainError(
                f"the cluster from {directory} is already running ({running['http']}): "
                "`coxswain status` shows it; `coxswain down` stops it"
                + (", and then `up --new-keys` starts one with new keys" if opts.new_keys else "")
            )
        if opts.redis_url and (why := _redis_ping(opts.redis_url)) is not None:
            raise ServiceUnavailableError(f"Redis at --redis-url is not usable: {why}")
        leftover = read_state()
        if leftover is not None:  # a cluster that died or an `up` that was killed halfway
            _stop_recorded(leftover)
        state: dict[str, Any] = {"bind": opts.host}
        try:  # before anything starts: a directory `up` cannot write fails here
            if left := _clear_state():
                raise left[0]
            _save_state(state)
        except OSError as e:
            raise _unwritable(directory, e) from None
        try:
            return _start(opts, directory, state)
        except BaseException:
            _stop_recorded(state)
            _clear_state()
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
        redis_url = _start_redis(directory, state)
    state["redis_url"] = redis_url
    _save_state(state)
    keys = _api_keys(opts, directory)
    model = str(resolve_model(opts.model))  # build the tiny model once, before replicas race

    gcs = _start_ray_head(opts, state)
    ray.init(address=gcs, namespace="coxswain", logging_level="WARNING", log_to_driver=False)
    try:
        state["ray_session_dir"] = ray._private.worker.global_worker.node.get_session_dir_path()
        state["ray_address"] = ray.get_runtime_context().gcs_address
        _save_state(state)
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
        "redis": _redacted(redis_url),
        "model": model,
        "controller": f"{host}:{opts.controller_grpc_port} (gRPC)",
        "api_keys_file": keys.file,
        "api_keys": keys.printed,
    }
    state.update(info)
    _save_state(state)
    return info


def _redacted(url: str) -> str:
    """A Redis URL with its password replaced (it stays in the 0600 state file)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


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


def down() -> tuple[list[str], list[OSError]]:
    """Stop what `up` started, and only that; returns what was stopped, and why each state
    file that could not be removed stays (a read-only directory: the cluster is down all
    the same, and the next `up` names the file)."""
    state = read_state()
    if state is None:
        return [], []
    stopped = _stop_recorded(state)
    return stopped, _clear_state()  # the API keys stay for the next `up`


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host.strip("[]"), int(port))) == 0


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
    report["ray_head_processes"] = len(_ray_processes(state))
    degraded = []
    if state.get("redis_url"):
        why = _redis_ping(state["redis_url"])
        report["redis"] = f"{_redacted(state['redis_url'])}: " + ("ok" if why is None else why)
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
        listening = _listening(address)
        report[name] = f"{address}: " + ("listening" if listening else "not listening")
        if not listening:
            degraded.append(name)
    running = isinstance(health, dict)
    report.update(running=running, degraded=degraded)
    report["state"] = "not running" if not running else "degraded" if degraded else "up"
    return report
