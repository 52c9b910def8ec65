"""`coxswain up --device cuda` on a machine with two GPUs (issue 26), through the real CLI:
each engine replica holds a GPU of its own (they all sat on GPU 0), a TP=2 replica's ranks
share one placement group on two GPUs, and the engines size their batch for CUDA.

Each `up` gets its own COXSWAIN_HOME and free ports, and `down` runs whatever happens."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
import torch

from services.common.net import free_port
from tests.e2e.test_cli import _coxswain, _home_env, _printed_keys
from tests.e2e.test_cluster import PROMPT, gpu_of, ranks_of, replica_stats  # skips without ray

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


def _up(tmp_path, *flags: str) -> tuple[dict[str, str], httpx.Client]:
    """`coxswain up --tiny --device cuda FLAGS`: its environment, and a client with the
    admin key it printed."""
    env = _home_env(tmp_path / "home")
    port = free_port()
    r = _coxswain(
        "up", "--tiny", "--device", "cuda", *flags, "--port", str(port),
        "--grpc-port", str(free_port()), "--controller-grpc-port", str(free_port()),
        env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    key = _printed_keys(r.stdout)["admin"]
    headers = {"Authorization": f"Bearer {key}"}
    return env, httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120)


def _completes(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def _gpu_memory_used_mib() -> dict[str, int]:
    """nvidia-smi's memory in use per GPU index ({} without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {i.strip(): int(m) for i, m in (line.split(",") for line in out.splitlines())}


def test_two_replicas_each_on_a_gpu_of_its_own(tmp_path):
    before = _gpu_memory_used_mib()
    env, client = _up(tmp_path, "--replicas", "2")
    try:
        _completes(client)
        gpus = []
        for stats in replica_stats(client, "/v1/stats", replicas=2).values():
            (rank,) = stats["placement"]["ranks"]
            gpus.append(gpu_of(rank))
            config = stats["config"]
            assert config["device"] == "cuda"
            # sized for CUDA when unset (EngineConfig.resolved_for)
            assert (config["max_num_seqs"], config["max_num_batched_tokens"]) == (256, 8192)
        assert len(set(gpus)) == 2, gpus
        after = _gpu_memory_used_mib()
        for gpu in gpus:  # a CUDA context, the model and the KV cache on each
            if gpu in before and gpu in after:
                assert after[gpu] - before[gpu] > 100, (gpu, before, after)
    finally:
        client.close()
        _coxswain("down", env=env)


def test_a_tensor_parallel_replica_spans_two_gpus_in_one_placement_group(tmp_path):
    env, client = _up(tmp_path, "--tp", "2")
    try:
        _completes(client)
        (ranks,) = ranks_of(client, "/v1/stats", replicas=1)
        assert [r["rank"] for r in ranks] == [0, 1]
        assert len({gpu_of(r) for r in ranks}) == 2
        (pg,) = {r["placement_group"] for r in ranks}
        assert pg is not None and len({r["node_id"] for r in ranks}) == 1
    finally:
        client.close()
        _coxswain("down", env=env)
