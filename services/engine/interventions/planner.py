"""One step's interventions as tensors: what each site of the forward pass does.

The planner (`plan_step.py`) turns the scheduler's output into per-token indices; the
model calls `StepInterventions.apply(layer, site, h)` at every site, which — in the order
the design fixes — captures the pristine residual, patches the rows a patch lands on, then
runs the fused op where anything is installed: steering, the monitor, gates, and the
read-out probes (all of which read the pristine residual).

What the host reads back from the fused op — gate bits fired per token, read-out scores
per request — is written into the fixed buffers of a `Readback`, so a CUDA graph can write
them, and comes back with one asynchronous pinned copy per kind behind the step.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.engine.host_memory import to_host_async
from services.engine.interventions.capture import BlockPlacement
from services.engine.interventions.host_rows import CaptureDrain, Lease, PinnedRows
from services.engine.interventions.resolve import RowContent, SiteKey
from services.engine.interventions.sites import SITES
from services.engine.interventions.tables import SteeringTables
from services.engine.kernels.capture import capture, capture_slot, scatter_rows
from services.engine.kernels.patch import patch
from services.engine.kernels.steer import steer


@dataclass
class SteerTokens:
    """Each token's inputs to the fused steer op, planned on the host. The runner writes them
    into the step batch (`StepBatch` fields `steer_*`), uploaded with everything else, and
    binds the device views to the step's `StepInterventions`."""

    rows: np.ndarray  # [T] int32: each token's steering row
    latched: np.ndarray  # [T] int32: latched gate bits of each token's request
    decode: np.ndarray  # [T] float32: 1 on decode tokens
    gain: np.ndarray  # [T] float32: dynamic-tier gain (0 on prefill tokens)
    read_rows: np.ndarray  # [T] int32: the request's row of the scores, on tokens that read out
    capture_rows: np.ndarray  # [T] int32: the token's row of `Readback.captures`, or -1
    carry: np.ndarray  # [T] bool: latch what the request's gates fired in the step before


# What padding rows of a graph batch hold in each `SteerTokens` field: no steering, no
# read-out, no capture, no carry.
STEER_PAD = {
    "rows": 0,
    "latched": 0,
    "decode": 0,
    "gain": 0,
    "read_rows": -1,
    "capture_rows": -1,
    "carry": -1,
}


def block_capture_sites(num_layers: int) -> frozenset[SiteKey]:
    """Where a block-capturing step runs the fused op, which writes the captures there:
    post_block of every layer (`StepInterventions.capture_at` covers the other sites)."""
    return frozenset((L, "post_block") for L in range(num_layers))


@dataclass
class CapturedBlock:
    """One step's captured rows `[tokens, len(slots), H]` on the host: column j holds
    capture slot `slots[j]` (`kernels.capture.capture_slot`), the slots the step's
    capturing requests asked for. On CUDA the rows land in pinned memory (`done`: the
    copy's event), and a `CaptureDrain` moves them to pageable memory (`drained`)."""

    host: torch.Tensor | None  # None: the device wrote every row where it goes (placed)
    slots: tuple[int, ...]
    done: Any = None  # torch.cuda.Event
    lease: Lease | None = None  # the reserved host rows `host` is, until drained
    drained: threading.Event | None = None  # set by the drain once `host` is pageable
    error: BaseException | None = None  # why the drain failed, if it did
    _columns: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def column(self) -> dict[int, int]:
        """Each captured slot's column."""
        return {slot: j for j, slot in enumerate(self.slots)}

    def columns(self, slots: tuple[int, ...]) -> torch.Tensor | None:
        """The columns of `slots`, in that order, as an index; None when they are the
        block's own columns in order (a row is then already the request's). Kept per
        block: the step's requests mostly ask the same keys."""
        if slots == self.slots:
            return None
        if slots not in self._columns:
            self._columns[slots] = torch.tensor([self.column[slot] for slot in slots])
        return self._columns[slots]

    def rows(self) -> torch.Tensor:
        """The rows, once the copy has landed (and been drained, where a drain runs)."""
        if self.drained is not None:
            self.drained.wait()
            if self.error is not None:
                raise RuntimeError(f"capture rows were lost: {self.error}") from self.error
        elif self.done is not None:
            self.done.synchronize()
        if self.host is None:
            raise RuntimeError("every row of this block was written where its request keeps it")
        return self.host


