"""Builds each step's flat token batch, runs the model over the paged KV cache, samples.

The runner never sees scheduling policy: it receives a `SchedulerOutput` and returns
tokens and logprobs. All device and dtype decisions of the engine live here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.attention import AttentionBackend, SdpaBackend, StepAttentionInputs
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaFamilyForCausalLM
from services.engine.model.loader import load_weights
from services.engine.parallel import ParallelContext
from services.engine.sampler import prompt_logprobs, sample
from services.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """'auto' picks CUDA when present, and float32 on CPU / bfloat16 on CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    if dtype == "auto":
        dtype = "float32" if dev.type == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or 'auto', got {dtype!r}")
    return dev, DTYPES[dtype]


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled token (or None) and its logprob dict, plus prompt
    logprobs computed this step as (first prompt position, list of dicts)."""

    sampled: list[int | None]
    logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[tuple[int, list[dict[int, float]]] | None]


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        ctx: ParallelContext,
        backend: AttentionBackend | None = None,
        seed: int = 0,
    ):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = backend or SdpaBackend()
        self.ctx = ctx
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with device:
                self.model = LlamaFamilyForCausalLM(cfg, ctx, self.backend)
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, model_dir)
        self.model.eval()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def kv_bytes_per_block(self) -> int:
        layers = len(self.model.attention_layers())
        a = self.model.attention_layers()[0] if layers else None
        per_token = 2 * (a.num_kv_heads * a.head_dim if a else 0) * layers
        return per_token * self.block_size * torch.tensor([], dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.kv_cache = (k, v)
            self.kv_caches.append((k, v))

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, interventions: Any = None) -> StepResult:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # index in `sched.scheduled` of each sampling seq
        logits_rows: list[int] = []  # token row of each sampling seq
        prompt_spans: list[tuple[int, int, int, int]] = []  # (seq idx, first pos, row0, count)
        for idx, s in enumerate(sched.scheduled):
            seq = s.seq
            row0 = len(input_ids)
            input_ids.extend(s.token_ids)
            for p in range(s.start, s.start + s.num_tokens):
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            qsl.append(len(input_ids))
            seq_lens.append(s.start + s.num_tokens)
            tables.append(seq.block_table)
            if s.samples:
                sample_rows.append(idx)
                logits_rows.append(len(input_ids) - 1)
            group = seq.group
            if group.prompt_logprobs is not None and seq.index == 0:
                # Position p's logits score prompt token p+1; record only positions not yet seen.
                first = max(s.start, len(group.prompt_logprobs) - 1)
                last = min(s.start + s.num_tokens, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append((idx, first, row0 + first - s.start, last - first))

        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        attn_inputs = StepAttentionInputs(
            slot_mapping=self._tensor(slots),
            query_start_loc=self._tensor(qsl),
            seq_lens=self._tensor(seq_lens),
            block_tables=self._tensor([x for row in padded for x in row]).view(len(padded), width),
            block_size=bs,
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
        )
        meta = self.backend.prepare(attn_inputs)
        ctx = self.ctx
        n = len(sched.scheduled)
        result = StepResult([None] * n, [None] * n, [None] * n)
        received = None
        if not ctx.is_first_stage:  # the previous stage's residual stream, [T, H]
            shape = (len(input_ids), self.cfg.hidden_size)
            received = ctx.recv_from_prev_stage(shape, self.dtype, self.device)
        hidden = self.model(
            self._tensor(positions),
            meta,
            input_ids=self._tensor(input_ids) if ctx.is_first_stage else None,
            hidden_states=received,
            interventions=interventions,
        )
        if not ctx.is_last_stage:  # only the last stage samples
            ctx.send_to_next_stage(hidden)
            return result
        if logits_rows:
            logits = self.model.compute_logits(hidden[self._tensor(logits_rows)]).float()
            seqs = [sched.scheduled[i].seq for i in sample_rows]
            out = sample(
                logits,
                [q.group.params for q in seqs],
                [q.generator for q in seqs],
                self.generator,
            )
            for j, i in enumerate(sample_rows):
                result.sampled[i] = out.token_ids[j]
                result.logprobs[i] = out.logprobs[j]
        for idx, first, row0, count in prompt_spans:
            seq = sched.scheduled[idx].seq
            logits = self.model.compute_logits(hidden[row0 : row0 + count])
            next_ids = seq.token_ids[first + 1 : first + 1 + count]
            k = seq.group.params.prompt_logprobs or 0
            result.prompt_logprobs[idx] = (first, prompt_logprobs(logits, next_ids, k))
        return result
