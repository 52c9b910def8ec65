"""Generated tok/s through the cluster (`coxswain up`) against one engine behind `coxswain
serve`'s process front end, on this host's GPUs, over HTTP with the same workload.

For each of `--clusters` it runs `coxswain up --model M --device cuda` with `up`'s defaults
and that shape (`1`: one replica, `2`: two replicas, `tp2`: one TP=2 replica), prints where
each replica's GPU memory went (nvidia-smi), measures `benchmarks/serving.py --url ...
--throughput`, then `coxswain down`. The baseline is `benchmarks/serving.py --throughput`
without `--url` (the engine in this process, uvicorn in child processes) at the engine
settings `up` resolves on CUDA. The load comes from `--client-processes` processes (one
Python SSE reader tops out near 10k chunks/s). With `--kill`, a second run on two replicas
kills one replica's process once `/v1/stats` shows it holding streams, and reports how many
it held, the requests that failed, how long the replica took to come back, and whether a
vector registered before the kill is still there.

    PYTHONPATH=. python3 benchmarks/cluster_serving.py --shape qwen3-0.6b --kill

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode import SHAPES  # noqa: E402

from services.cluster.processes import ray_psutil  # noqa: E402  (Ray's own copy)
from services.common.net import free_port  # noqa: E402
from services.engine.config import BATCH_LIMITS  # noqa: E402
from services.engine.model.tiny import make_tiny_checkpoint  # noqa: E402

CLUSTERS = {"1": [], "2": ["--replicas", "2"], "tp2": ["--tp", "2"]}
RATE = re.compile(r"([\d,]+) generated tok/s")


def _workload(args: argparse.Namespace) -> list[str]:
    return [
        "--throughput", "--num-requests", str(args.num_requests), "--concurrency",
        str(args.concurrency), "--prompt-len", str(args.prompt_len), "--output-len",
        str(args.output_len), "--client-processes", str(args.client_processes),
    ]  # fmt: skip


def _serving(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving.py"), *argv],
        capture_output=True, text=True, **kw,
    )  # fmt: skip


def _rate(out: subprocess.CompletedProcess) -> float:
    found = RATE.findall(out.stdout)
    if out.returncode or not found:
        raise SystemExit(f"serving.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    print("   ", out.stdout.strip().splitlines()[-1] if "--url" in out.args else out.stdout)
    return float(found[0].replace(",", ""))


def _cli(env: dict, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def _gpu_memory() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.replace("\n", "; ")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "(no nvidia-smi)"


def _engine_replica_pids() -> list[int]:
    """Processes of Serve's Engine replicas (Ray titles them ray::ServeReplica:APP:Engine)."""
    pids = []
    for proc in ray_psutil().process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if "ServeReplica" in line and ":Engine" in line:
            pids.append(proc.pid)
    return pids


