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
   the base model = adapters disabled), and a backward routed by the configured arm
   (`routed_backward.py`: vanilla, Arm A's gradient gate, Arm B's activation gate, their
   placebo, route2's LoRA quarantine, and the designs that train the kept part to stand
   alone), with flags given in
   advance by `oracle_flags` (the labels' upper bound, noisy with `oracle_flip`) or
   `random_flags` (a rate-matched placebo); `route-dropout` drops the quarantine from a
   step's forward here, with probability `quarantine_dropout`;
5. the optimiser step, then metrics. The oracle labels (true pass, hacked) are read only
   outside the training scope, for logging and evaluation: as trained, and as deployed
   (quarantine ablated), and the flags' precision and recall against them.

After the last step, expand-route-ablate's `coherence_steps` fine-tune the kept part alone,
label-free (`coherence.py`), and the run evaluates once more.

The configuration is `grpo_config.py`'s (re-exported here).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import InvalidRequestError
from services.engine import LLMEngine, SamplingParams
from services.engine.model.tokenizer import Tokenizer
from services.trainer.adapters import AdapterConfig, AdapterSet, attach_adapters
from services.trainer.async_rollouts import AsyncRollouts
from services.trainer.coherence import CoherencePhase
from services.trainer.envs import (
    ContrastivePair,
    Env,
    Grade,
    evaluation_rates,
    make_env,
    training_scope,
)
from services.trainer.gates import GateDecision, auroc, flag_quality, flip_flags, gate_auroc
from services.trainer.grpo_config import SAME_BASIS_ARMS, Arm, GRPOConfig, validate_config
from services.trainer.grpo_loss import GRPOLossConfig, group_advantages
from services.trainer.model import TokenBatch, TrainableModel, pad_batch
from services.trainer.probe import HackProbe, extract_probe
from services.trainer.rollouts import (
    POLICY,
    RayRollouts,
    Rollout,
    RolloutEngine,
    TrainingRollout,
)
from services.trainer.routed_backward import RoutedBackward, completion_logprobs
from services.trainer.routing import (
    HackDirection,
    activation_direction,
    gradient_direction,
    random_direction,
)
from services.trainer.weight_sync import engine_adapter_state

__all__ = [
    "SAME_BASIS_ARMS", "Arm", "GRPOConfig", "GRPOTrainer", "StepMetrics", "auroc", "plot_rates",
    "read_log", "run", "validate_config",
]  # fmt: skip


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
    # ‖δS‖, ‖δS_q‖ and ‖δS + δS_q‖ over all modules after the step (a LoRA quarantine's
    # ‖B_q A_q‖ and ‖U diag(δS) Vᵀ + B_q A_q‖): a routed run whose parts grow apart while
    # their sum does not is drifting (see AdapterNorms)
    kept_norm: float = 0.0
    quarantine_norm: float = 0.0
    sum_norm: float = 0.0
    staleness: float = 0.0  # mean policy-version lag of the step's groups (async rollouts)
    dropped_stale: int = 0  # groups dropped as too stale (async rollouts)
    quarantine_dropped: bool = False  # route-dropout: the step ran without the quarantine
    tau: float | None = None  # the τ a gate flagged by its own scores at (calibrated or not)
    oracle_flipped: float | None = None  # oracle_flip: the share of the oracle's flags flipped
    token_flag_rate: float | None = None  # route2 per token: the share of real tokens flagged


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
                lora_rank=cfg.quarantine_rank,
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
            lora_rank=cfg.quarantine_rank if cfg.quarantine == "lora" else 0,
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
        self.direction, pair_batches = self._hack_direction()
        self.router = RoutedBackward(
            cfg, self.model, self.adapters, self.loss_config, self.direction, pair_batches,
            self.probe,
        )  # fmt: skip
        self.eval_set = self.env.sample_eval_prompts(
            cfg.eval_prompts, random.Random(cfg.seed + 10**6)
        )
        self.step_index = 0
        self.coherence_done = False  # expand-route-ablate: the coherence steps have run
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

    def _hack_direction(
        self,
    ) -> tuple[HackDirection | None, tuple[TokenBatch, TokenBatch] | None]:
        """The arm's hack direction from the hack pairs, and the pairs' (hacking, clean)
        batches it came from (None for vanilla)."""
        if self.cfg.arm == "none":
            return None, None
        pairs = self.pairs
        device = self.model.device
        hack = pad_batch([(self._ids(p.prompt), self._completion_ids(p.hacking)) for p in pairs])
        clean = pad_batch([(self._ids(p.prompt), self._completion_ids(p.clean)) for p in pairs])
        hack, clean = hack.to(device), clean.to(device)
        if self.cfg.activation_gate:
            return activation_direction(self.model, self.adapters, hack, clean), (hack, clean)
        direction = gradient_direction(self.model, self.adapters, hack, clean)
        if self.cfg.arm == "placebo":
            direction = random_direction(direction, seed=self.cfg.seed + 13)
        return direction, (hack, clean)

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
        """`routed_backward.completion_logprobs` under the policy as it stands."""
        return completion_logprobs(self.model, batch, width)

    def _update(
        self,
        rolled: list[TrainingRollout],
        rewards: torch.Tensor,
        oracle: torch.Tensor | None = None,
    ) -> tuple[StepMetrics, GateDecision]:
        cfg, adapters = self.cfg, self.adapters
        self.router.calibrate(self.step_index)
        batch, old_logp = self._batch(rolled)
        width = old_logp.shape[1]
        adv = group_advantages(rewards, cfg.group_size, scale=cfg.advantage).to(old_logp)
        ref = None
        if cfg.kl_coef:
            with torch.no_grad(), adapters.disabled():
                ref, _ = self._completion_logp(batch, width)
        self.optimizer.zero_grad(set_to_none=True)
        # Flags fixed before the backward: rate-matched random ones, or the oracle's labels.
        placebo = self._random_flags(batch) if cfg.random_flags is not None else oracle
        dropped = self._quarantine_dropped()
        with adapters.deploy() if dropped else contextlib.nullcontext():
            out, flagged, scores, leakage = self.router.backward(
                self.step_index, batch, rolled, old_logp, rewards, adv, ref, placebo
            )
        if dropped:  # the quarantine was not in the forward: it learns nothing this step
            for p in adapters.quarantine_parameters():
                p.grad = None
        self.optimizer.step()
        norms = adapters.norms()
        return StepMetrics(
            step=self.step_index,
            reward=float(rewards.mean()),
            loss=float(out.loss.detach()),
            kl=float(out.kl),
            clip_fraction=float(out.clip_fraction),
            flagged=float(flagged.float().mean()),
            leakage=float(leakage),
            seconds=0.0,
            kept_norm=norms.kept,
            quarantine_norm=norms.quarantine,
            sum_norm=norms.total,
            quarantine_dropped=dropped,
            tau=self.router.tau if cfg.arm != "none" and placebo is None else None,
            token_flag_rate=self.router.token_flag_rate,
        ), GateDecision(flagged.detach().cpu(), scores.detach().cpu())

    def _random_flags(self, batch: TokenBatch) -> torch.Tensor:
        """`[B]` bool: each rollout flagged with probability `random_flags`, seeded by the
        run's seed and the step (a rate-matched placebo's decision); `[B, T]`, each token,
        for route2 per token (the only per-token arm that takes them)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step_index + 17)
        token = self.cfg.activation_granularity == "token"
        shape = batch.input_ids.shape if token else (batch.batch_size,)
        return torch.rand(shape, generator=g) < self.cfg.random_flags

    def _quarantine_dropped(self) -> bool:
        """Arm `route-dropout`: whether this step drops the quarantine from the forward, with
        probability `quarantine_dropout`, seeded by the run's seed and the step (a stream of
        its own, apart from a placebo's flags)."""
        if self.cfg.quarantine_dropout is None:
            return False
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step_index + 29)
        return bool(torch.rand(1, generator=g) < self.cfg.quarantine_dropout)

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
                "tau": self.router.tau,
                "coherence_done": self.coherence_done,
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
        self.coherence_done = state.get("coherence_done", False)
        self.router.tau = state.get("tau", self.cfg.tau)  # before calibration: the fixed τ


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
                    "gate_auroc": gate_auroc(grades, decision.scores, config),
                    **quality,
                }
            )
            if trainer.step_index % config.eval_every == 0 or trainer.step_index == config.steps:
                emit({"step": trainer.step_index, "kind": "eval", **trainer.evaluate()})
                trainer.save()
            if bar is not None:
                bar.update(1)
        if config.coherence_steps and not trainer.coherence_done:  # after the last step
            CoherencePhase(trainer).run(emit)
            trainer.coherence_done = True
            trainer.save()
    if bar is not None:
        bar.close()
    plot_rates(log_path, trainer.out / "rates.png")
    return records


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
