"""One engine replica over several processes: tensor and pipeline parallelism in lock-step.

Every rank runs the same `LLMEngine` (scheduler, block manager, intervention manager) over
its shard of the model. Rank 0, the driver, is the only rank callers talk to. At the top of
each step it broadcasts what changed since the last one: the requests it admitted (already
resolved: steering, patch sources and captures are resolved on the driver only), aborts,
vector-registry changes and the controller actions it drained. Every other rank replays that
list, so all ranks make the same scheduling and steering decisions with no further talk.
A patch pass (`LLMEngine.run_patch_pass`) travels the same way in place of a step: each rank
runs its forward with the driver, stage by stage, and the last stage's result is broadcast.

After the forward pass the ranks exchange what only some of them computed: the sampled
tokens of the last stage, and each stage's captures, read-out scores and gate firings. With
them goes a checksum of each rank's steering state (tiers, monitors, pool use, action
counts), which must agree: a rank that drifted fails the step loudly
(`ReplicaDivergedError`) instead of steering differently from its peers.

Collectives: the model's all-reduces and the stage-to-stage hand-off use the device backend
(gloo on CPU, NCCL on GPU); the object exchanges above use a gloo group.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from services.engine.interventions.actions import Action
from services.engine.parallel import ParallelContext, symmetric_all_reduce

if TYPE_CHECKING:
    from services.engine.interventions.planner import StepInterventions
    from services.engine.model.patch_pass import PassJob, PassResult
    from services.engine.scheduler import SchedulerOutput
    from services.engine.step_batch import StepResult

log = logging.getLogger(__name__)

# Idle worker ranks wait in a broadcast until the driver's next step, which can be hours.
IDLE_TIMEOUT = timedelta(days=7)
STOP = -1  # the length the driver broadcasts at the top of a step to shut the replica down
NO_TOKEN = -1  # a row that sampled nothing this step (a prefill chunk), in a token tensor


class ReplicaEngine(Protocol):
    """What lock-step needs of an engine (an `LLMEngine`, which imports this module: named
    by shape here so the two do not import each other)."""

    interventions: Any
    runner: Any
    scheduler: Any

    def step(self) -> Any: ...


class ReplicaDivergedError(RuntimeError):
    """The ranks of one replica no longer share the same steering state."""


class ReplicaStopped(Exception):
    """Raised in a worker rank's step when the driver shut the replica down."""


def init_replica(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    device_type: str = "cpu",
    fused_all_reduce_norm: bool | None = None,
    pipeline_microbatches: int = 1,
) -> tuple[ParallelContext, StepSync]:
    """Join this process to its replica's process groups; returns its context and step sync.

    Ranks are numbered stage by stage (`rank = pp_rank * tp_size + tp_rank`); every rank must
    call this with the same sizes, `init_method` (e.g. `tcp://127.0.0.1:29500`),
    `fused_all_reduce_norm` and `pipeline_microbatches` (`EngineConfig`'s; a None
    `fused_all_reduce_norm` is on for two TP ranks on CUDA).
    """
    world = tp_size * pp_size
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":  # one GPU per rank: under Ray each rank sees only its own
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=IDLE_TIMEOUT
    )
    objects = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend != "gloo" else None
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, timeout=IDLE_TIMEOUT) if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    token_group = None
    if pp_size > 1 and pipeline_microbatches > 1:
        for tp_rank in range(tp_size):  # each first-stage rank and its last-stage peer
            pair = [tp_rank, (pp_size - 1) * tp_size + tp_rank]
            group = dist.new_group(pair, timeout=IDLE_TIMEOUT)
            if rank in pair:
                token_group = group
        if token_group is not None:
            _meet_token_peer(token_group, rank, tp_size, device_type)
    symmetric = fused = None
    if device_type == "cuda" and tp_size > 1:
        device = torch.device("cuda", torch.cuda.current_device())
        symmetric = symmetric_all_reduce(tp_group, device)
        if fused_all_reduce_norm is None:  # measured to pay at TP=2 only (EngineConfig)
            fused_all_reduce_norm = tp_size == 2
        if fused_all_reduce_norm:
            from services.engine.kernels.all_reduce_norm import fused_all_reduce_norm as make

            fused = make(tp_group, device)
    elif fused_all_reduce_norm:
        log.warning("fused_all_reduce_norm applies to tensor parallelism on CUDA: not used")
    ctx = ParallelContext(
        tp_rank=rank % tp_size,
        tp_size=tp_size,
        pp_rank=rank // tp_size,
        pp_size=pp_size,
        tp_group=tp_group,
        symmetric=symmetric,
        fused_norm=fused,
        token_group=token_group,
    )
    return ctx, StepSync(ctx, objects)


