"""The engine's intervention state: tables, pools, tiers, actions, consumers, sinks.

`InterventionManager` is what `LLMEngine` talks to. It resolves each request's spec when
the request is added (bad input fails there), gives admitted requests their table rows
(a request waits while its pool is full: it never runs unsteered), applies controller
actions at the top of each step, plans each step's per-token tensors, and after the
forward pass routes captures to sinks, read-outs to outputs, gate firings to latches,
and the step view to sync consumers.

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
    RequestSpan,
    StepView,
    SyncConsumer,
)
from services.engine.interventions.planner import SteerTokens, StepInterventions
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
from services.engine.scheduler import ScheduledSeq, SchedulerOutput
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
class StepReport:
    """What the forward pass observed, per scheduled sequence (aligned with the schedule)."""

    readouts: list[dict[str, float] | None]
    aborts: list[str | None]  # the name of the abort_when probe that fired, if any


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
        # name -> (consumer, the (layer, site)s it reads), checked once when added
        self.consumers: dict[str, tuple[SyncConsumer, frozenset[SiteKey]]] = {}
        self.consumer_timing: dict[str, ConsumerTiming] = {}
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
        self.num_probe_aborts = 0
        # Declarative gates, per (layer, site): decode tokens they were evaluated on, and
        # how many of those they fired on (the dashboard's firing rates).
        self.gate_tokens: Counter[SiteKey] = Counter()
        self.gate_fired: Counter[SiteKey] = Counter()
        self.steps = 0
        self._prefill_env = b""
        self._decode_env = b""
        # Steady decode replans nothing: the last all-decode step's plan, by (epoch, the
        # sequences in batch order). The epoch moves whenever something a plan reads
        # changes: an admission, a release, an applied action, a latch, a gate change.
        self._epoch = 0
        self._plan_cache: tuple[tuple, tuple] | None = None
        self.num_cached_plans = 0  # steps planned from it

    # -- requests -------------------------------------------------------------------------

    def prepare(self, group: RequestGroup) -> None:
        """Resolve the request's spec (InvalidRequestError on bad input; nothing changes)."""
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
        self._refresh_sigs(group)

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
        self._epoch += 1
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
        self._refresh_sigs(seq.group)
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
        self._epoch += 1
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
        result = self.sink.result(group.request_id)
        iv = group.interventions
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
            self._epoch += 1
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
            self._refresh_sigs(group)
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
            self._refresh_sigs(group)

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
        self._refresh_sigs(group)

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
        self.consumers[name] = (consumer, keys)
        self.consumer_timing[name] = ConsumerTiming()

    def remove_consumer(self, name: str) -> None:
        self.consumers.pop(name, None)
        self.consumer_timing.pop(name, None)

    # -- KV signatures ----------------------------------------------------------------------

    def _env_changed(self) -> None:
        self._epoch += 1
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
            self._refresh_sigs(group)

    def _refresh_sigs(self, group: RequestGroup) -> None:
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

    def reads_nothing_back(self) -> bool:
        """No step needs its results on the host before the next is planned: no consumer,
        and no live request with a capture or patches. Steering, the dynamic tier and
        monitors are planned from host state alone; read-outs and abort probes are taken
        when the step is accepted (an abort drops the token the next step computed, as a
        stop token does); gates latch on the device too (the latch carry), so the step
        after one in flight sees what it fired. Such steps may overlap (`LLMEngine.step`)."""
        if self.consumers:
            return False
        for group in self.requests.values():
            iv = group.interventions
            if iv is not None and (iv.capture is not None or iv.patches is not None):
                return False
        return True

    def plan(self, sched: SchedulerOutput) -> StepInterventions | None:
        """Per-token tensors for this step, or None when nothing intervenes in it."""
        self.steps += 1
        decode_only = True
        for s in sched.scheduled:
            seq = s.seq
            seq.record_kv_sigs(s.start, s.num_tokens)
            decode_only = decode_only and s.num_tokens == 1 and s.start >= seq.num_prompt_tokens
        kernel_sites = self.tables.active_sites()
        key = None
        if decode_only and kernel_sites and not self.consumers:
            key = (self._epoch, *(s.seq.seq_id for s in sched.scheduled))
            cached = self._plan_cache
            if cached is not None and cached[0] == key:
                self.num_cached_plans += 1
                steer_tokens, readers, gated, read_index = cached[1]
                return StepInterventions(
                    self.tables,
                    kernel_sites,
                    steer_tokens,
                    readers=readers,
                    gated=gated,
                    read_index=read_index,
                )
        capture_rows: dict[SiteKey, list[int]] = {}
        capture_meta: dict[SiteKey, list[tuple[str, list[int]]]] = {}
        readers: list[tuple[int, RequestInterventions]] = []
        gated: list[tuple[int, RowContent]] = []
        patch_rows: dict[SiteKey, list[tuple[int, torch.Tensor, float]]] = {}
        row0 = 0
        for i, s in enumerate(sched.scheduled):
            iv = s.seq.group.interventions
            if iv is None:
                row0 += s.num_tokens
                continue
            if iv.capture is not None:
                self._plan_capture(row0, s, iv, capture_rows, capture_meta)
            if iv.probes and s.samples:  # probes read the residual a token is sampled from
                readers.append((i, iv))
            if iv.decode_content.gates:
                gated.append((i, iv.decode_content))
            if iv.patches is not None:
                end = s.start + s.num_tokens
                for key, entries in iv.patches.by_site.items():
                    for pos, target, alpha in entries:
                        if s.start <= pos < end:  # row = token offset + (position − start)
                            patch_rows.setdefault(key, []).append(
                                (row0 + pos - s.start, target, alpha)
                            )
            row0 += s.num_tokens
        if not (kernel_sites or self.consumers or capture_rows or patch_rows):
            return None
        # only the kernel reads them, so a step without kernel sites plans none
        steer_tokens = self._plan_tokens(sched, bool(readers)) if kernel_sites else None

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

        plan = StepInterventions(
            tables=self.tables,
            kernel_sites=kernel_sites,
            steer_tokens=steer_tokens,
            capture_index={k: tensor(v, torch.long) for k, v in capture_rows.items()},
            capture_meta=capture_meta,
            readers=readers,
            gated=gated,
            patch_index={
                k: (
                    tensor([r for r, _, _ in v], torch.long),
                    torch.stack([t for _, t, _ in v]),
                    tensor([a for _, _, a in v], torch.float32),
                )
                for k, v in patch_rows.items()
            },
            view_sites={k for _, keys in self.consumers.values() for k in keys},
        )
        # Cached unless planning itself moved the epoch (a gate met a sequence).
        if key is not None and not (capture_rows or patch_rows) and key[0] == self._epoch:
            self._plan_cache = (key, (steer_tokens, readers, gated, plan.read_index))
        return plan

    def _plan_tokens(self, sched: SchedulerOutput, reads: bool) -> SteerTokens:
        """Each token's steering row, latched bits, decode flag, dynamic gain, read-out row
        and latch carry (`reads`: some request reads out this step)."""
        rows: list[int] = []
        latched: list[int] = []
        decode: list[float] = []
        gain: list[float] = []
        carry: list[bool] = []
        read_rows = np.full(sched.num_tokens, -1, np.int32) if reads else None
        dyn = self.dynamic_gain if self.tables.dynamic else 0.0
        row0 = 0
        for i, s in enumerate(sched.scheduled):
            seq, n = s.seq, s.num_tokens
            iv = seq.group.interventions
            n_pre = min(n, seq.num_prompt_tokens - s.start)
            if n_pre > 0:  # prompt tokens (a prefill chunk, or a recompute)
                rows += [iv.prefill_row if iv else ZERO_ROW] * n_pre
                latched += [0] * n_pre
                decode += [0.0] * n_pre
                gain += [0.0] * n_pre
                carry += [False] * n_pre
            n_dec = n - max(n_pre, 0)
            if n_dec > 0:
                rows += [iv.effective_decode_row if iv else ZERO_ROW] * n_dec
                latched += [seq.latched] * n_dec
                decode += [1.0] * n_dec
                gain += [dyn * iv.dyn_gain if iv else dyn] * n_dec
                # The bits the step before fired (still on the device if it is in flight)
                # latch only under the gates they fired for.
                content = iv.decode_content if iv is not None else None
                carry += [content is not None and seq.gate_content is content] * n_dec
                gates = content if content is not None and content.gates else None
                if seq.gate_content is not gates:
                    seq.gate_content = gates
                    self._epoch += 1  # the next step's carry differs from this one's
            if read_rows is not None and iv is not None and iv.probes and s.samples:
                read_rows[row0 + n - 1] = i
            row0 += n
        return SteerTokens(
            rows=np.asarray(rows, np.int32),
            latched=np.asarray(latched, np.int32),
            decode=np.asarray(decode, np.float32),
            gain=np.asarray(gain, np.float32),
            read_rows=read_rows if read_rows is not None else np.full(row0, -1, np.int32),
            carry=np.asarray(carry, np.bool_),
        )

    @staticmethod
    def _plan_capture(
        row0: int,
        s: ScheduledSeq,
        iv: RequestInterventions,
        capture_rows: dict[SiteKey, list[int]],
        capture_meta: dict[SiteKey, list[tuple[str, list[int]]]],
    ) -> None:
        """Rows this sequence's captures copy, at each (layer, site)."""
        seq, n = s.seq, s.num_tokens
        assert iv.capture is not None
        if seq.index != 0:
            return
        P = seq.num_prompt_tokens
        positions = [p for p in range(s.start, s.start + n) if iv.capture.wants(p, P)]
        if positions:
            rows = [row0 + p - s.start for p in positions]
            for key in iv.capture.sites:
                capture_rows.setdefault(key, []).extend(rows)
                capture_meta.setdefault(key, []).append((seq.group.request_id, positions))

    def after_forward(self, sched: SchedulerOutput, step: StepInterventions) -> StepReport:
        """Route this step's captures, read-outs and gate firings; returns the read-outs."""
        if not (step.capture_meta or step.readers or step.gated or self.consumers):
            return None  # steering alone: nothing comes back
        n = len(sched.scheduled)
        report = StepReport([None] * n, [None] * n)
        spans = self._spans(sched)
        for key, rows in step.captured.items():
            rows = rows.float().cpu()  # [sum of positions, H], in capture_meta's order
            name, at = site_key(*key), 0
            for request_id, positions in step.capture_meta[key]:
                self.sink.write(request_id, name, positions, rows[at : at + len(positions)])
                at += len(positions)
        if step.readers:
            values, at = step.probe_values(), 0
            for i, iv in step.readers:
                k, end = len(iv.readouts), at + len(iv.probes)
                if k:
                    reads = values[at : at + k]
                    report.readouts[i] = dict(zip(iv.readout_names, reads, strict=True))
                for probe, value in zip(iv.probes[k:], values[at + k : end], strict=True):
                    if probe.fires(value):
                        report.aborts[i] = probe.name
                        self.num_probe_aborts += 1
                        break
                at = end
        if step.gated:
            self._latch(sched, step, spans)
        if self.consumers:
            self._run_consumers(sched, step, spans)
        return report

    def _latch(
        self, sched: SchedulerOutput, step: StepInterventions, spans: list[tuple[int, int]]
    ) -> None:
        """Latch the gate bits each gated request fired on its decode tokens, and count them
        for the firing rates (per distinct content, not per request)."""
        assert step.fired is not None, "collect() gives every gated step its fired bits"
        fired = step.fired.tolist()
        by_content: dict[int, tuple[RowContent, list[int]]] = {}
        for i, content in step.gated:
            s = sched.scheduled[i]
            seq = s.seq
            iv = seq.group.interventions
            if seq.is_finished or iv is None or iv.decode_content is not content:
                continue  # its gates changed since this step was planned: the bits mean others
            start, count = spans[i]
            # Gates act on decode tokens only: the span's tail past the prompt.
            n_dec = count - max(0, min(count, seq.num_prompt_tokens - s.start))
            if n_dec <= 0:
                continue
            tokens = fired[start + count - n_dec : start + count]
            bits = 0
            for f in tokens:
                bits |= f
            new = bits & content.latching_bits & ~seq.latched
            if new:
                seq.latched |= new  # n > 1 samples latch apart
                self._epoch += 1
                # Positions computed since (a step in flight) latched these bits on the
                # device already: their KV signatures say so now.
                seq.resign_kv_from(s.start + count)
            by_content.setdefault(id(content), (content, []))[1].extend(tokens)
        for content, tokens in by_content.values():
            for key, gate in content.gates.items():
                self.gate_tokens[key] += len(tokens)
                self.gate_fired[key] += sum((f >> gate.bit) & 1 for f in tokens)

    @staticmethod
    def _spans(sched: SchedulerOutput) -> list[tuple[int, int]]:
        spans, at = [], 0
        for s in sched.scheduled:
            spans.append((at, s.num_tokens))
            at += s.num_tokens
        return spans

    def _run_consumers(
        self, sched: SchedulerOutput, step: StepInterventions, spans: list[tuple[int, int]]
    ) -> None:
        requests = [
            RequestSpan(
                request_id=s.seq.group.request_id,
                sample=s.seq.index,
                start=start,
                num_tokens=count,
                first_position=s.start,
                num_prefill_tokens=max(0, min(count, s.seq.num_prompt_tokens - s.start)),
            )
            for s, (start, count) in zip(sched.scheduled, spans, strict=True)
        ]
        for name, (c, keys) in self.consumers.items():
            timing = self.consumer_timing[name]
            view = StepView(
                step=self.steps,
                activations={k: step.view[k] for k in keys},
                requests=requests,
            )
            t0 = time.perf_counter()
            try:
                actions = list(c.on_step(view) or [])
            except Exception as exc:  # a consumer's bug must not stop serving
                timing.errors += 1
                timing.last_error = repr(exc)
                log.exception("sync consumer %s failed", name)
                actions = []
            timing.record((time.perf_counter() - t0) * 1e3)
            for action in actions:
                if isinstance(action, ACTION_TYPES):
                    self.queue.put(action, name)
                else:
                    timing.errors += 1
                    timing.last_error = f"returned a non-action: {action!r}"

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
            self.steps,
        )
        h.update(repr(counts).encode())
        return h.digest()

    def snapshot(self) -> dict:
        """Queue counters, pool use, active tiers and monitors, consumer timing."""
        t = self.tables
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
            "consumers": {name: tm.as_dict() for name, tm in self.consumer_timing.items()},
            "probe_aborts": self.num_probe_aborts,
            "cached_plans": self.num_cached_plans,
            "gate_firing": {
                site_key(*k): {"tokens": n, "fired": self.gate_fired[k]}
                for k, n in sorted(self.gate_tokens.items())
            },
        }
