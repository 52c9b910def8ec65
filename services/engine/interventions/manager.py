"""The engine's intervention state: tables, pools, tiers, actions, consumers, sinks.

`InterventionManager` is what `LLMEngine` talks to. It resolves each request's spec when
the request is added (bad input fails there), gives admitted requests their table rows
and probe columns (a request waits while a pool is full: it never runs unsteered), and
applies controller actions at the top of each step. The step itself has two halves of
their own: `StepPlanner` (`plan_step.py`, pure: the per-token indices of a step from the
schedule and this state) and `StepObserver` (`observer.py`: after the forward pass,
captures to sinks, read-outs to outputs, gate firings to latches, the step view to sync
consumers).

It also keeps every request's KV signature current: the prefill signature (global
prefill steering + the request's prefill row) and the decode signature (global decode
steering, dynamic tier, monitors, the request's effective decode row, its scale, gain
and latches). Sequences record the signature each position was computed under; the
prefix cache folds them into `extra_keys`, so KV made under one steering is never reused
under another.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.common.errors import (
    InvalidRequestError,
    NotFoundError,
    RequestNotFoundError,
    RunNotFoundError,
)
from services.engine.interventions.actions import (
    ACTION_TYPES,
    Action,
    ActionQueue,
    GlobalSteeringUpdate,
    RequestSteeringOverride,
    SteeringMonitorUpdate,
    SteeringScaleUpdate,
    SteeringVectorUpdate,
)
from services.engine.interventions.capture import CaptureSink, InlineCaptureSink
from services.engine.interventions.consumers import (
    ConsumerTiming,
    SyncConsumer,
)
from services.engine.interventions.observer import StepObserver, StepReport
from services.engine.interventions.plan_step import StepPlanner
from services.engine.interventions.planner import StepInterventions
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
from services.engine.interventions.sites import SITES, parse_site, site_key
from services.engine.interventions.spec import (
    parse_capture,
    parse_patch,
    parse_readouts,
    parse_steering,
)
from services.engine.interventions.tables import (
    GLOBAL_DECODE_ROW,
    GLOBAL_PREFILL_ROW,
    ZERO_ROW,
    RowPool,
    SteeringTables,
)
from services.engine.interventions.vectors import VectorRegistry
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import RequestGroup, Sequence

log = logging.getLogger(__name__)

# Runs that patches read are leased for this long, renewed once half of it has passed.
RUN_LEASE_TTL_S = 300.0


def _finite(value: float, what: str) -> None:
    if not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
        raise InvalidRequestError(f"{what} must be a finite number, got {value!r}")


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


@dataclass
class _Counters:
    applied: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    last_rejection: dict[str, str] = field(default_factory=dict)


def resolve_global(resolver: Resolver, spec: Any) -> ResolvedSteering | None:
    """Engine-wide steering (vectors only) resolved by `resolver`, or InvalidRequestError."""
    parsed = parse_steering(spec)
    if parsed is not None and (parsed.gates or parsed.abort_when):
        raise InvalidRequestError("global steering takes `vectors` only (no gates/aborts)")
    return resolver.steering(parsed) if parsed else None


class InterventionManager:
    """Everything the engine knows about interventions; driven from the step thread only
    (`submit` is the one method safe to call from other threads)."""

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        per_request_rows: int = 256,
        dynamic_rows: int = 32,
        probe_columns: int = 8,
        action_queue_size: int = 1024,
        capture_rows: int = 0,
        registry: VectorRegistry | None = None,
    ):
        self.num_layers, self.hidden_size, self.device = num_layers, hidden_size, device
        self.registry = (
            registry
            if registry is not None
            else VectorRegistry(hidden_size=hidden_size, num_layers=num_layers)
        )
        self.resolver = Resolver(num_layers, hidden_size, self.registry)
        self.tables = SteeringTables(
            num_layers, hidden_size, device, dtype, per_request_rows, dynamic_rows, probe_columns
        )
        self.queue = ActionQueue(action_queue_size)
        self.counters = _Counters()
        self.sink: CaptureSink = InlineCaptureSink()
        # The step's two halves: planning it (pure) and observing what it read back.
        self.planner = StepPlanner(self.tables, device, capture_rows)
        self.observer = StepObserver(
            lambda: self.sink, self.queue, lambda: self.planner.steps, self.planner.invalidate
        )
        self.requests: dict[str, RequestGroup] = {}  # unfinished requests, by id
        self.patch_sources: Any = None  # a patch-source store: run sources, capture runs
        self.model_name = ""  # recorded in the manifests of runs this engine writes
        # Only one rank of a parallel replica writes capture runs to the store.
        self.writes_runs = True
        self.local_layers = range(num_layers)  # the layers this process's pipeline stage runs
        self.lease_holder = f"engine-{uuid.uuid4().hex[:12]}"
        self._lease_refresh_at: dict[str, float] = {}  # run -> when its lease is renewed
        self.global_rows = {"prefill": RowContent(), "decode": RowContent()}
        self.global_scale = {"prefill": 1.0, "decode": 1.0}
        self.dynamic_gain = 1.0
        self.num_waits_for_rows = 0  # admissions deferred because a pool was full
        self.num_waits_for_probes = 0  # ... because a site's probe bank was full
        self._prefill_env = b""
        self._decode_env = b""

    # -- requests -------------------------------------------------------------------------

    def prepare(self, group: RequestGroup) -> None:
        """Resolve the request's spec (InvalidRequestError on bad input; nothing changes)
        and sign it against the current global steering."""
        self.resolve(group)
        self.refresh_sigs(group)

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

    def release(self, group: RequestGroup) -> None:
        """Return a finished request's rows and forget its captures."""
        self.planner.invalidate()
        self.requests.pop(group.request_id, None)
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

    def captures(self, group: RequestGroup) -> tuple[dict[str, torch.Tensor], list[int]] | None:
        """A finished request's captures; with sink "patch_store", written as its run first."""
        iv = group.interventions
        dtype = iv.capture.dtype if iv is not None and iv.capture is not None else torch.float32
        result = self.sink.result(group.request_id, dtype)
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

    # -- global steering ------------------------------------------------------------------

    def steers_prefill_globally(self) -> bool:
        """Whether global steering touches prompt tokens (every prefill is steered)."""
        return not self.global_rows["prefill"].is_empty

    def check_global(self, spec: Any) -> ResolvedSteering | None:
        """Resolve engine-wide steering (vectors only); InvalidRequestError on bad input."""
        return resolve_global(self.resolver, spec)

    def _set_global(self, spec: Any) -> None:
        """Install engine-wide steering (the step thread only: it writes the tables)."""
        resolved = self.check_global(spec)
        for phase, row in (("prefill", GLOBAL_PREFILL_ROW), ("decode", GLOBAL_DECODE_ROW)):
            self.tables.clear_row(row, self.global_rows[phase])
            content = getattr(resolved, phase) if resolved else RowContent()
            self.tables.write_row(row, content)
            self.tables.set_row_scale(row, self.global_scale[phase])
            self.global_rows[phase] = content
        self._env_changed()

    # -- actions --------------------------------------------------------------------------

    def submit(self, action: Action, source: str = "api") -> bool:
        """Queue an action for the top of the next step; False if the queue dropped it."""
        if not isinstance(action, ACTION_TYPES):
            raise InvalidRequestError(f"not a steering action: {type(action).__name__}")
        return self.queue.put(action, source)

    def apply_actions(self, items: list[tuple[str, Action]] | None = None) -> None:
        """Apply `items`, by default the drained queue (the top of a step): each action
        applies or is counted rejected. A parallel replica's ranks all apply the list the
        driver drained."""
        for source, action in self.queue.drain() if items is None else items:
            self.planner.invalidate()
            try:
                self._apply(action)
            except Exception as exc:  # a bad action is rejected, never fatal to the step
                self.counters.rejected[source] += 1
                reason = (
                    str(exc) if isinstance(exc, InvalidRequestError | NotFoundError) else repr(exc)
                )
                self.counters.last_rejection[source] = reason
                log.info("rejected %s from %s: %s", type(action).__name__, source, reason)
            else:
                self.counters.applied[source] += 1

    def _apply(self, action: Action) -> None:
        if isinstance(action, SteeringVectorUpdate):
            site = parse_site(action.site)
            _finite(action.scale, "SteeringVectorUpdate: scale")
            for layer in action.layers:  # check everything before changing anything
                self.resolver.check_layer(layer, "SteeringVectorUpdate")
            vectors: dict[int, torch.Tensor | None] = (
                dict.fromkeys(action.layers)
                if action.vector is None
                else dict(
                    self.resolver.layer_vectors(
                        action.vector, list(action.layers), "SteeringVectorUpdate"
                    )
                )
            )
            scaled = {L: None if v is None else action.scale * v for L, v in vectors.items()}
            if any(v is not None and not bool(torch.isfinite(v).all()) for v in scaled.values()):
                raise InvalidRequestError("SteeringVectorUpdate: scale × vector overflows")
            for layer, vec in scaled.items():
                self.tables.set_dynamic((layer, site), vec)
            self._env_changed()
        elif isinstance(action, SteeringMonitorUpdate):
            site = parse_site(action.site)
            layer = self.resolver.check_layer(action.layer, "SteeringMonitorUpdate")
            probe = (
                None
                if action.probe is None
                else self.resolver.probe(action.probe, layer, "SteeringMonitorUpdate")
            )
            _finite(action.threshold, "SteeringMonitorUpdate: threshold")
            _finite(action.sharpness, "SteeringMonitorUpdate: sharpness")
            if not action.sharpness > 0:
                raise InvalidRequestError("SteeringMonitorUpdate: sharpness must be > 0")
            self.tables.set_monitor(
                (layer, site), probe, action.threshold, action.sharpness, action.gate_rows
            )
            self._env_changed()
        elif isinstance(action, SteeringScaleUpdate):
            self._apply_scale(action)
        elif isinstance(action, RequestSteeringOverride):
            self._apply_override(action)
        elif isinstance(action, GlobalSteeringUpdate):
            self._set_global(action.steering)
        else:
            raise InvalidRequestError(f"unknown action type {type(action).__name__}")

    def _request(
        self, request_id: str | None, what: str
    ) -> tuple[RequestGroup, RequestInterventions]:
        group = self.requests.get(request_id) if request_id is not None else None
        if group is None:
            raise RequestNotFoundError(f"{what}: no unfinished request {request_id!r}")
        if group.interventions is None:
            group.interventions = RequestInterventions(None, None, [])
        return group, group.interventions

    def _apply_scale(self, a: SteeringScaleUpdate) -> None:
        _finite(a.scale, "SteeringScaleUpdate: scale")
        if a.tier not in ("global_prefill", "global_decode", "dynamic", "request"):
            raise InvalidRequestError(f"SteeringScaleUpdate: unknown tier {a.tier!r}")
        if a.tier in ("global_prefill", "global_decode"):
            phase = a.tier.removeprefix("global_")
            self.global_scale[phase] = a.scale
            row = GLOBAL_PREFILL_ROW if phase == "prefill" else GLOBAL_DECODE_ROW
            self.tables.set_row_scale(row, a.scale)
            self._env_changed()
        elif a.tier == "dynamic" and a.request_id is None:
            self.dynamic_gain = a.scale
            self._env_changed()
        elif a.tier == "dynamic":
            group, iv = self._request(a.request_id, "SteeringScaleUpdate")
            iv.dyn_gain = a.scale
            self.refresh_sigs(group)
        else:
            group, iv = self._request(a.request_id, "SteeringScaleUpdate")
            if iv.decode_content.is_empty:
                raise InvalidRequestError(
                    f"SteeringScaleUpdate: request {a.request_id!r} has no decode steering row"
                )
            if not iv.decode_content.vectors:
                raise InvalidRequestError(
                    f"SteeringScaleUpdate: request {a.request_id!r} has no decode steering "
                    "vectors to scale (gates carry their own scale)"
                )
            if iv.override_row is None:  # scale a private copy: the shared row serves others
                self._install_override(group, iv, iv.decode_content, "SteeringScaleUpdate")
            assert iv.override_row is not None
            self.tables.set_row_scale(iv.override_row, a.scale)
            self.refresh_sigs(group)

    def _apply_override(self, a: RequestSteeringOverride) -> None:
        group, iv = self._request(a.request_id, "RequestSteeringOverride")
        if a.steering is None:
            self._drop_override(group, iv)
        else:
            spec = parse_steering(a.steering)
            if spec is None:
                content = RowContent()
            else:
                if spec.abort_when:
                    raise InvalidRequestError("RequestSteeringOverride: abort_when is not allowed")
                if any(v.phase == "prefill" for v in spec.vectors):
                    raise InvalidRequestError(
                        "RequestSteeringOverride: an override steers decode tokens only; "
                        "phase='prefill' vectors would never apply"
                    )
                content = self.resolver.steering(spec).decode
            self._install_override(group, iv, content, "RequestSteeringOverride")
        self.refresh_sigs(group)

    def _install_override(
        self, group: RequestGroup, iv: RequestInterventions, content: RowContent, what: str
    ) -> None:
        pool: RowPool = self.tables.dynamic_pool
        if iv.override_row is None and not pool.free:
            raise InvalidRequestError(f"{what}: the dynamic-override pool is full")
        self._drop_override(group, iv)
        row = pool.acquire(content.digest)
        assert row is not None
        self.tables.write_row(row, content)
        iv.override, iv.override_row = content, row

    # -- consumers ------------------------------------------------------------------------

    def add_consumer(self, consumer: SyncConsumer) -> None:
        """Register a sync consumer; its declared sites are checked now."""
        name = getattr(consumer, "name", type(consumer).__name__)
        if name in self.consumers:
            raise InvalidRequestError(f"a consumer named {name!r} is already registered")
        keys = frozenset(
            (self.resolver.check_layer(layer, f"consumer {name!r}"), parse_site(site))
            for site, layers in consumer.sites.items()
            for layer in layers
        )
        away = sorted(site_key(*k) for k in keys if k[0] not in self.local_layers)
        if away:
            raise InvalidRequestError(
                f"consumer {name!r} reads {away[:5]}, which run on another pipeline stage: a "
                "sync consumer sees the driver stage's layers only "
                f"({self.local_layers.start}..{self.local_layers.stop - 1})"
            )
        self.observer.consumers[name] = (consumer, keys)
        self.observer.consumer_timing[name] = ConsumerTiming()
        self.planner.invalidate()

    def remove_consumer(self, name: str) -> None:
        self.consumers.pop(name, None)
        self.observer.consumer_timing.pop(name, None)
        self.planner.invalidate()

    # -- KV signatures ----------------------------------------------------------------------

    def _env_changed(self) -> None:
        self.planner.invalidate()
        t = self.tables
        g = self.global_rows
        self._prefill_env = (
            digest("prefill", g["prefill"].digest, self.global_scale["prefill"])
            if not g["prefill"].is_empty
            else b""
        )
        parts: list[Any] = []
        if not g["decode"].is_empty:
            parts += ["global", g["decode"].digest, self.global_scale["decode"]]
        for key in sorted(t.dynamic):
            parts += ["dyn", key, t.dynamic[key]]
        if t.dynamic:
            parts += ["gain", self.dynamic_gain]
        for key in sorted(t.monitors):
            parts += ["mon", key, t.monitors[key], t.mon_probe[key[1]][key[0]].float().cpu()]
        self._decode_env = digest(*parts) if parts else b""
        for group in self.requests.values():
            self.refresh_sigs(group)

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

    # -- the step -------------------------------------------------------------------------

    @property
    def consumers(self) -> dict[str, tuple[SyncConsumer, frozenset[SiteKey]]]:
        return self.observer.consumers

    def plan_step(self, sched: SchedulerOutput) -> StepInterventions | None:
        """This step's intervention indices (`StepPlanner.plan` over the current state)."""
        obs = self.observer
        return self.planner.plan(sched, self.dynamic_gain, bool(obs.consumers), obs.view_sites())

    def observe(self, sched: SchedulerOutput, step: StepInterventions) -> StepReport | None:
        """After the step: route what it read back (`StepObserver.observe`)."""
        return self.observer.observe(sched, step)

    def reads_nothing_back(self) -> bool:
        """No step needs its results on the host before the next is planned: no consumer,
        and no live request with a patch still ahead of it (one whose positions are all
        computed is done). Steering, the dynamic tier and monitors are planned from host
        state alone; captures and read-outs are routed when the step is accepted (an abort
        drops the token the next step computed, as a stop token does, and what that step
        captured for a finished request is dropped with it); gates latch on the device too
        (the latch carry), so the step after one in flight sees what it fired. Such steps
        may overlap (`LLMEngine.step`)."""
        if self.consumers:
            return False
        for group in self.requests.values():
            iv = group.interventions
            if iv is None or iv.patches is None:
                continue
            if iv.patches.last_position >= group.seqs[0].num_computed:  # the first seq's
                return False
        return True

    # -- observability --------------------------------------------------------------------

    def state_digest(self) -> bytes:
        """A checksum of the steering state every rank of a parallel replica must share: the
        tier/monitor environment, pool use and the applied/rejected action counts."""
        t = self.tables
        h = hashlib.blake2b(digest_size=16)
        h.update(self._prefill_env)
        h.update(self._decode_env)
        counts = (
            t.request_pool.used,
            t.dynamic_pool.used,
            sum(self.counters.applied.values()),
            sum(self.counters.rejected.values()),
            self.planner.steps,
        )
        h.update(repr(counts).encode())
        return h.digest()

    def snapshot(self) -> dict:
        """Queue counters, pool use, active tiers and monitors, consumer timing."""
        t, obs = self.tables, self.observer
        return {
            "queue": {
                **self.queue.counters(),
                "applied": dict(self.counters.applied),
                "rejected": dict(self.counters.rejected),
                "last_rejection": dict(self.counters.last_rejection),
            },
            "pools": {
                "per_request": {"used": t.request_pool.used, "size": t.request_pool.size},
                "dynamic": {"used": t.dynamic_pool.used, "size": t.dynamic_pool.size},
                "admissions_waiting_for_rows": self.num_waits_for_rows,
                "probe_columns": t.probe_columns,
                "probes_used": {
                    site_key(*k): p.used for k, p in sorted(t.probe_pools.items()) if p.used
                },
                "admissions_waiting_for_probes": self.num_waits_for_probes,
            },
            "global": {
                phase: sorted(site_key(*k) for k in self.global_rows[phase].vectors)
                for phase in ("prefill", "decode")
            }
            | {"scale": dict(self.global_scale)},
            "dynamic": {
                "gain": self.dynamic_gain,
                "sites": sorted(site_key(*k) for k in t.dynamic),
            },
            "monitors": {site_key(*k): v for k, v in sorted(t.monitors.items())},
            "active_sites": sorted(
                (site_key(*k) for k in t.active_sites()),
                key=lambda s: (int(s.split(".")[0]), SITES.index(s.split(".")[1])),
            ),
            "consumers": {name: tm.as_dict() for name, tm in obs.consumer_timing.items()},
            "probe_aborts": obs.num_probe_aborts,
            # captured tokens, through a decode step's capture block or eager copies
            "captured_tokens": {
                "block": obs.num_block_captures,
                "eager": obs.num_eager_captures,
            },
            "cached_plans": self.planner.num_cached_plans,
            "gate_firing": {
                site_key(*k): {"tokens": n, "fired": obs.gate_fired[k]}
                for k, n in sorted(obs.gate_tokens.items())
            },
        }
