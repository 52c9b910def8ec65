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
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.errors import (
    InvalidRequestError,
    RunExistsError,
    RunNotFoundError,
    TooLargeError,
)
from services.common.wire import DTYPES

log = logging.getLogger(__name__)

LayerSite = tuple[int, str]
RowKey = tuple[int, str, int]  # (layer, site, position)

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEFAULT_MAX_LEASE_S = 3600.0  # the longest lease; a holder that needs longer refreshes it
_GONE_REMEMBERED = 4096  # gone run ids whose reason a not-found message can still name
VERSION_SEPARATOR = "@"  # "<run>@<version>": one version of a run; never part of a run id

# Counters kept by every store: name -> help. Each is in stats() and, as
# `coxswain_patch_store_<name>_total`, in the store's prometheus registry.
_COUNTERS = {
    "puts": "runs stored (overwrites included)",
    "gets": "get_rows calls",
    "hits": "get_rows calls that found every row asked for",
    "misses": "get_rows calls that failed: unknown run or missing rows",
    "rows_served": "rows returned by get_rows",
    "evictions": "runs evicted, least recently used first, to stay under the byte budget",
    "evicted_bytes": "bytes freed by evictions",
    "drops": "runs dropped by their owner",
    "invalidations": "invalidate_all calls (weights changed)",
    "invalidated_runs": "runs dropped by invalidate_all",
    "puts_refused": "puts refused: they fit the budget only by evicting leased runs",
    "leases_refused": "leases refused: the reader's leased runs would pass its byte share",
    "leases_granted": "leases taken",
    "leases_refreshed": "leases renewed by their holder",
    "leases_released": "leases released by their holder",
    "leases_expired": "leases that ran out",
}


@dataclass(frozen=True)
class Manifest:
    """What a run holds, without its tensors. `leased_until` is the latest unexpired lease
    expiry in the store's clock (a `PatchStoreClient` gives it in the caller's
    `time.monotonic()`), None when no lease is held."""

    run_id: str
    model: str
    hidden_size: int
    dtype: str
    keys: tuple[LayerSite, ...]  # the (layer, site) pairs held, sorted
    positions: tuple[int, ...]  # row order of every (layer, site) tensor
    token_ids: tuple[int, ...]  # empty when none were given
    created_at: float  # unix seconds
    bytes: int
    leased_until: float | None
    holders: tuple[str, ...]  # holders of unexpired leases, sorted
    version: int = 0  # this contents' version: each put gives a new, larger one

    @property
    def ref(self) -> str:
        """`"<run>@<version>"`: what to read, lease or patch from to get exactly this version."""
        return run_ref(self.run_id, self.version)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.keys}))

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(sorted({site for _, site in self.keys}))


@dataclass(frozen=True)
class _Lease:
    expiry: float  # store clock
    reader: str | None  # the read-only API key that took it; None: a caller that may write


@dataclass
class _Run:
    run_id: str
    model: str
    hidden_size: int
    dtype: torch.dtype
    blocks: dict[LayerSite, torch.Tensor]  # each [num_positions, H], CPU, contiguous
    positions: tuple[int, ...]
    row_of: dict[int, int]  # position -> row index in every block
    token_ids: tuple[int, ...]
    created_at: float
    bytes: int
    leases: dict[str, _Lease]  # by holder
    version: int
    pinned: set[str] = field(default_factory=set)  # holders who leased this very version


def run_ref(run_id: str, version: int) -> str:
    """The reference to one version of a run: `"<run>@<version>"`."""
    return f"{run_id}{VERSION_SEPARATOR}{version}"


def parse_ref(ref: object) -> tuple[str, int | None]:
    """`(run id, version)` of a run reference (version None: the current one)."""
    if not isinstance(ref, str) or not ref:
        raise InvalidRequestError(f"run id must be a non-empty string, got {ref!r}")
    run_id, sep, version = ref.rpartition(VERSION_SEPARATOR)
    if not sep:
        return ref, None
    if not run_id or not version.isdecimal() or not version.isascii():
        raise InvalidRequestError(
            f"run reference {ref!r} must be a run id or '<run>{VERSION_SEPARATOR}<version>' "
            "with an integer version"
        )
    return run_id, int(version)