def _meet_token_peer(group: Any, rank: int, tp_size: int, device_type: str) -> None:
    """Send one token id from a last-stage rank to its first-stage peer over their pair group,
    now, while both are here. NCCL makes a pair's communicator at its first send and receive,
    and that meets the peer: left to the first step, the last stage would wait in its send
    while the first stage waits in the next step's broadcast for it."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu"
    probe = torch.zeros(1, dtype=torch.int64, device=device)
    if rank < tp_size:
        dist.recv(probe, src=dist.get_process_group_ranks(group)[1], group=group)
    else:
        dist.send(probe, dst=rank % tp_size, group=group)


class StepSync:
    """Keeps one replica's engines in lock-step (see the module docstring)."""

    def __init__(self, ctx: ParallelContext, group: Any = None):
        self.ctx = ctx
        self.group = group  # the gloo group for object exchanges (None: the default group)
        self.is_driver = ctx.rank == 0
        self.result_rank = (ctx.pp_size - 1) * ctx.tp_size  # the last stage's first TP rank
        # Held by the driver from the broadcast through applying the drained actions, and by
        # anything that records a change, so no change lands between the two.
        self.lock = threading.RLock()
        self._outbox: list[tuple[str, Any]] = []
        self.stopped = False

    def attach(self, engine: ReplicaEngine) -> None:
        """Wire an engine built with this sync: the driver mirrors registry changes; the
        others write no capture runs (the driver does), resolve no patch sources, and keep
        no captures (their copies to the host would be dropped with their outputs: at
        TP=4 that was three times the driver's host work for nothing)."""
        iv = engine.interventions
        iv.local_layers = engine.runner.model.layer_range
        if self.is_driver:
            iv.registry.mirror_lock = self.lock
            iv.registry.mirror = lambda change: self._outbox.append(("vector", change))
        else:
            iv.writes_runs = False
            iv.observer.keeps_captures = False
            engine.runner.copies_captures = False

    def record(self, kind: str, payload: Any) -> None:
        """Driver: queue a change for the other ranks' next step (a no-op elsewhere)."""
        if self.is_driver:
            with self.lock:
                self._outbox.append((kind, payload))

    def record_request(self, group: Any) -> None:
        """Driver: a resolved request, pickled now so later changes to it don't travel."""
        self.record("add", pickle.dumps(group))

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def exchange(
        self, engine: ReplicaEngine, job: PassJob | None = None
    ) -> tuple[list[tuple[str, Action]], PassJob | None]:
        """The top of a step (call under `lock`): the driver broadcasts its changes and the
        actions it drained; other ranks replay the changes. Returns the actions to apply,
        and the patch pass the driver runs instead of a step (`job`, driver only: a TP
        replica's ranks run the pass's forward together, between steps).

        One broadcast of the pickle's length, and a second of the pickle only when there is
        something to say: a steady decode step costs one collective (`STOP`: the driver
        shut the replica down)."""
        data = b""
        if self.is_driver:
            changes, actions = self._outbox, engine.interventions.queue.drain()
            self._outbox = []
            if changes or actions or job is not None:
                if job is not None and job.source_rows is not None:  # the ranks' own devices
                    job = dataclasses.replace(job, source_rows=job.source_rows.cpu())
                data = pickle.dumps((changes, actions, job))
        size = torch.tensor([len(data)], dtype=torch.long)
        dist.broadcast(size, src=0, group=self.group)
        n = int(size.item())
        if n == STOP:
            self.stopped = True
            raise ReplicaStopped
        if n == 0:
            return [], None
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.is_driver
            else torch.empty(n, dtype=torch.uint8)
        )
        dist.broadcast(buf, src=0, group=self.group)
        if self.is_driver:
            return actions, None
        changes, actions, job = pickle.loads(buf.numpy().tobytes())
        for kind, payload in changes:
            engine.replay(kind, payload)
        return actions, job

    def finish_step(
        self,
        engine: ReplicaEngine,
        sched: SchedulerOutput,
        result: StepResult,
        plan: StepInterventions | None,
    ) -> StepResult:
        """After the forward: share the sampled tokens and each stage's captures, scores and
        gate firings; check every rank's steering state matches.

        A replica of one stage, or a step with nothing but tokens to share (no
        interventions, no logprobs asked for), shares one small tensor; otherwise the ranks
        exchange objects. Every rank decides alike, from the replicated schedule and plan."""
        if self.ctx.pp_size == 1 or (plan is None and not _wants_logprobs(sched)):
            return self._finish_by_tensor(engine, result)
        return self._finish_by_objects(engine, result, plan)

    def _finish_by_objects(
        self, engine: ReplicaEngine, result: StepResult, plan: StepInterventions | None
    ) -> StepResult:
        ctx = self.ctx
        part: dict[str, Any] = {"digest": engine.interventions.state_digest()}
        if ctx.rank == self.result_rank:
            part["result"] = result
        if plan is not None and ctx.tp_rank == 0 and ctx.pp_size > 1:
            part["captured"] = {k: v.cpu() for k, v in plan.captured.items()}
            layers = engine.interventions.local_layers
            part["layers"] = (layers.start, layers.stop)  # whose scores it computed
            part["scores"] = plan.scores
            part["fired"] = plan.fired
        parts: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(parts, part, group=self.group)
        digests = [p["digest"] for p in parts]
        if len(set(digests)) > 1:
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ReplicaDivergedError(
                f"ranks {bad} of this replica hold different steering state than rank 0"
            )
        if plan is not None:
            for rank, p in enumerate(parts):
                if rank == ctx.rank or "captured" not in p:
                    continue
                for key, rows in p["captured"].items():
                    plan.captured.setdefault(key, rows)
                if p["scores"] is not None:
                    lo, hi = p["layers"]
                    plan.scores[:, lo:hi] = p["scores"][:, lo:hi]
                if p["fired"] is not None:  # every rank's plan gates alike
                    plan.fired = plan.fired | p["fired"]
        return parts[self.result_rank]["result"]

    def _finish_by_tensor(self, engine: ReplicaEngine, result: StepResult) -> StepResult:
        """One all-gather of a small tensor: each rank's steering-state digest and the
        tokens it sampled (a stage before the last sampled none). Every rank takes the last
        stage's tokens as its own; the last stage's TP ranks sample from the same gathered
        logits, and must agree."""
        digest = engine.interventions.state_digest()
        tokens = [NO_TOKEN if t is None else t for t in result.sampled]
        mine = torch.tensor(
            list(int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)) + tokens,
            dtype=torch.long,
        )
        parts = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        bad = [r for r, p in enumerate(parts) if not torch.equal(p[:2], parts[0][:2])]
        if bad:
            raise ReplicaDivergedError(
                f"ranks {bad} of this replica hold different steering state than rank 0"
            )
        # Each TP rank feeds its own sampled tokens to the next step on its device
        # (overlapped steps' placeholders): a rank that sampled differently would embed
        # other tokens.
        sampled = parts[self.result_rank][2:]
        last_stage = range(self.result_rank, self.ctx.world_size)
        bad = [r for r in last_stage if not torch.equal(parts[r][2:], sampled)]
        if bad:
            raise ReplicaDivergedError(f"ranks {bad} of this replica sampled other tokens")
        if self.ctx.rank != self.result_rank:
            result.sampled = [None if t == NO_TOKEN else t for t in sampled.tolist()]
        return result

    def share_pass_result(self, result: PassResult | None) -> PassResult:
        """Every rank gets the patch pass's result, which only the last stage computed."""
        box = [result]
        dist.broadcast_object_list(box, src=self.result_rank, group=self.group)
        return box[0]

    def stop(self) -> None:
        """Driver: release the other ranks from their step loops (they raise ReplicaStopped)."""
        if self.is_driver and not self.stopped:
            self.stopped = True
            dist.broadcast(torch.tensor([STOP], dtype=torch.long), src=0, group=self.group)


def _wants_logprobs(sched: SchedulerOutput) -> bool:
    """Whether some request of the step asked for logprobs (top-k, of given token ids, or of
    its prompt): only the last stage has them, and they travel as objects."""
    for s in sched.scheduled:
        group = s.seq.group
        params = group.params
        if params.logprobs is not None or params.logprob_token_ids or group.prompt_logprobs:
            return True
    return False


def run_worker(engine: ReplicaEngine) -> None:
    """A non-driver rank's life: step in lock-step with the driver until it stops."""
    try:
        while True:
            engine.step()
    except ReplicaStopped:
        pass
