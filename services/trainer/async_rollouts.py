"""Asynchronous GRPO rollouts: producers stream graded groups through Redis while the trainer
trains, and the trainer drops groups sampled by a policy too many steps old.

    trainer ──publish(version, δ)──▶  Redis  <run>:weights  (hash: version, δ as safetensors)
                                        │
    producer actors (one engine each): pull the newest weights before each batch, sample
    `prompts_per_batch` prompts × `group_size`, grade them, XADD one entry per group
                                        ▼
    trainer ◀──XREADGROUP── <run>:rollouts (stream; entries carry the policy version)

A group sampled under version `v` reaches a trainer at version `t` with staleness `t − v`.
`take()` keeps groups with staleness ≤ `max_staleness` and drops (and counts) the rest; the
PPO ratio then corrects for the lag, since every rollout carries its sampling policy's own
token logprobs. Producers stop adding while `max_queued_groups` groups wait unread, so a slow
trainer never lets the queue, and with it the staleness, grow without bound.

Only the δ vectors travel through Redis (a few kB: DESIGN's rule keeps large tensors out
of Redis, and these are not). Entries are JSON; nothing from the stream is unpickled.
A group's oracle labels ride along for evaluation logging; training reads them only
through `Grade`, whose guard makes that fail inside a training scope.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from services.common.errors import CoxswainError, InvalidRequestError
from services.controller.connection import REDIS_ERRORS, connect
from services.engine import SamplingParams
from services.trainer.envs import EvalLabels, Grade
from services.trainer.rollouts import POLICY, Rollout, RolloutEngine, gather

GROUP = "trainer"


class RolloutStreamError(CoxswainError):
    """The asynchronous rollout path failed: a producer died or no fresh group arrived."""


@dataclass
class TakeStats:
    """What one `take()` saw: the kept groups' mean staleness and how many it dropped."""

    staleness: float
    dropped: int
    waited_s: float


class RolloutStream:
    """The Redis keys of one run and the (de)serialisation both sides share."""

    def __init__(self, url: str, run_id: str, *, block_s: float = 1.0):
        self.url, self.run_id = url, run_id
        self.stream = f"coxswain:grpo:{run_id}:rollouts"
        self.weights = f"coxswain:grpo:{run_id}:weights"
        self.r = connect(url, block_s=block_s)
        self.raw = redis.Redis.from_url(url, socket_timeout=5)  # bytes, for the δ blob

    # -- weights -----------------------------------------------------------------------------

    def publish_weights(self, version: int, state: dict[str, dict[str, torch.Tensor]]) -> None:
        flat = {
            f"{module}/{part}": t.detach().to("cpu").contiguous()
            for module, parts in state.items()
            for part, t in parts.items()
        }
        self.raw.hset(self.weights, mapping={"version": version, "state": st_save(flat)})

    def weights_version(self) -> int | None:
        v = self.r.hget(self.weights, "version")
        return None if v is None else int(v)

    def fetch_weights(self) -> tuple[int, dict[str, dict[str, torch.Tensor]]] | None:
        version, blob = self.raw.hmget(self.weights, ["version", "state"])
        if version is None or blob is None:
            return None
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in st_load(blob).items():
            module, _, part = key.rpartition("/")
            state.setdefault(module, {})[part] = t
        return int(version), state

    # -- groups ------------------------------------------------------------------------------

    def put_group(self, group: list[Rollout]) -> None:
        first = group[0]
        body = {
            "prompt": first.prompt,
            "prompt_token_ids": first.prompt_token_ids,
            "samples": [
                {
                    "token_ids": r.token_ids,
                    "logprobs": r.logprobs,
                    "text": r.text,
                    "reward": r.grade.reward,
                    "labels": r.grade.eval_only.as_record(),
                }
                for r in group
            ],
        }
        self.r.xadd(self.stream, {"v": first.policy_version, "group": json.dumps(body)})

    @staticmethod
    def decode_group(fields: dict[str, str]) -> list[Rollout]:
        version = int(fields["v"])
        body = json.loads(fields["group"])
        return [
            Rollout(
                prompt=body["prompt"],
                prompt_token_ids=body["prompt_token_ids"],
                token_ids=s["token_ids"],
                logprobs=s["logprobs"],
                text=s["text"],
                grade=Grade(
                    reward=float(s["reward"]),
                    eval_only=EvalLabels.from_record(s["labels"]),
                ),
                policy_version=version,
            )
            for s in body["samples"]
        ]

    def backlog(self) -> int:
        """Groups in the stream not yet consumed (the trainer deletes what it reads)."""
        return int(self.r.xlen(self.stream))

    def delete(self) -> None:
        self.r.delete(self.stream, self.weights)