def check_run(
    run_id: object,
    rows: object,
    positions: object,
    token_ids: object = None,
) -> tuple[int, torch.dtype]:
    """`(hidden_size, dtype)` of a run about to be stored; InvalidRequestError naming the first
    problem otherwise. The store and its client both call this before anything is stored."""
    if not isinstance(run_id, str) or not run_id:
        raise InvalidRequestError(f"run id must be a non-empty string, got {run_id!r}")
    if VERSION_SEPARATOR in run_id:
        raise InvalidRequestError(
            f"run id {run_id!r} contains {VERSION_SEPARATOR!r}, which names a version of a run "
            f"('<run>{VERSION_SEPARATOR}<version>'): choose an id without it"
        )
    if not isinstance(positions, Sequence) or isinstance(positions, str) or not positions:
        raise InvalidRequestError(f"run {run_id!r}: positions must be a non-empty list of ints")
    for p in positions:
        if not _is_int(p) or p < 0:
            raise InvalidRequestError(
                f"run {run_id!r}: positions must be non-negative ints, got {p!r}"
            )
    if len(set(positions)) != len(positions):
        repeated = [p for p, n in Tally(positions).items() if n > 1]
        raise InvalidRequestError(f"run {run_id!r}: positions repeat: {_summary(repeated)}")
    if token_ids is not None:
        if not isinstance(token_ids, Sequence) or not all(_is_int(t) and t >= 0 for t in token_ids):
            raise InvalidRequestError(
                f"run {run_id!r}: token_ids must be a list of non-negative ints"
            )
        if token_ids and max(positions) >= len(token_ids):
            raise InvalidRequestError(
                f"run {run_id!r}: position {max(positions)} is past its {len(token_ids)} token ids"
            )
    if not isinstance(rows, Mapping) or not rows:
        raise InvalidRequestError(
            f"run {run_id!r}: rows must be a non-empty dict {{(layer, site): tensor [P, H]}}"
        )
    hidden = dtype = None
    for key, t in rows.items():
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and _is_int(key[0])
            and key[0] >= 0
            and isinstance(key[1], str)
            and key[1]
        ):
            raise InvalidRequestError(
                f"run {run_id!r}: row keys must be (layer >= 0, site name) pairs, got {key!r}"
            )
        where = f"run {run_id!r} (layer {key[0]}, site {key[1]!r})"
        if not isinstance(t, torch.Tensor):
            raise InvalidRequestError(f"{where}: rows must be a tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_NAMES:
            raise InvalidRequestError(
                f"{where}: dtype {t.dtype} is not storable; use one of {', '.join(DTYPES)}"
            )
        if t.dim() != 2 or t.shape[0] != len(positions) or t.shape[1] == 0:
            raise InvalidRequestError(
                f"{where}: rows must be [num_positions={len(positions)}, H], got {list(t.shape)}"
            )
        if not bool(torch.isfinite(t).all()):  # a NaN row would patch in silently as NaN
            bad = (~torch.isfinite(t)).any(dim=1).nonzero().flatten().tolist()
            raise InvalidRequestError(
                f"{where}: rows hold NaN or inf at positions "
                f"[{_summary([positions[i] for i in bad])}]; a patch-source run must be finite"
            )
        if hidden is None:
            hidden, dtype = int(t.shape[1]), t.dtype
        elif t.shape[1] != hidden or t.dtype != dtype:
            raise InvalidRequestError(
                f"{where}: every (layer, site) of a run must share one hidden size and dtype; "
                f"got [{t.shape[1]}] {t.dtype} after [{hidden}] {dtype}"
            )
    assert hidden is not None and dtype is not None
    return hidden, dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a storable dtype (`float32`, `bfloat16`, ...)."""
    return _DTYPE_NAMES[dtype]


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
        if not _is_int(budget_bytes) or budget_bytes <= 0:
            raise InvalidRequestError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if not _is_number(max_lease_s) or not math.isfinite(max_lease_s) or max_lease_s <= 0:
            raise InvalidRequestError(
                f"max_lease_s must be a positive number of seconds, got {max_lease_s!r}"
            )
        if max_lease_bytes_per_reader is None:
            max_lease_bytes_per_reader = budget_bytes // 2
        if not _is_int(max_lease_bytes_per_reader) or max_lease_bytes_per_reader < 0:
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
        self._runs: OrderedDict[str, _Run] = OrderedDict()  # least recently used first
        # Overwritten versions kept for their lease holders, until their last lease ends.
        self._retired: dict[tuple[str, int], _Run] = {}
        self.started_at = time.time()
        self.restarted = restarted
        self.first_version = _version_now()  # every version this store gives is >= this
        self._last_version = self.first_version - 1
        self._gone: OrderedDict[str, str] = OrderedDict()  # run id -> why it is gone
        self._bytes = 0
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._counters = {
            name: Counter(f"coxswain_patch_store_{name}", doc, registry=self.registry)
            for name, doc in _COUNTERS.items()
        }
        gauges: dict[str, tuple[str, Callable[[], float]]] = {
            "runs": ("runs held", lambda: len(self._runs)),
            "bytes": ("bytes held", lambda: self._bytes),
            "budget_bytes": ("the byte budget", lambda: self.budget_bytes),
            "bytes_over_budget": (
                "bytes held over budget: always 0, the budget is hard",
                lambda: max(0, self._bytes - self.budget_bytes),
            ),
            "leased_runs": ("runs with an unexpired lease", self._count_leased_runs),
            "leased_bytes": ("bytes of the runs with an unexpired lease", self._leased_bytes),
            "retired_versions": (
                "overwritten versions kept readable for their lease holders",
                lambda: len(self._retired),
            ),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(f"coxswain_patch_store_{name}", doc, registry=self.registry).set_function(fn)

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
                self._count("puts_refused")
                raise TooLargeError(
                    f"run {run_id!r} ({size} bytes) does not fit the patch store's budget of "
                    f"{self.budget_bytes} bytes: leased runs hold {kept} bytes of it, and a "
                    "leased run is never evicted; release leases (each ends within "
                    f"{self.max_lease_s:g} s) or drop runs"
                )
            follow: dict[str, _Lease] = {}
            if old is not None:  # pinned leases keep the old version; the rest follow the id
                del self._runs[run_id]
                follow = {h: e for h, e in old.leases.items() if h not in old.pinned}
                old.leases = {h: e for h, e in old.leases.items() if h in old.pinned}
                if old.leases:
                    self._retired[(run_id, old.version)] = old
                else:
                    self._bytes -= old.bytes
            self._last_version = max(self._last_version + 1, _version_now())
            run = _Run(
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
            self._count("puts")
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
        if not _is_number(ttl_s) or not math.isfinite(ttl_s) or ttl_s <= 0:
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
                    self._count("leases_refused")
                    raise TooLargeError(
                        f"API key {reader!r} may not lease run {run_id!r} ({run.bytes} bytes): "
                        f"the runs it leases hold {held} bytes, and a read-only key may lease "
                        f"at most {self.max_lease_bytes_per_reader} of the patch store's "
                        f"{self.budget_bytes} (max_lease_bytes_per_reader); release leases "
                        "it no longer needs"
                    )
            self._count("leases_refreshed" if holder in run.leases else "leases_granted")
            expiry = now + float(ttl_s)
            run.leases[holder] = _Lease(expiry, reader)
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
                    self._count("leases_released")
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
            self._count("drops")
            return sum(run.bytes for run in runs)

    def invalidate_all(self, reason: str = "") -> int:
        """Drop every run, leased or not (the weights changed); how many runs were dropped."""
        why = f"invalidated ({reason})" if reason else "invalidated (weights changed)"
        with self._lock:
            runs = [*self._runs.values(), *self._retired.values()]
            for run in runs:
                self._remove_locked(run, why)
            self._count("invalidations")
            self._count("invalidated_runs", len(runs))
        log.info("patch store invalidated %d runs: %s", len(runs), why)
        return len(runs)

    # -- reads -------------------------------------------------------------------------------

    def get_rows(self, run_id: str, keys: Sequence[RowKey]) -> torch.Tensor:
        """The rows at `keys` (each `(layer, site, position)`) as `[len(keys), H]` in the run's
        dtype; `run_id` may name a version (`"<run>@<v>"`). Every key must be held: a missing
        one is an error, never a zero row, and a version gone is an error, never another's."""
        with self._lock:
            self._count("gets")
            try:
                run = self._get_locked(run_id)
                groups = _group_rows(run, keys)
            except (RunNotFoundError, InvalidRequestError):
                self._count("misses")
                raise
            self._touch_locked(run)
            self._count("hits")
            self._count("rows_served", len(keys))
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
                **self._n,
            }

    # -- internals (call with the lock held) -------------------------------------------------

    def _count(self, name: str, amount: int = 1) -> None:
        self._n[name] += amount
        if amount:
            self._counters[name].inc(amount)

    def _get_locked(self, ref: str) -> _Run:
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

    def _versions_locked(self, run_id: str) -> list[_Run]:
        """Every version of `run_id` held: the current one (if any) and those kept by leases."""
        current = self._runs.get(run_id)
        kept = [run for (name, _), run in self._retired.items() if name == run_id]
        return ([current] if current is not None else []) + kept

    def _touch_locked(self, run: _Run) -> None:
        if self._runs.get(run.run_id) is run:
            self._runs.move_to_end(run.run_id)

    def _remove_locked(self, run: _Run, why: str | None) -> None:
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

    def _prune_leases_locked(self, run: _Run, now: float) -> None:
        for holder, lease in list(run.leases.items()):
            if lease.expiry <= now:
                del run.leases[holder]
                run.pinned.discard(holder)
                self._count("leases_expired")

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
            self._count("evictions")
            self._count("evicted_bytes", run.bytes)
        assert self._bytes <= self.budget_bytes, "put_run let leased runs pass the budget"

    def _manifest_locked(self, run: _Run, now: float) -> Manifest:
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


