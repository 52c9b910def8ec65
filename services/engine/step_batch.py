"""The plain data a step moves between host and device.

- `StepBatch`: the step's flat token batch, built in one pass into persistent pinned host
  buffers (two sets, used in turn) and copied to persistent device buffers in one
  transfer; its views are what attention, sampling and the fused steering op read.
- `PendingStep` / `StepResult`: a launched step, whose sampled tokens come back through a
  pinned host buffer behind the device's work, and what it sampled.
- `graph_batch_sizes`: the decode batch sizes CUDA graphs are captured for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.attention import StepAttentionInputs
from services.engine.interventions.planner import StepInterventions
from services.engine.sampler import PromptLogprobs, SampledBatch


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled token (or None) and its logprob dict, plus prompt
    logprobs computed this step as (first prompt position, list of dicts)."""

    sampled: list[int | None]
    logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[tuple[int, list[dict[int, float]]] | None]


class PendingStep:
    """A launched step: its sampled tokens are computed (or being computed) on the device
    and copied to a pinned host buffer behind them; `result()` waits for that copy only."""

    def __init__(self, num_seqs: int, sample_rows: list[int]):
        self.num_seqs = num_seqs
        self.sample_rows = sample_rows  # index in the step's requests of each sampled row
        self.sampled: SampledBatch | None = None
        self.host: torch.Tensor | None = None  # pinned copy of sampled.packed()
        self.copied: torch.cuda.Event | None = None
        # Prompt logprobs this step computes, as (first prompt position, their copy home)
        self.prompt_logprobs: list[tuple[int, PromptLogprobs] | None] = [None] * num_seqs
        # The step's interventions and the host copies of what the fused op wrote for them.
        self.interventions: StepInterventions | None = None
        self.readback: dict[str, Any] = {}  # `Readback` copies, by what they are
        # What must be queued before the step counts as done (a first pipeline stage's
        # receive of the step's tokens from the last stage, if no later launch took them).
        self.settle: Callable[[], None] | None = None

    def result(self) -> StepResult:
        if self.settle is not None:
            self.settle()
            self.settle = None
        n = self.num_seqs
        prompt_logprobs = [
            p if p is None else (p[0], p[1].to_dicts()) for p in self.prompt_logprobs
        ]
        result = StepResult([None] * n, [None] * n, prompt_logprobs)
        if self.copied is not None:
            self.copied.synchronize()
        if self.interventions is not None:
            self.interventions.collect(self.readback)
            self.interventions = None  # collected once
        if self.sampled is None:
            return result
        assert self.host is not None
        out = self.sampled.unpack(self.host.tolist())
        for j, i in enumerate(self.sample_rows):
            result.sampled[i] = out.token_ids[j]
            result.logprobs[i] = out.logprobs[j]
        return result


