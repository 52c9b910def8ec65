"""The sync controller tier: Python consumers called inside the engine after every step.

A consumer declares the (layer, site)s it reads; after each step it gets a `StepView` with
the pristine residuals there for every token of the step and each request's span, and
may return actions. Actions go through the engine's action queue, so they apply at the
top of the next step like any other controller's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.engine.interventions.actions import Action


@dataclass(frozen=True)
class RequestSpan:
    """One sample's tokens in this step: rows [start, start + num_tokens) of each tensor."""

    request_id: str
    sample: int
    start: int
    num_tokens: int
    first_position: int
    num_prefill_tokens: int  # tokens of the span that are prompt (prefill) tokens

    @property
    def phase(self) -> str:
        if self.num_prefill_tokens == self.num_tokens:
            return "prefill"
        return "decode" if self.num_prefill_tokens == 0 else "mixed"


@dataclass
class StepView:
    step: int
    activations: dict[tuple[int, str], torch.Tensor]  # (layer, site) -> [T, H] pristine
    requests: list[RequestSpan]


class SyncConsumer(Protocol):
    name: str
    sites: dict[str, list[int]]  # {site: [layers]} this consumer reads

    def on_step(self, view: StepView) -> list[Action] | None: ...


@dataclass
class ConsumerTiming:
    calls: int = 0
    total_ms: float = 0.0
    last_ms: float = 0.0
    max_ms: float = 0.0
    errors: int = 0
    last_error: str | None = field(default=None)

    def record(self, ms: float) -> None:
        self.calls += 1
        self.total_ms += ms
        self.last_ms = ms
        self.max_ms = max(self.max_ms, ms)

    def as_dict(self) -> dict:
        mean = self.total_ms / self.calls if self.calls else 0.0
        return {
            "calls": self.calls,
            "mean_ms": round(mean, 4),
            "last_ms": round(self.last_ms, 4),
            "max_ms": round(self.max_ms, 4),
            "errors": self.errors,
            "last_error": self.last_error,
        }
