"""A replica's side of the admin state: `Reconciler` brings its engine to the desired state
in the store, entry by entry and by content, skips (and reports) an entry the engine refuses,
and reports the (epoch, version) it applied for the gateway's `wait_applied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from services.cluster.state import (
    RECONCILE_PERIOD_S,
    REPORT_TTL_S,
    ClusterStore,
    Desired,
    spec_digest,
)
from services.common.errors import (
    CoxswainError,
    NotFoundError,
    public_message,
    unwrap_ray_error,
)

log = logging.getLogger(__name__)

Apply = Callable[..., Awaitable[Any]]


class Reconciler:
    """Brings one replica's engine to the desired state and reports what it applied.

    `apply(fn, *args)` runs `fn(service, *args)` against the replica's EngineService
    (awaitable). Entries are applied one by one, by content: an entry the engine refuses
    (a 4xx error) is skipped and reported in `rejected`; any other failure leaves the
    version unapplied, so the whole pass is retried.
    """

    def __init__(
        self,
        store: ClusterStore,
        apply: Apply,
        replica: str,
        *,
        period_s: float = RECONCILE_PERIOD_S,
        ttl_s: float = REPORT_TTL_S,
        extra: dict | None = None,
    ) -> None:
        """`extra`: more of this replica to report with its versions (where its engine
        takes generations: `backend`)."""
        self.store, self.apply, self.replica = store, apply, replica
        self.extra = dict(extra or {})
        self.period_s, self.ttl_s = period_s, ttl_s
        self.epoch: str | None = None
        self.version = -1  # nothing applied yet
        self.global_spec: Any = None  # the engine starts with no global steering
        self.vectors: dict[str, tuple[str, Any]] = {}  # name -> (digest, value) applied
        self._rejected: dict[str, tuple[str, str]] = {}  # entry -> (digest, reason)
        self.last_error: str | None = None
        self._stop = threading.Event()

    @property
    def rejected(self) -> dict[str, str]:
        """Entries this replica refused and why: `vector:<name>` or `global`."""
        return {entry: reason for entry, (_, reason) in sorted(self._rejected.items())}

    def report(self) -> dict:
        return {
            **self.extra,
            "epoch": self.epoch,
            "version": self.version,
            "rejected": self.rejected,
            "error": self.last_error,
        }

    async def step(self) -> None:
        """Report (before the first read, so no write committed after it goes unwaited for),
        bring the engine to the desired state, report again. Never raises: a failure is
        kept in `last_error` and the next step retries."""
        try:
            await asyncio.to_thread(self.store.report, self.replica, self.report(), self.ttl_s)
            await self.once()
            self.last_error = None
            await asyncio.to_thread(self.store.report, self.replica, self.report(), self.ttl_s)
        except Exception as exc:
            message = public_message(unwrap_ray_error(exc, "the engine"), 500)
            message = message or type(exc).__name__
            if message != self.last_error:
                log.warning("reconciling admin state failed (retrying): %s", message)
            self.last_error = message

    async def run(self) -> None:
        """`step()` whenever the state changes, and every `period_s` (the report's refresh)."""
        while not self._stop.is_set():
            await self.step()
            if self.last_error is not None:  # the state is still newer: retry after a period
                await asyncio.sleep(self.period_s)
                continue
            try:
                head = (self.epoch, self.version)
                await asyncio.to_thread(self.store.wait_change, head, self.period_s)
            except Exception:  # the store is unreachable: retry after a period
                await asyncio.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()

    async def once(self) -> None:
        """Seed a blank store with what this replica applied, then converge to the store."""
        head = await asyncio.to_thread(self.store.head)
        if head[0] is None:
            values = {name: value for name, (_, value) in self.vectors.items()}
            if await asyncio.to_thread(self.store.seed, self.global_spec, values):
                log.warning(
                    "the cluster state was blank: seeded it with this replica's %d vector(s) "
                    "and %s global steering",
                    len(values),
                    "its" if self.global_spec is not None else "no",
                )
            head = await asyncio.to_thread(self.store.head)
        if head == (self.epoch, self.version):
            return
        await self._converge(await asyncio.to_thread(self.store.desired))

    async def _converge(self, desired: Desired) -> None:
        # Vectors first (the global spec may name one), removals last (it may have named one).
        for name, value in desired.vectors.items():
            digest = spec_digest(value)
            if self.vectors.get(name, ("",))[0] != digest and await self._try(
                f"vector:{name}", digest, _register, name, value
            ):
                self.vectors[name] = (digest, value)
        digest = spec_digest(desired.global_spec)
        if digest != spec_digest(self.global_spec) and await self._try(
            "global", digest, _set_global, desired.global_spec
        ):
            self.global_spec = desired.global_spec
        for name in set(self.vectors) - set(desired.vectors):
            await self.apply(_unregister, name)
            del self.vectors[name]
        for entry in list(self._rejected):
            if entry.startswith("vector:") and entry[len("vector:") :] not in desired.vectors:
                del self._rejected[entry]
        self.epoch, self.version = desired.head

    async def _try(self, entry: str, digest: str, fn: Any, *args: Any) -> bool:
        """Apply one entry; False (recorded in `rejected`) when the engine refuses it."""
        if self._rejected.get(entry, ("",))[0] == digest:
            return False  # refused already: the same value is refused again
        try:
            await self.apply(fn, *args)
        except Exception as exc:
            reason = _refusal(exc)
            if reason is None:
                raise
            log.warning("admin state: skipping %s, which this engine refuses: %s", entry, reason)
            self._rejected[entry] = (digest, reason)
            return False
        self._rejected.pop(entry, None)
        return True


def _refusal(exc: BaseException) -> str | None:
    """Why the engine refused an entry (a 4xx error, also behind a Ray error), or None."""
    err = unwrap_ray_error(exc)
    if isinstance(err, CoxswainError) and 400 <= err.http_status < 500:
        return str(err)
    return None


async def _register(service: Any, name: str, value: Any) -> None:
    service.register_vector(name, value, overwrite=True)


async def _unregister(service: Any, name: str) -> None:
    with contextlib.suppress(NotFoundError):
        service.unregister_vector(name)


async def _set_global(service: Any, spec: Any) -> None:
    if spec is None:
        await service.clear_global_steering()
    else:
        await service.set_global_steering(spec)
