"""The Serve application's configuration: `AppArgs`, the `args` of the Serve config
(`import_path: services.gateway.serve_app:build_app`), validated by every replica and every
front-end process as it starts. Everything the application does is configured here, never in
code; unknown keys are an error.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.auth import ApiKeys
from services.common.errors import CoxswainError
from services.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES


class AppArgs(BaseModel):
    """The `args` of the Serve config (`import_path: services.gateway.serve_app:build_app`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny", description='a local HF checkpoint directory, or "tiny"')
    model_id: str | None = None
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    device: str = "auto"
    dtype: str = "auto"
    engine: dict[str, Any] = Field(default_factory=dict, description="more EngineConfig fields")
    num_gpus_per_rank: float = Field(
        0,
        ge=0,
        description="GPUs Ray gives each rank of an engine replica (the Serve replica itself "
        "when tp * pp == 1); see engine_resources",
    )
    api_keys_file: str | None = Field(
        None,
        description="name:scope:secret lines, read by each replica as it starts (a mounted "
        "Secret: restarting the replicas picks up an edited one)",
    )
    api_keys: str | None = Field(
        None,
        description="the keys themselves, as name:scope:secret lines, instead of a file: "
        "`coxswain up` passes its cluster's, so that a restarted replica needs no file",
        repr=False,
    )
    redis_url: str | None = Field(
        None,
        validate_default=True,
        description="redis://:PASSWORD@host:port/db; unset: $COXSWAIN_REDIS_URL (a Secret)",
    )
    patch_store_budget_gb: float = Field(1.0, gt=0)
    admin_apply_timeout_s: float = Field(
        10.0,
        gt=0,
        description="how long an admin write waits for every live engine replica to apply "
        "it before answering 503 with the replicas' versions",
    )
    controller_grpc_port: int | None = Field(50071, description="controller gRPC; null: off")
    allow_no_auth: bool = Field(
        False, description="serve with no API keys configured (local development only)"
    )
    engine_replicas: int | None = Field(
        None, ge=1, description="fix the Engine replica count (else the Serve config's)"
    )
    grpc_port: int | None = Field(50051, description="engine gRPC front; null: off")
    bind_host: str = Field(
        "127.0.0.1",
        description="interface of the engine, controller and patch-store gRPC servers",
    )
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES,
        ge=0,
        description="largest HTTP request body (413 beyond, before reading)",
    )
    body_timeout_s: float = Field(
        DEFAULT_BODY_TIMEOUT_S,
        gt=0,
        description="how long after its headers an HTTP request's body may take to arrive "
        "(408 beyond, and the connection closed)",
    )
    http_port: int | None = Field(
        None,
        description="serve HTTP on this port from front-end processes of the Gateway replica, "
        "each linked to every engine replica, instead of through Serve's proxy (coxswain up "
        "does); null: Serve's proxy only",
    )
    http_workers: int = Field(2, ge=1, description="front-end processes with http_port")
    backend_secret: str | None = Field(
        None,
        description="hex key of the links between the gateway and the engine replicas' delta "
        "servers (build_app draws one when unset)",
        repr=False,
    )

    @field_validator("engine")
    @classmethod
    def _engine_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Checked where the application is built, not when a replica's engine fails to start.
        from services.engine.config import check_settings

        check_settings(value, "engine", {"device": "args.device", "dtype": "args.dtype"})
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url_from_env(cls, value: str | None) -> str | None:
        # A password belongs in a Secret, not in the Serve config: deployments put the URL
        # in each pod's environment, which every replica reads when it validates its args.
        return value or os.environ.get("COXSWAIN_REDIS_URL") or None

    @model_validator(mode="after")
    def _gpus_from_ray(self) -> AppArgs:
        # Ray shows a rank only the GPUs it gave it, as cuda:0...: a rank left without one
        # would share whatever GPU it sees with every other such rank.
        if self.num_gpus_per_rank and self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device}: Ray gives each rank its own GPU, which it sees as "
                "cuda:0; use device cuda"
            )
        if self.tp * self.pp > 1 and self.device.startswith("cuda") and not self.num_gpus_per_rank:
            raise ValueError(
                "tp * pp > 1 on cuda needs num_gpus_per_rank: 1, so that Ray gives each rank "
                "actor a GPU of its own"
            )
        return self

    def keys(self) -> ApiKeys:
        """The keys every front end and shared actor of the application checks."""
        if self.api_keys is not None:
            return ApiKeys.parse(self.api_keys)
        return ApiKeys.from_env(self.api_keys_file)

    def device_type(self) -> str:
        """The engine replicas' device type, "cuda" or "cpu", as far as the application can
        tell without seeing their hosts: device cuda, or auto with GPUs asked of Ray."""
        if self.device.startswith("cuda") or (self.device == "auto" and self.num_gpus_per_rank):
            return "cuda"
        return "cpu"

    def backend_key(self) -> bytes:
        """The key of the links between the gateway and the engine replicas' delta servers."""
        if not self.backend_secret:
            raise CoxswainError("backend_secret is unset: build the application with build_app")
        return bytes.fromhex(self.backend_secret)