def _group_rows(run: _Run, keys: Sequence[RowKey]) -> dict[LayerSite, tuple[list[int], list[int]]]:
    """Per (layer, site) of `run`: (indices into the output, row indices into its tensor)."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InvalidRequestError("keys must be a list of (layer, site, position) triples")
    groups: dict[LayerSite, tuple[list[int], list[int]]] = {}
    for i, key in enumerate(keys):
        if not (
            isinstance(key, Sequence)
            and len(key) == 3
            and _is_int(key[0])
            and isinstance(key[1], str)
            and _is_int(key[2])
        ):
            raise InvalidRequestError(
                f"key {i} must be a (layer, site, position) triple, got {key!r}"
            )
        layer, site, position = key
        block = (int(layer), site)
        row = run.row_of.get(int(position))
        if block not in run.blocks or row is None:
            missing = (
                f"(layer {layer}, site {site!r})"
                if block not in run.blocks
                else f"position {position}"
            )
            raise InvalidRequestError(
                f"run {run.run_id!r} has no row for (layer {layer}, site {site!r}, position "
                f"{position}) (key {i}): no {missing}; the run holds "
                f"[{_describe_blocks(run.blocks)}] at positions [{_summary(run.positions)}]"
            )
        out_idx, row_idx = groups.setdefault(block, ([], []))
        out_idx.append(i)
        row_idx.append(row)
    return groups


def _describe_blocks(blocks: Iterable[LayerSite]) -> str:
    """`post_block at layers 0-31; pre_attn at layers 3, 5`."""
    by_site: dict[str, list[int]] = {}
    for layer, site in sorted(blocks):
        by_site.setdefault(site, []).append(layer)
    return "; ".join(f"{site} at layers {_summary(ls)}" for site, ls in sorted(by_site.items()))


def _summary(xs: Sequence[int], max_parts: int = 8) -> str:
    """Sorted ints as ranges, `0-15, 20, 22-24`, cut after `max_parts` parts."""
    parts: list[str] = []
    values = sorted(xs)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    if len(parts) > max_parts:
        parts = [*parts[:max_parts], f"... ({len(values)} in all)"]
    return ", ".join(parts)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
