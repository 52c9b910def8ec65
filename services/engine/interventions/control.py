"""Steering that changes while requests run: the action queue, global steering, the
dynamic tier, monitors, scales and per-request overrides.

`SteeringControl` is the part of `InterventionManager` that controllers and the API
drive. Actions are queued from any thread (`submit`) and applied on the step thread at
the top of a step (`apply_actions`); a bad action is counted rejected, never fatal to the
step. Whatever an action changes that KV depends on is folded into the environment
digests here (`_env_changed`), and every live request is re-signed, so KV made under one
steering is never reused under another.

The state it uses is made in `InterventionManager.__init__`; the annotations below name it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import InvalidRequestError, NotFoundError, RequestNotFoundError
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
from services.engine.interventions.admission import RequestAdmission, RequestInterventions
from services.engine.interventions.resolve import ResolvedSteering, Resolver, RowContent, digest
from services.engine.interventions.sites import parse_site
from services.engine.interventions.spec import parse_steering
from services.engine.interventions.tables import GLOBAL_DECODE_ROW, GLOBAL_PREFILL_ROW, RowPool
from services.engine.sequence import RequestGroup

log = logging.getLogger(__name__)


def _finite(value: float, what: str) -> None:
    if not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
        raise InvalidRequestError(f"{what} must be a finite number, got {value!r}")


@dataclass
class ActionCounters:
    """Actions applied and rejected, by source, and each source's last rejection."""

    applied: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    last_rejection: dict[str, str] = field(default_factory=dict)


def resolve_global(resolver: Resolver, spec: Any) -> ResolvedSteering | None:
    """Engine-wide steering (vectors only) resolved by `resolver`, or InvalidRequestError."""
    parsed = parse_steering(spec)
    if parsed is not None and (parsed.gates or parsed.abort_when):
        raise InvalidRequestError("global steering takes `vectors` only (no gates/aborts)")
    return resolver.steering(parsed) if parsed else None


class SteeringControl(RequestAdmission):
    """Queue and apply steering actions; keep the KV environment digests current (a base
    of `InterventionManager`)."""

    queue: ActionQueue
    counters: ActionCounters
    global_rows: dict[str, RowContent]
    global_scale: dict[str, float]
    dynamic_gain: float

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

    # -- KV environment ---------------------------------------------------------------------

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
