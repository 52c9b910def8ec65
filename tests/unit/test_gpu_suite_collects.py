"""`tests/gpu` runs only on CUDA hosts, but it must import everywhere: a GPU test that no
longer imports (a helper moved away) would otherwise be found only in a device session,
where the whole suite stops at collection and runs nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_suite_collects_on_any_machine():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/gpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " collected" in done.stdout or "tests collected" in done.stdout
