"""Conversions between the controller's gRPC messages and its Python values.

Policies arrive as messages and leave as pydantic configs (`parse_policy` checks them, as it
checks JSON): optional fields left unset take the config's defaults. Vectors travel as typed
`Tensor`s or registry names; inside a config they are kept in the packed JSON form
(`services.common.wire`), so configs stay plain JSON that compares, logs and pickles
(`LatchConfig` packs the tensors of its steering spec itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.wire import decode_vector, pack_tensor, unpack_tensor
from services.controller.policies import (
    LatchConfig,
    MonitorConfig,
    ScaleConfig,
    parse_policy,
)
from services.engine.interventions.spec import parse_steering
from services.gateway.grpc_convert import steering_from_proto, steering_to_proto
from services.patch_store.convert import tensor_from_proto, tensor_to_proto
from services.proto.coxswain.v1 import controller_pb2 as pb
from services.proto.coxswain.v1 import engine_pb2 as engine_pb

PolicyConfig = ScaleConfig | MonitorConfig | LatchConfig


def _optional(msg: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: getattr(msg, f) for f in fields if msg.HasField(f)}


def _vector_to_proto(value: Any, what: str) -> engine_pb.VectorValue:
    if isinstance(value, str):
        return engine_pb.VectorValue(name=value)
    if isinstance(value, Mapping):
        return engine_pb.VectorValue(tensor=tensor_to_proto(unpack_tensor(dict(value))))
    return engine_pb.VectorValue(tensor=tensor_to_proto(decode_vector(value, name=what)))


def _vector_from_proto(msg: engine_pb.VectorValue, what: str) -> Any:
    kind = msg.WhichOneof("value")
    if kind == "name":
        return msg.name
    if kind == "tensor":
        return pack_tensor(tensor_from_proto(msg.tensor, what=what))
    raise InvalidRequestError(f"{what} is missing: give a tensor or a registered name")


def policy_from_proto(msg: pb.Policy) -> PolicyConfig:
    """The checked config of a policy message (InvalidRequestError names what is wrong)."""
    kind = msg.WhichOneof("kind")
    what = f"policy {msg.name!r}"
    body: dict[str, Any] = {"name": msg.name, "readout": msg.readout, "kind": kind}
    if kind == "scale":
        s = msg.scale
        body |= {"target": s.target, "k": s.k}
        body |= {"tier": s.tier} if s.tier else {}
        body |= _optional(
            s,
            (
                "offset",
                "min_gain",
                "max_gain",
                "per_request",
                "initial_gain",
                "deadband",
                "min_interval_tokens",
                "max_tracked",
            ),
        )
    elif kind == "monitor":
        m = msg.monitor
        body |= {"fire_threshold": m.fire_threshold}
        body |= _optional(m, ("window", "min_tokens", "install_rate", "clear_rate"))
        if not m.HasField("monitor"):
            raise InvalidRequestError(f"{what}: monitor.monitor is missing")
        spec = m.monitor
        body["monitor"] = {
            "layer": spec.layer,
            "probe": _vector_from_proto(spec.probe, f"{what}: monitor.probe"),
            "threshold": spec.threshold,
            "gate_rows": spec.gate_rows,
            **({"site": spec.site} if spec.site else {}),
            **_optional(spec, ("sharpness",)),
        }
        if m.HasField("dynamic"):
            d = m.dynamic
            body["dynamic"] = {
                "layers": list(d.layers),
                "vector": _vector_from_proto(d.vector, f"{what}: dynamic.vector"),
                **({"site": d.site} if d.site else {}),
                **_optional(d, ("scale",)),
            }
    elif kind == "latch":
        la = msg.latch
        body |= {"threshold": la.threshold, "steering": steering_from_proto(la.steering)}
        body |= _optional(la, ("max_conversations", "max_requests"))
    else:
        raise InvalidRequestError(f"{what}: give one of scale, monitor or latch")
    return parse_policy(body)


def policy_to_proto(cfg: PolicyConfig) -> pb.Policy:
    """The message of a policy config (every field set, defaults included)."""
    msg = pb.Policy(name=cfg.name, readout=cfg.readout)
    what = f"policy {cfg.name!r}"
    if isinstance(cfg, ScaleConfig):
        msg.scale.CopyFrom(
            pb.ScalePolicy(
                target=cfg.target,
                k=cfg.k,
                offset=cfg.offset,
                min_gain=cfg.min_gain,
                max_gain=cfg.max_gain,
                tier=cfg.tier,
                per_request=cfg.per_request,
                initial_gain=cfg.initial_gain,
                deadband=cfg.deadband,
                min_interval_tokens=cfg.min_interval_tokens,
                max_tracked=cfg.max_tracked,
            )
        )
    elif isinstance(cfg, MonitorConfig):
        m, d = cfg.monitor, cfg.dynamic
        policy = pb.MonitorPolicy(
            fire_threshold=cfg.fire_threshold,
            window=cfg.window,
            min_tokens=cfg.min_tokens,
            install_rate=cfg.install_rate,
            clear_rate=cfg.clear_rate,
            monitor=pb.MonitorSpec(
                site=m.site,
                layer=m.layer,
                probe=_vector_to_proto(m.probe, f"{what}: monitor.probe"),
                threshold=m.threshold,
                sharpness=m.sharpness,
                gate_rows=m.gate_rows,
            ),
        )
        if d is not None:
            policy.dynamic.CopyFrom(
                pb.DynamicSpec(
                    site=d.site,
                    layers=d.layers,
                    vector=_vector_to_proto(d.vector, f"{what}: dynamic.vector"),
                    scale=d.scale,
                )
            )
        msg.monitor.CopyFrom(policy)
    else:
        spec = parse_steering(cfg.steering)
        assert spec is not None  # LatchConfig refuses an empty spec
        msg.latch.CopyFrom(
            pb.LatchPolicy(
                threshold=cfg.threshold,
                steering=steering_to_proto(spec),
                max_conversations=cfg.max_conversations,
                max_requests=cfg.max_requests,
            )
        )
    return msg


def policies_to_proto(configs: list[PolicyConfig]) -> pb.PolicyList:
    return pb.PolicyList(policies=[policy_to_proto(c) for c in configs])


_POLICY_STATUS_FIELDS = ("name", "kind", "entries", "actions", "errors", "last_error")


def status_to_proto(status: dict[str, Any]) -> pb.ControllerStatus:
    """`Controller.status()` as its message."""
    policies = []
    for p in status["policies"]:
        counters = {
            k: int(v)
            for k, v in p.items()
            if k not in _POLICY_STATUS_FIELDS and isinstance(v, int) and not isinstance(v, bool)
        }
        policies.append(
            pb.PolicyStatus(
                name=p["name"],
                kind=p["kind"],
                entries=p["entries"],
                actions=p["actions"],
                errors=p["errors"],
                last_error=p["last_error"] or "",
                counters=counters,
                installed_on=p.get("installed_on", []),
            )
        )
    scalars = {
        k: status[k]
        for k in (
            "running",
            "ready",
            "connected",
            "stream",
            "group",
            "consumer",
            "processed",
            "reclaimed",
            "malformed",
            "redis_errors",
            "reconnects",
            "stream_resets",
            "lost_entries",
            "latched_conversations",
            "policies_loaded",
        )
    }
    return pb.ControllerStatus(
        **scalars,
        **{k: status[k] for k in ("lag", "pending") if status[k] is not None},
        actions_written=status["actions_written"],
        actions_dropped=status["actions_dropped"],
        last_error=status["last_error"] or "",
        last_rejection=status["last_rejection"] or "",
        policies=policies,
    )


def status_from_proto(msg: pb.ControllerStatus) -> dict[str, Any]:
    """The status message as the dict `Controller.status()` returns."""
    out: dict[str, Any] = {
        f.name: getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
        if f.name not in ("policies", "actions_written", "actions_dropped", "lag", "pending")
    }
    out["lag"] = msg.lag if msg.HasField("lag") else None
    out["pending"] = msg.pending if msg.HasField("pending") else None
    out["last_error"] = msg.last_error or None
    out["last_rejection"] = msg.last_rejection or None
    out["actions_written"] = dict(msg.actions_written)
    out["actions_dropped"] = dict(msg.actions_dropped)
    out["policies"] = [
        {
            "name": p.name,
            "kind": p.kind,
            "entries": p.entries,
            "actions": p.actions,
            "errors": p.errors,
            "last_error": p.last_error or None,
            **dict(p.counters),
            **({"installed_on": list(p.installed_on)} if p.kind == "monitor" else {}),
        }
        for p in msg.policies
    ]
    return out
