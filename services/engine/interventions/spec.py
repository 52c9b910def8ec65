"""The request-side schema of interventions: steering, gates, read-outs and capture.

One schema for Python, HTTP and gRPC: pydantic models that a JSON body validates into.
Structure is checked here (names, enums, signs); what depends on the model or on the
engine's vector registry (layer ranges, hidden size, whether a vector name is registered)
is checked when the engine resolves the spec (`resolve.py`).

Identifiers a request gives (vector names, run ids, read-out names) follow one rule,
`check_identifier`: they are stored, quoted back in errors, keyed on in read-outs and the
dashboard, and sent in gRPC metadata, so a newline, an emoji or a 10,000-character name is
refused here, by whichever front the request came through, before any work is done.

A vector value is a JSON float list (or a list of per-layer lists), a packed tensor
`{"dtype", "shape", "data"}` (see `services/common/wire.py`), or the name of a vector in
the engine's registry.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from services.common.errors import InvalidRequestError
from services.engine.interventions.sites import parse_site, tl_hook
from services.patch_store.store import VERSION_SEPARATOR, parse_ref

_IDENTIFIER = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
IDENTIFIER_RULE = "1-128 letters, digits or _ . : / -"


def check_identifier(value: object, what: str) -> str:
    """`value` if it can be an identifier (`IDENTIFIER_RULE`), else InvalidRequestError
    saying why, with `what` (e.g. "vector name") naming the field."""
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"invalid {what}: it must be a string, got {type(value).__name__}"
        )
    if not _IDENTIFIER.fullmatch(value):
        shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
        raise InvalidRequestError(f"invalid {what} {shown!r}: use {IDENTIFIER_RULE}")
    return value


def check_run_id(value: object) -> str:
    """`value` if a run may be stored under it: an identifier, which never holds the patch
    store's version separator (`"<run>@<version>"` names one version of a run)."""
    if isinstance(value, str) and VERSION_SEPARATOR in value:
        raise InvalidRequestError(
            f"invalid run id {value[:40]!r}: {VERSION_SEPARATOR!r} names a version of a run "
            f"('<run>{VERSION_SEPARATOR}<version>'): choose an id without it"
        )
    return check_identifier(value, "run id")


def check_run_ref(value: object) -> str:
    """`value` if it can name a stored run to read: a run id, or one version of it
    (`"<run>@<version>"`, as the patch store parses it)."""
    run_id, _ = parse_ref(value)
    check_identifier(run_id, "run id")
    return value  # type: ignore[return-value]


def _as_value_error(check: Callable[[Any], Any]) -> BeforeValidator:
    """A field validator running `check`, whose InvalidRequestError pydantic reports as the
    field's error (with its location), like every other field's."""

    def validate(value: Any) -> Any:
        try:
            check(value)
        except InvalidRequestError as exc:
            raise ValueError(str(exc)) from None
        return value

    return BeforeValidator(validate)


def _site(value: Any) -> str:
    try:
        return parse_site(value)
    except InvalidRequestError as exc:
        raise ValueError(str(exc)) from None


def _vector_name(value: Any) -> None:
    if isinstance(value, str):  # a vector given by name
        check_identifier(value, "vector name")


def _hook_layer(data: Any, field: str, many: bool) -> Any:
    """A full TransformerLens hook name as `site` (`blocks.3.hook_resid_post`) names the
    layer too: it fills `field` (one layer, or with `many` a list of them) when that is
    absent, and must agree with it when given (never a silently different layer)."""
    hook = tl_hook(data.get("site")) if isinstance(data, dict) else None
    if hook is None:
        return data
    site, layer = hook
    want = [layer] if many else layer
    given = data.get(field)
    if given is not None and given != want:
        raise ValueError(f"site {data['site']!r} names layer {layer}, but {field} is {given!r}")
    return {**data, "site": site, field: want}


Site = Annotated[str, BeforeValidator(_site)]
RunId = Annotated[str, _as_value_error(check_run_id)]
RunRef = Annotated[str, _as_value_error(check_run_ref)]
ReadoutName = Annotated[str, _as_value_error(lambda v: check_identifier(v, "read-out name"))]
# In Python a tensor is accepted too, so callers holding activations skip a list round trip.
VectorValue = Annotated[
    list[float] | list[list[float]] | dict[str, Any] | str | torch.Tensor,
    _as_value_error(_vector_name),
]
Phase = Literal["prefill", "decode", "both"]


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, arbitrary_types_allowed=True
    )


