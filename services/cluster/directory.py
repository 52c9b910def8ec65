"""The cluster directory: where `coxswain up` keeps what it started and the secrets it made.

`$COXSWAIN_HOME/cluster` (default `~/.cache/coxswain/cluster`) is mode 0700, and the files
holding secrets (state.json, api_keys, redis.conf, and what Redis writes there) are created
0600. `state.json` records each thing `up` starts as soon as it runs, so that a failure at
any later step, and `down`, stop exactly that. One `up` at a time holds the directory
(`up.lock`): two would start two clusters on the same ports.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.common.errors import CoxswainError
from services.common.paths import coxswain_home


def cluster_dir() -> Path:
    return coxswain_home() / "cluster"


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)  # an older directory may have been created with the umask's mode
    return path


def unwritable(directory: Path, e: OSError) -> CoxswainError:
    """One line for a cluster directory `up` cannot keep its state in."""
    return CoxswainError(
        f"cannot keep the cluster's state in {directory} ({e.filename or directory}: "
        f"{e.strerror or e}): make it writable, or set COXSWAIN_HOME to another directory"
    )


@contextlib.contextmanager
def hold_directory(directory: Path) -> Iterator[None]:
    """Hold the cluster directory (made private) for one `up`'s start-up, so that a second
    `up` from it fails at once, naming this one, instead of starting a second Redis and a
    second Serve on the same ports. The lock is an flock: it goes with the process, however
    that ends."""
    import fcntl

    try:
        private_dir(directory)
        fd = os.open(directory / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise unwritable(directory, e) from None
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


def save_state(state: dict[str, Any]) -> None:
    write_private(_state_path(), json.dumps(state, indent=2))


def clear_state() -> list[OSError]:
    """Remove what only a running cluster needs (the keys stay); why each file that could
    not be removed stays."""
    left = []
    for name in ("state.json", "redis.conf", "redis.pid"):
        try:
            (cluster_dir() / name).unlink(missing_ok=True)
        except OSError as e:
            left.append(e)
    return left
