"""Conversions between the patch store's Python values and its protobuf messages, one function
per pair, in both directions. Tensors travel as little-endian row-major bytes + dtype + shape,
the convention of `services.common.wire`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import InvalidRequestError, TooLargeError
from services.common.wire import _NUMPY_LE, DTYPES
from services.patch_store.store import (
    LayerSite,
    Manifest,
    RowKey,
    check_run,
    dtype_name,
)
from services.proto.coxswain.v1 import patch_store_pb2 as pb


def _le_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's elements (bfloat16 as its int16 bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


# -- Tensor ------------------------------------------------------------------------------------


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    """A `Tensor` message holding `t`'s little-endian bytes."""
    t = t.detach().to("cpu").contiguous()
    name = dtype_name(t.dtype) if t.dtype in _NUMPY_LE else None
    if name is None:
        raise InvalidRequestError(f"cannot send dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    raw = _le_view(t).astype(_NUMPY_LE[t.dtype], copy=False).tobytes()
    return pb.Tensor(dtype=name, shape=list(t.shape), data=raw)


def tensor_from_proto(msg: pb.Tensor, *, what: str = "tensor") -> torch.Tensor:
    """The tensor a `Tensor` message holds (an owned CPU copy), validated field by field."""
    dtype = _check_tensor(msg, what)
    arr = np.frombuffer(msg.data, dtype=_NUMPY_LE[dtype]).astype(_NUMPY_LE[dtype].newbyteorder("="))
    t = torch.from_numpy(arr)  # astype copied: the tensor owns writable memory
    return (t.view(torch.bfloat16) if dtype == torch.bfloat16 else t).reshape(list(msg.shape))


def _check_tensor(msg: pb.Tensor, what: str) -> torch.dtype:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"{what} has unknown dtype {msg.dtype!r}; supported: {', '.join(DTYPES)}"
        )
    if any(d < 0 for d in msg.shape):
        raise InvalidRequestError(f"{what} has a negative dimension in shape {list(msg.shape)}")
    expected = math.prod(msg.shape) * _NUMPY_LE[dtype].itemsize
    if len(msg.data) != expected:
        raise InvalidRequestError(
            f"{what} holds {len(msg.data)} bytes; shape {list(msg.shape)} of {msg.dtype} "
            f"needs {expected}"
        )
    return dtype


# -- PutRun: (run id, rows, positions, ...) <-> stream of PutRunChunk --------------------------


@dataclass
class PutRunArgs:
    """The arguments of `PatchStore.put_run`, as a PutRun stream carried them."""

    run_id: str
    rows: Mapping[LayerSite, torch.Tensor]  # each [num_positions, H]
    positions: Sequence[int]
    model: str
    token_ids: Sequence[int] | None
    overwrite: bool


