"""Continuous batching: which sequences compute how many tokens this step.

Pure Python over `Sequence` objects and the `BlockManager`: no tensors, no model, so every
scheduling decision is unit-testable. Running sequences go first (in admission order),
then waiting ones are admitted while the token budget, `max_num_seqs` and free KV blocks
allow. When a running sequence needs a block and none is free, the most recently admitted
running sequence is preempted: its blocks are freed and it is recomputed later.

Scheduled in `parts` M > 1 (overlapped steps of pipeline stages), a step takes at most
⌈running / M⌉ running sequences and none sampled by one of the M - 1 steps before it, so
consecutive steps carry disjoint parts of the batch: while the last stage computes one
part, the first stage computes the next, whose tokens it took from the last stage on the
device (`recent_tokens.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine.kv.block_manager import BlockManager
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import RequestGroup, SeqStatus, Sequence


@dataclass(slots=True)
class StepRequest:
    """What the model runner gets for one scheduled sequence: plain data, no live state.

    As in vLLM's `SchedulerOutput`, the runner never sees a `Sequence`: it reads these
    fields while building the step batch and nothing after. `block_ids` is the sequence's
    block table at scheduling time (covering positions < start + num_tokens).
    """

    seq_id: int
    token_ids: list[int]  # tokens [start, start + num_tokens)
    start: int  # positions before it already have KV (num_computed)
    block_ids: list[int]
    samples: bool  # the span reaches the last token, so the step samples the next one
    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own generator
    # Prompt logprobs this step computes: (first position, count, the actual next prompt
    # tokens, top-k). Position p's logits score prompt token p + 1.
    prompt_logprobs: tuple[int, int, list[int], int] | None = None
    adapter_row: int = 0  # its row in the adapted Linears' coefficient tables (0: none)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + num_tokens) get KV computed.

    The engine's side of the seam (interventions and bookkeeping read the live sequence);
    `request()` is the runner's side."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so it samples the next one."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]

    def request(self) -> StepRequest:
        seq, start, n = self.seq, self.start, self.num_tokens
        group = seq.group
        prompt_lp = None
        if group.prompt_logprobs is not None and seq.index == 0:
            # Record only positions not yet scored (a preempted request recomputes).
            first = max(start, len(group.prompt_logprobs) - 1)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last > first:
                next_ids = seq.token_ids[first + 1 : last + 1]
                prompt_lp = (first, last - first, next_ids, group.params.prompt_logprobs or 0)
        return StepRequest(
            seq.seq_id,
            seq.token_ids[start : start + n],
            start,
            seq.block_table,
            start + n == seq.num_tokens,
            group.params,
            seq.generator,
            prompt_lp,
            group.adapter_row,
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def requests(self) -> list[StepRequest]:
        """The runner's input: every scheduled sequence as plain data, in batch order."""
        return [s.request() for s in self.scheduled]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        admit_hook: Callable[[Sequence], bool] | None = None,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Called before a waiting sequence is admitted; False makes it (and those behind it)
        # wait. The engine uses it to hand out steering rows.
        self.admit_hook = admit_hook
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, group: RequestGroup) -> None:
        self.waiting.append(group.seqs[0])

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, parts: int = 1, step: int = 0) -> SchedulerOutput:
        """Step `step`'s sequences; `parts` > 1: one part of the batch (module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i, taken = 0, 0
        cap = -(-len(self.running) // parts)  # running sequences this step
        while i < len(self.running) and budget > 0 and taken < cap:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            # Its last token is still on the device; scheduled in parts, a sequence also
            # sits out the steps of the other parts, while its token is still being computed.
            late = parts > 1 and seq.num_pending and step - seq.pending_step < parts
            if seq.final_pending or n == 0 or late:
                i += 1
                continue
            while self.bm.blocks_needed(seq, n) > self.bm.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # preempted itself: nothing later in `running` is left either
            self.bm.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
            i += 1
            taken += 1

        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            cached, hashes = [], []
            if not seq.block_table and not self._needs_all_prompt_positions(seq):
                cached, hashes = self.bm.match_prefix(seq)
            start = max(seq.num_computed, len(cached) * self.bm.block_size)
            remaining = seq.num_tokens - start
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            new_blocks = self.bm.blocks_for(start + n) - max(len(seq.block_table), len(cached))
            if new_blocks > self.bm.num_free_after_touch(cached):
                break
            if self.admit_hook is not None and not self.admit_hook(seq):
                break
            self.waiting.popleft()
            if not seq.block_table:
                self.bm.admit(seq, cached, hashes)
                if seq.group.num_cached_tokens is None and seq.index == 0:
                    seq.group.num_cached_tokens = seq.num_computed
            self.bm.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return out

    @staticmethod
    def _needs_all_prompt_positions(seq: Sequence) -> bool:
        # Prompt logprobs (and captures of the prompt) need every prompt position computed.
        return (
            seq.group.skip_prefix_cache
            and seq.index == 0
            and (seq.num_computed < seq.num_prompt_tokens)
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the step ran and publish newly full blocks."""
        self.advance(out)
        self.publish(out)

    @staticmethod
    def advance(out: SchedulerOutput) -> None:
        """Count the step's tokens as computed (an overlapped step: as soon as it is launched,
        so the next step can be scheduled behind it)."""
        for s in out.scheduled:
            s.seq.num_computed += s.num_tokens

    def publish(self, out: SchedulerOutput) -> None:
        """Offer the step's newly full blocks to the prefix cache, once their tokens are known."""
        for s in out.scheduled:
            if not s.seq.is_finished:
                self.bm.register_full_blocks(s.seq)

    def fork_samples(self, parent: Sequence) -> None:
        """Release samples 1..n-1 of `parent`'s request, sharing its computed prompt blocks."""
        # Share only blocks made of prompt tokens, and leave one token for each child
        # to compute itself so it samples its own first token.
        k = (parent.num_prompt_tokens - 1) // self.bm.block_size
        for child in parent.group.seqs[1:]:
            if child.status is SeqStatus.PENDING_FORK:
                self.bm.fork(parent, child, k)
                child.status = SeqStatus.WAITING
                self.waiting.appendleft(child)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence and free its blocks (cached blocks stay revivable)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        if seq.status is not SeqStatus.FINISHED:
            self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
