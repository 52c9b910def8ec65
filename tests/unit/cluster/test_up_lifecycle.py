"""`coxswain up` / `down` and the cluster directory (issue 29): one `up` at a time per
directory, and a directory `up` cannot write refused in one line before anything starts,
while `down` in it still stops the cluster and says which file it left. Each test runs the
command as a user does (a subprocess with its own COXSWAIN_HOME); none starts Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from services.cluster.directory import hold_directory
from services.common.errors import CoxswainError
from services.controller.redis_server import RedisServer
from tests.e2e.test_cli import _home_env, _processes_in


def _coxswain(home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_home_env(home),
    )


@pytest.fixture
def immutable():
    """`immutable(path)`: make a file or directory one nobody, root included, may change (chattr +i,
    since the tests may run as root, whom permission bits do not stop); undone after."""
    made = []

    def make(path) -> None:
        if shutil.which("chattr") is None:
            pytest.skip("chattr is not installed")
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not supported here: {done.stderr.strip()}")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_second_up_from_the_same_directory_fails_naming_the_first(tmp_path):
    home = tmp_path / "home"
    directory = home / "cluster"
    with hold_directory(directory):  # as a first `up` holds it while it starts
        with pytest.raises(CoxswainError, match=f"pid {os.getpid()}"), hold_directory(directory):
            pass
        r = _coxswain(home, "up", "--tiny", "--device", "cpu")
        if r.returncode == 0:  # without the lock it starts a second cluster: stop it
            _coxswain(home, "down")
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert line == (
        f"coxswain: error: another `coxswain up` (pid {os.getpid()}) is starting a cluster "
        f"from {directory}"
    )
    assert _processes_in(home) == [] and not (directory / "state.json").exists()
    with hold_directory(directory):  # released with its holder
        pass


def test_up_refuses_a_directory_it_cannot_write_before_starting_anything(tmp_path, immutable):
    home = tmp_path / "home"
    directory = home / "cluster"
    directory.mkdir(parents=True, mode=0o700)
    immutable(directory)
    r = _coxswain(home, "up", "--tiny", "--device", "cpu")
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"coxswain: error: cannot keep the cluster's state in {directory} (")
    assert "Operation not permitted" in line and "COXSWAIN_HOME" in line
    assert _processes_in(home) == []  # no Redis; and Ray is only ever started after Redis


def test_up_refuses_state_it_cannot_replace_before_starting_anything(tmp_path, immutable):
    home = tmp_path / "home"
    directory = home / "cluster"
    directory.mkdir(parents=True, mode=0o700)
    (directory / "state.json").write_text(json.dumps({"bind": "127.0.0.1"}))  # a dead `up`'s
    immutable(directory / "state.json")
    r = _coxswain(home, "up", "--tiny", "--device", "cpu")
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert f"({directory / 'state.json'}: Operation not permitted)" in line
    assert _processes_in(home) == []


def test_down_in_a_directory_it_cannot_write_stops_the_cluster_and_names_the_file(
    tmp_path, immutable
):
    home = tmp_path / "home"
    directory = home / "cluster"
    directory.mkdir(parents=True, mode=0o700)
    redis = RedisServer().start()  # a cluster's Redis, as `up` records it
    try:
        state = {"bind": "127.0.0.1", "redis_started": True, "redis_pid": redis._proc.pid}
        (directory / "state.json").write_text(json.dumps(state))
        immutable(directory)
        r = _coxswain(home, "down")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == "stopped: redis"
        assert not redis.running
        (line,) = r.stderr.splitlines()
        assert line == (
            f"coxswain: warning: could not remove {directory / 'state.json'}: "
            "Operation not permitted"
        )
    finally:
        redis.stop()
