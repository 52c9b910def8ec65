"""The async controller's policies: read-out entries in, engine actions out.

Each policy is configured by a pydantic model (JSON over gRPC or from a file) and keeps its
own bounded state. `on_readout(entry)` returns the actions for the replica that published
the entry; the controller writes them to that replica's queue.

- `scale`: `gain = clip(offset + k·(score − target), min_gain, max_gain)` for a request's
  decode row (tier `request`) or its dynamic-tier gain (tier `dynamic`; with
  `per_request=False` the replica's whole dynamic tier). An update goes out only when the
  gain moved by at least `deadband` and `min_interval_tokens` passed since the last one.
- `monitor`: the fraction of recent tokens (per replica) whose score passed
  `fire_threshold`; at `install_rate` it installs an in-graph monitor (and optionally a
  dynamic-tier vector for it to gate), at `clear_rate` it clears them again.
- `latch`: once a token's score passes `threshold` in a conversation, the firing request
  and every later request of that conversation get `steering` as a decode override. Its
  latched conversations are what the controller saves in Redis (`take_changes`, `restore`),
  so a restarted controller keeps steering them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from services.common.errors import InvalidRequestError
from services.common.wire import unpack_tensor
from services.controller.messages import ReadoutEntry, jsonable
from services.engine.interventions.actions import (
    Action,
    RequestSteeringOverride,
    SteeringMonitorUpdate,
    SteeringScaleUpdate,
    SteeringVectorUpdate,
)
from services.engine.interventions.sites import parse_site
from services.engine.interventions.spec import parse_steering

log = logging.getLogger(__name__)


def _site(value: Any) -> str:
    try:
        return parse_site(value)
    except InvalidRequestError as e:
        raise ValueError(str(e)) from None


def _vector(value: Any) -> Any:
    """A JSON vector value: a float list, a packed tensor (checked now) or a registry name.
    Its length is the engine's to check, when the action applies."""
    if isinstance(value, dict):
        try:
            unpack_tensor(value)
        except InvalidRequestError as e:
            raise ValueError(str(e)) from None
    return value