def put_run_to_chunks(args: PutRunArgs, chunk_bytes: int) -> Iterator[pb.PutRunChunk]:
    """The PutRun stream for a run: a header, then row blocks of at most `chunk_bytes` of
    tensor data each (at least one row). Validates the run before returning."""
    hidden, dtype = check_run(args.run_id, args.rows, args.positions, args.token_ids)
    if not isinstance(args.model, str):
        raise InvalidRequestError(f"run {args.run_id!r}: model must be a string")
    if chunk_bytes <= 0:
        raise InvalidRequestError(f"chunk_bytes must be positive, got {chunk_bytes}")
    rows_per_chunk = max(1, chunk_bytes // (hidden * _NUMPY_LE[dtype].itemsize))
    header = pb.RunHeader(
        run_id=args.run_id,
        model=args.model,
        positions=[int(p) for p in args.positions],
        token_ids=[int(t) for t in args.token_ids or ()],
        overwrite=args.overwrite,
        hidden_size=hidden,
        dtype=dtype_name(dtype),
    )

    def chunks() -> Iterator[pb.PutRunChunk]:  # lazy: one chunk's bytes in memory at a time
        yield pb.PutRunChunk(header=header)
        for (layer, site), t in args.rows.items():
            for start in range(0, t.shape[0], rows_per_chunk):
                block = t[start : start + rows_per_chunk]  # [n, H]
                yield pb.PutRunChunk(
                    rows=pb.RowBlock(
                        layer=int(layer),
                        site=site,
                        row_offset=start,
                        rows=tensor_to_proto(block),
                    )
                )

    return chunks()


def put_run_from_chunks(chunks: Iterable[pb.PutRunChunk], *, max_run_bytes: int) -> PutRunArgs:
    """Assemble a PutRun stream into put_run arguments. Row blocks are copied straight into
    one `[num_positions, H]` tensor per (layer, site); a run that would hold more than
    `max_run_bytes` is refused before it is allocated."""
    it = iter(chunks)
    first = next(it, None)
    if first is None or first.WhichOneof("chunk") != "header":
        raise InvalidRequestError(
            "a PutRun stream must start with a header chunk (run id, positions, hidden size, "
            "dtype); got " + ("no chunks" if first is None else "a row block first")
        )
    h = first.header
    dtype = DTYPES.get(h.dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"PutRun header for run {h.run_id!r} has unknown dtype {h.dtype!r}; "
            f"supported: {', '.join(DTYPES)}"
        )
    if h.hidden_size <= 0 or not h.positions:
        raise InvalidRequestError(
            f"PutRun header for run {h.run_id!r} needs hidden_size > 0 and at least one "
            f"position; got hidden_size {h.hidden_size}, {len(h.positions)} positions"
        )
    num_positions, hidden = len(h.positions), h.hidden_size
    block_bytes = num_positions * hidden * _NUMPY_LE[dtype].itemsize
    rows: dict[LayerSite, torch.Tensor] = {}
    filled: dict[LayerSite, int] = {}
    for i, chunk in enumerate(it, start=1):
        if chunk.WhichOneof("chunk") != "rows":
            raise InvalidRequestError(
                f"PutRun chunk {i} of run {h.run_id!r} is not a row block: only the first "
                "chunk is a header"
            )
        b = chunk.rows
        key = (b.layer, b.site)
        where = f"PutRun chunk {i} of run {h.run_id!r} (layer {b.layer}, site {b.site!r})"
        if b.layer < 0 or not b.site:
            raise InvalidRequestError(f"{where}: layer must be >= 0 and site non-empty")
        if b.rows.dtype != h.dtype:
            raise InvalidRequestError(
                f"{where}: rows are {b.rows.dtype!r} but the header says {h.dtype!r}"
            )
        if len(b.rows.shape) != 2 or b.rows.shape[1] != hidden:
            raise InvalidRequestError(
                f"{where}: rows must be [n, hidden_size={hidden}], got {list(b.rows.shape)}"
            )
        _check_tensor(b.rows, where)
        if key not in rows:
            if (len(rows) + 1) * block_bytes > max_run_bytes:
                raise TooLargeError(
                    f"run {h.run_id!r} would hold more than {max_run_bytes} bytes, the patch "
                    f"store's whole budget ({len(rows) + 1} (layer, site) pairs of "
                    f"{block_bytes} bytes)"
                )
            rows[key] = torch.empty(num_positions, hidden, dtype=dtype)
            filled[key] = 0
        n, start = b.rows.shape[0], b.row_offset
        if start != filled[key] or start + n > num_positions:
            raise InvalidRequestError(
                f"{where}: rows {start}..{start + n} do not continue the {filled[key]} rows "
                f"sent so far within the run's {num_positions} positions (blocks of one "
                "(layer, site) come in order, without gaps)"
            )
        dest = _le_view(rows[key][start : start + n])  # [n, H] view into the run's tensor
        dest[...] = np.frombuffer(b.rows.data, dtype=_NUMPY_LE[dtype]).reshape(n, hidden)
        filled[key] = start + n
    if not rows:
        raise InvalidRequestError(f"PutRun stream for run {h.run_id!r} has no row blocks")
    for (layer, site), got in filled.items():
        if got != num_positions:
            raise InvalidRequestError(
                f"PutRun stream for run {h.run_id!r} ended with {got} of {num_positions} rows "
                f"for (layer {layer}, site {site!r})"
            )
    return PutRunArgs(
        run_id=h.run_id,
        rows=rows,
        positions=list(h.positions),
        model=h.model,
        token_ids=list(h.token_ids) or None,
        overwrite=h.overwrite,
    )


# -- Manifest ----------------------------------------------------------------------------------


def manifest_to_proto(m: Manifest, now: float) -> pb.Manifest:
    """A `Manifest` message; the lease expiry goes as seconds left after `now` (the store's
    clock), since clocks of two machines do not compare."""
    return pb.Manifest(
        run_id=m.run_id,
        model=m.model,
        hidden_size=m.hidden_size,
        dtype=m.dtype,
        keys=[pb.LayerSite(layer=layer, site=site) for layer, site in m.keys],
        positions=m.positions,
        token_ids=m.token_ids,
        created_at=m.created_at,
        bytes=m.bytes,
        lease_remaining_s=max(0.0, m.leased_until - now) if m.leased_until is not None else 0.0,
        holders=m.holders,
        version=m.version,
    )


def manifest_from_proto(msg: pb.Manifest, now: float) -> Manifest:
    """A `Manifest` whose `leased_until` is in the receiver's clock (`now` + seconds left)."""
    return Manifest(
        run_id=msg.run_id,
        model=msg.model,
        hidden_size=msg.hidden_size,
        dtype=msg.dtype,
        keys=tuple((k.layer, k.site) for k in msg.keys),
        positions=tuple(msg.positions),
        token_ids=tuple(msg.token_ids),
        created_at=msg.created_at,
        bytes=msg.bytes,
        leased_until=now + msg.lease_remaining_s if msg.holders else None,
        holders=tuple(msg.holders),
        version=msg.version,
    )


# -- Row keys ----------------------------------------------------------------------------------


def row_keys_to_proto(keys: Sequence[RowKey]) -> list[pb.RowKey]:
    """`RowKey` messages for (layer, site, position) triples."""
    out = []
    for i, key in enumerate(keys):
        try:
            layer, site, position = key
            out.append(pb.RowKey(layer=layer, site=site, position=position))
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"key {i} must be a (layer, site, position) triple, got {key!r}"
            ) from None
    return out


def row_keys_from_proto(msgs: Iterable[pb.RowKey]) -> list[RowKey]:
    """(layer, site, position) triples from `RowKey` messages."""
    return [(k.layer, k.site, k.position) for k in msgs]


# -- Stats -------------------------------------------------------------------------------------


def stats_to_proto(stats: Mapping[str, int]) -> pb.StatsResponse:
    return pb.StatsResponse(stats=stats)


def stats_from_proto(msg: pb.StatsResponse) -> dict[str, int]:
    return dict(sorted(msg.stats.items()))
