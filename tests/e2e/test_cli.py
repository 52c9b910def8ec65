"""The `coxswain` command line, run as a user runs it: a subprocess per command.

The local-cluster tests give each `up` its own COXSWAIN_HOME and free ports, so they never
touch the user's ~/.cache/coxswain or a cluster the user has running; a second Ray head,
started beside them, checks that `down` stops only what `up` started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import redis

from services.cluster.processes import alive, ray_processes, ray_psutil, terminate
from services.common.net import free_port

REPO = Path(__file__).resolve().parents[2]
GRPO_CONFIG = str(REPO / "examples" / "grpo" / "none.yaml")


def _coxswain(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _home_env(home: Path) -> dict[str, str]:
    return {**os.environ, "COXSWAIN_HOME": str(home)}


def _processes_in(home: Path) -> list[str]:
    """Live processes working in `home` (redis-server runs in its cluster directory)."""
    psutil = ray_psutil()
    found = []
    for p in psutil.process_iter(["cwd", "cmdline"]):
        cwd = p.info.get("cwd") or ""
        if cwd.startswith(str(home)) and alive(p):
            found.append(" ".join(p.info.get("cmdline") or []))
    return found


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def _outside_ip() -> str | None:
    """This machine's address on its default route, if it has one besides loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def _printed_keys(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^\s+(admin|read)\s+(cx-\S+)$", stdout, re.MULTILINE))


