"""The pure part of a step: what the fused op and the capture/patch code need per token.

`StepPlanner.plan(scheduler output, steering state)` reads the scheduled sequences and their
requests' resolved interventions and returns a `StepInterventions` (each token's steering
row, latched bits, decode flag, dynamic gain, read-out row and latch carry; the rows each
capture copies and each patch replaces; who reads out and who gates). It changes no
steering state: the only things it writes are each sequence's KV signatures for the
positions it plans and the sequence's `gate_content` (what the latch carry compares).

Steady decode — the same sequences, one decode token each, nothing changed since — reuses
the last plan whole. The planner's epoch moves on anything a plan reads (admissions,
releases, actions, latches: the manager calls `invalidate`), and a plan is reused only
under the epoch it was made in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from services.engine.host_memory import to_device_async
from services.engine.interventions.planner import (
    SteerTokens,
    StepInterventions,
    block_capture_sites,
)
from services.engine.interventions.resolve import RowContent, SiteKey
from services.engine.interventions.tables import ZERO_ROW, SteeringTables
from services.engine.scheduler import SchedulerOutput


class StepPlanner:
    """Plans each step's intervention indices from the schedule and the steering state."""

    def __init__(self, tables: SteeringTables, device: torch.device, capture_rows: int = 0):
        self.tables, self.device = tables, device
        # Rows of the fixed capture buffer (0: every capture is an eager copy), and the
        # sites a block-capturing step runs the fused op at (post_block of every layer).
        self.capture_rows = capture_rows
        self.capture_sites = block_capture_sites(tables.num_layers)
        self.steps = 0  # steps planned
        self._epoch = 0
        self._plan_cache: tuple[tuple, tuple] | None = None
        self.num_cached_plans = 0  # steps planned from it

    def invalidate(self) -> None:
        """Something a plan reads changed: no earlier plan may be reused."""
        self._epoch += 1

    def plan(
        self,
        sched: SchedulerOutput,
        dynamic_gain: float,
        consumers: bool = False,
        view_sites: frozenset[SiteKey] = frozenset(),
    ) -> StepInterventions | None:
        """Per-token indices for this step, or None when nothing intervenes in it.
        `dynamic_gain`: the dynamic tier's gain; `consumers`: sync consumers are attached
        (they see every step), reading the residual at `view_sites`."""
        self.steps += 1
        self.tables.flush()  # the rows admitted since the last step, before it reads them
        decode_only = True
        capturers: list[tuple[int, Any]] = []  # (request index, its capture)
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            seq.record_kv_sigs(s.start, s.num_tokens)
            decode_only = decode_only and s.num_tokens == 1 and s.start >= seq.num_prompt_tokens
            iv = seq.group.interventions
            if iv is not None and iv.capture is not None and seq.index == 0:
                capturers.append((i, iv.capture))
        kernel_sites = self.tables.active_sites()
        key = None
        if decode_only and (kernel_sites or capturers) and not consumers:
            key = (self._epoch, *(s.seq.seq_id for s in sched.scheduled))
            cached = self._plan_cache
            if cached is not None and cached[0] == key:
                plan = self._reuse(sched, kernel_sites, *cached[1])
                if plan is not None:
                    self.num_cached_plans += 1
                    return plan
        capture_rows: dict[SiteKey, list[int]] = {}
        capture_meta: dict[SiteKey, list[tuple[str, list[int]]]] = {}
        # (request index, position, token row) of each token a capture wants this step
        block: list[tuple[int, int, int]] = []
        readers: list[tuple[int, Any]] = []
        gated: list[tuple[int, RowContent]] = []
        patch_rows: dict[SiteKey, list[tuple[int, torch.Tensor, float]]] = {}
        row0 = 0
        for i, s in enumerate(sched.scheduled):
            iv = s.seq.group.interventions
            if iv is None:
                row0 += s.num_tokens
                continue
            if iv.capture is not None and s.seq.index == 0:
                P = s.seq.num_prompt_tokens
                wanted = [
                    p for p in range(s.start, s.start + s.num_tokens) if iv.capture.wants(p, P)
                ]
                block += [(i, p, row0 + p - s.start) for p in wanted]
            if iv.probes and s.samples:  # probes read the residual a token is sampled from
                readers.append((i, iv))
            if iv.decode_content.gates:
                gated.append((i, iv.decode_content))
            if iv.patches is not None:
                end = s.start + s.num_tokens
                for key, entries in iv.patches.by_site.items():
                    for pos, target, alpha in entries:
                        if s.start <= pos < end:  # row = token offset + (position − start)
                            patch_rows.setdefault(key, []).append(
                                (row0 + pos - s.start, target, alpha)
                            )
            row0 += s.num_tokens
        if len(block) > self.capture_rows:  # more than the buffer holds: eager copies
            self._plan_eager_captures(sched, block, capture_rows, capture_meta)
            block = []
        if block:  # the fused op runs at every post_block: it writes the captures there
            kernel_sites = kernel_sites | self.capture_sites
        if not (kernel_sites or consumers or capture_rows or patch_rows):
            return None
        # only the kernel reads them, so a step without kernel sites plans none
        steer_tokens = (
            self._plan_tokens(sched, bool(readers), dynamic_gain) if kernel_sites else None
        )
        if block:
            assert steer_tokens is not None
            steer_tokens.capture_rows[[r for _, _, r in block]] = np.arange(len(block))

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device_async(data, dtype, self.device)

        plan = StepInterventions(
            tables=self.tables,
            kernel_sites=kernel_sites,
            steer_tokens=steer_tokens,
            capture_index={k: tensor(v, torch.long) for k, v in capture_rows.items()},
            capture_meta=capture_meta,
            readers=readers,
            gated=gated,
            patch_index={
                k: (
                    tensor([r for r, _, _ in v], torch.long),
                    torch.stack([t for _, t, _ in v]),
                    tensor([a for _, _, a in v], torch.float32),
                )
                for k, v in patch_rows.items()
            },
            view_sites=set(view_sites),
            decode_only=decode_only,
            capture_block=bool(block),
            block_captures=[(i, pos) for i, pos, _ in block],
        )
        if block:
            caps = [sched.scheduled[i].seq.group.interventions.capture for i, _, _ in block]
            plan.block_slots, plan.block_dtype = self._block_columns(caps)
        # Cached unless planning itself moved the epoch (a gate met a sequence).
        cacheable = not (capture_rows or patch_rows) and steer_tokens is not None
        if key is not None and cacheable and key[0] == self._epoch:
            entry = (steer_tokens, readers, gated, plan.read_index, plan.gate_index, capturers)
            self._plan_cache = (key, entry)
        return plan

    def _reuse(
        self,
        sched: SchedulerOutput,
        kernel_sites: set[SiteKey],
        steer_tokens: SteerTokens,
        readers: list,
        gated: list,
        read_index: Any,
        gate_index: Any,
        capturers: list[tuple[int, Any]],
    ) -> StepInterventions | None:
        """The plan of the step before for the same all-decode sequences, with this step's
        captures (each request's one token, at its next position); None when they do not
        fit the capture buffer (the step is planned in full, with eager copies)."""
        block = []
        for i, cap in capturers:
            s = sched.scheduled[i]
            if cap.wants(s.start, s.seq.num_prompt_tokens):
                block.append((i, s.start))
        if len(block) > self.capture_rows:
            return None
        if capturers:  # this step's capture rows, on a copy of the steady fields
            rows = np.full(len(sched.scheduled), -1, np.int32)
            rows[[i for i, _ in block]] = np.arange(len(block), dtype=np.int32)
            steer_tokens = dataclasses.replace(steer_tokens, capture_rows=rows)
        slots, dtype = (), torch.float32
        if block:
            by_request = dict(capturers)
            slots, dtype = self._block_columns([by_request[i] for i, _ in block])
        return StepInterventions(
            self.tables,
            kernel_sites | self.capture_sites if block else kernel_sites,
            steer_tokens,
            readers=readers,
            gated=gated,
            read_index=read_index,
            gate_index=gate_index,
            decode_only=True,
            capture_block=bool(block),
            block_captures=block,
            block_slots=slots,
            block_dtype=dtype,
        )

    @staticmethod
    def _block_columns(caps: list[Any]) -> tuple[tuple[int, ...], torch.dtype]:
        """A capture block's columns, the slots some capture of `caps` asked for (sorted),
        and its host dtype: bfloat16 only if every one asked for it."""
        slots = frozenset().union(*{cap.slots for cap in caps})
        wide = any(cap.dtype != torch.bfloat16 for cap in caps)
        return tuple(sorted(slots)), torch.float32 if wide else torch.bfloat16

    def _plan_tokens(self, sched: SchedulerOutput, reads: bool, dynamic_gain: float) -> SteerTokens:
        """Each token's steering row, latched bits, decode flag, dynamic gain, read-out row
        and latch carry (`reads`: some request reads out this step)."""
        # One segment per request's prompt tokens and one per its decode tokens, each
        # token of a segment alike: built per request, repeated per token by numpy.
        rows: list[int] = []
        latched: list[int] = []
        decode: list[float] = []
        gain: list[float] = []
        carry: list[bool] = []
        lengths: list[int] = []
        read_rows = np.full(sched.num_tokens, -1, np.int32) if reads else None
        dyn = dynamic_gain if self.tables.dynamic else 0.0
        row0 = 0
        for i, s in enumerate(sched.scheduled):
            seq, n = s.seq, s.num_tokens
            iv = seq.group.interventions
            n_pre = min(n, seq.num_prompt_tokens - s.start)
            if n_pre > 0:  # prompt tokens (a prefill chunk, or a recompute)
                rows.append(iv.prefill_row if iv else ZERO_ROW)
                latched.append(0)
                decode.append(0.0)
                gain.append(0.0)
                carry.append(False)
                lengths.append(n_pre)
            n_dec = n - max(n_pre, 0)
            if n_dec > 0:
                rows.append(iv.effective_decode_row if iv else ZERO_ROW)
                latched.append(seq.latched)
                decode.append(1.0)
                gain.append(dyn * iv.dyn_gain if iv else dyn)
                # The bits the step before fired (still on the device if it is in flight)
                # latch only under the gates they fired for.
                content = iv.decode_content if iv is not None else None
                carry.append(content is not None and seq.gate_content is content)
                lengths.append(n_dec)
                gates = content if content is not None and content.gates else None
                if seq.gate_content is not gates:
                    seq.gate_content = gates
                    self._epoch += 1  # the next step's carry differs from this one's
            if read_rows is not None and iv is not None and iv.probes and s.samples:
                read_rows[row0 + n - 1] = i
            row0 += n
        counts = np.asarray(lengths, np.int64)

        def per_token(values: list, dtype: type) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype), counts)

        return SteerTokens(
            rows=per_token(rows, np.int32),
            latched=per_token(latched, np.int32),
            decode=per_token(decode, np.float32),
            gain=per_token(gain, np.float32),
            read_rows=read_rows if read_rows is not None else np.full(row0, -1, np.int32),
            capture_rows=np.full(row0, -1, np.int32),
            carry=per_token(carry, np.bool_),
        )

    @staticmethod
    def _plan_eager_captures(
        sched: SchedulerOutput,
        wanted: list[tuple[int, int, int]],
        capture_rows: dict[SiteKey, list[int]],
        capture_meta: dict[SiteKey, list[tuple[str, list[int]]]],
    ) -> None:
        """The rows each (layer, site) copies eagerly, for `wanted` captures given as
        (request index, position, token row), grouped by request in order."""
        by_request: dict[int, list[tuple[int, int]]] = {}
        for i, p, r in wanted:
            by_request.setdefault(i, []).append((p, r))
        for i, entries in by_request.items():
            group = sched.scheduled[i].seq.group
            positions = [p for p, _ in entries]
            rows = [r for _, r in entries]
            for key in group.interventions.capture.sites:
                capture_rows.setdefault(key, []).extend(rows)
                capture_meta.setdefault(key, []).append((group.request_id, positions))
