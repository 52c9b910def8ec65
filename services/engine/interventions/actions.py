"""The controller's vocabulary, and the bounded queue that carries it into the engine.

Actions apply at the top of the engine step after they are queued: exactly one step of
latency. The queue never blocks a producer or the step: when full it drops the newest
action and counts the drop against its source. The Redis transport (async tier) feeds
the same interface.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Literal

Tier = Literal["global_prefill", "global_decode", "dynamic", "request"]


@dataclass(frozen=True)
class SteeringVectorUpdate:
    """Set (or with `vector=None` clear) the dynamic tier's vector at `site` of `layers`."""

    site: str
    layers: list[int]
    vector: Any | None  # a vector value (float list, packed tensor or registry name)
    scale: float = 1.0


@dataclass(frozen=True)
class RequestSteeringOverride:
    """Replace a running request's decode steering with `steering` (None: back to its own).

    The override takes a row from the dynamic-override pool; prefill is never changed.
    """

    request_id: str
    steering: Any | None  # a SteeringSpec or its dict form


@dataclass(frozen=True)
class SteeringScaleUpdate:
    """Set a gain. `tier="request"` scales the request's decode row (copied first if shared);
    `tier="dynamic"` with a `request_id` sets that request's dynamic-tier gain, without one
    the tier's gain; `global_prefill`/`global_decode` scale the global rows."""

    scale: float
    tier: Tier = "request"
    request_id: str | None = None


@dataclass(frozen=True)
class SteeringMonitorUpdate:
    """Install (or with `probe=None` clear) the in-graph monitor at (layer, site).

    The monitor `sigmoid(sharpness · (h·probe − threshold))` multiplies the dynamic tier's
    gain on decode tokens, and with `gate_rows` each request's own decode row too.
    """

    site: str
    layer: int
    probe: Any | None
    threshold: float = 0.0
    sharpness: float = 1.0
    gate_rows: bool = False


@dataclass(frozen=True)
class GlobalSteeringUpdate:
    """Replace the engine-wide steering with `steering` (vectors only; None clears it)."""

    steering: Any | None


Action = (
    SteeringVectorUpdate
    | RequestSteeringOverride
    | SteeringScaleUpdate
    | SteeringMonitorUpdate
    | GlobalSteeringUpdate
)
ACTION_TYPES = (
    SteeringVectorUpdate,
    RequestSteeringOverride,
    SteeringScaleUpdate,
    SteeringMonitorUpdate,
    GlobalSteeringUpdate,
)


class ActionQueue:
    """A bounded, thread-safe FIFO of (source, action); `put` never blocks."""

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise ValueError("the action queue needs a capacity of at least 1")
        self.capacity = capacity
        self._items: deque[tuple[str, Action]] = deque()
        self._lock = threading.Lock()
        self.enqueued: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def put(self, action: Action, source: str = "api") -> bool:
        """Queue an action; False (and counted as dropped) when the queue is full."""
        with self._lock:
            if len(self._items) >= self.capacity:
                self.dropped[source] += 1
                return False
            self._items.append((source, action))
            self.enqueued[source] += 1
            return True

    def counters(self) -> dict:
        with self._lock:
            return {
                "capacity": self.capacity,
                "depth": len(self._items),
                "enqueued": dict(self.enqueued),
                "dropped": dict(self.dropped),
            }

    def drain(self) -> list[tuple[str, Action]]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)
