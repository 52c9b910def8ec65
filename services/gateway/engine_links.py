"""The gateway's direct links to the engine replicas, for generation.

Through Serve's handle a generation costs a Ray call per token in both processes, and in
the engine's process those calls take the GIL from the thread that steps the engine: one
replica served 1,804 generated tok/s where the same engine behind `coxswain serve`'s process
front end served 22,869 (`benchmarks/cluster_serving.py`, two H200s). So each engine replica
also serves its engine on a `process_backend.BackendServer` over TCP (one message per engine
step, however many streams it advanced; an HMAC challenge with the application's key before
a byte is unpickled), and reports where in the cluster store beside its applied version.
`EngineLinks` keeps one `ProcessBackend` per live replica, refreshed from those reports, and
picks the one with the fewest running streams. Everything else (admin writes, sweeps,
observability) still goes through the Serve handle.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing import AuthenticationError
from typing import Any

from services.common.errors import ServiceUnavailableError
from services.gateway.process_backend import BackendAddress, ProcessBackend

log = logging.getLogger(__name__)


class EngineLinks:
    """One link per live engine replica of Serve application `app` that reports a `backend`
    address in `store` (applications may share a store)."""

    def __init__(
        self, store: Any, key: bytes, app: str, refresh_s: float = 1.0, tokenizer: Any = None
    ):
        """`tokenizer`: with one, each link decodes its generations' text in this process
        (`ProcessBackend`), not on the engines' threads."""
        self.store, self.key, self.app, self.refresh_s = store, key, app, refresh_s
        self.tokenizer = tokenizer
        self._links: dict[str, ProcessBackend] = {}  # replica id -> its link
        self._seen: set[str] = set()  # replicas linked, or whose link failed or broke
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        threading.Thread(target=self._run, name="engine-links", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def refresh(self) -> None:
        """Link to replicas that appeared, drop those whose report expired or whose link
        broke (a replica that comes back is a new one, with a new id)."""
        try:
            reports = self.store.reports()
        except Exception as exc:  # the store is down: keep the links there are
            log.warning("engine links: the cluster store is unreachable: %s", exc)
            return
        live = {
            replica: (r["backend"][0], int(r["backend"][1]))
            for replica, r in reports.items()
            if r.get("backend") and r.get("app") == self.app
        }
        with self._lock:
            gone = [r for r in self._links if r not in live]
            for replica in gone:
                self._links.pop(replica).close()
        for replica, address in live.items():
            if replica in self._seen:  # linked, or its link broke: not again
                continue
            self._seen.add(replica)
            try:
                link = ProcessBackend(BackendAddress(address, self.key), None, self.tokenizer)
            except (ServiceUnavailableError, AuthenticationError, OSError, EOFError) as exc:
                log.warning("engine links: replica %s at %s: %s", replica, address, exc)
                continue
            with self._lock:
                self._links[replica] = link
        self._seen &= live.keys()

    def pick(self) -> ProcessBackend | None:
        """The live link with the fewest running generations (None: no replica linked)."""
        with self._lock:
            links = [link for link in self._links.values() if link.alive]
        return min(links, key=lambda link: link.num_streams) if links else None

    def __len__(self) -> int:
        with self._lock:
            return sum(link.alive for link in self._links.values())

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()
