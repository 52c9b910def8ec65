"""The patch-source store: captured activations ("runs") held in memory for activation patching.

A run maps (layer, site, position) to a row `[H]`. Per (layer, site) it keeps one
`[num_positions, H]` CPU tensor in the dtype it was given, plus the run's positions list.
Runs live under a byte budget with whole-run LRU eviction; a lease (a TTL hold per holder)
protects a run from eviction. The budget is hard: a put that would only fit by evicting leased
runs is refused (TooLargeError, RESOURCE_EXHAUSTED) rather than stored over budget or
un-patching an admitted request, so the store, and the leased bytes in it, never exceed it.
Eviction runs only when a put needs room; reads never evict.

Leases are bounded, because a read-only API key may take them: a TTL is at most
`max_lease_s` (longer is refused, not clamped: the holder would believe it holds the run
longer than it does), and the runs a read-only key (a *reader*, named by the server) leases
hold at most `max_lease_bytes_per_reader` bytes together, so no reader can pin the whole
store and refuse everyone's captures. Callers that may write anyway (in-process, admin keys)
are bounded by the budget alone.

Every put gives the run a new version. `"<run>@<version>"` names one version (a *run
reference*; a bare run id names the current one). A lease taken on a reference pins that
version: an overwrite replaces the current version, but a pinned one stays readable under its
reference until its last pinning lease ends (its bytes still count against the budget). A
lease taken on a bare run id follows the run id to the new contents, as it protects whatever
its holder reads next. So a sweep that leased version 7 reads version 7 to its end, whatever
is re-captured under the run id meanwhile; once nobody holds version 7 it is gone, and
reading it is RunNotFoundError saying it was overwritten, never the new data.

Versions are microseconds since the epoch (then +1 per put), so a store started after another
one (an actor restart) never hands out a version the lost store used: a reference from before
a restart is an explicit RunNotFoundError naming the restart, never a different run's rows.

What a run is (its records, references and checks) is in `runs.py`; the store's counters and
gauges in `metrics.py`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from prometheus_client import CollectorRegistry

from services.common.errors import (
    InvalidRequestError,
    RunExistsError,
    RunNotFoundError,
    TooLargeError,
)
from services.patch_store.metrics import StoreMetrics
from services.patch_store.runs import (
    VERSION_SEPARATOR,
    HeldRun,
    LayerSite,
    Manifest,
    RowKey,
    RunLease,
    check_run,
    dtype_name,
    group_rows,
    is_int,
    is_number,
    parse_ref,
    run_ref,
)

# The run records' names as their callers import them (`services.patch_store.store`).
__all__ = [
    "DEFAULT_MAX_LEASE_S",
    "VERSION_SEPARATOR",
    "LayerSite",
    "Manifest",
    "PatchStore",
    "RowKey",
    "check_run",
    "dtype_name",
    "parse_ref",
    "run_ref",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_LEASE_S = 3600.0  # the longest lease; a holder that needs longer refreshes it
_GONE_REMEMBERED = 4096  # gone run ids whose reason a not-found message can still name


class PatchStore:
    """An in-process, thread-safe store of runs under a byte budget, with leases.

    `max_lease_s` bounds every lease's TTL; `max_lease_bytes_per_reader` (default: half the
    budget) bounds the bytes of the runs one read-only key leases (see the module docstring).
    `clock` times leases (inject one to expire them in tests); `registry` receives the
    store's prometheus metrics (a fresh one per store when not given). `restarted`: this
    store replaces one that was lost (a restarted actor), so a run it does not know may have
    been lost with the old one, and its not-found errors say so."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        max_lease_s: float = DEFAULT_MAX_LEASE_S,
        max_lease_bytes_per_reader: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        restarted: bool = False,
    ) -> None:
        if not is_int(budget_bytes) or budget_bytes <= 0:
            raise InvalidRequestError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if not is_number(max_lease_s) or not math.isfinite(max_lease_s) or max_lease_s <= 0:
            raise InvalidRequestError(
                f"max_lease_s must be a positive number of seconds, got {max_lease_s!r}"
            )
        if max_lease_bytes_per_reader is None:
            max_lease_bytes_per_reader = budget_bytes // 2
        if not is_int(max_lease_bytes_per_reader) or max_lease_bytes_per_reader < 0:
            raise InvalidRequestError(
                "max_lease_bytes_per_reader must be a non-negative int (0: readers may not "
                f"lease), got {max_lease_bytes_per_reader!r}"
            )
        self.budget_bytes = int(budget_bytes)
        self.max_lease_s = float(max_lease_s)
        self.max_lease_bytes_per_reader = int(max_lease_bytes_per_reader)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.clock = clock
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, HeldRun] = OrderedDict()  # least recently used first
        # Overwritten versions kept for their lease holders, until their last lease ends.
        self._retired: dict[tuple[str, int], HeldRun] = {}
        self.started_at = time.time()
        self.restarted = restarted
        self.first_version = _version_now()  # every version this store gives is >= this
        self._last_version = self.first_version - 1
        self._gone: OrderedDict[str, str] = OrderedDict()  # run id -> why it is gone
        self._bytes = 0
        self.metrics = StoreMetrics(
            self.registry,
            gauges={
                "runs": lambda: len(self._runs),
                "bytes": lambda: self._bytes,
                "budget_bytes": lambda: self.budget_bytes,
                "bytes_over_budget": lambda: max(0, self._bytes - self.budget_bytes),
                "leased_runs": self._count_leased_runs,
                "leased_bytes": self._leased_bytes,
                "retired_versions": lambda: len(self._retired),
            },
        )

    # -- writes ------------------------------------------------------------------------------

    def put_run(
        self,
        run_id: str,
        rows: Mapping[LayerSite, torch.Tensor],
        positions: Sequence[int],
        *,
        model: str = "",
        token_ids: Sequence[int] | None = None,
        overwrite: bool = False,
        copy: bool = True,
    ) -> Manifest:
        """Store a run: `rows[(layer, site)]` is `[len(positions), H]`, row i at positions[i].
        `copy=False` hands the (CPU, contiguous) tensors over instead of copying them.
        TooLargeError when it fits the budget only by evicting leased runs."""
        hidden, dtype = check_run(run_id, rows, positions, token_ids)
        if not isinstance(model, str):
            raise InvalidRequestError(f"run {run_id!r}: model must be a string, got {model!r}")
        size = sum(t.numel() * t.element_size() for t in rows.values())
        if size > self.budget_bytes:
            raise TooLargeError(
                f"run {run_id!r} holds {size} bytes, more than the patch store's whole budget "
                f"of {self.budget_bytes} bytes"
            )
        blocks = {
            (int(layer), site): t.detach().to(
                device="cpu", memory_format=torch.contiguous_format, copy=copy
            )
            for (layer, site), t in rows.items()
        }
        positions = tuple(int(p) for p in positions)
        with self._lock:
            now = self.clock()
            old = self._runs.get(run_id)
            if old is not None and not overwrite:
                raise RunExistsError(
                    f"run {run_id!r} is already stored; pass overwrite=True to replace it"
                )
            self._prune_retired_locked(now)
            if old is not None:
                self._prune_leases_locked(old, now)
            kept = self._leased_bytes_locked(now)
            if old is not None and old.leases and not old.pinned:
                kept -= old.bytes  # its leases follow the id to the new contents, not keep it
            if kept + size > self.budget_bytes:
                self.metrics.count("puts_refused")
                raise TooLargeError(
                    f"run {run_id!r} ({size} bytes) does not fit the patch store's budget of "
                    f"{self.budget_bytes} bytes: leased runs hold {kept} bytes of it, and a "
                    "leased run is never evicted; release leases (each ends within "
                    f"{self.max_lease_s:g} s) or drop runs"
                )
            follow: dict[str, RunLease] = {}
            if old is not None:  # pinned leases keep the old version; the rest follow the id
                del self._runs[run_id]
                follow = {h: e for h, e in old.leases.items() if h not in old.pinned}
                old.leases = {h: e for h, e in old.leases.items() if h in old.pinned}
                if old.leases:
                    self._retired[(run_id, old.version)] = old
                else:
                    self._bytes -= old.bytes
            self._last_version = max(self._last_version + 1, _version_now())
            run = HeldRun(
                run_id=run_id,
                model=model,
                hidden_size=hidden,
                dtype=dtype,
                blocks=blocks,
                positions=positions,
                row_of={p: i for i, p in enumerate(positions)},
                token_ids=tuple(int(t) for t in token_ids or ()),
                created_at=time.time(),
                bytes=size,
                leases=follow,
                version=self._last_version,
            )
            self._runs[run_id] = run
            self._bytes += size
            self._gone.pop(run_id, None)
            self.metrics.count("puts")
            self._enforce_budget_locked(now, keep=run_id)
            return self._manifest_locked(run, now)

    def lease(self, run_id: str, ttl_s: float, holder: str, *, reader: str | None = None) -> float:
        """Hold a run against eviction for `ttl_s` (at most `max_lease_s`) seconds; the expiry
        in the store's clock. `"<run>@<v>"` leases version v and pins it (it outlives an
        overwrite while leased); a bare run id leases the current version and follows the id
        to an overwrite's new contents. A holder leasing again refreshes its lease to now +
        ttl_s. `reader`: the read-only API key asking, as the server names it, whose leased
        runs together may hold at most `max_lease_bytes_per_reader` bytes (TooLargeError past
        that); None for a caller that may write anyway."""
        if not is_number(ttl_s) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidRequestError(f"lease ttl_s must be a positive number, got {ttl_s!r}")
        if ttl_s > self.max_lease_s:
            raise InvalidRequestError(
                f"lease ttl_s {ttl_s:g} is longer than the patch store's maximum of "
                f"{self.max_lease_s:g} s (max_lease_s): lease for at most that, and lease "
                "again before it ends to keep the run longer"
            )
        if not isinstance(holder, str) or not holder:
            raise InvalidRequestError(f"lease holder must be a non-empty string, got {holder!r}")
        with self._lock:
            now = self.clock()
            self._prune_retired_locked(now)
            run = self._get_locked(run_id)
            self._prune_leases_locked(run, now)
            if reader is not None and all(ls.reader != reader for ls in run.leases.values()):
                held = self._leased_bytes_locked(now, reader)
                if held + run.bytes > self.max_lease_bytes_per_reader:
                    self.metrics.count("leases_refused")
                    raise TooLargeError(
                        f"API key {reader!r} may not lease run {run_id!r} ({run.bytes} bytes): "
                        f"the runs it leases hold {held} bytes, and a read-only key may lease "
                        f"at most {self.max_lease_bytes_per_reader} of the patch store's "
                        f"{self.budget_bytes} (max_lease_bytes_per_reader); release leases "
                        "it no longer needs"
                    )
            self.metrics.count("leases_refreshed" if holder in run.leases else "leases_granted")
            expiry = now + float(ttl_s)
            run.leases[holder] = RunLease(expiry, reader)
            if parse_ref(run_id)[1] is not None:
                run.pinned.add(holder)
            else:
                run.pinned.discard(holder)
            self._touch_locked(run)
            return expiry

    def release(self, run_id: str, holder: str) -> bool:
        """Give up `holder`'s leases on `run_id` (every version of it; `"<run>@<v>"`: on
        version v only). False when it held none (never, expired, or the run is gone):
        releasing is idempotent cleanup. A version kept only for its leases goes with the last."""
        name, version = parse_ref(run_id)
        with self._lock:
            now = self.clock()
            released = False
            for run in self._versions_locked(name):
                if version is not None and run.version != version:
                    continue
                self._prune_leases_locked(run, now)
                run.pinned.discard(holder)
                if run.leases.pop(holder, None) is not None:
                    released = True
                    self.metrics.count("leases_released")
            self._prune_retired_locked(now)
            return released

    def drop_run(self, run_id: str) -> int:
        """Remove a run now, every version of it, leased or not (the owner's action); the
        bytes freed. `"<run>@<v>"` drops version v only."""
        name, version = parse_ref(run_id)
        with self._lock:
            runs = [self._get_locked(run_id)] if version is not None else []
            runs = runs or self._versions_locked(name) or [self._get_locked(run_id)]
            for run in runs:
                self._remove_locked(run, "dropped by its owner")
            self.metrics.count("drops")
            return sum(run.bytes for run in runs)

    def invalidate_all(self, reason: str = "") -> int:
        """Drop every run, leased or not (the weights changed); how many runs were dropped."""
        why = f"invalidated ({reason})" if reason else "invalidated (weights changed)"
        with self._lock:
            runs = [*self._runs.values(), *self._retired.values()]
            for run in runs:
                self._remove_locked(run, why)
            self.metrics.count("invalidations")
            self.metrics.count("invalidated_runs", len(runs))
        log.info("patch store invalidated %d runs: %s", len(runs), why)
        return len(runs)

    # -- reads -------------------------------------------------------------------------------

    def get_rows(self, run_id: str, keys: Sequence[RowKey]) -> torch.Tensor:
        """The rows at `keys` (each `(layer, site, position)`) as `[len(keys), H]` in the run's
        dtype; `run_id` may name a version (`"<run>@<v>"`). Every key must be held: a missing
        one is an error, never a zero row, and a version gone is an error, never another's."""
        with self._lock:
            self.metrics.count("gets")
            try:
                run = self._get_locked(run_id)
                groups = group_rows(run, keys)
            except (RunNotFoundError, InvalidRequestError):
                self.metrics.count("misses")
                raise
            self._touch_locked(run)
            self.metrics.count("hits")
            self.metrics.count("rows_served", len(keys))
        # Stored tensors are never written after put, so the gather needs no lock.
        out = torch.empty(len(keys), run.hidden_size, dtype=run.dtype)  # [K, H]
        for block, (out_idx, row_idx) in groups.items():
            out.index_copy_(
                0, torch.tensor(out_idx), run.blocks[block].index_select(0, torch.tensor(row_idx))
            )
        return out

    def manifests(self, run_ids: Iterable[str] | None = None) -> list[Manifest]:
        """Metadata of the runs named (all runs' current versions, least recently used first,
        when None); a `"<run>@<v>"` names that version."""
        with self._lock:
            now = self.clock()
            self._prune_retired_locked(now)
            if run_ids is None:
                runs = list(self._runs.values())
            elif isinstance(run_ids, str):
                raise InvalidRequestError("run_ids must be a list of run ids, not one string")
            else:
                runs = [self._get_locked(run_id) for run_id in run_ids]
            return [self._manifest_locked(run, now) for run in runs]

    def stats(self) -> dict[str, int]:
        """Counts and sizes: runs, bytes, budget, leases, and every counter since start."""
        with self._lock:
            now = self.clock()
            for run in self._runs.values():
                self._prune_leases_locked(run, now)
            self._prune_retired_locked(now)
            leased = [run for run in [*self._runs.values(), *self._retired.values()] if run.leases]
            return {
                "runs": len(self._runs),
                "retired_versions": len(self._retired),
                "bytes": self._bytes,
                "budget_bytes": self.budget_bytes,
                "bytes_over_budget": max(0, self._bytes - self.budget_bytes),
                "leased_runs": len(leased),
                "leased_bytes": sum(run.bytes for run in leased),
                "leases_active": sum(len(run.leases) for run in leased),
                **self.metrics.counts,
            }

    # -- internals (call with the lock held) -------------------------------------------------

    def _get_locked(self, ref: str) -> HeldRun:
        """The run a reference names (a run id: its current version), or RunNotFoundError
        saying why it is not here."""
        run_id, version = parse_ref(ref)
        run = self._runs.get(run_id)
        if version is None:
            if run is not None:
                return run
            raise RunNotFoundError(f"run {run_id!r} is not in the patch store: {self._why(run_id)}")
        if run is not None and run.version == version:
            return run
        retired = self._retired.get((run_id, version))
        if retired is not None:
            return retired
        if version < self.first_version:
            why = (
                f"the patch store restarted at {_clock_time(self.started_at)} and lost it"
                if self.restarted
                else "it is from before this patch store started"
            )
        elif run is not None and run.version > version:
            why = (
                f"it was overwritten by version {run.version} and no lease held it; lease "
                f"'{run_id}{VERSION_SEPARATOR}<version>' to keep a version while you read it"
            )
        elif run is not None:
            why = f"the run's current version is {run.version}"
        else:
            why = self._why(run_id)
        raise RunNotFoundError(f"version {version} of run {run_id!r} is gone: {why}")

    def _why(self, run_id: str) -> str:
        """Why a run id is not held, as far as this store knows."""
        why = self._gone.get(run_id)
        if why is not None:
            return f"it was {why}"
        if self.restarted:
            return (
                f"the patch store restarted at {_clock_time(self.started_at)}, and every run "
                "stored before that is gone (or it was never stored): capture it again"
            )
        return "it was never stored (or is long gone)"

    def _versions_locked(self, run_id: str) -> list[HeldRun]:
        """Every version of `run_id` held: the current one (if any) and those kept by leases."""
        current = self._runs.get(run_id)
        kept = [run for (name, _), run in self._retired.items() if name == run_id]
        return ([current] if current is not None else []) + kept

    def _touch_locked(self, run: HeldRun) -> None:
        if self._runs.get(run.run_id) is run:
            self._runs.move_to_end(run.run_id)

    def _remove_locked(self, run: HeldRun, why: str | None) -> None:
        if self._runs.get(run.run_id) is run:
            del self._runs[run.run_id]
        else:
            del self._retired[(run.run_id, run.version)]
        self._bytes -= run.bytes
        if why is not None:
            self._gone[run.run_id] = why
            self._gone.move_to_end(run.run_id)
            while len(self._gone) > _GONE_REMEMBERED:
                self._gone.popitem(last=False)

    def _prune_retired_locked(self, now: float) -> None:
        """Forget overwritten versions whose last lease has ended."""
        for run in list(self._retired.values()):
            self._prune_leases_locked(run, now)
            if not run.leases:
                self._remove_locked(run, None)

    def _prune_leases_locked(self, run: HeldRun, now: float) -> None:
        for holder, lease in list(run.leases.items()):
            if lease.expiry <= now:
                del run.leases[holder]
                run.pinned.discard(holder)
                self.metrics.count("leases_expired")

    def _enforce_budget_locked(self, now: float, keep: str) -> None:
        """Evict unleased runs, least recently used first, until the store fits its budget;
        `keep` (the run just stored) is never the one evicted. It always fits in the end:
        `put_run` refused the run unless the leased runs leave room for it."""
        for run in list(self._runs.values()):
            if self._bytes <= self.budget_bytes:
                break
            self._prune_leases_locked(run, now)
            if run.run_id == keep or run.leases:
                continue
            self._remove_locked(run, "evicted: least recently used, over the byte budget")
            self.metrics.count("evictions")
            self.metrics.count("evicted_bytes", run.bytes)
        assert self._bytes <= self.budget_bytes, "put_run let leased runs pass the budget"

    def _manifest_locked(self, run: HeldRun, now: float) -> Manifest:
        self._prune_leases_locked(run, now)
        return Manifest(
            run_id=run.run_id,
            model=run.model,
            hidden_size=run.hidden_size,
            dtype=dtype_name(run.dtype),
            keys=tuple(sorted(run.blocks)),
            positions=run.positions,
            token_ids=run.token_ids,
            created_at=run.created_at,
            bytes=run.bytes,
            leased_until=max(ls.expiry for ls in run.leases.values()) if run.leases else None,
            holders=tuple(sorted(run.leases)),
            version=run.version,
        )

    def _count_leased_runs(self) -> int:
        with self._lock:
            now = self.clock()
            runs = [*self._runs.values(), *self._retired.values()]
            return sum(any(ls.expiry > now for ls in run.leases.values()) for run in runs)

    def _leased_bytes(self) -> int:
        with self._lock:
            return self._leased_bytes_locked(self.clock())

    def _leased_bytes_locked(self, now: float, reader: str | None = None) -> int:
        """Bytes of the runs (versions) with an unexpired lease; with `reader`: with one of
        that reader's. A run leased by several holders counts once."""
        return sum(
            run.bytes
            for run in [*self._runs.values(), *self._retired.values()]
            if any(
                ls.expiry > now and (reader is None or ls.reader == reader)
                for ls in run.leases.values()
            )
        )


def _version_now() -> int:
    """Microseconds since the epoch: the smallest version a store may give now."""
    return time.time_ns() // 1000


def _clock_time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))
