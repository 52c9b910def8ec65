"""Where GRPO rollouts come from: rollout engines that generate under the policy adapter and
grade the results with the environment, so rewards are computed off the trainer.

`RolloutEngine` is one engine (in the trainer's process, or inside a Ray actor);
`RayRollouts` spreads each batch of prompts over several of them as Ray actors. Both take
weight sync as the adapters' δ vectors (`sync`) and return one `Rollout` per sample: the
prompt and completion tokens, the sampled tokens' logprobs (the old policy of the PPO ratio)
and its `Grade`. A `Rollout` is an evaluation record: the trainer splits it into a
`TrainingRollout` (no oracle label anywhere in it), which is all the update sees, and the
labels, which only logging reads. The asynchronous path through a Redis stream is in
`async_rollouts.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.outputs import OutputAccumulator, RequestOutput
from services.trainer.envs import Grade, make_env

POLICY = "policy"


@dataclass
class Rollout:
    """One sampled completion of a prompt, graded. `logprobs[i]` is the sampling policy's
    logprob of `token_ids[i]`; `policy_version` is the trainer step whose weights sampled it
    (the asynchronous path uses it to bound staleness)."""

    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    grade: Grade
    policy_version: int = 0
    # Per generated token, the probes the sampling request read out (`{name: h·probe}`):
    # activations, not labels (the trainer's residual-stream hack probe, `probe.py`).
    readouts: list[dict[str, float]] | None = None

    def for_training(self) -> TrainingRollout:
        """What the trainer may learn from: the tokens, their logprobs, the reward and the
        activations read out while sampling."""
        return TrainingRollout(
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            reward=self.grade.training_view().reward,
            policy_version=self.policy_version,
            readouts=self.readouts,
        )


@dataclass(frozen=True)
class TrainingRollout:
    """A rollout as the GRPO update receives it. It has no field that holds or reaches an
    oracle label (`tests/integration/test_grpo.py` walks what the update is given)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    reward: float
    policy_version: int = 0
    readouts: list[dict[str, float]] | None = None


class RolloutEngine:
    """An engine serving the policy adapter, plus the environment that grades its rollouts."""

    def __init__(
        self,
        model: str,
        *,
        env: str,
        env_args: dict[str, Any],
        rank: int,
        targets: tuple[str, ...],
        max_num_seqs: int,
        seed: int,
        device: str = "cpu",
        lora_rank: int = 0,
    ):
        """`lora_rank`: the LoRA quarantine's rank, reserved in the engine's adapter tables
        at start (a larger LoRA's first sync would re-lay them)."""
        self.env = make_env(env, **env_args)
        self.engine = LLMEngine(
            model,
            EngineConfig(
                device=device,
                dtype="float32",
                max_num_seqs=max_num_seqs,
                adapter_capacity=1,
                adapter_rank=rank,
                adapter_targets=tuple(targets),
                adapter_lora_rank=lora_rank,
                seed=seed,
            ),
        )
        self._ids = 0

    def sync(self, state: dict) -> int:
        """Install the policy's δ vectors; the adapter's new version on this engine."""
        return self.engine.load_adapter(POLICY, state)

    def version(self) -> int:
        return self.engine.adapters.loaded[POLICY].version if self.engine.adapters else 0

    def generate(self, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
        """Every prompt to completion (one continuous batch), in prompt order."""
        rids = []
        for prompt in prompts:
            self._ids += 1
            rid = f"rollout-{self._ids}"
            self.engine.add_request(rid, prompt, params)
            rids.append(rid)
        totals = OutputAccumulator()
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in totals.finished(self.engine.step()):
                done[out.request_id] = out
        return [done[r] for r in rids]

    def rollouts(
        self, prompts: list[str], params: SamplingParams, policy_version: int = 0
    ) -> list[Rollout]:
        """Generate and grade: one entry per sample, a prompt's samples consecutive. Needs
        `params.logprobs` set (the sampled tokens' logprobs are the PPO ratio's old policy)."""
        outs = self.generate(prompts, params)
        return [
            Rollout(
                prompt=p,
                prompt_token_ids=o.prompt_token_ids,
                token_ids=list(c.token_ids),
                logprobs=[c.logprobs[i][t] for i, t in enumerate(c.token_ids)]
                if c.logprobs is not None
                else [],
                text=c.text,
                grade=self.env.grade(p, c.text),
                policy_version=policy_version,
                readouts=c.readouts,
            )
            for p, o in zip(prompts, outs, strict=True)
            for c in o.outputs
        ]


class RayRollouts:
    """`RolloutEngine`s as Ray actors; each batch of prompts is split across them."""

    def __init__(self, workers: int, **engine_args: Any):
        import ray

        cls = ray.remote(RolloutEngine)
        self.actors = [cls.options(num_cpus=0).remote(**engine_args) for _ in range(workers)]

    def sync(self, state: dict) -> int:
        import ray

        versions = ray.get([a.sync.remote(state) for a in self.actors])
        return versions[0]

    def versions(self) -> list[int]:
        import ray

        return ray.get([a.version.remote() for a in self.actors])

    def generate(self, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
        return gather(self.actors, "generate", prompts, params)

    def rollouts(self, prompts: list[str], params: SamplingParams) -> list[Rollout]:
        return gather(self.actors, "rollouts", prompts, params)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


def gather(actors: list, method: str, prompts: list[str], params: SamplingParams) -> list:
    """Call `method(part, params)` on Ray actors, prompt j going to actor j % k; the results
    come back in prompt order, each prompt's samples (or its one output) consecutive."""
    import ray

    k = len(actors)
    parts = [prompts[i::k] for i in range(k)]
    busy = [(a, part) for a, part in zip(actors, parts, strict=True) if part]
    results = ray.get([getattr(a, method).remote(part, params) for a, part in busy])
    out: list = []
    for j in range(len(prompts)):
        result, part = results[j % k], parts[j % k]  # actors with no part come last
        n = len(result) // len(part)  # results per prompt
        i = j // k
        out.extend(result[i * n : (i + 1) * n])
    return out
