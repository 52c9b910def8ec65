"""Running a kernel test module's Triton tests under the interpreter, on CPU.

Triton decides compiled vs interpreted once, when it is imported, so a module's kernel tests
run in a fresh pytest process with TRITON_INTERPRET=1 set from the start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[1]


def assert_passes_interpreted(test_file: str, select: str) -> None:
    """Run the tests of `test_file` that `select` (a `-k` expression) picks, under the
    interpreter; every one must pass and none may be skipped."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
        cwd=REPO,  # so `services` and `tests` import
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
