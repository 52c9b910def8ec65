"""The engine's intervention state: tables, pools, tiers, actions, consumers, sinks.

`InterventionManager` is what `LLMEngine` talks to. It holds the state and splits the work
by lifecycle:

- `RequestAdmission` (`admission.py`): each request's spec resolved when it is added (bad
  input fails there), table rows and probe columns given on admission (a request waits
  while a pool is full: it never runs unsteered), returned when it finishes.
- `SteeringControl` (`control.py`): controller actions queued from any thread and applied
  at the top of each step: global steering, the dynamic tier, monitors, scales, overrides.
- The step itself, here: its two halves are `StepPlanner` (`plan_step.py`, pure: the
  per-token indices of a step from the schedule and this state) and `StepObserver`
  (`observer.py`: after the forward pass, captures to sinks, read-outs to outputs, gate
  firings to latches, the step view to the sync consumers registered here).

Every request's KV signature is kept current: the prefill signature (global prefill
steering + the request's prefill row) and the decode signature (global decode steering,
dynamic tier, monitors, the request's effective decode row, its scale, gain and latches).
Sequences record the signature each position was computed under; the prefix cache folds
them into `extra_keys`, so KV made under one steering is never reused under another.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import torch

from services.common.errors import InvalidRequestError
from services.engine.interventions.actions import ActionQueue
from services.engine.interventions.capture import CaptureSink, InlineCaptureSink
from services.engine.interventions.consumers import ConsumerTiming, SyncConsumer
from services.engine.interventions.control import (
    ActionCounters,
    SteeringControl,
    resolve_global,
)
from services.engine.interventions.host_rows import CaptureArena
from services.engine.interventions.observer import StepObserver, StepReport
from services.engine.interventions.plan_step import StepPlanner
from services.engine.interventions.planner import StepInterventions
from services.engine.interventions.resolve import Resolver, RowContent, SiteKey
from services.engine.interventions.sites import SITES, parse_site, site_key
from services.engine.interventions.tables import SteeringTables
from services.engine.interventions.vectors import VectorRegistry
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import RequestGroup

# `resolve_global` lives in `control.py`; the gateway imports it from here.
__all__ = ["InterventionManager", "resolve_global"]


class InterventionManager(SteeringControl):
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
        capture_arena_bytes: int = 0,
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
        self.counters = ActionCounters()
        arena = None
        if capture_rows and capture_arena_bytes:
            arena = CaptureArena(hidden_size, capture_arena_bytes, pin=device.type == "cuda")
        self.sink: CaptureSink = InlineCaptureSink(arena)
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

    # -- the step -------------------------------------------------------------------------

    @property
    def consumers(self) -> dict[str, tuple[SyncConsumer, frozenset[SiteKey]]]:
        return self.observer.consumers

    def plan_step(self, sched: SchedulerOutput) -> StepInterventions | None:
        """This step's intervention indices (`StepPlanner.plan` over the current state)."""
        obs = self.observer
        plan = self.planner.plan(sched, self.dynamic_gain, bool(obs.consumers), obs.view_sites())
        if plan is not None and plan.capture_block:
            obs.place_block(sched, plan)
        return plan

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
