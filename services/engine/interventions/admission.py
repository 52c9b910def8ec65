"""A request's way through the intervention state: resolved, admitted, signed, released.

`RequestAdmission` is the part of `InterventionManager` that handles one request at a
time. When the request is added its spec is resolved (bad input fails there, before it
queues) and checked servable: what could never run or never be delivered is refused
rather than skipped. The runs its patches read are leased. On admission it gets its table
rows and probe columns, or waits while a pool is full: it never runs unsteered. When it
finishes its rows go back and its captures are delivered, written as a run first where it
asked for one. Its KV signatures (`refresh_sigs`) fold its own rows into the environment
that `SteeringControl` keeps current.

The state it uses is made in `InterventionManager.__init__`; the annotations below name it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.errors import InvalidRequestError, RunNotFoundError
from services.engine.interventions.capture import CaptureSink
from services.engine.interventions.plan_step import StepPlanner
from services.engine.interventions.resolve import (
    ProbeRead,
    ResolvedCapture,
    ResolvedPatches,
    ResolvedSteering,
    Resolver,
    RowContent,
    SiteKey,
    digest,
)
from services.engine.interventions.sites import SITES, site_key
from services.engine.interventions.spec import (
    parse_capture,
    parse_patch,
    parse_readouts,
    parse_steering,
)
from services.engine.interventions.tables import ZERO_ROW, SteeringTables
from services.engine.sequence import RequestGroup, Sequence

log = logging.getLogger(__name__)

# Runs that patches read are leased for this long, renewed once half of it has passed.
RUN_LEASE_TTL_S = 300.0

NO_CONTENT = RowContent()  # what a request without steering adds: nothing (never written)


@dataclass
class RequestInterventions:
    """One request's resolved interventions and the table rows it holds."""

    steering: ResolvedSteering | None
    capture: ResolvedCapture | None
    readouts: list[ProbeRead]
    patches: ResolvedPatches | None = None
    capture_run: str | None = None  # the run its capture was written to
    capture_error: str | None = None  # why writing it failed
    prefill_row: int = ZERO_ROW
    decode_row: int = ZERO_ROW
    override: RowContent | None = None  # decode content from a controller override
    override_row: int | None = None  # its row, in the dynamic pool (also a private copy)
    has_rows: bool = False
    dyn_gain: float = 1.0

    @property
    def decode_content(self) -> RowContent:
        """What the request's decode tokens get now: an override's content, or its own."""
        if self.override is not None:
            return self.override
        return self.steering.decode if self.steering else NO_CONTENT

    @property
    def effective_decode_row(self) -> int:
        return self.override_row if self.override_row is not None else self.decode_row

    def __post_init__(self) -> None:
        # Every probe read on this request's sampled tokens: read-outs, then abort_when.
        self.probes: list[ProbeRead] = self.readouts + (
            self.steering.abort_when if self.steering else []
        )
        self.probe_digests = [digest(p.probe) for p in self.probes]
        self.readout_names = [p.name for p in self.readouts]
        # Once admitted: each probe's column in its site's bank, and its offset in a
        # request's row of the read-back scores ([layers, sites, columns], flattened).
        self.probe_cols: list[int] = []
        self.probe_flat = np.zeros(0, np.int64)

    def probe_wants(self) -> dict[SiteKey, set[bytes]]:
        """The probe bank columns this request reads, by site: their digests."""
        wants: dict[SiteKey, set[bytes]] = {}
        for probe, d in zip(self.probes, self.probe_digests, strict=True):
            wants.setdefault((probe.layer, probe.site), set()).add(d)
        return wants


