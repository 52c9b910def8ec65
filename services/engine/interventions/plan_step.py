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

from typing import Any

import numpy as np
import torch

from services.engine.interventions.planner import SteerTokens, StepInterventions
from services.engine.interventions.resolve import RowContent, SiteKey
from services.engine.interventions.tables import ZERO_ROW, SteeringTables
from services.engine.scheduler import ScheduledSeq, SchedulerOutput


class StepPlanner:
    """Plans each step's intervention indices from the schedule and the steering state."""

    def __init__(self, tables: SteeringTables, device: torch.device):
        self.tables, self.device = tables, device
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
        decode_only = True
        for s in sched.scheduled:
            seq = s.seq
            seq.record_kv_sigs(s.start, s.num_tokens)
            decode_only = decode_only and s.num_tokens == 1 and s.start >= seq.num_prompt_tokens
        kernel_sites = self.tables.active_sites()
        key = None
        if decode_only and kernel_sites and not consumers:
            key = (self._epoch, *(s.seq.seq_id for s in sched.scheduled))
            cached = self._plan_cache
            if cached is not None and cached[0] == key:
                self.num_cached_plans += 1
                steer_tokens, readers, gated, read_index, gate_index = cached[1]
                return StepInterventions(
                    self.tables,
                    kernel_sites,
                    steer_tokens,
                    readers=readers,
                    gated=gated,
                    read_index=read_index,
                    gate_index=gate_index,
                    decode_only=True,
                )
        capture_rows: dict[SiteKey, list[int]] = {}
        capture_meta: dict[SiteKey, list[tuple[str, list[int]]]] = {}
        readers: list[tuple[int, Any]] = []
        gated: list[tuple[int, RowContent]] = []
        patch_rows: dict[SiteKey, list[tuple[int, torch.Tensor, float]]] = {}
        row0 = 0
        for i, s in enumerate(sched.scheduled):
            iv = s.seq.group.interventions
            if iv is None:
                row0 += s.num_tokens
                continue
            if iv.capture is not None:
                self._plan_capture(row0, s, iv, capture_rows, capture_meta)
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
        if not (kernel_sites or consumers or capture_rows or patch_rows):
            return None
        # only the kernel reads them, so a step without kernel sites plans none
        steer_tokens = (
            self._plan_tokens(sched, bool(readers), dynamic_gain) if kernel_sites else None
        )

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

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
        )
        # Cached unless planning itself moved the epoch (a gate met a sequence).
        if key is not None and not (capture_rows or patch_rows) and key[0] == self._epoch:
            self._plan_cache = (
                key,
                (steer_tokens, readers, gated, plan.read_index, plan.gate_index),
            )
        return plan

    def _plan_tokens(self, sched: SchedulerOutput, reads: bool, dynamic_gain: float) -> SteerTokens:
        """Each token's steering row, latched bits, decode flag, dynamic gain, read-out row
        and latch carry (`reads`: some request reads out this step)."""
        rows: list[int] = []
        latched: list[int] = []
        decode: list[float] = []
        gain: list[float] = []
        carry: list[bool] = []
        read_rows = np.full(sched.num_tokens, -1, np.int32) if reads else None
        dyn = dynamic_gain if self.tables.dynamic else 0.0
        row0 = 0
        for i, s in enumerate(sched.scheduled):
            seq, n = s.seq, s.num_tokens
            iv = seq.group.interventions
            n_pre = min(n, seq.num_prompt_tokens - s.start)
            if n_pre > 0:  # prompt tokens (a prefill chunk, or a recompute)
                rows += [iv.prefill_row if iv else ZERO_ROW] * n_pre
                latched += [0] * n_pre
                decode += [0.0] * n_pre
                gain += [0.0] * n_pre
                carry += [False] * n_pre
            n_dec = n - max(n_pre, 0)
            if n_dec > 0:
                rows += [iv.effective_decode_row if iv else ZERO_ROW] * n_dec
                latched += [seq.latched] * n_dec
                decode += [1.0] * n_dec
                gain += [dyn * iv.dyn_gain if iv else dyn] * n_dec
                # The bits the step before fired (still on the device if it is in flight)
                # latch only under the gates they fired for.
                content = iv.decode_content if iv is not None else None
                carry += [content is not None and seq.gate_content is content] * n_dec
                gates = content if content is not None and content.gates else None
                if seq.gate_content is not gates:
                    seq.gate_content = gates
                    self._epoch += 1  # the next step's carry differs from this one's
            if read_rows is not None and iv is not None and iv.probes and s.samples:
                read_rows[row0 + n - 1] = i
            row0 += n
        return SteerTokens(
            rows=np.asarray(rows, np.int32),
            latched=np.asarray(latched, np.int32),
            decode=np.asarray(decode, np.float32),
            gain=np.asarray(gain, np.float32),
            read_rows=read_rows if read_rows is not None else np.full(row0, -1, np.int32),
            carry=np.asarray(carry, np.bool_),
        )

    @staticmethod
    def _plan_capture(
        row0: int,
        s: ScheduledSeq,
        iv: Any,
        capture_rows: dict[SiteKey, list[int]],
        capture_meta: dict[SiteKey, list[tuple[str, list[int]]]],
    ) -> None:
        """Rows this sequence's captures copy, at each (layer, site)."""
        seq, n = s.seq, s.num_tokens
        assert iv.capture is not None
        if seq.index != 0:
            return
        P = seq.num_prompt_tokens
        positions = [p for p in range(s.start, s.start + n) if iv.capture.wants(p, P)]
        if positions:
            rows = [row0 + p - s.start for p in positions]
            for key in iv.capture.sites:
                capture_rows.setdefault(key, []).extend(rows)
                capture_meta.setdefault(key, []).append((seq.group.request_id, positions))