Site = Annotated[str, BeforeValidator(_site)]
Vector = Annotated[list[float] | dict[str, Any] | str, BeforeValidator(_vector)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: Name
    readout: Annotated[str, Field(min_length=1)]  # the read-out name the policy watches


class ScaleConfig(_Config):
    """Set a gain from a read-out score (see the module docstring)."""

    kind: Literal["scale"] = "scale"
    target: float
    k: float  # gain per unit of (score − target)
    offset: float = 0.0  # the gain at score == target
    min_gain: float = 0.0
    max_gain: float = 1.0
    tier: Literal["request", "dynamic"] = "request"
    per_request: bool = True  # False: the replica's dynamic-tier gain (tier "dynamic" only)
    initial_gain: float = 1.0  # the engine's gain before any update
    deadband: Annotated[float, Field(ge=0)] = 0.05
    min_interval_tokens: Annotated[int, Field(ge=1)] = 4
    max_tracked: Annotated[int, Field(ge=1)] = 10_000  # requests with remembered gains (LRU)

    @model_validator(mode="after")
    def _consistent(self) -> ScaleConfig:
        if self.min_gain > self.max_gain:
            raise ValueError("min_gain must be <= max_gain")
        if not self.per_request and self.tier != "dynamic":
            raise ValueError(
                "per_request=false needs tier 'dynamic' (a request row has no replica-wide gain)"
            )
        return self


class MonitorSpec(BaseModel):
    """The in-graph monitor to install: `sigmoid(sharpness · (h·probe − threshold))`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    site: Site = "post_block"
    layer: Annotated[int, Field(ge=0)]
    probe: Vector
    threshold: float = 0.0
    sharpness: Annotated[float, Field(gt=0)] = 1.0
    gate_rows: bool = False


class DynamicSpec(BaseModel):
    """A dynamic-tier vector set beside the monitor (which gates it) and cleared with it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    site: Site = "post_block"
    layers: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    vector: Vector
    scale: float = 1.0


class MonitorConfig(_Config):
    """Install/clear an in-graph monitor from a read-out's firing rate (per replica)."""

    kind: Literal["monitor"] = "monitor"
    fire_threshold: float  # a token "fires" when its score is above this
    window: Annotated[int, Field(ge=1)] = 64  # recent tokens the rate is over
    min_tokens: Annotated[int, Field(ge=1)] = 16  # tokens needed before any decision
    install_rate: Annotated[float, Field(gt=0, le=1)] = 0.25
    clear_rate: Annotated[float, Field(ge=0, lt=1)] = 0.05
    monitor: MonitorSpec
    dynamic: DynamicSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MonitorConfig:
        if self.clear_rate >= self.install_rate:
            raise ValueError("clear_rate must be below install_rate (the gap is the hysteresis)")
        if self.min_tokens > self.window:
            raise ValueError("min_tokens must be <= window")
        return self


class LatchConfig(_Config):
    """Keep steering a conversation once a probe fired in it."""

    kind: Literal["latch"] = "latch"
    threshold: float  # fires when a token's score is above this
    steering: dict[str, Any]  # a decode-only SteeringSpec (vectors, gates), kept canonical
    max_conversations: Annotated[int, Field(ge=1)] = 10_000  # latched conversations (LRU)
    max_requests: Annotated[int, Field(ge=1)] = 100_000  # overridden requests remembered

    @field_validator("steering")
    @classmethod
    def _decode_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            spec = parse_steering(value)
        except InvalidRequestError as e:
            raise ValueError(str(e)) from None
        if spec is None:
            raise ValueError("steering is empty: a latch needs vectors or gates to apply")
        if spec.abort_when:
            raise ValueError("abort_when cannot be latched (an override steers, it never stops)")
        if any(v.phase == "prefill" for v in spec.vectors):
            raise ValueError("a latch overrides decode steering: phase='prefill' never applies")
        # canonical (defaults filled, tensors packed): equal specs give equal configs
        return jsonable(spec.model_dump())


PolicyConfig = Annotated[ScaleConfig | MonitorConfig | LatchConfig, Field(discriminator="kind")]
_POLICY_ADAPTER: TypeAdapter[ScaleConfig | MonitorConfig | LatchConfig] = TypeAdapter(PolicyConfig)


def parse_policy(value: Any) -> ScaleConfig | MonitorConfig | LatchConfig:
    """A policy config from its dict (JSON) form; InvalidRequestError names every problem."""
    if isinstance(value, ScaleConfig | MonitorConfig | LatchConfig):
        return value
    try:
        return _POLICY_ADAPTER.validate_python(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'policy'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidRequestError(f"invalid policy: {problems}") from None


# -- policies -----------------------------------------------------------------------------


class Policy:
    """A configured policy with its counters. Subclasses implement `on_readout`."""

    kind: str = ""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.entries = 0  # entries that carried this policy's read-out (or concerned it)
        self.actions = 0
        self.errors = 0
        self.last_error: str | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def on_readout(self, entry: ReadoutEntry) -> list[Action]:
        raise NotImplementedError

    def process(self, entry: ReadoutEntry) -> list[Action]:
        """`on_readout` with counting; a policy's failure is counted, never raised, so one
        bad policy (or entry) cannot stall the stream for the others."""
        try:
            actions = self.on_readout(entry)
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("policy %s failed on entry %s", self.name, entry.stream_id)
            return []
        self.actions += len(actions)
        return actions

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "entries": self.entries,
            "actions": self.actions,
            "errors": self.errors,
            "last_error": self.last_error,
        }


@dataclass
class _Gain:
    value: float
    updated_at: int | None = None  # the tick of the last update sent


class ScalePolicy(Policy):
    kind = "scale"
    config: ScaleConfig

    def __init__(self, config: ScaleConfig) -> None:
        super().__init__(config)
        self._gains: OrderedDict[tuple[str, ...], _Gain] = OrderedDict()
        self._ticks: dict[str, int] = {}  # per replica, when not per request

    def on_readout(self, entry: ReadoutEntry) -> list[Action]:
        c = self.config
        key = (entry.replica, entry.request_id) if c.per_request else (entry.replica,)
        if entry.finished and c.per_request:
            self._gains.pop(key, None)
            return []
        score = entry.scores.get(c.readout)
        if score is None or entry.sample != 0:  # one gain per request: its first sample's
            return []
        self.entries += 1
        if c.per_request:
            tick = entry.token or 0
        else:
            tick = self._ticks[entry.replica] = self._ticks.get(entry.replica, -1) + 1
        state = self._gains.get(key) or _Gain(c.initial_gain)
        self._gains[key] = state
        self._gains.move_to_end(key)
        if len(self._gains) > c.max_tracked:
            self._gains.popitem(last=False)
        gain = min(c.max_gain, max(c.min_gain, c.offset + c.k * (score - c.target)))
        if gain == state.value or abs(gain - state.value) < c.deadband:
            return []
        if state.updated_at is not None and tick - state.updated_at < c.min_interval_tokens:
            return []
        state.value, state.updated_at = gain, tick
        request_id = entry.request_id if c.per_request else None
        return [SteeringScaleUpdate(gain, tier=c.tier, request_id=request_id)]

    def status(self) -> dict[str, Any]:
        return {**super().status(), "tracked": len(self._gains)}


@dataclass
class _Window:
    fired: deque[bool]
    installed: bool = False


class MonitorPolicy(Policy):
    kind = "monitor"
    config: MonitorConfig

    def __init__(self, config: MonitorConfig) -> None:
        super().__init__(config)
        self._replicas: dict[str, _Window] = {}
        self.installs = self.clears = 0

    def on_readout(self, entry: ReadoutEntry) -> list[Action]:
        c = self.config
        score = entry.scores.get(c.readout)
        if score is None:
            return []
        self.entries += 1
        w = self._replicas.setdefault(entry.replica, _Window(deque(maxlen=c.window)))
        w.fired.append(score > c.fire_threshold)
        if len(w.fired) < c.min_tokens:
            return []
        rate = sum(w.fired) / len(w.fired)
        if not w.installed and rate >= c.install_rate:
            w.installed = True
            w.fired.clear()  # decide the next change on evidence gathered under this one
            self.installs += 1
            return self._install()
        if w.installed and rate <= c.clear_rate:
            w.installed = False
            w.fired.clear()
            self.clears += 1
            return self._clear()
        return []

    def _install(self) -> list[Action]:
        m, d = self.config.monitor, self.config.dynamic
        actions: list[Action] = []
        if d is not None:
            actions.append(SteeringVectorUpdate(d.site, list(d.layers), d.vector, d.scale))
        actions.append(
            SteeringMonitorUpdate(m.site, m.layer, m.probe, m.threshold, m.sharpness, m.gate_rows)
        )
        return actions

    def _clear(self) -> list[Action]:
        m, d = self.config.monitor, self.config.dynamic
        actions: list[Action] = [SteeringMonitorUpdate(m.site, m.layer, None)]
        if d is not None:
            actions.append(SteeringVectorUpdate(d.site, list(d.layers), None))
        return actions

    def status(self) -> dict[str, Any]:
        installed = sorted(r for r, w in self._replicas.items() if w.installed)
        return {
            **super().status(),
            "installs": self.installs,
            "clears": self.clears,
            "installed_on": installed,
        }


class LatchPolicy(Policy):
    kind = "latch"
    config: LatchConfig

    def __init__(self, config: LatchConfig) -> None:
        super().__init__(config)
        self._latched: OrderedDict[str, None] = OrderedDict()  # conversation ids, LRU
        self._overridden: OrderedDict[tuple[str, str], None] = OrderedDict()  # (replica, rid)
        self.fired = self.evictions = 0
        # Since the last `take_changes`: conversations (re)latched, in LRU order, and evicted.
        self._touched: OrderedDict[str, None] = OrderedDict()
        self._evicted: list[str] = []

    @property
    def latched(self) -> int:
        return len(self._latched)

    def latched_conversations(self) -> list[str]:
        """The latched conversations, least recently latched first."""
        return list(self._latched)

    def restore(self, conversations: list[str]) -> None:
        """Latch `conversations` (least recently latched first), as saved by a previous life."""
        for conv in conversations[-self.config.max_conversations :]:
            self._latched[conv] = None
            self._latched.move_to_end(conv)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """(conversations latched or touched, conversations evicted) since the last call,
        for the controller to save before it acknowledges the entries that caused them."""
        touched, evicted = list(self._touched), self._evicted
        self._touched, self._evicted = OrderedDict(), []
        return touched, evicted

    def is_latched(self, conversation_id: str) -> bool:
        return conversation_id in self._latched

    def on_readout(self, entry: ReadoutEntry) -> list[Action]:
        c, conv = self.config, entry.conversation_id
        score = entry.scores.get(c.readout)
        fired = score is not None and score > c.threshold
        latched = conv is not None and conv in self._latched
        if score is not None or latched:
            self.entries += 1
        if fired:
            self.fired += 1
        if conv is not None and (fired or latched):
            self._latched[conv] = None
            self._latched.move_to_end(conv)
            self._touched[conv] = None
            self._touched.move_to_end(conv)
            if len(self._latched) > c.max_conversations:
                gone, _ = self._latched.popitem(last=False)
                self._touched.pop(gone, None)
                self._evicted.append(gone)
                self.evictions += 1
        key = (entry.replica, entry.request_id)
        if entry.finished:  # the conversation stays latched; the request is done
            self._overridden.pop(key, None)
            return []
        if key in self._overridden or not (fired or latched):
            return []
        self._overridden[key] = None
        if len(self._overridden) > c.max_requests:
            self._overridden.popitem(last=False)
        return [RequestSteeringOverride(entry.request_id, c.steering)]

    def status(self) -> dict[str, Any]:
        return {
            **super().status(),
            "fired": self.fired,
            "latched_conversations": len(self._latched),
            "evictions": self.evictions,
        }


_POLICY_CLASSES: dict[str, type[Policy]] = {
    "scale": ScalePolicy,
    "monitor": MonitorPolicy,
    "latch": LatchPolicy,
}


def build_policy(config: Any) -> Policy:
    """A fresh policy (empty state) from its config or the config's dict form."""
    cfg = parse_policy(config)
    return _POLICY_CLASSES[cfg.kind](cfg)  # type: ignore[arg-type]
