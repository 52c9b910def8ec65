"""`coxswain up --device cuda` on a machine without the GPUs it needs (issue 26): one line
naming what is missing, exit status 2, in seconds, and nothing started or left behind (it
used to run 30 s into a Ray Serve traceback that never said CUDA)."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from tests.e2e.test_cli import _home_env, _processes_in


def test_up_refuses_gpus_this_machine_lacks_before_starting_anything(tmp_path):
    home = tmp_path / "home"
    gpus = torch.cuda.device_count()
    replicas = gpus + 1  # one more than there are, on a GPU machine too
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--tiny", "--device", "cuda",
         "--replicas", str(replicas)],
        capture_output=True, text=True, timeout=120, env=_home_env(home),
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    if gpus == 0:
        want = "--device cuda: no CUDA device is visible on this machine"
    else:
        want = f"--replicas {replicas} × --tp 1 × --pp 1 needs {replicas} GPUs; this machine "
        want += f"has {gpus}"
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"coxswain: error: {want}"), r.stderr
    assert time.monotonic() - start < 60  # no Ray, no Redis: the imports are all it waits for
    assert _processes_in(home) == []
    assert not (home / "cluster").exists()
