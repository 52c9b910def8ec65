"""A local `redis-server` process for development, `coxswain up` and tests.

It keeps nothing on disk (no RDB, no AOF): a restart comes back empty, the harder case the
engine link and the controller must survive. Production deployments run their own Redis.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

from services.common.errors import ServiceUnavailableError
from services.common.net import free_port


class RedisServer:
    """`redis-server` on `host:port` (port 0: a free one, kept across restarts)."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        executable: str = "redis-server",
        password: str | None = None,
    ):
        path = shutil.which(executable)
        if path is None:
            raise ServiceUnavailableError(f"{executable!r} is not installed (apt install redis)")
        self.executable, self.host, self.password = path, host, password
        self.port = port or free_port(host)
        self._dir = tempfile.TemporaryDirectory(prefix="coxswain-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        log = Path(self._dir.name) / "redis.log"
        self._proc = subprocess.Popen(
            [
                self.executable,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir.name,
                "--logfile", str(log),
                # On the command line (visible to `ps`): fine for tests; `coxswain up`
                # writes its password to a 0600 config file instead.
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.exceptions.ConnectionError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        tail = log.read_text()[-2000:] if log.exists() else ""
                        self.stop()
                        raise ServiceUnavailableError(
                            f"redis-server on {self.host}:{self.port} did not start: {tail}"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: as abrupt as a crash) and wait for it to exit."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(10)
            self._proc = None

    def restart(self) -> RedisServer:
        """Kill and start again on the same port, empty."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
