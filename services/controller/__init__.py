"""The async steering controller: engines publish per-token read-outs to a Redis stream, the
controller runs policies over them and writes actions to each replica's bounded Redis queue,
which the engine drains at the top of its next step.

- `engine_link.EngineLink`: the engine's side (publish read-outs, drain actions).
- `controller.Controller`: the consumer-group reader, the policies, the bounded queues.
- `policies`: `scale`, `monitor`, `latch` (pydantic configs).
- `server` / `client`: the `coxswain.v1.Controller` gRPC service; `actor`: the Ray actor.
"""

from services.controller.controller import Controller
from services.controller.engine_link import EngineLink
from services.controller.messages import ReadoutEntry
from services.controller.policies import (
    LatchConfig,
    MonitorConfig,
    ScaleConfig,
    build_policy,
    parse_policy,
)

__all__ = [
    "Controller",
    "EngineLink",
    "LatchConfig",
    "MonitorConfig",
    "ReadoutEntry",
    "ScaleConfig",
    "build_policy",
    "parse_policy",
]
