"""Bodies of the Coxswain routes (steering control, the vector registry, sweeps) and of
errors, as pydantic models so the OpenAPI document shows them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.engine.interventions.sites import tl_hook
from services.engine.interventions.spec import RunRef
from services.engine.sweep import SweepSpec
from services.gateway.openai_api import PackedTensor, check_texts


class _Body(BaseModel):
    """Request bodies: unknown fields are an error, no NaN/Inf, strict types (no `"1"` for
    1, no `"true"` for true)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    code: str | None = Field(None, description="The Coxswain error class, e.g. RunNotFoundError.")


class ErrorBody(BaseModel):
    """Every error response, OpenAI-style."""

    error: ErrorDetail


# -- vectors ---------------------------------------------------------------------------------

VectorValue = list[float] | list[list[float]] | dict[str, Any]


class VectorPut(_Body):
    """`PUT /v1/vectors/{name}`."""

    value: VectorValue = Field(
        description="`[H]` (every layer), `[num_layers, H]` (row i for layer i), "
        "`{layer: [H]}`, or a packed {dtype, shape, data} tensor."
    )
    overwrite: bool = Field(False, description="Replace an existing vector of that name.")


class VectorInfo(BaseModel):
    name: str
    hidden_size: int
    layers: list[int] | None = Field(description="Per-layer entries: the layers; else null.")
    source: str = Field(description="'api' or the file it was imported from.")


class VectorData(VectorInfo):
    value: PackedTensor = Field(description="`[H]`, or `[len(layers), H]` in `layers` order.")


class VectorRemoved(BaseModel):
    """What `DELETE /v1/vectors/{name}` removed (its metadata, where the backend has it)."""

    model_config = ConfigDict(extra="allow")

    name: str


class VectorList(BaseModel):
    data: list[VectorInfo]


# -- patching --------------------------------------------------------------------------------


class SweepRequest(_Body):
    """`POST /v1/patch_sweep`: a causal-tracing sweep (see `services/engine/sweep.py`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_texts(data)

    corrupt_prompt: str | list[Annotated[int, Field(ge=0)]]
    answer_token: int | str = Field(description="A token id, or text that is exactly one token.")
    clean_prompt: str | list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="The clean prompt (captured inline); or give source_run."
    )
    source_run: RunRef | None = Field(
        None, description="A stored clean run in the patch store (`<run>` or `<run>@<version>`)."
    )
    layers: list[Annotated[int, Field(ge=0)]] | Literal["all"] = "all"
    positions: list[Annotated[int, Field(ge=0)] | str] | Literal["all_prompt"] = Field(
        "all_prompt", description="Corrupt-prompt positions, or text spans of it."
    )
    sites: list[str] = Field(
        ["post_block"],
        description="Ours or TransformerLens names; `blocks.<L>.hook_resid_*` sweeps layer L.",
    )
    alpha: float = 1.0
    foil_token: int | str | None = None
    metric: Literal["logprob", "logit_diff", "recovered"] = "logprob"

    @model_validator(mode="after")
    def _hook_names(self) -> SweepRequest:
        """Full TransformerLens names (`blocks.3.hook_resid_post`) name their layer: the grid
        is sites × layers, so they must all name one layer, which `layers` is (or becomes)."""
        hooks = [h for h in map(tl_hook, self.sites) if h is not None]
        if not hooks:
            return self
        named = sorted({layer for _, layer in hooks})
        if len(named) > 1 or self.layers not in ("all", named):
            raise ValueError(
                f"sites {self.sites} name layers {named} but layers is {self.layers!r}: a sweep "
                "is a grid of sites × layers, so name the sites and list the layers"
            )
        self.sites = [hook[0] if (hook := tl_hook(s)) else s for s in self.sites]
        self.layers = named
        return self

    def to_spec(self) -> SweepSpec:
        return SweepSpec(**self.model_dump())


class PatchSourceDropped(BaseModel):
    run: str
    dropped: bool
    bytes_freed: int


# -- service state -----------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    steps: int
    engine_links: int | None = Field(
        None, description="a cluster's gateway: engine replicas it streams from directly"
    )


class State(BaseModel):
    """A snapshot whose keys follow the engine's (see the route's description)."""

    model_config = ConfigDict(extra="allow")


class ClusterView(BaseModel):
    """A cluster gateway's view of admin state: one engine replica's, and the cluster
    store's. Every key is always there: while the store does not answer, `version` and
    `replicas` are null and `store_error` says why (the replica's view still shows)."""

    model_config = ConfigDict(extra="allow")

    replica: str | None = Field(None, description="The engine replica that answered.")
    applied_version: int | None = Field(None, description="The version it has applied.")
    epoch: str | None = None
    rejected: dict[str, str] = Field({}, description="Entries it refused, with the reason.")
    last_error: str | None = Field(None, description="Its last reconciliation failure.")
    version: int | None = Field(
        None, description="The cluster store's recorded version (null: see store_error)."
    )
    replicas: dict[str, Any] | None = Field(
        None, description="Every live replica's report (null: see store_error)."
    )
    store_error: str | None = Field(None, description="Why the cluster store did not answer.")


class SteeringState(State):
    """`State` of the steering routes, with a cluster gateway's admin view."""

    cluster: ClusterView | None = Field(None, description="A cluster's gateway only.")
