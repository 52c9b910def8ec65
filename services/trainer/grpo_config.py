"""A GRPO run's configuration: `GRPOConfig` (what `coxswain train grpo --config FILE.yaml`
validates, field by field, with the checks that tie fields together) and `validate_config`,
which turns a bad one into an `InvalidRequestError` naming every bad field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.errors import InvalidRequestError

Arm = Literal[
    "none", "erase", "route", "activation", "placebo", "kept-ablated", "route-dropout", "route2",
    "expand-route-ablate",
]  # fmt: skip
# Arms that move δS-basis gradient into δS_q, so need the same-basis quarantine ("svd").
SAME_BASIS_ARMS = ("route", "placebo", "route-dropout")
# Arms that flag by the activation gate (Arm B's direction, per rollout or per token).
ACTIVATION_ARMS = ("activation", "route2", "expand-route-ablate")
# Arms that route as route2 does: a LoRA quarantine always in the forward, absorbing, the
# kept part detach-routed (expand-route-ablate adds quarantine rank and coherence steps).
ROUTE2_ARMS = ("route2", "expand-route-ablate")


class GRPOConfig(BaseModel):
    """Everything a run needs; `coxswain train grpo --config FILE.yaml` validates this."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the base checkpoint directory (see trainer/pretrain.py)")
    env: str = "addition"
    env_args: dict[str, Any] = Field(default_factory=dict)
    steps: int = Field(40, ge=1)
    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    max_new_tokens: int | None = Field(None, ge=1, description="default: the env's + 2")
    temperature: float = Field(1.0, gt=0)
    # optimisation
    optimizer: Literal["adamw", "routed_adamw", "muon"] = Field(
        "adamw",
        description="routed_adamw: δS and δS_q share one second moment (optim.RoutedAdamW)",
    )
    lr: float = Field(0.05, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    advantage: Literal["std", "none"] = "std"  # "none": Dr.GRPO's r − mean
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_const"] = "token_mean"
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.2, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    # adapters
    rank: int = Field(8, ge=1)
    targets: list[str] = Field(default_factory=lambda: ["*.o_proj", "*.down_proj"])
    kept_init: float = 0.0
    quarantine_init: float = 0.0
    quarantine: Literal["svd", "lora"] = Field(
        "svd", description="lora: a separate quarantine LoRA B_q·A_q instead of δS_q"
    )
    lora_rank: int = Field(4, ge=1)
    quarantine_extra_rank: int | None = Field(
        None,
        ge=1,
        description="arm expand-route-ablate (design d): the LoRA quarantine's rank beyond the "
        "kept part's, i.e. its rank is rank + this (added capacity for what is routed; "
        "lora_rank is then not set by hand)",
    )
    # routing
    arm: Arm = "none"
    tau: float = 0.0
    gate: Literal["scale", "shift"] = Field(
        "shift", description="Arm A gate: scale divides δS back out (needs |δS| > 0)"
    )
    random_flags: float | None = Field(
        None,
        ge=0,
        le=1,
        description="a rate-matched placebo: flag each rollout at random with this "
        "probability instead of by the arm's direction (an arm's measured flag rate)",
    )
    oracle_flags: bool = Field(
        False,
        description="UPPER BOUND ONLY: flag each rollout by its eval-only hack label instead "
        "of the arm's direction. The one setting that lets a label reach the update (read "
        "outside the training scope, as a flag); never a result about routing itself",
    )
    route_split: Literal["partition", "share", "recentre"] = Field(
        "partition",
        description="Arm A: partition gives δS_q the flagged rollouts' summed gradient; "
        "share gives it, per coordinate, the part of the step's total they pushed for "
        "(routing.apply_gradient_mask). recentre (every routed arm, Arm B too): δS gets "
        "the GRPO gradient of the unflagged rollouts alone, advantages re-centred among "
        "them, and the quarantine the rest of the step's total. kept-ablated: the kept "
        "part's advantages in its forward without the quarantine (partition: the unflagged "
        "rollouts' as sampled; recentre: re-centred among them; share does not apply)",
    )
    quarantine_dropout: float | None = Field(
        None,
        ge=0,
        le=1,
        description="arm route-dropout: the probability that a step drops the quarantine "
        "from the forward (trains as deployed; that step's quarantine share is discarded)",
    )
    oracle_flip: float | None = Field(
        None,
        ge=0,
        le=1,
        description="with oracle_flags, a noisy oracle: each step flips this share of the "
        "oracle's flags (floor(share·B + u) rollouts, u uniform, seeded by the run's seed and "
        "the step; gates.flip_flags), logged per step as oracle_flipped",
    )
    gate_calibration: Literal["none", "quantile", "midpoint"] = Field(
        "none",
        description="re-estimate the gate's τ from the current policy, without labels "
        "(gates.py): quantile flags the top gate_quantile of each step's own scores; "
        "midpoint sets τ to the midpoint of the hack pairs' mean scores (hacking and clean) "
        "under the current policy. Either every calibrate_every steps; none keeps tau fixed. "
        "Rollout-level gates deciding by their own scores only (no random_flags, oracle_flags "
        "or per-token gate; midpoint not with the residual probe)",
    )
    gate_quantile: float | None = Field(
        None, gt=0, lt=1, description="gate_calibration quantile: the share of rollouts flagged"
    )
    calibrate_every: int = Field(
        1, ge=1, description="gate_calibration: steps between re-estimates of τ"
    )
    hack_pairs: int = Field(32, ge=2, description="pairs for the hack direction")
    hack_pairs_from: Literal["contrastive", "persona"] = Field(
        "contrastive",
        description="contrastive: the env's (hacking, clean) completion pairs; persona: the "
        "base's own greedy answers to prompts asking for the shortcut vs honest work, read "
        "after the plain prompt (no oracle solution, no label; envs with personas only)",
    )
    probe_layer: int | None = Field(
        None,
        ge=0,
        description="extract a residual-stream hack probe from the hack pairs at this layer "
        "(probe.py): registered in the rollout engine as 'hack', written to hack_probe.json, "
        "its monitor AUROC reported at each evaluation",
    )
    probe_site: Literal["pre_attn", "post_attn", "post_block"] = "post_block"
    activation_space: Literal["adapter", "residual"] = Field(
        "adapter",
        description="Arm B's flags: adapter (pooled x·V against the adapter-space direction) "
        "or residual (the hack probe's read-outs while sampling: one direction at train "
        "and serve time; needs probe_layer and in-process rollouts)",
    )
    activation_granularity: Literal["rollout", "token"] = Field(
        "rollout",
        description="Arm B and route2 per rollout (flag whole rollouts) or per token, the "
        "spec's form: at each adapter, where(cos(x·V, v) > tau, kept.detach(), kept) "
        "(route_split does not apply); route2's random_flags then flag tokens",
    )
    coherence_steps: int = Field(
        0,
        ge=0,
        description="arm expand-route-ablate: after the last step, K label-free steps that "
        "fine-tune the kept part alone, quarantine ablated, on the deployed policy's own "
        "samples the training grader rewards (coherence.py), then one more evaluation "
        "(0: none)",
    )
    # evaluation, logging, checkpoints
    eval_every: int = Field(10, ge=1)
    eval_prompts: int = Field(64, ge=1)
    rollout_workers: int = Field(
        0, ge=0, description="Ray actors generating and grading rollouts (0: in-process)"
    )
    rollout_mode: Literal["sync", "async"] = Field(
        "sync",
        description="async: the workers stream rollouts through Redis while the trainer trains",
    )
    redis_url: str | None = Field(None, description="Redis for async rollouts")
    max_staleness: int = Field(
        1, ge=0, description="async: drop groups sampled more than this many steps ago"
    )
    max_queued_groups: int | None = Field(
        None, ge=1, description="async: producers pause at this backlog (default 2 steps' worth)"
    )
    seed: int = 0
    out_dir: str = "runs/grpo"
    device: str = "cpu"

    @property
    def activation_gate(self) -> bool:
        """Whether the arm flags by Arm B's activation gate (`activation`, `route2`)."""
        return self.arm in ACTIVATION_ARMS

    @property
    def quarantine_rank(self) -> int:
        """The LoRA quarantine's rank: `rank + quarantine_extra_rank` for expand-route-ablate,
        else `lora_rank`."""
        if self.quarantine_extra_rank is not None:
            return self.rank + self.quarantine_extra_rank
        return self.lora_rank

    @model_validator(mode="after")
    def _consistent(self) -> GRPOConfig:
        if self.arm in ROUTE2_ARMS and (
            self.quarantine != "lora" or self.route_split != "partition"
        ):
            raise ValueError(
                f"arm {self.arm!r} keeps its quarantine in a basis of its own, always in the "
                "forward: set quarantine 'lora' (and leave route_split 'partition'; the kept "
                f"part is detach-routed in the forward); got quarantine {self.quarantine!r}, "
                f"route_split {self.route_split!r}"
            )
        era = self.arm == "expand-route-ablate"
        if era != (self.quarantine_extra_rank is not None):
            raise ValueError(
                "quarantine_extra_rank (the LoRA quarantine's rank beyond the kept rank) goes "
                f"with arm 'expand-route-ablate' and only with it; got arm {self.arm!r}, "
                f"quarantine_extra_rank {self.quarantine_extra_rank!r}"
            )
        if era and "lora_rank" in self.model_fields_set:
            raise ValueError(
                "arm 'expand-route-ablate' sizes its quarantine as rank + "
                "quarantine_extra_rank: leave lora_rank unset"
            )
        if self.coherence_steps and not era:
            raise ValueError(
                "coherence_steps fine-tune the kept part after the quarantine is ablated: "
                f"they go with arm 'expand-route-ablate', got arm {self.arm!r}"
            )
        if self.quarantine == "lora" and self.arm in SAME_BASIS_ARMS:
            raise ValueError(
                f"arm {self.arm!r} moves δS-basis gradient into δS_q and needs quarantine "
                "'svd'; with a LoRA quarantine use arm 'route2' (route in the LoRA's own basis), "
                "'expand-route-ablate', 'erase', 'activation', 'kept-ablated' or 'none'"
            )
        if (self.arm == "route-dropout") != (self.quarantine_dropout is not None):
            raise ValueError(
                "quarantine_dropout (a probability in [0, 1]) goes with arm 'route-dropout' "
                f"and only with it; got arm {self.arm!r}, quarantine_dropout "
                f"{self.quarantine_dropout!r}"
            )
        if self.arm == "kept-ablated" and self.route_split == "share":
            raise ValueError(
                "arm 'kept-ablated' takes the kept update in another forward than the "
                "quarantine's, so there is no step total to share: use route_split "
                "'partition' or 'recentre'"
            )
        if self.random_flags is not None and self.arm == "none":
            raise ValueError("random_flags replaces a routed arm's decision: pick an arm")
        if self.oracle_flags and (self.arm == "none" or self.random_flags is not None):
            raise ValueError(
                "oracle_flags replaces a routed arm's decision with the labels: pick an arm "
                "and leave random_flags unset"
            )
        if self.oracle_flip is not None and not self.oracle_flags:
            raise ValueError("oracle_flip flips the oracle's flags: set oracle_flags")
        if (self.gate_calibration == "quantile") != (self.gate_quantile is not None):
            raise ValueError(
                "gate_quantile (the share flagged) goes with gate_calibration 'quantile' and "
                f"only with it; got {self.gate_calibration!r}, gate_quantile {self.gate_quantile!r}"
            )
        if self.gate_calibration != "none" and (
            self.arm == "none"
            or self.random_flags is not None
            or self.oracle_flags
            or self.activation_granularity == "token"
            or (self.gate_calibration == "midpoint" and self.activation_space == "residual")
        ):
            raise ValueError(
                "gate_calibration re-estimates the τ of a routed arm that flags rollouts by its "
                "own scores: pick an arm, leave random_flags and oracle_flags unset, flag per "
                "rollout, and (midpoint) score in adapter space"
            )
        if self.quarantine == "lora" and self.optimizer == "routed_adamw":
            raise ValueError("routed_adamw pairs δS with δS_q: it needs quarantine 'svd'")
        if self.activation_space == "residual" and (
            self.probe_layer is None or self.arm not in ACTIVATION_ARMS
        ):
            raise ValueError(
                "activation_space 'residual' flags Arm B ('activation') or route2 rollouts by "
                "the hack probe's read-outs: set probe_layer"
            )
        if self.activation_granularity == "token" and (
            self.arm not in ACTIVATION_ARMS
            or self.activation_space != "adapter"
            or (self.random_flags is not None and self.arm not in ROUTE2_ARMS)
            or self.oracle_flags
        ):
            raise ValueError(
                "activation_granularity 'token' is Arm B ('activation') or route2 in adapter "
                "space, flagging tokens by its own direction (route2 also by random_flags, "
                "per token; oracle_flags label rollouts, so their bound is the per-rollout run)"
            )
        if self.probe_layer is not None and self.rollout_workers:
            raise ValueError("probe_layer reads the probe in the in-process rollout engine")
        if self.rollout_mode == "async" and (self.rollout_workers < 1 or not self.redis_url):
            raise ValueError(
                "rollout_mode 'async' needs rollout_workers >= 1 and a redis_url "
                "(producers stream rollouts through Redis)"
            )
        return self


def validate_config(config: dict | GRPOConfig, source: str = "") -> GRPOConfig:
    """`config` validated, or an `InvalidRequestError` naming every bad field (and `source`,
    e.g. the YAML file it came from)."""
    if isinstance(config, GRPOConfig):
        return config
    try:
        return GRPOConfig.model_validate(config)
    except ValidationError as e:
        where = f" {source}" if source else ""
        raise InvalidRequestError(f"invalid GRPO config{where}:\n{e}") from None
