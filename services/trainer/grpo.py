"""GRPO with gradient routing: rollouts from the engine, gradients through the trainer.

One step:
1. weight sync: the adapters' δ vectors go to the rollout engines (`load_adapter`; async:
   published to Redis for the producers to pull);
2. rollouts: `prompts_per_step` prompts × `group_size` samples under the trained policy
   (kept + quarantine), with the sampled tokens' logprobs (the old policy), graded where
   they were generated (async: groups within `max_staleness` versions, from the stream);
3. rewards: the environment's (gameable) grader, seen through `TrainingView` only, inside a
   `training_scope()` so that reading an oracle label there fails loudly;
4. the GRPO loss over the rollouts' completions (group advantages, clipped ratio, k3 KL to
   the base model = adapters disabled), and a backward routed by the configured arm:
   - `none`: vanilla GRPO (the kept δS learns everything);
   - `erase` / `route` (Arm A): per-rollout gradients from one backward through gates;
     rollouts whose gradient points along the hack direction (cos > τ) lose their share
     (`erase`) or hand it to the quarantine δS_q (`route`);
   - `activation` (Arm B): rollouts whose pooled adapter-space activations project on the
     activation hack direction above τ train only the quarantine;
   - `placebo`: `route` with a random direction of the same shape;
   - `kept-ablated` (design b): flags as Arm A's, but the kept δS takes its update in a
     forward with the quarantine ablated (as deployed), from the unflagged rollouts only,
     so it is trained to stand alone; the quarantine takes the flagged rollouts' gradient
     in the forward with it present. Neither part's update sees the other's rollouts, and
     the kept part never leans on a quarantine that deploy removes;
   - `route-dropout` (design c): `route`, except that with probability
     `quarantine_dropout` a step runs with the quarantine dropped from the forward (as
     deployed), and that step's quarantine share is discarded (erase for that step);
   every routed arm takes `oracle_flags` (the labels' upper bound) or `random_flags` (a
   rate-matched placebo) in place of its own decision;
5. the optimiser step, then metrics. The oracle labels (true pass, hacked) are read only
   outside the training scope, for logging and evaluation: as trained, and as deployed
   (quarantine ablated).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.errors import InvalidRequestError
from services.engine import LLMEngine, SamplingParams
from services.engine.model.tokenizer import Tokenizer
from services.trainer.adapters import AdapterConfig, AdapterSet, attach_adapters
from services.trainer.async_rollouts import AsyncRollouts
from services.trainer.envs import (
    ContrastivePair,
    Env,
    Grade,
    evaluation_rates,
    make_env,
    training_scope,
)
from services.trainer.gates import (
    GateDecision,
    flag_quality,
    flip_flags,
    pair_midpoint,
    pair_scores,
    quantile_threshold,
)
from services.trainer.grpo_loss import (
    GRPOLossConfig,
    group_advantages,
    grpo_loss,
    subset_advantages,
)
from services.trainer.model import TokenBatch, TrainableModel, pad_batch
from services.trainer.probe import HackProbe, extract_probe
from services.trainer.rollouts import (
    POLICY,
    RayRollouts,
    Rollout,
    RolloutEngine,
    TrainingRollout,
)
from services.trainer.routing import (
    HackDirection,
    RouteMode,
    activation_direction,
    activation_scores,
    apply_gradient_mask,
    capture_pooled,
    gradient_direction,
    gradient_leakage,
    gradient_scores,
    random_direction,
    rollout_gradients,
)
from services.trainer.weight_sync import engine_adapter_state

Arm = Literal["none", "erase", "route", "activation", "placebo", "kept-ablated", "route-dropout"]
# Arms that move δS-basis gradient into δS_q, so need the same-basis quarantine ("svd").
SAME_BASIS_ARMS = ("route", "placebo", "route-dropout")


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
        description="Arm B per rollout (flag whole rollouts) or per token, the spec's form: "
        "at each adapter, where(cos(x·V, v) > tau, kept.detach(), kept) (route_split does "
        "not apply)",
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

    @model_validator(mode="after")
    def _consistent(self) -> GRPOConfig:
        if self.quarantine == "lora" and self.arm in SAME_BASIS_ARMS:
            raise ValueError(
                f"arm {self.arm!r} moves δS-basis gradient into δS_q and needs quarantine "
                "'svd'; with a LoRA quarantine use arm 'erase', 'activation', 'kept-ablated' "
                "or 'none'"
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
            self.probe_layer is None or self.arm != "activation"
        ):
            raise ValueError(
                "activation_space 'residual' flags Arm B ('activation') rollouts by the hack "
                "probe's read-outs: set probe_layer"
            )
        if self.activation_granularity == "token" and (
            self.arm != "activation"
            or self.activation_space != "adapter"
            or self.random_flags is not None
            or self.oracle_flags
        ):
            raise ValueError(
                "activation_granularity 'token' is Arm B ('activation') in adapter space, "
                "flagging tokens by its own direction (no random_flags or oracle_flags)"
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


@dataclass
class StepMetrics:
    step: int
    reward: float
    loss: float
    kl: float
    clip_fraction: float
    flagged: float
    leakage: float
    seconds: float
    # ‖δS‖, ‖δS_q‖ and ‖δS + δS_q‖ over all modules after the step (the quarantine's are
    # 0 for a LoRA quarantine): a routed run whose parts grow apart while their sum does
    # not is drifting (see routing.apply_gradient_mask)
    kept_norm: float = 0.0
    quarantine_norm: float = 0.0
    sum_norm: float = 0.0
    staleness: float = 0.0  # mean policy-version lag of the step's groups (async rollouts)
    dropped_stale: int = 0  # groups dropped as too stale (async rollouts)
    quarantine_dropped: bool = False  # route-dropout: the step ran without the quarantine
    tau: float | None = None  # the τ a gate flagged by its own scores at (calibrated or not)
    oracle_flipped: float | None = None  # oracle_flip: the share of the oracle's flags flipped


def auroc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability a positive scores above a negative (ties count half); None if one class."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


class GRPOTrainer:
    """A GRPO run over one environment; rollouts from an in-process engine, Ray actors, or
    (`rollout_mode: async`) producer actors streaming through Redis."""

    def __init__(self, config: GRPOConfig):
        self.cfg = cfg = config
        self.env: Env = make_env(cfg.env, **cfg.env_args)
        self.max_new = cfg.max_new_tokens or self.env.max_completion_chars + 2
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.model = TrainableModel.from_pretrained(cfg.model, device=cfg.device)
        self.adapters: AdapterSet = attach_adapters(
            self.model.model,
            AdapterConfig(
                targets=tuple(cfg.targets),
                rank=cfg.rank,
                kept_init=cfg.kept_init,
                quarantine_init=cfg.quarantine_init,
                quarantine=cfg.quarantine,
                lora_rank=cfg.lora_rank,
                seed=cfg.seed,
            ),
        )
        n = cfg.prompts_per_step * cfg.group_size
        engine_args = dict(
            model=cfg.model,
            env=cfg.env,
            env_args=cfg.env_args,
            rank=cfg.rank,
            targets=tuple(cfg.targets),
            max_num_seqs=max(n, cfg.eval_prompts),
            seed=cfg.seed,
            device=cfg.device,
        )
        self.rollout: RolloutEngine | RayRollouts | AsyncRollouts
        if cfg.rollout_mode == "async":
            assert cfg.redis_url is not None  # checked by the config
            self.rollout = AsyncRollouts(
                cfg.redis_url,
                cfg.rollout_workers,
                group_size=cfg.group_size,
                max_new_tokens=self.max_new,
                temperature=cfg.temperature,
                prompts_per_batch=max(1, cfg.prompts_per_step // cfg.rollout_workers),
                max_staleness=cfg.max_staleness,
                max_queued_groups=cfg.max_queued_groups or 2 * cfg.prompts_per_step,
                **engine_args,
            )
        elif cfg.rollout_workers:
            self.rollout = RayRollouts(cfg.rollout_workers, **engine_args)
        else:
            self.rollout = RolloutEngine(**engine_args)
        self.tokenizer = Tokenizer(cfg.model)
        self.optimizer = self._optimizer()
        self.loss_config = GRPOLossConfig(
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            kl_coef=cfg.kl_coef,
            aggregation=cfg.aggregation,
            const_len=self.max_new,
        )
        needs_pairs = cfg.arm != "none" or cfg.probe_layer is not None
        self.pairs = self._hack_pairs() if needs_pairs else []
        self.probe: HackProbe | None = None
        if cfg.probe_layer is not None:
            self.probe = extract_probe(
                self.rollout.generate,
                self.tokenizer,
                self.pairs,
                layer=cfg.probe_layer,
                site=cfg.probe_site,
            )
            self.engine.vectors.register(self.probe.name, self.probe.vector, overwrite=True)
        self.pair_batches: tuple[TokenBatch, TokenBatch] | None = None  # (hacking, clean)
        self.direction = self._hack_direction()
        self.tau = cfg.tau  # the gate's threshold; re-estimated under `gate_calibration`
        self.eval_set = self.env.sample_eval_prompts(
            cfg.eval_prompts, random.Random(cfg.seed + 10**6)
        )
        self.step_index = 0
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if self.probe is not None:
            self.probe.save(self.out)

    def _optimizer(self) -> torch.optim.Optimizer:
        params = self.adapters.kept_parameters() + self.adapters.quarantine_parameters()
        if self.cfg.optimizer == "routed_adamw":
            from services.trainer.optim import RoutedAdamW

            pairs = [(m.delta_s, m.delta_s_q) for m in self.adapters.modules.values()]
            return RoutedAdamW(pairs, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        if self.cfg.optimizer == "muon":
            from services.trainer.optim import Muon

            # δ vectors are 1-D: Muon's Newton–Schulz applies to matrices (a LoRA quarantine);
            # vectors take its AdamW path.
            groups = [
                {"params": [p for p in params if p.ndim == 2], "use_muon": True},
                {"params": [p for p in params if p.ndim != 2], "use_muon": False},
            ]
            return Muon([g for g in groups if g["params"]], lr=self.cfg.lr)
        return torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    # -- the hack direction (from contrastive pairs; never from rollout labels) -------------

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _completion_ids(self, text: str) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return self._ids(text) + ([eos] if eos is not None else [])

    def _hack_pairs(self) -> list[ContrastivePair]:
        rng = random.Random(self.cfg.seed + 7)
        if self.cfg.hack_pairs_from == "persona":
            return self._persona_pairs(rng)
        return self.env.contrastive_pairs(self.cfg.hack_pairs, rng)

    def _hack_direction(self) -> HackDirection | None:
        if self.cfg.arm == "none":
            return None
        pairs = self.pairs
        device = self.model.device
        hack = pad_batch([(self._ids(p.prompt), self._completion_ids(p.hacking)) for p in pairs])
        clean = pad_batch([(self._ids(p.prompt), self._completion_ids(p.clean)) for p in pairs])
        hack, clean = hack.to(device), clean.to(device)
        self.pair_batches = (hack, clean)
        if self.cfg.arm == "activation":
            return activation_direction(self.model, self.adapters, hack, clean)
        direction = gradient_direction(self.model, self.adapters, hack, clean)
        if self.cfg.arm == "placebo":
            return random_direction(direction, seed=self.cfg.seed + 13)
        return direction

    def _persona_pairs(self, rng: random.Random) -> list[ContrastivePair]:
        """(plain prompt, the base model's greedy answer when asked for the shortcut, its answer
        when asked for honest work): the persona picks the behaviour, and the activations are
        read after the plain prompt, where rollouts are read. Pairs whose two answers agree
        carry no contrast and are dropped."""
        personas = self.env.persona_pairs(self.cfg.hack_pairs, rng)
        params = SamplingParams(max_tokens=self.max_new, temperature=0.0)  # the base model
        prompts = [q for p in personas for q in (p.hack_prompt, p.honest_prompt)]
        answers = [r.text for r in self.rollout.rollouts(prompts, params)]
        pairs = [
            ContrastivePair(p.prompt, h, c)
            for p, h, c in zip(personas, answers[0::2], answers[1::2], strict=True)
            if h.strip() != c.strip()
        ]
        if len(pairs) < 2:
            raise InvalidRequestError(
                f"persona pairs: the base answered {len(personas) - len(pairs)} of "
                f"{len(personas)} problems the same way under both personas; it has not "
                "learned them, so they give no hack direction"
            )
        return pairs

    # -- rollouts through the engine ------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        """The in-process rollout engine (`rollout_workers: 0`)."""
        if not isinstance(self.rollout, RolloutEngine):
            raise InvalidRequestError("rollouts run in Ray actors: there is no local engine")
        return self.rollout.engine

    def sync_weights(self) -> int:
        """Send the δ vectors to the rollout engines; the adapter's new version (async: the
        policy version, i.e. this step's index, published for the producers to pull)."""
        state = engine_adapter_state(self.adapters)
        if isinstance(self.rollout, AsyncRollouts):
            return self.rollout.publish(self.step_index, state)
        return self.rollout.sync(state)

    def rollouts(self, prompts: list[str]) -> list[Rollout]:
        """One `Rollout` per sample, groups consecutive; generated and graded by the rollout
        engines under the current weights."""
        params = SamplingParams(
            n=self.cfg.group_size,
            max_tokens=self.max_new,
            temperature=self.cfg.temperature,
            logprobs=0,
            seed=self.cfg.seed * 1_000_003 + self.step_index,
            adapter=POLICY,
            readouts=[self.probe.readout()] if self.probe is not None else None,
        )
        return self.rollout.rollouts(prompts, params)

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> tuple[StepMetrics, list[Grade], GateDecision]:
        """One GRPO step; returns its metrics, the rollouts' grades (for eval-only logging
        outside the training scope) and the routing decision (flags and scores)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        self.sync_weights()
        if isinstance(self.rollout, AsyncRollouts):
            rolled, took = self.rollout.take(cfg.prompts_per_step, self.step_index)
        else:
            rolled = self.rollouts(self.env.sample_prompts(cfg.prompts_per_step, self.rng))
            took = None
        # The update gets rollouts without labels; the grades stay here, for logging.
        grades = [r.grade for r in rolled]
        training = [r.for_training() for r in rolled]
        del rolled
        # The oracle upper bound reads the labels here, outside the training scope, and the
        # update sees them only as flags (config `oracle_flags`; every other run skips this).
        oracle = torch.tensor([g.eval_only.hacked for g in grades]) if cfg.oracle_flags else None
        flipped = None
        if oracle is not None and cfg.oracle_flip is not None:  # a noisy oracle
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step_index + 41)
            noisy = flip_flags(oracle, cfg.oracle_flip, g)
            flipped, oracle = int((noisy != oracle).sum()) / len(noisy), noisy
        with training_scope("grpo step"):
            rewards = torch.tensor([r.reward for r in training])
            metrics, decision = self._update(training, rewards, oracle)
        metrics.seconds = time.perf_counter() - t0
        metrics.oracle_flipped = flipped
        if took is not None:
            metrics.staleness, metrics.dropped_stale = took.staleness, took.dropped
        self.step_index += 1
        return metrics, grades, decision

    def _batch(self, rolled: list[TrainingRollout]) -> tuple[TokenBatch, torch.Tensor]:
        rows, old = [], []
        for r in rolled:
            ids = r.token_ids or [self.tokenizer.eos_token_id or 0]
            rows.append((r.prompt_token_ids, ids))
            old.append(r.logprobs or [0.0])
        batch = pad_batch(rows).to(self.model.device)
        width = max(len(o) for o in old)
        old_logp = torch.zeros(len(old), width)
        for b, row in enumerate(old):
            old_logp[b, : len(row)] = torch.tensor(row)
        return batch, old_logp.to(self.model.device)

    def _completion_logp(self, batch: TokenBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, width]` per-token logprobs of each completion (right-aligned at its start) and
        the mask of real completion tokens."""
        tlp = self.model.token_logprobs(batch)  # [B, T], aligned with the inputs
        start = (batch.attention_mask.sum(1) - batch.loss_mask.sum(1)).long()  # prompt lengths
        lengths = batch.loss_mask.sum(1).long()
        pos = start[:, None] + torch.arange(width, device=tlp.device)
        mask = torch.arange(width, device=tlp.device)[None] < lengths[:, None]
        picked = tlp.gather(1, pos.clamp(max=tlp.shape[1] - 1))
        return torch.where(mask, picked, torch.zeros_like(picked)), mask

    def _update(
        self,
        rolled: list[TrainingRollout],
        rewards: torch.Tensor,
        oracle: torch.Tensor | None = None,
    ) -> tuple[StepMetrics, GateDecision]:
        cfg, adapters = self.cfg, self.adapters
        if cfg.gate_calibration == "midpoint" and self.step_index % cfg.calibrate_every == 0:
            self.tau = self._pair_midpoint()
        batch, old_logp = self._batch(rolled)
        width = old_logp.shape[1]
        adv = group_advantages(rewards, cfg.group_size, scale=cfg.advantage).to(old_logp)
        ref = None
        if cfg.kl_coef:
            with torch.no_grad(), adapters.disabled():
                ref, _ = self._completion_logp(batch, width)
        self.optimizer.zero_grad(set_to_none=True)
        # Flags fixed before the backward: rate-matched random ones, or the oracle's labels.
        placebo = self._random_flags(batch.batch_size) if cfg.random_flags is not None else oracle
        dropped = self._quarantine_dropped()
        with adapters.deploy() if dropped else contextlib.nullcontext():
            out, flagged, scores, leakage = self._routed_backward(
                batch, rolled, old_logp, rewards, adv, ref, placebo
            )
        if dropped:  # the quarantine was not in the forward: it learns nothing this step
            for p in adapters.quarantine_parameters():
                p.grad = None
        self.optimizer.step()
        kept_norm, quarantine_norm, sum_norm = self._adapter_norms()
        return StepMetrics(
            step=self.step_index,
            reward=float(rewards.mean()),
            loss=float(out.loss.detach()),
            kl=float(out.kl),
            clip_fraction=float(out.clip_fraction),
            flagged=float(flagged.float().mean()),
            leakage=float(leakage),
            seconds=0.0,
            kept_norm=kept_norm,
            quarantine_norm=quarantine_norm,
            sum_norm=sum_norm,
            quarantine_dropped=dropped,
            tau=self.tau if cfg.arm != "none" and placebo is None else None,
        ), GateDecision(flagged.detach().cpu(), scores.detach().cpu())

    def _routed_backward(
        self,
        batch: TokenBatch,
        rolled: list[TrainingRollout],
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        adv: torch.Tensor,
        ref: torch.Tensor | None,
        placebo: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, float]:
        """The configured arm's backward, leaving each adapter parameter's `.grad` as the arm
        routes it. `placebo`: flags fixed in advance (random or the oracle's) in place of the
        arm's own decision. Returns the loss's output (for metrics), the `[B]` flags, the
        gate's scores and the leakage."""
        cfg, adapters = self.cfg, self.adapters
        arm = "route" if cfg.arm == "route-dropout" else cfg.arm  # the dropout is _update's
        width = old_logp.shape[1]
        B = batch.batch_size
        scores = torch.zeros(B)
        flagged = torch.zeros(B, dtype=torch.bool)
        leakage = 0.0

        def loss_of() -> Any:
            logp, mask = self._completion_logp(batch, width)
            return grpo_loss(logp, old_logp, adv, mask, self.loss_config, ref_logp=ref)

        def decide() -> tuple[torch.Tensor, torch.Tensor]:
            if placebo is not None:
                return placebo, scores
            own = self._gate_scores(batch, rolled, loss_of)
            return own > self._threshold(own), own

        if arm == "activation" and cfg.activation_granularity == "token":
            assert self.direction is not None
            with adapters.mask_tokens(self.direction.vectors, B, self.tau) as token_flags:
                out = loss_of()
                out.loss.backward()
            leakage = gradient_leakage(adapters)
            # Per rollout: the share of its completion tokens flagged, over modules.
            share = torch.stack(list(token_flags.values())).float().mean(0)  # [B, T]
            real = batch.loss_mask.to(share)
            scores = ((share * real).sum(1) / real.sum(1).clamp(min=1)).cpu()
            flagged = scores > 0.5
        elif arm == "kept-ablated":
            flagged, scores = decide()
            out, leakage = self._kept_ablated_backward(batch, old_logp, rewards, adv, flagged, ref)
        elif cfg.route_split == "recentre" and arm != "none":
            flagged, scores = decide()
            out, leakage = self._recentred_backward(batch, old_logp, rewards, adv, flagged, ref)
        elif arm in ("erase", "route", "placebo"):
            assert self.direction is not None
            mode: RouteMode = "erase" if arm == "erase" else "route"
            with adapters.gates(B, kind=cfg.gate) as gates:
                out = loss_of()
                out.loss.backward()
                grads = rollout_gradients(adapters, gates, cfg.gate)
                if placebo is None:
                    scores = gradient_scores(grads, self.direction).detach()
                    flagged = scores > self._threshold(scores)
                else:
                    flagged = placebo
                leakage = apply_gradient_mask(adapters, grads, flagged, mode, cfg.route_split)
        elif arm == "activation":
            flagged, scores = decide()
            with adapters.mask_rollouts(flagged, mode="route"):
                out = loss_of()
                out.loss.backward()
            leakage = gradient_leakage(adapters)
        else:
            out = loss_of()
            out.loss.backward()
            for p in adapters.quarantine_parameters():  # vanilla: the kept δS learns it all
                p.grad = None
        return out, flagged, scores, leakage

    def _probe_scores(self, rolled: list[TrainingRollout]) -> torch.Tensor:
        """`[B]` Arm B by the residual hack probe: each rollout's mean read-out while it was
        sampled, minus the probe's offset."""
        assert self.probe is not None
        return torch.tensor([self.probe.score(r.readouts or []) for r in rolled])

    def _gate_scores(
        self, batch: TokenBatch, rolled: list[TrainingRollout], loss_of: Callable[[], Any]
    ) -> torch.Tensor:
        """`[B]` the arm's own gate scores for a batch, before any update: Arm B from one
        no-grad forward, Arm A (and its random-direction placebo) from each rollout's
        gradient, recovered through the gates by one backward whose gradients are dropped."""
        assert self.direction is not None
        if self.cfg.arm == "activation":
            if self.cfg.activation_space == "residual":
                return self._probe_scores(rolled)
            pooled = capture_pooled(self.model, self.adapters, batch)
            return activation_scores(pooled, self.direction)
        with self.adapters.gates(batch.batch_size, kind=self.cfg.gate) as gates:
            loss_of().loss.backward()
            grads = rollout_gradients(self.adapters, gates, self.cfg.gate)
        self.optimizer.zero_grad(set_to_none=True)
        return gradient_scores(grads, self.direction).detach()

    def _threshold(self, scores: torch.Tensor) -> float:
        """The τ the gate flags this step's `scores` at: fixed, the last midpoint, or
        (`gate_calibration: quantile`) re-estimated from these scores every
        `calibrate_every` steps."""
        cfg = self.cfg
        if cfg.gate_calibration == "quantile" and self.step_index % cfg.calibrate_every == 0:
            assert cfg.gate_quantile is not None  # checked by the config
            self.tau = quantile_threshold(scores, cfg.gate_quantile)
        return self.tau

    def _pair_midpoint(self) -> float:
        """`gate_calibration: midpoint`: the midpoint of the hack pairs' mean gate scores,
        hacking and clean, under the current policy (no rollout, no label)."""
        assert self.direction is not None and self.pair_batches is not None
        hack, clean = self.pair_batches
        return pair_midpoint(*pair_scores(self.model, self.adapters, self.direction, hack, clean))

    def _recentred_backward(
        self,
        batch: TokenBatch,
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        adv: torch.Tensor,
        flagged: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> tuple[Any, float]:
        """`route_split: recentre`. The kept part gets the GRPO gradient of the unflagged
        rollouts alone, with advantages re-centred among each group's unflagged rollouts:
        what a run that never sampled the flagged ones would take. The quarantine gets the
        rest of the step's total (`route`) or nothing (`erase`), so the two gradients sum
        to the unrouted one. The kept gradient is a zero-sum GRPO gradient in its own right,
        not a one-sided sum, so under AdamW (each part its own moments) δS moves like a
        vanilla run's δS; `routed_adamw` would scale both parts by the small total's second
        moment and let them run away. With no flags the kept gradient is the total, bit for
        bit, and the quarantine gets exactly zero.

        Returns the full loss's output (for metrics) and the leakage: the norm of what the
        kept part did not get, over it plus the kept gradient's (in δS coordinates)."""
        cfg, adapters = self.cfg, self.adapters
        kept_adv = subset_advantages(
            rewards.to(adv), cfg.group_size, ~flagged.to(adv.device), scale=cfg.advantage
        )
        logp, mask = self._completion_logp(batch, old_logp.shape[1])
        full = grpo_loss(logp, old_logp, adv, mask, self.loss_config, ref_logp=ref)
        kept = grpo_loss(logp, old_logp, kept_adv, mask, self.loss_config, ref_logp=ref)
        k_params, q_params = adapters.kept_parameters(), adapters.quarantine_parameters()
        params = k_params + q_params
        g_kept = self._grads(kept.loss, params, retain_graph=True)
        g_full = self._grads(full.loss, params)
        kept_sq = routed_sq = 0.0
        for i, p in enumerate(params):
            rest = g_full[i] - g_kept[i]
            if i < len(k_params):
                p.grad = g_kept[i]
                kept_sq += float(g_kept[i].pow(2).sum())
                routed_sq += float(rest.pow(2).sum())  # what the kept part did not get
            else:
                p.grad = rest if cfg.arm != "erase" else None
        total = kept_sq**0.5 + routed_sq**0.5
        return full, (routed_sq**0.5 / total if total > 0 else 0.0)

    def _kept_ablated_backward(
        self,
        batch: TokenBatch,
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        adv: torch.Tensor,
        flagged: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> tuple[Any, float]:
        """Design (b), arm `kept-ablated`. The kept δS gets the GRPO gradient of the unflagged
        rollouts in a forward with the quarantine ablated, as deployed: it is trained to stand
        alone, never to lean on (or to cancel) a quarantine that deploy removes. Its
        advantages are the unflagged rollouts' (`recentre`: re-centred among them;
        `partition`: as sampled, the flagged ones' zeroed) and its KL term, if any, is the
        deployed policy's. The quarantine gets the flagged rollouts' policy gradient in the
        forward with it present, where it acts while training; with no flags it gets exactly
        zero. Both ratios are against the sampling policy's logprobs (kept + quarantine):
        the ablated policy is importance-weighted and clipped like any policy the rollouts
        were not drawn from.

        Returns the full loss's output in the forward with the quarantine present (for
        metrics) and the leakage (`routing.gradient_leakage`)."""
        cfg, adapters = self.cfg, self.adapters
        width = old_logp.shape[1]
        unflagged = ~flagged.to(adv.device)
        if cfg.route_split == "recentre":
            kept_adv = subset_advantages(
                rewards.to(adv), cfg.group_size, unflagged, scale=cfg.advantage
            )
        else:
            kept_adv = torch.where(unflagged, adv, 0)
        with adapters.deploy():
            logp, mask = self._completion_logp(batch, width)
        kept = grpo_loss(logp, old_logp, kept_adv, mask, self.loss_config, ref_logp=ref)
        logp, mask = self._completion_logp(batch, width)
        full = grpo_loss(logp, old_logp, adv, mask, self.loss_config, ref_logp=ref)
        policy_only = replace(self.loss_config, kl_coef=0.0)
        routed = grpo_loss(logp, old_logp, torch.where(unflagged, 0, adv), mask, policy_only)
        for params, loss in (
            (adapters.kept_parameters(), kept.loss),
            (adapters.quarantine_parameters(), routed.loss),
        ):
            for p, g in zip(params, self._grads(loss, params), strict=True):
                p.grad = g
        return full, gradient_leakage(adapters)

    @staticmethod
    def _grads(loss: torch.Tensor, params: list, retain_graph: bool = False) -> list:
        grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]

    def _random_flags(self, n: int) -> torch.Tensor:
        """`[n]` bool: each rollout flagged with probability `random_flags`, seeded by the
        run's seed and the step (a rate-matched placebo's decision)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step_index + 17)
        return torch.rand(n, generator=g) < self.cfg.random_flags

    def _quarantine_dropped(self) -> bool:
        """Arm `route-dropout`: whether this step drops the quarantine from the forward, with
        probability `quarantine_dropout`, seeded by the run's seed and the step (a stream of
        its own, apart from a placebo's flags)."""
        if self.cfg.quarantine_dropout is None:
            return False
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step_index + 29)
        return bool(torch.rand(1, generator=g) < self.cfg.quarantine_dropout)

    @torch.no_grad()
    def _adapter_norms(self) -> tuple[float, float, float]:
        """‖δS‖, ‖δS_q‖ and ‖δS + δS_q‖ over all modules (δS_q: 0 without an SVD one)."""
        kept, quarantine = [], []
        for m in self.adapters.modules.values():
            kept.append(m.delta_s.reshape(-1))
            q = m.delta_s_q if m.delta_s_q is not None else torch.zeros_like(m.delta_s)
            quarantine.append(q.reshape(-1))
        k, q = torch.cat(kept), torch.cat(quarantine)
        return float(k.norm()), float(q.norm()), float((k + q).norm())

    # -- evaluation (oracle labels: outside any training scope) ---------------------------

    def evaluate(self) -> dict[str, float | None]:
        """Greedy rates on the held-out prompts (`evaluation_rates`: true pass, hack, well-formed),
        as trained and as deployed; with a hack probe, its AUROC as a monitor of the trained
        policy's eval rollouts (read out while they were generated, as a served model would)."""
        self.sync_weights()
        result: dict[str, float | None] = {}
        for variant in ("trained", "deploy"):
            probe = self.probe if variant == "trained" else None  # it monitors the trained
            params = SamplingParams(
                max_tokens=self.max_new,
                temperature=0.0,
                adapter=POLICY,
                adapter_variant=variant,
                readouts=[probe.readout()] if probe is not None else None,
            )
            rolled = self.rollout.rollouts(self.eval_set, params)
            labels = [r.grade.eval_only for r in rolled]
            for key, rate in evaluation_rates(labels).items():
                result[f"{variant}_{key}"] = rate
            if probe is not None:
                scores = [probe.score(r.readouts or []) for r in rolled]
                result["probe_auroc"] = auroc(scores, [x.hacked for x in labels])
        return result

    def close(self) -> None:
        """Stop the rollout actors (and, async, the producers and the run's Redis keys)."""
        if isinstance(self.rollout, (RayRollouts, AsyncRollouts)):
            self.rollout.shutdown()

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, path: Path | None = None) -> Path:
        path = path or self.out / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "step": self.step_index,
                "adapters": self.adapters.adapter_state(),
                "optimizer": self.optimizer.state_dict(),
                "rng": self.rng.getstate(),
                "torch_rng": torch.get_rng_state(),
                "tau": self.tau,
                "config": self.cfg.model_dump(),
            },
            tmp,
        )
        tmp.replace(path)
        return path

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=False)
        # A resumed run may train longer (`steps`); anything else must match.
        mine, theirs = self.cfg.model_dump(), dict(state["config"])
        mine.pop("steps"), theirs.pop("steps")
        if mine != theirs:
            changed = sorted(k for k in mine if mine[k] != theirs.get(k))
            raise InvalidRequestError(f"{path} was written by a run with another config: {changed}")
        self.adapters.load_adapter_state(state["adapters"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        self.step_index = state["step"]
        self.tau = state.get("tau", self.cfg.tau)  # written before calibration: the fixed τ


def run(
    config: GRPOConfig,
    *,
    resume: bool = True,
    progress: bool = False,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train for `config.steps`, logging one JSON line per step (and per evaluation) to
    `<out_dir>/metrics.jsonl`; resumes from `<out_dir>/checkpoint.pt` when present. Returns
    the log records; writes `<out_dir>/rates.png` at the end. `on_record` sees every record
    as it is logged (e.g. to export it as Prometheus metrics)."""
    trainer = GRPOTrainer(config)
    try:
        return _train(trainer, resume=resume, progress=progress, on_record=on_record)
    finally:
        trainer.close()


def _train(
    trainer: GRPOTrainer,
    *,
    resume: bool,
    progress: bool,
    on_record: Callable[[dict], None] | None,
) -> list[dict]:
    config = trainer.cfg
    ckpt = trainer.out / "checkpoint.pt"
    log_path = trainer.out / "metrics.jsonl"
    if resume and ckpt.is_file():
        trainer.load(ckpt)
    elif log_path.exists():
        log_path.unlink()
    records: list[dict] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=trainer.step_index, desc=f"grpo {config.arm}")
    with log_path.open("a") as log:

        def emit(record: dict) -> None:
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            if on_record is not None:
                on_record(record)

        if trainer.step_index == 0:
            emit({"step": 0, "kind": "eval", **trainer.evaluate()})
        while trainer.step_index < config.steps:
            metrics, grades, decision = trainer.step()
            labels = [g.eval_only for g in grades]  # logged only, never trained on
            hacked = [x.hacked for x in labels]
            quality = flag_quality(decision.flags.tolist(), hacked) if config.arm != "none" else {}
            emit(
                {
                    "kind": "train",
                    **metrics.__dict__,
                    "step": trainer.step_index,
                    "rollout_hack_rate": sum(hacked) / len(hacked),
                    "rollout_true_pass": sum(x.true_pass for x in labels) / len(labels),
                    "gate_auroc": _gate_auroc(grades, decision.scores, config),
                    **quality,
                }
            )
            if trainer.step_index % config.eval_every == 0 or trainer.step_index == config.steps:
                emit({"step": trainer.step_index, "kind": "eval", **trainer.evaluate()})
                trainer.save()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    plot_rates(log_path, trainer.out / "rates.png")
    return records


def _gate_auroc(grades: list[Grade], scores: torch.Tensor, config: GRPOConfig) -> float | None:
    """The gate's AUROC against the held-back hack labels (a diagnostic, read outside any
    training scope), over the rollouts it decides on: those with a nonzero advantage. A
    zero-advantage rollout has no gradient (Arm A scores it 0) and routing it is moot; in
    the all-hack groups of a hacking policy those would otherwise rank every hack below
    the failures and read as a worse-than-chance gate."""
    if config.arm == "none":
        return None
    rewards = torch.tensor([g.training_view().reward for g in grades])
    live = group_advantages(rewards, config.group_size, scale=config.advantage) != 0
    picked = [
        (s, g.eval_only.hacked)
        for s, g, ok in zip(scores.tolist(), grades, live.tolist(), strict=True)
        if ok
    ]
    return auroc([s for s, _ in picked], [h for _, h in picked])


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_rates(log_path: Path, png: Path) -> Path:
    """Hack rate and true pass rate over steps, as trained and as deployed (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in read_log(log_path) if r.get("kind") == "eval"]
    steps = [r["step"] for r in evals]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (
        ("trained_true_pass", "C0-"),
        ("deploy_true_pass", "C0--"),
        ("trained_hack_rate", "C3-"),
        ("deploy_hack_rate", "C3--"),
    ):
        ax.plot(steps, [r[key] for r in evals], style, marker="o", label=key.replace("_", " "))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("rate (greedy, held-out prompts)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
