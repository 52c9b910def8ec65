"""The step observer: after the forward pass, what the step read back goes where it belongs.

Captures go to the capture sink; read-outs and `abort_when` verdicts to the step's
report (the engine attaches them to tokens and stops requests); gate bits latch into
their sequences and count for the firing rates; sync consumers see the step's view and
their actions go to the action queue. It runs when a step is accepted, which with
overlapped steps is after the next step was planned and launched.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.engine.interventions.actions import ACTION_TYPES, ActionQueue
from services.engine.interventions.capture import BlockWrite, CaptureSink
from services.engine.interventions.consumers import (
    ConsumerTiming,
    RequestSpan,
    StepView,
    SyncConsumer,
)
from services.engine.interventions.planner import StepInterventions
from services.engine.interventions.resolve import RowContent, SiteKey
from services.engine.interventions.sites import site_key
from services.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class StepReport:
    """What the forward pass observed, per scheduled sequence (aligned with the schedule)."""

    readouts: list[dict[str, float] | None]
    aborts: list[str | None]  # the name of the abort_when probe that fired, if any


class StepObserver:
    """Routes what each step read back; holds the sync consumers and the gate/probe counts."""

    def __init__(
        self,
        sink: Callable[[], CaptureSink],
        queue: ActionQueue,
        steps: Callable[[], int],
        invalidate: Callable[[], None],
    ):
        self._sink, self.queue, self.steps, self.invalidate = sink, queue, steps, invalidate
        # name -> (consumer, the (layer, site)s it reads), checked once when added
        self.consumers: dict[str, tuple[SyncConsumer, frozenset[SiteKey]]] = {}
        self.consumer_timing: dict[str, ConsumerTiming] = {}
        self.num_probe_aborts = 0
        # Captured tokens routed from a decode step's capture block, and from eager copies
        self.num_block_captures = 0
        self.num_eager_captures = 0
        # False on the ranks of a parallel replica that deliver no outputs (`StepSync`):
        # they hold the same requests, but only the driver's captures reach anyone.
        self.keeps_captures = True
        # Declarative gates, per (layer, site): decode tokens they were evaluated on, and
        # how many of those they fired on (the dashboard's firing rates).
        self.gate_tokens: Counter[SiteKey] = Counter()
        self.gate_fired: Counter[SiteKey] = Counter()

    @property
    def sink(self) -> CaptureSink:
        return self._sink()

    def view_sites(self) -> frozenset[SiteKey]:
        """The (layer, site)s some sync consumer reads."""
        return frozenset(k for _, keys in self.consumers.values() for k in keys)

    def observe(self, sched: SchedulerOutput, step: StepInterventions) -> StepReport | None:
        """Route this step's captures, read-outs and gate firings, and run the sync
        consumers; returns the read-outs and aborts (None when nothing came back)."""
        reads = step.capture_meta or step.block_captures or step.readers or step.gated
        if not (reads or self.consumers):
            return None  # steering alone: nothing comes back
        n = len(sched.scheduled)
        report = StepReport([None] * n, [None] * n)
        if step.capture_meta and self.keeps_captures:
            self._write_captures(sched, step)
        if step.block_captures and self.keeps_captures:
            self._write_block(sched, step)
        if step.readers:
            values, at = step.probe_values(), 0
            for i, iv in step.readers:
                names = iv.readout_names
                k = len(names)
                if k:
                    report.readouts[i] = dict(zip(names, values[at : at + k], strict=True))
                end = at + len(iv.probes)
                if end > at + k:  # abort_when probes follow the read-outs
                    for probe, value in zip(iv.probes[k:], values[at + k : end], strict=True):
                        if probe.fires(value):
                            report.aborts[i] = probe.name
                            self.num_probe_aborts += 1
                            break
                at = end
        if step.gate_index is not None:
            self._latch_decode(sched, step)
        elif step.gated:
            self._latch(sched, step, self._spans(sched))
        if self.consumers:
            self._run_consumers(sched, step, self._spans(sched))
        return report

    def _write_captures(self, sched: SchedulerOutput, step: StepInterventions) -> None:
        """The step's eager copies, per (layer, site), to the sink; a request that finished
        while this step was in flight (overlapped) gets nothing more."""
        done = {s.seq.group.request_id for s in sched.scheduled if s.seq.is_finished}
        # This stage's rows the step copied back itself (`Readback.copy_eager`); a pipeline
        # replica's driver also holds the other stages' rows (`StepSync`), on the host.
        landed = step.captured_host or {}
        for key, rows in step.captured.items():
            # [sum of positions, H] float32, in capture_meta's order
            rows = landed[key] if key in landed else rows.float().cpu()
            name, at = site_key(*key), 0
            for request_id, positions in step.capture_meta[key]:
                if request_id not in done:
                    self.sink.write(request_id, name, positions, rows[at : at + len(positions)])
                at += len(positions)
        # positions captured, each request's once however many sites it captures
        per_request = {rid: len(p) for meta in step.capture_meta.values() for rid, p in meta}
        self.num_eager_captures += sum(per_request.values())

    def place_block(self, sched: SchedulerOutput, step: StepInterventions) -> None:
        """Before the step runs: where the device is to write its capture block's rows
        (`CaptureSink.place`, every row, finished or not: that is known after the step)."""
        if step.block_captures and self.keeps_captures:
            step.block_writes = self._block_writes(sched, step)
            step.block_placement = self.sink.place(step.block_writes, step.block_slots)

    def _write_block(self, sched: SchedulerOutput, step: StepInterventions) -> None:
        """The step's capture block, one sink call for all its capturing requests (those
        not finished while the step was in flight)."""
        block = step.captured_block
        assert block is not None, "collect() gives every block-capturing step its block"
        writes = step.block_writes or self._block_writes(sched, step)
        scheduled = sched.scheduled
        if any(scheduled[i].seq.is_finished for i, _ in step.block_captures):
            writes = [
                w
                for w, (i, _) in zip(writes, step.block_captures, strict=True)
                if not scheduled[i].seq.is_finished
            ]
        self.sink.write_block(block, writes)
        self.num_block_captures += len(writes)

    @staticmethod
    def _block_writes(sched: SchedulerOutput, step: StepInterventions) -> list[BlockWrite]:
        """Each capturing request's row of the step's block, in block row order."""
        scheduled, writes = sched.scheduled, []
        for row, (i, position) in enumerate(step.block_captures):  # 128 a step at batch 128
            seq = scheduled[i].seq
            group = seq.group
            capture = group.interventions.capture
            rows = capture.max_positions(seq.num_prompt_tokens, group.params.max_tokens)
            writes.append(
                BlockWrite(group.request_id, position, row, capture.keys, capture.dtype, rows)
            )
        return writes

    def _latch_decode(self, sched: SchedulerOutput, step: StepInterventions) -> None:
        """`_latch` for an all-decode step, whose gated requests have one token each at their
        own row: the bits are gathered and tested as arrays, and only requests whose
        latching gates fired are visited."""
        assert step.fired is not None and step.gate_index is not None
        rows, latching, groups = step.gate_index
        current = np.fromiter(
            (self._current(sched.scheduled[i].seq, c) for i, c in step.gated), bool, len(rows)
        )
        bits = np.where(current, step.fired.numpy()[rows], 0)
        for j in np.flatnonzero(bits & latching).tolist():
            i, content = step.gated[j]
            s = sched.scheduled[i]
            self._latch_bits(s.seq, content, int(bits[j]), s.start + 1)
        for (key, bit), idx in groups:
            idx = idx[current[idx]]
            self.gate_tokens[key] += len(idx)
            self.gate_fired[key] += int(((bits[idx] >> bit) & 1).sum())

    @staticmethod
    def _current(seq: Any, content: RowContent) -> bool:
        """Whether `seq` still runs under the gates of `content` (else the bits it fired
        under them mean other gates, or nothing: it has finished)."""
        iv = seq.group.interventions
        return not seq.is_finished and iv is not None and iv.decode_content is content

    def _latch_bits(self, seq: Any, content: RowContent, bits: int, next_position: int) -> None:
        """Latch `bits` of `content`'s latching gates into `seq`."""
        new = bits & content.latching_bits & ~seq.latched
        if new:
            seq.latched |= new  # n > 1 samples latch apart
            self.invalidate()
            # Positions computed since (a step in flight) latched these bits on the device
            # already: their KV signatures say so now.
            seq.resign_kv_from(next_position)

    def _latch(
        self, sched: SchedulerOutput, step: StepInterventions, spans: list[tuple[int, int]]
    ) -> None:
        """Latch the gate bits each gated request fired on its decode tokens, and count them
        for the firing rates (per distinct content, not per request)."""
        assert step.fired is not None, "collect() gives every gated step its fired bits"
        fired = step.fired.tolist()
        by_content: dict[int, tuple[RowContent, list[int]]] = {}
        for i, content in step.gated:
            s = sched.scheduled[i]
            start, count = spans[i]
            # Gates act on decode tokens only: the span's tail past the prompt.
            n_dec = count - max(0, min(count, s.seq.num_prompt_tokens - s.start))
            if n_dec <= 0:
                continue
            if not self._current(s.seq, content):
                continue
            tokens = fired[start + count - n_dec : start + count]
            bits = 0
            for f in tokens:
                bits |= f
            self._latch_bits(s.seq, content, bits, s.start + count)
            by_content.setdefault(id(content), (content, []))[1].extend(tokens)
        for content, tokens in by_content.values():
            for key, gate in content.gates.items():
                self.gate_tokens[key] += len(tokens)
                self.gate_fired[key] += sum((f >> gate.bit) & 1 for f in tokens)

    @staticmethod
    def _spans(sched: SchedulerOutput) -> list[tuple[int, int]]:
        spans, at = [], 0
        for s in sched.scheduled:
            spans.append((at, s.num_tokens))
            at += s.num_tokens
        return spans

    def _run_consumers(
        self, sched: SchedulerOutput, step: StepInterventions, spans: list[tuple[int, int]]
    ) -> None:
        requests = [
            RequestSpan(
                request_id=s.seq.group.request_id,
                sample=s.seq.index,
                start=start,
                num_tokens=count,
                first_position=s.start,
                num_prefill_tokens=max(0, min(count, s.seq.num_prompt_tokens - s.start)),
            )
            for s, (start, count) in zip(sched.scheduled, spans, strict=True)
        ]
        for name, (c, keys) in self.consumers.items():
            timing = self.consumer_timing[name]
            view = StepView(
                step=self.steps(),
                activations={k: step.view[k] for k in keys},
                requests=requests,
            )
            t0 = time.perf_counter()
            try:
                actions = list(c.on_step(view) or [])
            except Exception as exc:  # a consumer's bug must not stop serving
                timing.errors += 1
                timing.last_error = repr(exc)
                log.exception("sync consumer %s failed", name)
                actions = []
            timing.record((time.perf_counter() - t0) * 1e3)
            for action in actions:
                if isinstance(action, ACTION_TYPES):
                    self.queue.put(action, name)
                else:
                    timing.errors += 1
                    timing.last_error = f"returned a non-action: {action!r}"