@pytest.fixture(scope="module")
def other_ray_head():
    """A Ray head that is not `coxswain up`'s (no CPUs: nothing can be placed on it)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run([*ray, "get-auth-token", "--generate"], capture_output=True, env=env)
    proc = subprocess.Popen(
        [*ray, "start", "--head", f"--port={port}", "--num-cpus=0",
         "--include-dashboard=false", "--disable-usage-stats",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    head = {"ray_session_id": proc.pid, "ray_gcs_port": port, "address": f"127.0.0.1:{port}"}
    try:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        yield head
    finally:
        terminate(ray_processes(head))


def test_make_tiny_then_generate(tmp_path):
    out = tmp_path / "tiny-qwen2"
    r = _coxswain("model", "make-tiny", "--arch", "qwen2", "--out", str(out), "--layers", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3

    r = _coxswain(
        "generate",
        "--model",
        str(out),
        "--device",
        "cpu",
        "--json",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--logprobs",
        "2",
        "Once upon a time",
        "The harbour",
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Once upon a time", "The harbour"]
    for x in lines:
        (c,) = x["outputs"]
        assert len(c["token_ids"]) == 6 and c["finish_reason"] == "length"
        assert len(c["logprobs"]) == 6


def test_serve_answers_over_http_with_its_keys_and_stops_on_sigterm(tmp_path):
    model = tmp_path / "tiny"
    assert _coxswain("model", "make-tiny", "--arch", "llama", "--out", str(model)).returncode == 0
    keys = tmp_path / "keys"
    keys.write_text("me:read:" + "k" * 24 + "\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", str(model), "--device", "cpu",
         "--port", str(port), "--workers", "1", "--api-keys-file", str(keys),
         "--max-body-bytes", "4096", "--body-timeout-s", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert "serving" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}/v1/completions"
        auth = {"Authorization": "Bearer " + "k" * 24}
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        assert httpx.post(url, json=body).status_code == 401  # every port authenticates
        r = httpx.post(url, json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        # --max-body-bytes: a larger body is refused by its declared length
        big = httpx.post(url, json={**body, "prompt": "x" * 5000}, headers=auth, timeout=60)
        assert big.status_code == 413, big.text
        # --body-timeout-s: a body that stalls is answered 408 about a second after its headers
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nAuthorization: Bearer " + b"k" * 24 + b"\r\nContent-Length: 1000\r\n\r\n{"
            )
            started = time.monotonic()
            reply = conn.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert time.monotonic() - started < 8
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_generate_reports_bad_checkpoint_and_bad_values(tmp_path):
    r = _coxswain("generate", "--model", str(tmp_path / "missing"), "hello")
    assert r.returncode == 2
    assert "does not exist" in r.stderr or "no config.json" in r.stderr
    out = tmp_path / "tiny"
    assert _coxswain("model", "make-tiny", "--out", str(out)).returncode == 0
    r = _coxswain("generate", "--model", str(out), "--device", "cpu", "--top-p", "0", "hi")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_a_missing_model_is_worded_the_same_by_every_command(tmp_path):
    missing = str(tmp_path / "no-such-model")
    gen = _coxswain("generate", "--model", missing, "hello")
    up = _coxswain("up", "--model", missing, "--device", "cpu", env=_home_env(tmp_path))
    assert gen.returncode == up.returncode == 2
    assert (
        gen.stderr
        == up.stderr
        == f"coxswain: error: checkpoint directory {missing} does not exist\n"
    )


def test_generate_takes_engine_settings_and_refuses_bad_ones(tiny_checkpoint):
    model = str(tiny_checkpoint("qwen3"))
    long = " ".join(["word"] * 20)
    r = _coxswain("generate", "--model", model, "--device", "cpu", "--engine",
                  "max_model_len=8", long)  # fmt: skip
    assert r.returncode == 2 and "the model's context is 8" in r.stderr  # the setting took
    r = _coxswain("generate", "--model", model, "--engine", "max_num_seqs=3", "hi")
    assert r.returncode == 2
    assert r.stderr == "coxswain: error: --engine max_num_seqs: set it with --max-num-seqs\n"


def test_up_refuses_engine_settings_no_replica_could_take_before_starting(tmp_path):
    env = _home_env(tmp_path)
    for flag, said in (
        ("bogus=1", "--engine bogus: EngineConfig has no such field (action_queue_size, "),
        ("max_num_seqs=lots", "--engine max_num_seqs='lots': expected int | None"),
        ("max_num_seqs=0", "--engine: max_num_seqs must be >= 1, got 0"),
        ("dtype=float32", "--engine dtype: set it with --dtype"),
        ("max_num_seqs", "--engine 'max_num_seqs': expected FIELD=VALUE"),
    ):
        r = _coxswain("up", "--tiny", "--device", "cpu", "--engine", flag, env=env)
        assert r.returncode == 2, r.stdout + r.stderr
        (line,) = r.stderr.splitlines()
        assert line.startswith("coxswain: error: " + said), line
        assert not (tmp_path / "cluster" / "state.json").exists()  # nothing started


def test_the_cli_runs_from_an_uninstalled_tree(monkeypatch):
    """Offline GPU hosts run the tree from PYTHONPATH, with no package metadata: the CLI
    must still build (its --version then comes from pyproject.toml)."""
    import importlib.metadata
    import tomllib

    from services.cli import parser as cli_parser

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    parser = cli_parser.build_parser()
    version = next(a for a in parser._actions if a.dest == "version").version
    assert version == f"%(prog)s {pyproject['project']['version']}"


def test_version_and_help_of_every_option_with_its_default():
    from importlib.metadata import version

    from services.cli.parser import build_parser

    r = _coxswain("--version")
    assert (r.returncode, r.stdout) == (0, f"coxswain {version('coxswain')}\n")

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action.choices, dict):  # the subcommands
                for child in action.choices.values():
                    yield from parsers(child)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            if action.dest not in ("help", "version") and action.option_strings:
                assert action.help, f"{parser.prog} {action.option_strings[0]} has no help"
    up = _coxswain("up", "--help").stdout
    # one entry per option: "--flag VALUE  help ... (default: D)", over several lines
    entries = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=-)", up)[1:]}
    for flag, default in (
        ("--device", "auto"),
        ("--dtype", "auto"),
        ("--controller-grpc-port", "50071"),
    ):
        assert entries[flag].endswith(f"(default: {default})"), entries[flag]
    assert "(default: 32)" in _coxswain("generate", "--help").stdout
    top = _coxswain("--help").stdout
    assert "--cluster" in top.split("\n    demo ", 1)[1].split("\n    patch-store")[0]


def test_a_stray_flag_shows_the_usage_of_its_command():
    r = _coxswain("serve", "--bogus-flag")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: coxswain serve ")
    assert (
        r.stderr.splitlines()[-1] == "coxswain serve: error: unrecognized arguments: --bogus-flag"
    )


def test_demo_runs_on_the_embedded_default(tmp_path):
    r = _coxswain("demo", "--model-dir", str(tmp_path / "demo"), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "prefix cache hits" in r.stdout
    hits = r.stdout.split("prefix cache hits ")[1].split("/")[0]
    assert int(hits) > 0


# -- training commands -------------------------------------------------------------------------


def test_train_pretrain_takes_the_readmes_flags(tmp_path):
    # The README's `coxswain train pretrain --out runs/base --steps 1000`, shortened.
    out = tmp_path / "base"
    r = _coxswain("train", "pretrain", "--out", str(out), "--steps", "1", "--eval", "0")
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_train_grpo_steps_reaches_the_config():
    r = _coxswain("train", "grpo", "--config", GRPO_CONFIG, "--steps", "0")
    assert r.returncode == 2
    assert "unrecognized" not in r.stderr and "steps" in r.stderr  # validated: steps >= 1


def test_train_grpo_on_a_ray_cluster_without_a_free_cpu_fails_fast(other_ray_head, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": other_ray_head["address"], "RAY_AUTH_MODE": "token"}
    r = _coxswain(
        "train", "grpo", "--config", GRPO_CONFIG, "--ray", "--steps", "1",
        "--out", str(tmp_path / "grpo"), env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "no room for the trainer actor" in r.stderr
    assert "0 of 0 CPUs free" in r.stderr
    assert "Traceback" not in r.stderr


# -- the local cluster: up, status, down -------------------------------------------------------


def test_up_refuses_a_bad_model_path_before_starting_anything(tmp_path):
    home = tmp_path / "home"
    missing = tmp_path / "no-such-model"
    r = _coxswain("up", "--model", str(missing), "--device", "cpu", env=_home_env(home))
    assert r.returncode == 2
    assert str(missing) in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr

    incomplete = tmp_path / "only-config"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    r = _coxswain("up", "--model", str(incomplete), "--device", "cpu", env=_home_env(home))
    assert r.returncode == 2
    assert str(incomplete) in r.stderr and "model.safetensors" in r.stderr
    assert _processes_in(home) == []
    assert not (home / "cluster" / "state.json").exists()


def test_up_stops_its_redis_when_a_later_step_fails(tmp_path):
    home = tmp_path / "home"
    (home / "cluster").mkdir(parents=True)
    keys = home / "cluster" / "api_keys"
    keys.write_text("admin:admin:short\n")  # an unusable keys file: read after Redis starts
    r = _coxswain("up", "--tiny", "--device", "cpu", env=_home_env(home))
    assert r.returncode == 2
    assert str(keys) in r.stderr and "--new-keys" in r.stderr
    assert _processes_in(home) == []  # the redis-server it started is gone
    assert not (home / "cluster" / "state.json").exists()
    assert not (home / "cluster" / "redis.conf").exists()


def _frontend_processes() -> list:
    found = []
    for proc in ray_psutil().process_iter(["cmdline"]):
        if "services.gateway.cluster_frontend" in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def _ray_token_file() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.TimeoutException:  # a new Gateway replica still linking to the engine
        return False


def _served_metrics(host: str, port: int) -> bool:
    try:
        r = httpx.get(f"http://{host}:{port}/metrics", timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and "# TYPE" in r.text


def test_up_status_down(tmp_path, other_ray_head):
    home = tmp_path / "home"
    env = _home_env(home)
    ports = [str(free_port()) for _ in range(3)]
    up_args = ["up", "--tiny", "--device", "cpu", "--num-cpus", "2", "--port", ports[0],
               "--grpc-port", ports[1], "--controller-grpc-port", ports[2],
               "--engine", "max_num_seqs=24"]  # fmt: skip
    token = _ray_token_file()
    if token.is_file():
        token.chmod(0o644)  # as an older Ray left it
    try:
        r = _coxswain(*up_args, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "listening  127.0.0.1" in r.stdout
        first_keys = _printed_keys(r.stdout)
        assert set(first_keys) == {"admin", "read"}
        # Serve's "Connecting to existing Serve app" is not true of a fresh cluster.
        assert "existing Serve app" not in r.stdout + r.stderr

        # Secrets are private from the first byte; the directory is the user's alone.
        cluster = home / "cluster"
        assert stat.S_IMODE(cluster.stat().st_mode) == 0o700
        for name in ("state.json", "api_keys", "redis.conf", "redis.log", "redis.pid"):
            assert stat.S_IMODE((cluster / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE(token.stat().st_mode) == 0o600

        # A second `up` (with --new-keys too) is refused while this cluster runs; the keys stay.
        for extra in ([], ["--new-keys"]):
            again = _coxswain(*up_args, *extra, env=env)
            assert again.returncode == 2, again.stdout + again.stderr
            (line,) = again.stderr.splitlines()
            assert f"the cluster from {cluster} is already running" in line
            assert "`coxswain down` stops it" in line
        assert all(key in (cluster / "api_keys").read_text() for key in first_keys.values())

        # Redis has a password: an unauthenticated LPUSH onto an action queue is refused.
        state = json.loads((cluster / "state.json").read_text())
        url = urlparse(state["redis_url"])
        assert url.hostname == "127.0.0.1" and url.password
        anonymous = redis.Redis(host=url.hostname, port=url.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.lpush("coxswain:actions:replica-0", "{}")
        with redis.Redis.from_url(state["redis_url"]) as authenticated:
            assert authenticated.ping()
        assert "***" in r.stdout and url.password not in r.stdout

        # Every server listens where `up` says: loopback, and nowhere else.
        outside = _outside_ip()
        for port in ports:
            assert _accepts("127.0.0.1", int(port)), port
            if outside is not None:
                assert not _accepts(outside, int(port)), (outside, port)
        # Ray's Prometheus exporters (no token) answer on loopback only.
        listening = {
            (c.laddr.ip, c.laddr.port)
            for proc in ray_processes(state)
            for c in proc.net_connections()
            if c.status == "LISTEN"
        }
        loopback = [port for ip, port in listening if _served_metrics("127.0.0.1", port)]
        assert loopback, listening  # the metrics agent's (the others' fixed ports may be taken)
        if outside is not None:
            assert [p for _, p in listening if _served_metrics(outside, p)] == []

        # HTTP comes from the Gateway's front-end processes, each linked to the engine.
        frontends = _frontend_processes()
        assert len(frontends) == 2
        for proc in frontends:
            listening = {c.laddr.port for c in proc.net_connections() if c.status == "LISTEN"}
            assert int(ports[0]) in listening
        headers = {"Authorization": f"Bearer {first_keys['admin']}"}
        base = f"http://127.0.0.1:{ports[0]}"
        assert httpx.get(base + "/health").json()["engine_links"] == 1
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
        done = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        stats = httpx.get(base + "/v1/stats", headers=headers, timeout=30).json()
        assert stats["config"]["max_num_seqs"] == 24  # --engine reached the replica

        # A front end that dies: the other serves on; Serve replaces the Gateway replica,
        # whose new front ends take the port again, and check the keys `up` read, though
        # their file is gone (the replicas have them from the cluster, not the file).
        keys_file = cluster / "api_keys"
        kept_keys = keys_file.read_text()
        keys_file.unlink()
        frontends[0].kill()
        done = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
        assert done.status_code == 200
        old = {proc.pid for proc in frontends}
        deadline = time.monotonic() + 120
        while not (len(fresh := _frontend_processes()) == 2 and not {p.pid for p in fresh} & old):
            assert time.monotonic() < deadline, "the front ends were not replaced"
            time.sleep(1)
        deadline = time.monotonic() + 60
        while not _healthy(base):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        done = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
        assert done.status_code == 200, done.text
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 401
        keys_file.write_text(kept_keys)  # back, for the checks of `down` below

        s = _coxswain("status", "--json", env=env)
        assert s.returncode == 0, s.stdout + s.stderr
        report = json.loads(s.stdout)
        assert report["running"] is True
        assert report["grpc"].endswith("listening") and report["controller"].endswith("listening")
        assert report["redis"].endswith("ok") and report["ray_head_processes"] > 0
        assert (report["state"], report["degraded"]) == ("up", [])

        # A Redis that does not answer: degraded, naming it, and not "up".
        redis_proc = ray_psutil().Process(state["redis_pid"])
        redis_proc.suspend()
        try:
            s = _coxswain("status", env=env)
        finally:
            redis_proc.resume()
        assert s.returncode == 1, s.stdout + s.stderr
        assert s.stdout.splitlines()[0] == "coxswain is degraded: redis not answering"

        # `down` stops this cluster's Ray and Redis, and leaves another Ray on the host alone.
        d = _coxswain("down", env=env)
        assert d.returncode == 0, d.stderr
        assert "ray head" in d.stdout and "redis" in d.stdout
        assert ray_processes(other_ray_head) != []
        assert ray_processes(state) == []
        assert _processes_in(home) == []
        deadline = time.monotonic() + 10  # they leave within a second of their replica
        while _frontend_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _frontend_processes() == []
        assert not _accepts("127.0.0.1", int(ports[0]))
        s = _coxswain("status", env=env)
        assert s.returncode == 1 and "not running" in s.stdout

        # The keys survive `down` for the next `up` (which reuses the file: see
        # tests/unit/cluster/test_local_files.py), while the Redis password goes with it.
        kept = (cluster / "api_keys").read_text()
        assert all(key in kept for key in first_keys.values())
        assert not (cluster / "redis.conf").exists() and not (cluster / "state.json").exists()
    finally:
        _coxswain("down", env=env)
    assert ray_processes(other_ray_head) != []