class HostCopies:
    """Pinned host buffers a step's sampled ids (and asked logprobs) come back through,
    per dtype, `ring` of each used in turn: a step's copy never overwrites one the host has
    not read, with up to `ring - 1` later steps launched before it is (the engine's steps
    in flight: one, or a pipeline's microbatches)."""

    def __init__(self, device: torch.device, ring: int = 2):
        self.device = device
        self.ring = ring
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}

    def copy(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying `packed` to the host behind the step: (its host tensor, the
        copy's event); on CPU, `packed` itself."""
        if self.device.type != "cuda":
            return packed, None
        kind = self._buffers.setdefault(packed.dtype, [])
        while len(kind) < self.ring:
            kind.append(torch.empty(0))
        kind.append(kind.pop(0))  # the oldest goes again
        if kind[-1].numel() < packed.numel():
            kind[-1] = torch.empty(2 * packed.numel(), dtype=packed.dtype, pin_memory=True)
        host = kind[-1][: packed.numel()]
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch-size buckets a CUDA graph is captured for: 1, 2, 4, 8, then every 8."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 8)
    return [*sizes, max_num_seqs]


# SteerTokens, as StepBatch `steer_*` fields (and StepInterventions.bind's order)
STEER_FIELDS = ("rows", "latched", "decode", "gain", "read_rows", "capture_rows", "carry")


class StepBatch:
    """The flat inputs of one step, in persistent buffers reused by every step.

    A pinned host buffer holds every field at a fixed offset (the block table last, so a
    step copies only the rows it uses); one device buffer mirrors it. Fields are typed
    views of the same bytes, so building a step writes numpy arrays and uploading it is a
    single `copy_`. A CUDA graph captured over the device views sees each step's values.

    On CUDA there are two host buffers, used in turn: with overlapped steps the host builds
    step N+1 while step N's upload may still wait in the stream, so a buffer is rewritten
    only after its previous upload has run (an event per buffer).
    """

    FIELDS = (  # name, dtype, length in units of (tokens, sequences)
        ("input_ids", torch.int64, (1, 0)),
        ("positions", torch.int64, (1, 0)),
        ("slot_mapping", torch.int64, (1, 0)),
        ("prev_rows", torch.int64, (1, 0)),  # placeholder tokens: row in the last sampled
        # the fused steer op's per-token inputs (interventions.planner.SteerTokens)
        ("steer_rows", torch.int32, (1, 0)),
        ("steer_latched", torch.int32, (1, 0)),
        ("steer_decode", torch.float32, (1, 0)),
        ("steer_gain", torch.float32, (1, 0)),
        ("steer_read_rows", torch.int32, (1, 0)),
        ("steer_capture_rows", torch.int32, (1, 0)),  # row of Readback.captures, or -1
        ("steer_carry", torch.int32, (1, 0)),  # row of Readback.last_fired to latch, or -1
        ("adapter_rows", torch.int32, (1, 0)),  # row of the adapters' coefficient tables
        ("logits_rows", torch.int64, (0, 1)),
        ("query_start_loc", torch.int32, (0, 1)),  # plus one
        ("seq_lens", torch.int32, (0, 1)),
        ("block_tables", torch.int32, (0, 1)),  # times max_blocks
    )

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.device = device
        self.spans, offset = {}, 0
        for name, dtype, (per_token, per_seq) in self.FIELDS:
            n = per_token * max_tokens + per_seq * max_seqs
            n += name == "query_start_loc"
            n *= max_blocks if name == "block_tables" else 1
            self.spans[name] = (offset, n, dtype)
            offset += -(-n * dtype.itemsize // 8) * 8  # keep every field 8-byte aligned
        self.nbytes = offset
        self.on_cuda = device.type == "cuda"
        self._hosts = [
            torch.zeros(offset, dtype=torch.uint8, pin_memory=self.on_cuda)
            for _ in range(2 if self.on_cuda else 1)
        ]
        self._uploaded: list[torch.cuda.Event | None] = [None] * len(self._hosts)
        self._turn = 0
        self.dev_bytes = (
            torch.zeros(offset, dtype=torch.uint8, device=device)
            if self.on_cuda
            else self._hosts[0]
        )
        self.dev = {k: self._view(self.dev_bytes, *v) for k, v in self.spans.items()}
        self._select(0)

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return buf[offset : offset + n * dtype.itemsize].view(dtype)

    def _select(self, turn: int) -> None:
        self._turn = turn
        host = self._hosts[turn]
        self.np = {k: self._view(host, *v).numpy() for k, v in self.spans.items()}
        self.np_tables = self.np["block_tables"].reshape(self.max_seqs, self.max_blocks)

    def begin(self) -> None:
        """Take the next host buffer for writing, once its last upload has run."""
        turn = (self._turn + 1) % len(self._hosts)
        if self._uploaded[turn] is not None:
            self._uploaded[turn].synchronize()
        self._select(turn)

    def upload(self, num_seqs: int) -> None:
        """Copy the fields and the first `num_seqs` block-table rows to the device."""
        if not self.on_cuda:
            return
        end = self.spans["block_tables"][0] + num_seqs * self.max_blocks * 4
        self.dev_bytes[:end].copy_(self._hosts[self._turn][:end], non_blocking=True)
        event = self._uploaded[self._turn] = torch.cuda.Event()
        event.record()

    def steer_views(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """The device `steer_*` fields of a step's first tokens, in `StepInterventions.bind`
        order (STEER_FIELDS)."""
        return tuple(self.dev["steer_" + k][:num_tokens] for k in STEER_FIELDS)

    def attention_inputs(
        self, num_tokens: int, num_seqs: int, block_size: int, qsl: list[int], lens: list[int]
    ) -> StepAttentionInputs:
        d = self.dev
        return StepAttentionInputs(
            slot_mapping=d["slot_mapping"][:num_tokens],
            query_start_loc=d["query_start_loc"][: num_seqs + 1],
            seq_lens=d["seq_lens"][:num_seqs],
            block_tables=d["block_tables"][: num_seqs * self.max_blocks].view(
                num_seqs, self.max_blocks
            ),
            block_size=block_size,
            query_start_loc_host=qsl,
            seq_lens_host=lens,
            max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
        )
