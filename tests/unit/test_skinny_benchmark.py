"""`benchmarks/skinny_gemm.py` on its tiny shape under the Triton interpreter: every system's
output is checked against `F.linear` before it is timed, and a wrong one stops the run (no
timing asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import skinny_gemm  # noqa: E402


def test_the_smoke_run_checks_and_times_every_system_and_linear():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    argv = ["--shape", "tiny", "--device", "cpu", "--rows", "1,3", "--iters", "1"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "skinny_gemm.py"), *argv],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    tables = out.split("\n\nbatch ")[1:]
    assert [t.split(":")[0] for t in tables] == ["1", "3"]
    for table in tables:
        rows = {line.split()[0]: line for line in table.splitlines()[2:]}
        assert set(rows) == set(skinny_gemm.SYSTEMS)
        assert all(line.count("GB/s") == 5 for line in rows.values())  # 4 Linears + layer


def test_an_output_unlike_cublas_stops_the_run():
    want = torch.ones(2, 8)
    skinny_gemm.check("fine", want + 1e-3, want)
    with pytest.raises(SystemExit, match="wrong: output differs from cuBLAS's"):
        skinny_gemm.check("wrong", want * 1.1, want)


def test_the_cpu_smoke_run_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(sys, "argv", ["skinny_gemm.py", "--shape", "tiny", "--device", "cpu"])
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        skinny_gemm.main()