class RequestAdmission:
    """Resolve, admit, sign and release requests (a base of `InterventionManager`)."""

    device: torch.device
    resolver: Resolver
    tables: SteeringTables
    planner: StepPlanner
    sink: CaptureSink
    requests: dict[str, RequestGroup]
    patch_sources: Any
    model_name: str
    writes_runs: bool
    lease_holder: str
    _lease_refresh_at: dict[str, float]
    num_waits_for_rows: int
    num_waits_for_probes: int
    _prefill_env: bytes
    _decode_env: bytes

    def resolve(self, group: RequestGroup) -> None:
        """Resolve the request's spec into `group.interventions` (InvalidRequestError on bad
        input). Reads the vector registry and the patch store but changes no engine state,
        so it may run off the engine's thread; `refresh_sigs` follows on it."""
        p = group.params
        steering = parse_steering(p.steering)
        capture = parse_capture(p.capture)
        readouts = parse_readouts(p.readouts)
        patch = parse_patch(p.patch)
        iv = None
        if steering or capture or readouts or patch:
            P = len(group.prompt_token_ids)
            iv = RequestInterventions(
                steering=self.resolver.steering(steering) if steering else None,
                capture=self.resolver.capture(capture) if capture else None,
                readouts=self.resolver.readouts(readouts),
                patches=self._resolve_patches(patch, P) if patch else None,
            )
            self._check_servable(group, iv)
            if iv.capture and iv.capture.needs_full_prompt(P):
                group.skip_prefix_cache = True
            if iv.patches is not None:
                group.patch_from = iv.patches.first_position
                group.patch_sig = iv.patches.digest
                iv.patches = self._on_device(iv.patches)
        group.interventions = iv

    def _resolve_patches(self, entries: list, num_prompt_tokens: int) -> ResolvedPatches:
        """Lease the runs the patches read (at most once per run per half lease), then fetch."""
        runs = {e.source.run for e in entries if e.source.run is not None}
        if runs and self.patch_sources is not None:
            now = time.monotonic()
            for run in sorted(runs):
                if self._lease_refresh_at.get(run, 0.0) > now:
                    continue
                # Leasing also checks that the run exists (RunNotFoundError otherwise).
                self.patch_sources.lease(run, RUN_LEASE_TTL_S, self.lease_holder)
                self._lease_refresh_at[run] = now + RUN_LEASE_TTL_S / 2
        return self.resolver.patches(entries, num_prompt_tokens, self.patch_sources)

    def _check_servable(self, group: RequestGroup, iv: RequestInterventions) -> None:
        """Reject what could never run or never be delivered, rather than skip it silently."""
        if iv.steering is not None:
            contents = {c.digest for c in (iv.steering.prefill, iv.steering.decode) if c.digest}
            if len(contents) > self.tables.request_pool.size:
                raise InvalidRequestError(
                    f"this steering needs {len(contents)} table rows but the per-request pool "
                    f"has {self.tables.request_pool.size} (EngineConfig.steering_request_rows)"
                )
        for (layer, site), digests in iv.probe_wants().items():
            if len(digests) > self.tables.probe_columns:
                raise InvalidRequestError(
                    f"{len(digests)} distinct probes read at {site_key(layer, site)}, but a "
                    f"site's probe bank holds {self.tables.probe_columns} "
                    "(EngineConfig.readout_probes_per_site)"
                )
        if iv.capture is not None and iv.capture.run is not None:
            if self.patch_sources is None:
                raise InvalidRequestError(
                    "capture sink 'patch_store' needs a patch-source store attached to the engine"
                )
            try:
                self.patch_sources.manifests([iv.capture.run])
            except RunNotFoundError:
                pass  # free to write
            else:
                raise InvalidRequestError(f"capture run {iv.capture.run!r} already exists")
        if iv.capture is not None:
            if group.params.n > 1:
                raise InvalidRequestError("capture is supported for n=1 requests only")
            positions = iv.capture.positions
            max_tokens = group.params.max_tokens
            if isinstance(positions, frozenset) and max_tokens is not None:
                last = len(group.prompt_token_ids) + max_tokens - 2  # the last fed position
                beyond = sorted(p for p in positions if p > last)
                if beyond:
                    raise InvalidRequestError(
                        f"capture positions {beyond[:5]} are never computed: the last position "
                        f"fed through the model is {last} (prompt + max_tokens − 2)"
                    )

    def _on_device(self, patches: ResolvedPatches) -> ResolvedPatches:
        dev, dtype = self.device, self.tables.dtype
        by_site = {
            k: [(pos, t.to(dev, dtype), a) for pos, t, a in v] for k, v in patches.by_site.items()
        }
        return ResolvedPatches(by_site, patches.first_position, patches.digest)

    def add(self, group: RequestGroup) -> None:
        self.requests[group.request_id] = group

    def try_admit(self, seq: Sequence) -> bool:
        """Give the request its table rows and probe columns; False (it waits) while the
        per-request pool or a probe bank it reads is full."""
        self.planner.invalidate()
        iv = seq.group.interventions
        if iv is None or iv.has_rows or (iv.steering is None and not iv.probes):
            return True
        if iv.steering is not None:
            pool = self.tables.request_pool
            contents = [iv.steering.prefill, iv.steering.decode]
            needed = {
                c.digest for c in contents if not c.is_empty and pool.lookup(c.digest) is None
            }
            if len(needed) > len(pool.free):
                self.num_waits_for_rows += 1
                return False
        if iv.probes and not self.tables.probe_room(iv.probe_wants()):
            self.num_waits_for_probes += 1
            return False
        if iv.steering is not None:
            iv.prefill_row, iv.decode_row = (
                self._acquire_shared(c) for c in (iv.steering.prefill, iv.steering.decode)
            )
        iv.probe_cols = [
            self.tables.acquire_probe((p.layer, p.site), d, p.probe)
            for p, d in zip(iv.probes, iv.probe_digests, strict=True)
        ]
        C = self.tables.probe_columns
        iv.probe_flat = np.array(
            [(p.layer * len(SITES) + SITES.index(p.site)) * C + col
             for p, col in zip(iv.probes, iv.probe_cols, strict=True)],
            np.int64,
        )  # fmt: skip
        iv.has_rows = True
        self.refresh_sigs(seq.group)
        return True

    def _acquire_shared(self, content: RowContent) -> int:
        if content.is_empty:
            return ZERO_ROW
        pool = self.tables.request_pool
        row = pool.lookup(content.digest)
        if row is not None:
            pool.ref(row)
            return row
        row = pool.acquire(content.digest)
        assert row is not None, "checked by try_admit"
        self.tables.write_row(row, content)
        return row

    def release(self, group: RequestGroup, keep_captures: bool = False) -> None:
        """Return a finished request's rows and forget its captures (with `keep_captures`,
        not yet: `drop_captures` once they are delivered)."""
        self.planner.invalidate()
        self.requests.pop(group.request_id, None)
        if not keep_captures:
            self.sink.drop(group.request_id)
        iv = group.interventions
        if iv is None:
            return
        if iv.has_rows and iv.steering is not None:
            for row, content in (
                (iv.prefill_row, iv.steering.prefill),
                (iv.decode_row, iv.steering.decode),
            ):
                if row != ZERO_ROW and self.tables.request_pool.release(row):
                    self.tables.clear_row(row, content)
        if iv.has_rows:
            for probe, col in zip(iv.probes, iv.probe_cols, strict=True):
                self.tables.release_probe((probe.layer, probe.site), col)
            iv.probe_cols = []
        iv.has_rows = False
        self._drop_override(group, iv)

    def _drop_override(self, group: RequestGroup, iv: RequestInterventions) -> None:
        if iv.override_row is not None:
            assert iv.override is not None
            self.tables.dynamic_pool.release(iv.override_row)
            self.tables.clear_row(iv.override_row, iv.override)
            for seq in group.seqs:  # gate bits now mean other gates
                seq.latched = 0
        iv.override, iv.override_row = None, None

    def drop_captures(self, group: RequestGroup) -> None:
        """Forget a released request's captures (delivered)."""
        self.sink.drop(group.request_id)

    def captures_ready(self, group: RequestGroup) -> bool:
        """Whether a finished request's captures are all on the host (its last decode
        blocks' rows may still be on their way: `captures` would wait for them)."""
        return self.sink.ready(group.request_id)

    def captures(self, group: RequestGroup) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        """A finished request's captures; with sink "patch_store", written as its run first."""
        iv = group.interventions
        dtype = iv.capture.dtype if iv is not None and iv.capture is not None else torch.float32
        try:
            result = self.sink.result(group.request_id, dtype)
        except RuntimeError as exc:  # its rows were lost: its output says so, the rest run on
            if iv is not None:
                iv.capture_error = str(exc)
            log.warning("request %s: %s", group.request_id, exc)
            return None
        run = iv.capture.run if iv is not None and iv.capture is not None else None
        if result is None or run is None or iv is None or iv.capture_run or iv.capture_error:
            return result
        if not self.writes_runs:
            return result
        tensors, positions = result
        rows: dict[tuple[int, str], torch.Tensor] = {}
        for key, t in tensors.items():
            layer, site = key.split(".")
            rows[(int(layer), site)] = t
        seq = group.seqs[0]
        try:
            self.patch_sources.put_run(
                run,
                rows,
                positions,
                model=self.model_name,
                token_ids=seq.token_ids[: max(positions) + 1],
            )
            iv.capture_run = run
        except Exception as exc:  # the output says so; the other requests run on
            iv.capture_error = f"writing capture run {run!r} failed: {exc}"
            log.warning(iv.capture_error)
        return result

    def refresh_sigs(self, group: RequestGroup) -> None:
        """The request's prefix-cache signatures under the current global steering."""
        iv = group.interventions
        own_prefill = iv.steering.prefill.digest if iv and iv.steering else b""
        group.prefill_sig = (
            digest(self._prefill_env, own_prefill) if self._prefill_env or own_prefill else b""
        )
        parts: list[Any] = []
        if iv is not None:
            content = iv.decode_content
            if not content.is_empty:
                parts += [content.digest, self.tables.scale_of(iv.effective_decode_row)]
            if self.tables.dynamic:
                parts += [iv.dyn_gain]
        group.decode_sig = digest(self._decode_env, *parts) if self._decode_env or parts else b""