class Readback:
    """Fixed device buffers the fused op writes for the host, and the pinned host buffers
    they come back through (`ring` of each used in turn, as the sampled ids': one more than
    the steps in flight).

    - `fired` [tokens] int32: gate bits each token fired this step;
    - `last_fired` [sequences] int32: the bits each sampled row of the step before fired
      (the latch carry reads it: with overlapped steps the host has not seen them yet);
    - `scores` [sequences, layers, sites, columns] float32: read-out scores per request;
    - `captures` [capture rows, layers x sites, H] in the model's dtype: the residuals of
      the tokens a step captures (None when `capture_rows` is 0). They come back on a copy
      stream of their own (`copy_captures`), so the next step need not wait, into
      `host_rows` pinned host rows reserved at start (`PinnedRows`), which a drain thread
      gives back as soon as each copy lands (`CaptureDrain`).
    """

    # How long a step waits for pinned rows the drain has not given back yet before it
    # page-locks a block of its own: back-pressure when the drain falls behind.
    HOST_ROWS_WAIT_S = 2.0

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        num_layers: int,
        columns: int,
        device: torch.device,
        capture_rows: int = 0,
        hidden: int = 0,
        dtype: torch.dtype = torch.float32,
        host_rows: int = 0,
        ring: int = 2,
    ):
        self.on_cuda = device.type == "cuda"
        i32 = torch.int32
        self.fired = torch.zeros(max_tokens, dtype=i32, device=device)
        self.last_fired = torch.zeros(max_seqs, dtype=i32, device=device)
        shape = (max_seqs, num_layers, len(SITES), columns)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=device)
        self._score_views: dict[SiteKey, torch.Tensor] = {}  # `scores_at`'s
        self.num_layers = num_layers
        self.captures: torch.Tensor | None = None
        if capture_rows > 0:
            shape = (capture_rows, num_layers * len(SITES), hidden)
            self.captures = torch.zeros(shape, dtype=dtype, device=device)
        self._copy_stream = torch.cuda.Stream(device) if self.on_cuda and capture_rows else None
        # Two staging buffers the copy stream reads from, each with its last copy's event.
        self._staging: list[torch.Tensor] = []
        if self._copy_stream is not None:
            assert self.captures is not None
            self._staging = [torch.empty_like(self.captures) for _ in "ab"]
        self._staging_done: list[Any] = [None, None]
        self._staging_turn = 0
        self.host_rows: PinnedRows | None = None
        self.drain: CaptureDrain | None = None
        if self._copy_stream is not None:
            row_shape = (num_layers * len(SITES), hidden)
            self.host_rows = PinnedRows(host_rows, row_shape, dtype)
            self.drain = CaptureDrain()
            weakref.finalize(self, self.drain.stop)  # the thread ends with its readback
        self._slot_index: dict[tuple[int, ...], torch.Tensor] = {}
        # pinned staging for placement tables (`_upload_table`), grown on demand
        self._tables = [torch.empty(0, dtype=torch.int64) for _ in range(self.TABLE_RING)]
        self._table_done: list[Any] = [None] * self.TABLE_RING
        self._table_turn = 0
        self._hosts: dict[str, list[torch.Tensor]] = {}
        self.ring = ring
        if self.on_cuda:
            self._hosts = {
                name: [torch.empty_like(t, device="cpu").pin_memory() for _ in range(ring)]
                for name, t in (("fired", self.fired), ("scores", self.scores))
            }
        self._turn = 0

    def scores_at(self, layer: int, site: str) -> torch.Tensor:
        """[sequences, columns] view of one site's scores (row stride: every site's)."""
        view = self._score_views.get((layer, site))
        if view is None:  # made once a site: the buffer is written in place only
            view = self._score_views[(layer, site)] = self.scores[:, layer, SITES.index(site)]
        return view

    def copy(self, num_tokens: int, num_seqs: int, fired: bool, scores: bool) -> dict:
        """Start copying this step's `fired[:num_tokens]` and `scores[:num_seqs]` (those
        asked for) to the host, behind the step; returns the host tensors (on CPU, copies
        taken now: the next step would overwrite the buffers)."""
        out = {}
        self._turn = (self._turn + 1) % self.ring
        for name, wanted, n in (("fired", fired, num_tokens), ("scores", scores, num_seqs)):
            if not wanted:
                continue
            src = getattr(self, name)[:n]
            if not self.on_cuda:
                out[name] = src.clone()
                continue
            out[name] = host = self._hosts[name][self._turn][:n]
            host.copy_(src, non_blocking=True)
        return out

    def copy_eager(
        self, captured: dict[SiteKey, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[SiteKey, slice]]:
        """Start copying a step's eager captures (`StepInterventions.captured`: per site the
        rows it copied out, in the model's dtype) to the host as float32, behind the step:
        one concatenation on the device and one copy into pinned memory, which the step's
        event covers (on CPU, at once). Returns that block and each site's rows of it.
        Site by site `.cpu()` copied each synchronously, so every capturing step waited,
        once a site, for the step launched after it."""
        host = to_host_async(torch.cat(list(captured.values())).float())  # [rows, H]
        spans, at = {}, 0
        for key, rows in captured.items():
            spans[key], at = slice(at, at + len(rows)), at + len(rows)
        return host, spans

    def copy_captures(
        self,
        num_rows: int,
        slots: tuple[int, ...] = (),
        dtype: torch.dtype = torch.float32,
        placement: BlockPlacement | None = None,
    ) -> CapturedBlock:
        """Start bringing this step's `captures[:num_rows]` to the host, only the columns of
        `slots` (sorted; empty: every slot): a device copy (a gather of those columns) into
        one of two staging buffers behind the step (the next step overwrites the capture
        buffer), then a copy into pinned host memory on a stream of its own, while the next
        step runs. A staging buffer is written again only after its copy out has finished
        (a wait on the device, not the host), so the hot path allocates no device memory.

        The host rows are a run of the pinned reserve (`host_rows`); the drain thread moves
        them to pageable memory in `dtype` once they land and gives the run back, so the
        reserve is reused step after step. Page-locking a fresh block costs milliseconds
        (about 16 ms for 22 MB on an H100 host); reusing reserved rows costs nothing.

        With a `placement` (the sink's, planned before the step) the rows it places are
        written straight into their requests' buffers instead, by one kernel a dtype on the
        copy stream (`scatter_rows`, on CPU at once); when it places every row the block
        has no pinned run and goes to no drain (`host` None)."""
        assert self.captures is not None
        src = self.captures[:num_rows]
        width = src.shape[1]
        slots = slots or tuple(range(width))
        if not self.on_cuda:
            cols = src if len(slots) == width else src[:, list(slots)]
            if placement is not None:
                self.scatter_placed(cols.contiguous(), placement)
                placement.queued = True
                if placement.complete:
                    return CapturedBlock(None, slots)
            return CapturedBlock(cols.to(dtype, copy=True), slots)
        k = self._staging_turn
        self._staging_turn ^= 1
        main, stream = torch.cuda.current_stream(), self._copy_stream
        assert stream is not None
        if self._staging_done[k] is not None:
            main.wait_event(self._staging_done[k])
        shape = (num_rows, len(slots), src.shape[2])
        staged = self._staging[k].view(-1)[: shape[0] * shape[1] * shape[2]].view(shape)
        if len(slots) == width:
            staged.copy_(src)
        else:
            torch.index_select(src, 1, self._slots_on_device(slots), out=staged)
        ready = torch.cuda.Event()
        ready.record(main)
        stream.wait_event(ready)
        if placement is not None:
            with torch.cuda.stream(stream):
                self.scatter_placed(staged, placement, self._upload_table)
                placement.landed = torch.cuda.Event()
                placement.landed.record(stream)
                placement.queued = True
            if placement.complete:
                self._staging_done[k] = placement.landed
                return CapturedBlock(None, slots, placement.landed)
        assert self.host_rows is not None and self.drain is not None
        arena_rows = -(-shape[0] * shape[1] // width)
        run, lease = self.host_rows.take(arena_rows, wait_s=self.HOST_ROWS_WAIT_S)
        host = run.view(-1)[: staged.numel()].view(shape)
        with torch.cuda.stream(stream):
            host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._staging_done[k] = done
        block = CapturedBlock(host, slots, done, lease)
        self.drain.submit(block, dtype)
        return block

    @staticmethod
    def scatter_placed(
        block: torch.Tensor,
        placement: BlockPlacement,
        upload: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> None:
        """Write `block`'s placed rows into their chunks (on the current stream): one launch
        a dtype, its table brought to the block's device by `upload` (on CPU, as it is)."""
        rows, columns = block.shape[0], block.shape[1]
        for chunks, host in placement.writes:
            table = torch.from_numpy(host) if upload is None else upload(host)
            maps = table[3 * rows :].view(-1, columns)
            scatter_rows(block, chunks, table[: 3 * rows].view(rows, 3), maps)

    TABLE_RING = 4  # placement tables in flight to the device

    def _upload_table(self, table: np.ndarray) -> torch.Tensor:
        """A placement table on the device, through a ring of pinned buffers (from pageable
        memory the copy would wait for the stream, and the host with it: 3.9 ms a step at
        batch 128 on an H200 host). A buffer is written again once its last copy is done."""
        k = self._table_turn
        self._table_turn = (k + 1) % self.TABLE_RING
        if self._table_done[k] is not None:
            self._table_done[k].synchronize()  # long done: four steps ago
        if self._tables[k].numel() < len(table):
            self._tables[k] = torch.empty(2 * len(table), dtype=torch.int64, pin_memory=True)
        host = self._tables[k][: len(table)]
        host.numpy()[:] = table
        assert self.captures is not None
        device_table = host.to(self.captures.device, non_blocking=True)
        self._table_done[k] = torch.cuda.Event()
        self._table_done[k].record()
        return device_table

    def _slots_on_device(self, slots: tuple[int, ...]) -> torch.Tensor:
        index = self._slot_index.get(slots)
        if index is None:
            if len(self._slot_index) >= 64:  # a server sees few sets; bound it anyway
                self._slot_index.clear()
            device = self.captures.device
            index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
            self._slot_index[slots] = index
        return index


@dataclass
class StepInterventions:
    tables: SteeringTables
    kernel_sites: set[SiteKey]
    steer_tokens: SteerTokens | None  # None when no site runs the steer op this step
    capture_index: dict[SiteKey, torch.Tensor] = field(default_factory=dict)  # rows to copy
    # per (layer, site): (request id, positions) of the copied rows, in row order
    capture_meta: dict[SiteKey, list[tuple[str, list[int]]]] = field(default_factory=dict)
    # (request index, its RequestInterventions) of each request whose probes read this step;
    # `probe_flat` there: each probe's offset in a request's row of `Readback.scores`
    readers: list[tuple[int, Any]] = field(default_factory=list)
    # (request index, the decode content planned) of each request whose gates may fire
    gated: list[tuple[int, RowContent]] = field(default_factory=list)
    # rows [P], targets [P, H], alpha [P] of the patches that land in this step
    patch_index: dict[SiteKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    view_sites: set[SiteKey] = field(default_factory=set)
    # where `probe_values` finds the readers' scores: (request rows, flat offsets), or None
    read_index: tuple[np.ndarray, np.ndarray] | None = None
    # All-decode steps (one token per request, at its own row): the gated requests' rows,
    # their latching bits, and per (gate site, bit) which of them have that gate; else None
    gate_index: tuple[np.ndarray, np.ndarray, list] | None = None
    decode_only: bool = False
    # A step whose captures fit `Readback.captures` writes them there (every site of every
    # layer, by the fused op at post_block and `capture` where no op runs): per buffer row,
    # the capturing request's index in the schedule and the position captured.
    capture_block: bool = False
    block_captures: list[tuple[int, int]] = field(default_factory=list)
    # The block's columns: the capture slots its requests asked for (sorted), and the dtype
    # its rows are kept in on the host (float32 unless every one of them asked bfloat16).
    block_slots: tuple[int, ...] = ()
    block_dtype: torch.dtype = torch.float32
    # Each row's `BlockWrite`, and where the device writes the rows on the host (the sink's
    # `place`, before the step), if anywhere
    block_writes: list | None = None
    block_placement: BlockPlacement | None = None

    def __post_init__(self) -> None:
        if self.gated and self.decode_only and self.gate_index is None:
            groups: dict[tuple[SiteKey, int], list[int]] = {}
            for j, (_, content) in enumerate(self.gated):
                for key, gate in content.gates.items():
                    groups.setdefault((key, gate.bit), []).append(j)
            self.gate_index = (
                np.fromiter((i for i, _ in self.gated), np.int64, len(self.gated)),
                np.fromiter((c.latching_bits for _, c in self.gated), np.int64, len(self.gated)),
                [(k, np.asarray(v, np.int64)) for k, v in groups.items()],
            )
        if self.readers and self.read_index is None:
            counts = [len(iv.probe_flat) for _, iv in self.readers]
            rows = np.repeat(np.fromiter((i for i, _ in self.readers), np.int64), counts)
            self.read_index = (rows, np.concatenate([iv.probe_flat for _, iv in self.readers]))
        self.captured: dict[SiteKey, torch.Tensor] = {}
        self.view: dict[SiteKey, torch.Tensor] = {}
        self.readback: Readback | None = None
        # Host results, set by `collect` once the step's copies have landed (None where the
        # step read nothing back): gate bits per token [T] int32, and the scores
        # [requests, layers, sites, columns] float32.
        self.fired: torch.Tensor | None = None
        self.scores: np.ndarray | None = None
        self.captured_block: CapturedBlock | None = None
        # The eager captures (`captured`) on the host, float32, where the step copied them
        # back itself (`Readback.copy_eager`); None: the observer copies them.
        self.captured_host: dict[SiteKey, torch.Tensor] | None = None

    @property
    def reads_scores(self) -> bool:
        return bool(self.readers)

    @property
    def reads_fired(self) -> bool:
        return bool(self.gated)

    def collect(self, host: dict) -> None:
        """Take the step's copied read-back (`Readback.copy`'s result, landed) as results."""
        self.fired = host.get("fired")
        scores = host.get("scores")
        self.scores = scores.numpy() if scores is not None else None
        self.captured_block = host.get("captures")
        eager = host.get("eager_captures")
        if eager is not None:
            block, spans = eager
            if block.is_pinned():  # the pinned block goes back: one copy out of it
                block = block.clone()
            self.captured_host = {key: block[at] for key, at in spans.items()}

    def probe_values(self) -> list[float]:
        """Every reader's probe scores, readers in order and each one's probes in order."""
        assert self.scores is not None
        rows, cols = self.read_index
        return self.scores.reshape(len(self.scores), -1)[rows, cols].tolist()

    def touches(self, layer: int, site: str) -> bool:
        """Whether anything happens at (layer, site) this step (else the model may fuse
        across it)."""
        key = (layer, site)
        return key in self.kernel_sites or self._reads_or_patches(key)

    def _reads_or_patches(self, key: SiteKey) -> bool:
        """Whether something besides the fused op reads the residual at `key` (a capture,
        a consumer's view) or replaces rows of it (a patch)."""
        return key in self.capture_index or key in self.patch_index or key in self.view_sites

    def bind(self, readback: Readback, *views: torch.Tensor) -> None:
        """The device views of `steer_tokens` in the uploaded step batch (each [T], in
        `SteerTokens` field order), and the buffers the fused op writes for the host."""
        (
            self.rows,
            self.latched,
            self.decode,
            self.dyn_gain,
            self.read_rows,
            self.capture_rows,
            self.carry,
        ) = views
        self.readback = readback
        self._fired = readback.fired[: len(self.rows)]  # [T]: ORed into by the gates

    def capture_at(self, layer: int, site: str, h: torch.Tensor) -> None:
        """In a block-capturing step, write each capturing token's residual at (layer, site)
        into its row of the capture buffer (where no fused op does it)."""
        if self.capture_block:
            assert self.readback is not None and self.readback.captures is not None
            capture(h, self.capture_rows, self.readback.captures, capture_slot(layer, site))

    def _capture_args(self, layer: int, site: str) -> dict:
        """The fused op's capture arguments at (layer, site): the pristine residual to its
        own slot, and at post_block the output to the next layer's pre_attn slot."""
        if not self.capture_block:
            return {}
        assert self.readback is not None
        last = self.readback.num_layers - 1
        has_next = site == "post_block" and layer < last
        return {
            "capture_rows": self.capture_rows,
            "capture_out": self.readback.captures,
            "capture_slot": capture_slot(layer, site),
            "capture_next": capture_slot(layer + 1, "pre_attn") if has_next else -1,
        }

    def reset_fired(self) -> None:
        """Zero the step's fired bits before the forward (the gates OR theirs in)."""
        self._fired.zero_()

    def apply(self, layer: int, site: str, h: torch.Tensor) -> torch.Tensor:
        """capture → patch → the fused op (read-outs, monitor, gates, steering) at one
        site; [T, H]. Probes (read-outs, the monitor, gates) read the pristine `h`;
        steering adds onto the patched residual."""
        return self.apply_and_norm(layer, site, h)[0]

    def apply_and_norm(
        self,
        layer: int,
        site: str,
        h: torch.Tensor,
        add: torch.Tensor | None = None,
        norm: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`apply`, with the residual add before the site and the norm after it folded in
        where they can be: returns (the residual after the site, `norm` of it or None).

        `add`: the residual add still to do (the residual is `h + add`); `norm`: an
        `RMSNorm` whose output the caller needs next (the next layer's input norm). When
        the fused op is all that runs here, it does both; when nothing runs here, the
        add and the norm are one fused kernel, as on the plain path.
        """
        key = (layer, site)
        runs_op, other = key in self.kernel_sites, self._reads_or_patches(key)
        fused = runs_op and not other  # the op alone: it takes the add and the norm
        if add is not None and not fused:
            if norm is not None and not (runs_op or other):
                normed, h = norm(add, h)  # nothing at this site: the plain fused add + norm
                if site != "pre_attn":  # (pre_attn is written where its residual is made)
                    self.capture_at(layer, site, h)
                return h, normed
            h, add = h + add, None
        idx = self.capture_index.get(key)
        if idx is not None:
            self.captured[key] = h.index_select(0, idx)
        if key in self.view_sites:
            self.view[key] = h  # the op below is out of place, so `h` stays pristine
        patched = None
        if key in self.patch_index:
            patched = patch(h, *self.patch_index[key])
        if not runs_op:
            if site != "pre_attn":
                self.capture_at(layer, site, h)
            out = h if patched is None else patched
            return out, (norm(out) if norm is not None else None)
        result = steer(
            h,
            self.rows,
            self.decode,
            dyn_gain=self.dyn_gain,
            latched=self.latched,
            fired=self._fired,
            base=patched,
            add=add,
            read_rows=self.read_rows,
            scores=self.readback.scores_at(layer, site),
            carry=self.carry,
            last_fired=self.readback.last_fired,
            norm_weight=norm.weight if norm is not None and fused else None,
            eps=norm.eps if norm is not None else 0.0,
            **self._capture_args(layer, site),
            **self.tables.site_args(layer, site),
        )
        if norm is None:
            return result, None
        if fused:
            return result
        return result, norm(result)