def _up(args, env: dict, flags: list[str]) -> tuple[str, str]:
    port = free_port()
    r = _cli(
        env, "up", "--model", str(args.model), "--device", "cuda", *flags, "--port", str(port),
        "--grpc-port", str(free_port()), "--controller-grpc-port", str(free_port()),
    )  # fmt: skip
    if r.returncode:
        raise SystemExit(f"coxswain up failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    (key,) = re.findall(r"^\s+admin\s+(cx-\S+)$", r.stdout, re.MULTILINE)
    return f"http://127.0.0.1:{port}", key


def _kill_run(args, url: str, key: str) -> None:
    """Four times the workload on two replicas, and one replica's process killed once it
    holds streams (its running requests, from `/v1/stats`, which also names its pid)."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        r = client.put("/v1/vectors/kept", json={"value": [0.5] * args.hidden, "overwrite": True})
        r.raise_for_status()
        run = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--url", url,
             "--api-key", key, *_workload(args), "--tolerate-errors",
             "--num-requests", str(4 * args.num_requests)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        t_start = time.perf_counter()
        victim, held = None, 0
        while victim is None and time.perf_counter() - t_start < 120 and run.poll() is None:
            stats = client.get("/v1/stats").json()
            held = stats.get("requests_running", 0)
            if held >= min(32, args.concurrency // 4):
                victim = stats["placement"]["ranks"][0]["pid"]
            else:
                time.sleep(0.1)
        if victim is None:
            run.kill()
            raise SystemExit("no replica held streams within 120 s of the run's start")
        t_kill = time.perf_counter()
        ray_psutil().Process(victim).kill()
        print(
            f"    killed Engine replica pid {victim}, holding {held} running streams, "
            f"{t_kill - t_start:.1f} s into the run:"
        )
        out, err = run.communicate(timeout=900)
        print("   ", (out.strip().splitlines() or [err[-500:]])[-1])
        back = None
        while time.perf_counter() - t_kill < 300:
            pids = [p for p in _engine_replica_pids() if p != victim]
            if len(pids) == 2 and client.get("/health").status_code == 200:
                back = time.perf_counter() - t_kill
                break
            time.sleep(1)
        print(f"    a replacement replica is up {back:.0f} s after the kill" if back else
              "    no replacement replica within 300 s")  # fmt: skip
        kept = client.get("/v1/vectors/kept")
        print(f"    vector registered before the kill: HTTP {kept.status_code}")
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        print(f"    a completion after: HTTP {r.status_code}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model", type=Path, help="a local HF checkpoint dir instead of --shape")
    p.add_argument("--clusters", default="1,2,tp2", help=f"of {', '.join(CLUSTERS)}")
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--client-processes",
        type=int,
        default=8,
        help="load generators (one Python SSE reader tops out near 10k chunks/s)",
    )
    p.add_argument("--kill", action="store_true", help="also kill a replica of two mid-run")
    p.add_argument("--skip-baseline", action="store_true")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if args.model is None:
        t = time.perf_counter()
        args.model = make_tiny_checkpoint(
            Path(tmp.name) / args.shape, **SHAPES[args.shape], dtype="bfloat16"
        )
        print(f"generated a random {args.shape} checkpoint in {time.perf_counter() - t:.0f} s")
    args.hidden = SHAPES[args.shape]["hidden"]
    rates: dict[str, float] = {}
    if not args.skip_baseline:
        seqs, tokens = BATCH_LIMITS["cuda"]
        print("coxswain serve (the engine in process, uvicorn in child processes):")
        rates["serve"] = _rate(_serving([
            "--model", str(args.model), *_workload(args), "--max-num-seqs", str(seqs),
            "--max-num-batched-tokens", str(tokens), "--gpu-memory-utilization", "0.85",
        ]))  # fmt: skip
    for name in args.clusters.split(","):
        env = {**os.environ, "COXSWAIN_HOME": str(Path(tmp.name) / f"home-{name}")}
        t = time.perf_counter()
        url, key = _up(args, env, CLUSTERS[name])
        print(f"coxswain up {' '.join(CLUSTERS[name]) or '(one replica)'}: up in "
              f"{time.perf_counter() - t:.0f} s; GPU memory: {_gpu_memory()}")  # fmt: skip
        try:
            rates[name] = _rate(_serving(["--url", url, "--api-key", key, *_workload(args)]))
            if name == "2" and args.kill:
                _kill_run(args, url, key)
        finally:
            _cli(env, "down", timeout=300)
    base = rates.get("serve")
    print("\ngenerated tok/s over HTTP, 256 streams in flight")
    for name, rate in rates.items():
        ratio = f"  {rate / base:.2f}x serve" if base and name != "serve" else ""
        if name in ("2", "tp2") and "1" in rates:
            ratio += f"  {rate / rates['1']:.2f}x one replica"
        print(f"  {name:>6}: {rate:10,.0f}{ratio}")


if __name__ == "__main__":
    main()