class RolloutProducer:
    """A rollout engine that keeps producing graded groups into the stream (a Ray actor:
    the loop runs in its own thread, so `rollouts()` for evaluation and `status()` still
    answer; the engine is used under one lock)."""

    def __init__(
        self,
        url: str,
        run_id: str,
        worker: int,
        *,
        params: dict[str, Any],
        prompts_per_batch: int,
        max_queued_groups: int,
        **engine_args: Any,
    ):
        self.stream = RolloutStream(url, run_id)
        self.worker = worker
        self.engine = RolloutEngine(**engine_args)
        self.params = params
        self.prompts_per_batch = prompts_per_batch
        self.max_queued = max_queued_groups
        self.rng = random.Random(engine_args.get("seed", 0) * 1_000_003 + worker)
        self.version = -1
        self.batches = 0
        self.error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rollout-producer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def status(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "version": self.version,
            "batches": self.batches,
            "running": self._thread is not None and self._thread.is_alive(),
            "error": self.error,
        }

    def _refresh_weights(self) -> None:
        latest = self.stream.weights_version()
        if latest is None or latest == self.version:
            return
        fetched = self.stream.fetch_weights()
        if fetched is not None:
            self.engine.sync(fetched[1])
            self.version = fetched[0]

    def rollouts(self, prompts: list[str], params: SamplingParams) -> list[Rollout]:
        """Under the newest published weights (evaluation goes through here)."""
        with self._lock:
            self._refresh_weights()
            return self.engine.rollouts(prompts, params, self.version)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if self.stream.backlog() >= self.max_queued:
                        time.sleep(0.02)
                        continue
                    with self._lock:
                        self._refresh_weights()
                        if self.version < 0:  # nothing published yet
                            time.sleep(0.02)
                            continue
                        prompts = self.engine.env.sample_prompts(self.prompts_per_batch, self.rng)
                        seed = self.rng.getrandbits(31)
                        params = SamplingParams(**self.params, seed=seed, adapter=POLICY)
                        rolled = self.engine.rollouts(prompts, params, self.version)
                    n = params.n
                    for i in range(0, len(rolled), n):
                        self.stream.put_group(rolled[i : i + n])
                    self.batches += 1
                except REDIS_ERRORS:
                    time.sleep(0.5)  # Redis restarting: try again; the trainer times out
        except Exception as exc:  # surfaced through status(), never a silent stop
            self.error = f"{type(exc).__name__}: {exc}"
            raise


class AsyncRollouts:
    """The trainer's side: publishes weights, starts the producers, takes fresh groups."""

    def __init__(
        self,
        url: str,
        workers: int,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        prompts_per_batch: int,
        max_staleness: int,
        max_queued_groups: int,
        timeout_s: float = 300.0,
        **engine_args: Any,
    ):
        import ray

        if workers < 1:
            raise InvalidRequestError("asynchronous rollouts need at least one rollout worker")
        self.run_id = uuid.uuid4().hex[:12]
        self.stream = RolloutStream(url, self.run_id)
        self.max_staleness, self.timeout_s = max_staleness, timeout_s
        self.consumer = f"trainer-{self.run_id}"
        try:
            self.stream.r.xgroup_create(self.stream.stream, GROUP, id="0", mkstream=True)
        except REDIS_ERRORS as exc:
            raise RolloutStreamError(f"cannot reach Redis at {url}: {exc}") from exc
        params = dict(n=group_size, max_tokens=max_new_tokens, temperature=temperature, logprobs=0)
        cls = ray.remote(RolloutProducer)
        self.actors = [
            cls.options(num_cpus=0, max_concurrency=4).remote(
                url,
                self.run_id,
                w,
                params=params,
                prompts_per_batch=prompts_per_batch,
                max_queued_groups=max_queued_groups,
                **engine_args,
            )
            for w in range(workers)
        ]
        ray.get([a.start.remote() for a in self.actors])
        self.dropped = 0

    def publish(self, version: int, state: dict[str, dict[str, torch.Tensor]]) -> int:
        self.stream.publish_weights(version, state)
        return version

    def statuses(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.status.remote() for a in self.actors], timeout=30)

    def _check_producers(self) -> None:
        import ray

        try:
            statuses = self.statuses()
        except ray.exceptions.RayError as exc:
            raise RolloutStreamError(f"a rollout producer is gone: {exc}") from exc
        failed = [s for s in statuses if s["error"] or not s["running"]]
        if failed:
            s = failed[0]
            raise RolloutStreamError(
                f"rollout producer {s['worker']} stopped: {s['error'] or 'its loop exited'}"
            )

    def take(self, groups: int, version: int) -> tuple[list[Rollout], TakeStats]:
        """`groups` groups sampled at most `max_staleness` versions before `version`, in
        arrival order; older ones are dropped (acknowledged and deleted, and counted)."""
        t0 = time.perf_counter()
        kept: list[list[Rollout]] = []
        dropped = 0
        last_check = t0
        while len(kept) < groups:
            try:
                reply = self.stream.r.xreadgroup(
                    GROUP,
                    self.consumer,
                    {self.stream.stream: ">"},
                    count=groups - len(kept),
                    block=500,
                )
            except REDIS_ERRORS as exc:
                raise RolloutStreamError(f"reading rollouts from Redis failed: {exc}") from exc
            entries = reply[0][1] if reply else []
            for _, fields in entries:
                group = RolloutStream.decode_group(fields)
                if version - group[0].policy_version > self.max_staleness:
                    dropped += 1
                else:
                    kept.append(group)
            if entries:
                ids = [e for e, _ in entries]
                self.stream.r.xack(self.stream.stream, GROUP, *ids)
                self.stream.r.xdel(self.stream.stream, *ids)
            now = time.perf_counter()
            if not entries and now - last_check > 5.0:
                self._check_producers()
                last_check = now
            if now - t0 > self.timeout_s:
                raise RolloutStreamError(
                    f"only {len(kept)} of {groups} fresh rollout groups arrived in "
                    f"{self.timeout_s:.0f}s (dropped {dropped} stale); producers: "
                    f"{self.statuses()}"
                )
        self.dropped += dropped
        staleness = sum(version - g[0].policy_version for g in kept) / len(kept)
        rolled = [r for g in kept for r in g]
        return rolled, TakeStats(staleness, dropped, time.perf_counter() - t0)

    def rollouts(self, prompts: list[str], params: SamplingParams) -> list[Rollout]:
        """Evaluation rollouts under the newest published weights, split over the producers."""
        return gather(self.actors, "rollouts", prompts, params)

    def shutdown(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):  # already gone
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        for a in self.actors:
            ray.kill(a)
        with contextlib.suppress(*REDIS_ERRORS):  # Redis is gone: nothing left to clean
            self.stream.delete()
