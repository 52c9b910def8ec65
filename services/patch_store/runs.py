"""Runs as plain data: the reference that names one version of a run (`"<run>@<version>"`),
the checks a run passes before anything stores it, the `Manifest` that describes a stored one,
and the record of one held version (`HeldRun`, with its leases) with the row lookup into it.
No store state lives here, so the gRPC converters, the client and intervention specs read
these without the store (`store.py`), which keeps the runs under its lock and budget.
"""

from __future__ import annotations

import numbers
from collections import Counter as Tally
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from services.common.errors import InvalidRequestError
from services.common.wire import DTYPES

LayerSite = tuple[int, str]
RowKey = tuple[int, str, int]  # (layer, site, position)

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
VERSION_SEPARATOR = "@"  # "<run>@<version>": one version of a run; never part of a run id


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
class RunLease:
    """One holder's hold on a run against eviction."""

    expiry: float  # store clock
    reader: str | None  # the read-only API key that took it; None: a caller that may write


@dataclass
class HeldRun:
    """One version of a run as the store holds it: its tensors, its leases and version."""

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
    leases: dict[str, RunLease]  # by holder
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
        if not is_int(p) or p < 0:
            raise InvalidRequestError(
                f"run {run_id!r}: positions must be non-negative ints, got {p!r}"
            )
    if len(set(positions)) != len(positions):
        repeated = [p for p, n in Tally(positions).items() if n > 1]
        raise InvalidRequestError(f"run {run_id!r}: positions repeat: {int_ranges(repeated)}")
    if token_ids is not None:
        if not isinstance(token_ids, Sequence) or not all(is_int(t) and t >= 0 for t in token_ids):
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
            and is_int(key[0])
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
                f"[{int_ranges([positions[i] for i in bad])}]; a patch-source run must be finite"
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


def group_rows(
    run: HeldRun, keys: Sequence[RowKey]
) -> dict[LayerSite, tuple[list[int], list[int]]]:
    """Per (layer, site) of `run`: (indices into the output, row indices into its tensor)."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InvalidRequestError("keys must be a list of (layer, site, position) triples")
    groups: dict[LayerSite, tuple[list[int], list[int]]] = {}
    for i, key in enumerate(keys):
        if not (
            isinstance(key, Sequence)
            and len(key) == 3
            and is_int(key[0])
            and isinstance(key[1], str)
            and is_int(key[2])
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
                f"[{_describe_blocks(run.blocks)}] at positions [{int_ranges(run.positions)}]"
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
    return "; ".join(f"{site} at layers {int_ranges(ls)}" for site, ls in sorted(by_site.items()))


def int_ranges(xs: Sequence[int], max_parts: int = 8) -> str:
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


def is_int(x: object) -> bool:
    """Whether `x` is an integer (a bool is not)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """Whether `x` is a real number (a bool is not)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