class SteerVector(_Strict):
    """Add `scale · vector` to the residual at `site` of each of `layers`, in `phase`."""

    @model_validator(mode="before")
    @classmethod
    def _hook_name(cls, data: Any) -> Any:
        return _hook_layer(data, "layers", many=True)

    site: Site = "post_block"
    layers: list[Annotated[int, Field(ge=0)]] | None = None  # None: every layer a named vector has
    vector: VectorValue
    scale: float = 1.0
    phase: Phase = "both"


class ProbeCondition(_Strict):
    """`sigmoid(sharpness · (h·probe − threshold)) > 0.5` at one (layer, site)."""

    @model_validator(mode="before")
    @classmethod
    def _hook_name(cls, data: Any) -> Any:
        return _hook_layer(data, "layer", many=False)

    probe: VectorValue
    site: Site = "post_block"
    layer: Annotated[int, Field(ge=0)]
    threshold: float = 0.0
    sharpness: Annotated[float, Field(gt=0)] = 1.0


class GateAdd(_Strict):
    vector: VectorValue
    scale: float = 1.0


class GateAttenuate(_Strict):
    """Remove `scale` × the component along `vector` (default: the gate's own probe)."""

    vector: VectorValue | None = None
    scale: Annotated[float, Field(ge=0)] = 1.0


class GateApply(_Strict):
    add: GateAdd | None = None
    attenuate: GateAttenuate | Annotated[float, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> GateApply:
        if (self.add is None) == (self.attenuate is None):
            raise ValueError("a gate's `apply` needs exactly one of `add` or `attenuate`")
        return self


class Gate(_Strict):
    """A probe-weighted edit at the probe's (layer, site), on decode tokens only.

    On each decode token `apply` is weighted by `sigmoid(sharpness · (h·probe − threshold))`
    (soft; a large sharpness makes it a switch). The gate "fires" when that weight passes
    0.5. `this_token`: every token gets its own weight. `rest_of_request`: once it has
    fired, every later decode token of that sample gets weight 1 (the gate latches).
    """

    when: ProbeCondition
    scope: Literal["this_token", "rest_of_request"] = "this_token"
    apply: GateApply


class SteeringSpec(_Strict):
    """Per-request steering: static vectors, probe-gated vectors, and probe-triggered stops."""

    vectors: list[SteerVector] = []
    gates: list[Gate] = []
    abort_when: list[ProbeCondition] = []

    @model_validator(mode="before")
    @classmethod
    def _single_abort(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("abort_when"), dict):
            data = {**data, "abort_when": [data["abort_when"]]}
        return data

    @property
    def is_empty(self) -> bool:
        return not (self.vectors or self.gates or self.abort_when)


class Readout(_Strict):
    """Report `h·probe` at (layer, site) for every generated token, under `name`."""

    @model_validator(mode="before")
    @classmethod
    def _hook_name(cls, data: Any) -> Any:
        return _hook_layer(data, "layer", many=False)

    probe: VectorValue
    site: Site = "post_block"
    layer: Annotated[int, Field(ge=0)]
    name: ReadoutName | None = None


CapturePositions = Literal["last_prompt", "all_prompt", "all_generated", "all"]


class CaptureSpec(_Strict):
    """Which pristine residuals to return: `{site: [layers] | "all"}` at `positions`."""

    sites: dict[Site, list[Annotated[int, Field(ge=0)]] | Literal["all"]]
    positions: CapturePositions | list[Annotated[int, Field(ge=0)]] = "last_prompt"
    # "inline": returned with the output; "patch_store": also written to the engine's
    # patch-source store as run `run` when the request finishes (a patch source for later).
    sink: Literal["inline", "patch_store"] = "inline"
    run: RunId | None = None
    # The returned rows' dtype: bfloat16 halves what a long per-token capture holds and sends.
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="before")
    @classmethod
    def _hook_names(cls, data: Any) -> Any:
        """`{"blocks.3.hook_resid_post": "all"}` (or `[3]`) captures layer 3 of post_block;
        several names of one site merge into one list of layers."""
        sites = data.get("sites") if isinstance(data, dict) else None
        if not isinstance(sites, dict) or not any(tl_hook(k) for k in sites):
            return data
        merged: dict[Any, Any] = {}
        for name, layers in sites.items():
            hook = tl_hook(name)
            if hook is not None:
                site, layer = hook
                if layers not in ("all", [layer]):
                    raise ValueError(
                        f"site {name!r} names layer {layer}, but its layers are {layers!r}"
                    )
                name, layers = site, [layer]
            else:
                with contextlib.suppress(InvalidRequestError):  # the Site validator says why
                    name = parse_site(name)
            before = merged.get(name)
            if "all" in (before, layers):
                merged[name] = "all"
            elif isinstance(before, list) and isinstance(layers, list):
                merged[name] = sorted({*before, *layers})
            else:
                merged[name] = layers
        return {**data, "sites": merged}

    @model_validator(mode="after")
    def _not_empty(self) -> CaptureSpec:
        if not self.sites:
            raise ValueError("capture.sites is empty: name at least one site")
        if isinstance(self.positions, list) and not self.positions:
            raise ValueError("capture.positions is an empty list")
        if (self.sink == "patch_store") != (self.run is not None):
            raise ValueError("capture.run names the run with sink 'patch_store' (and only then)")
        return self


class PatchSource(_Strict):
    """Where a patch's activation comes from: a stored run's row, a vector, or zeros."""

    run: RunRef | None = None
    position: Annotated[int, Field(ge=0)] | None = None  # the run's position (with `run`)
    vector: VectorValue | None = None
    zeros: bool | None = None

    @model_validator(mode="after")
    def _one_of(self) -> PatchSource:
        given = [self.run is not None, self.vector is not None, bool(self.zeros)]
        if sum(given) != 1:
            raise ValueError("a patch source needs exactly one of run, vector or zeros: true")
        if self.run is not None and self.position is None:
            raise ValueError("a run source needs the run's `position`")
        if self.run is None and self.position is not None:
            raise ValueError("`position` only goes with a run source")
        return self


class PatchEntry(_Strict):
    """Set the residual at (layer, site, position) to `(1 − α)·h + α·source` (α = 1: replace)."""

    @model_validator(mode="before")
    @classmethod
    def _hook_name(cls, data: Any) -> Any:
        return _hook_layer(data, "layer", many=False)

    layer: Annotated[int, Field(ge=0)]
    site: Site = "post_block"
    position: Annotated[int, Field(ge=0)]
    alpha: float = 1.0
    source: PatchSource


def _parse(model: type[BaseModel], value: Any, what: str) -> Any:
    if value is None or isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or what}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidRequestError(f"invalid {what}: {problems}") from None


def parse_steering(value: Any) -> SteeringSpec | None:
    spec = _parse(SteeringSpec, value, "steering")
    return None if spec is None or spec.is_empty else spec


def parse_global_steering(value: Any) -> SteeringSpec:
    """A spec to set as global steering: as `parse_steering`, but an empty one is refused.
    Setting it would clear global steering while looking like a set; clearing is its own
    call, so a client whose spec lost its vectors on the way hears about it."""
    spec = _parse(SteeringSpec, value, "global steering")
    if spec is None or spec.is_empty:
        raise InvalidRequestError(
            "the global steering spec is empty (no vectors, gates or abort_when): to clear "
            "global steering, call POST /v1/steering/clear (gRPC: Steering.ClearGlobal)"
        )
    return spec


def parse_capture(value: Any) -> CaptureSpec | None:
    return _parse(CaptureSpec, value, "capture")


def parse_readouts(value: Any) -> list[Readout]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise InvalidRequestError("invalid readouts: expected a list of {probe, site, layer}")
    return [_parse(Readout, v, f"readouts[{i}]") for i, v in enumerate(value)]


def parse_patch(value: Any) -> list[PatchEntry]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(
            "invalid patch: expected a list of {layer, site, position, alpha, source}"
        )
    return [_parse(PatchEntry, v, f"patch[{i}]") for i, v in enumerate(value)]
