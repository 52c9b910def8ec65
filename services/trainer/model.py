"""The engine's Llama-family model in training mode: a full-sequence causal forward with autograd.

The trainer runs exactly the modules the engine serves (`LlamaFamilyForCausalLM`, loaded by the
engine's loader), so a trained adapter means the same thing in both. Only attention differs: the
engine attends over a paged KV cache one step batch at a time, the trainer over whole padded
sequences. `DenseCausalBackend` implements the engine's `AttentionBackend` interface for that.

Padding: either side works. Positions are counted over each row's real tokens
(`cumsum(attention_mask) - 1`) and keys outside the mask are never attended, so a row's logits
at its real tokens do not depend on how much padding it carries or where. Rollouts are usually
left-padded prompts followed by completions and right padding; both are fine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import InvalidRequestError
from services.engine.attention import AttentionBackend, StepAttentionInputs
from services.engine.model.config import load_model_config
from services.engine.model.llama import LlamaFamilyForCausalLM
from services.engine.model.loader import load_weights
from services.engine.parallel import ParallelContext


@dataclass
class DenseAttentionMeta:
    """Per-forward attention metadata of a padded batch, shared by every layer."""

    batch_size: int
    seq_len: int
    allowed: torch.Tensor  # [B, 1, T, T] bool: query t may attend key s
    positions: torch.Tensor  # [B, T] position of each token among its row's real tokens
    windowed: dict[int, torch.Tensor]  # sliding window -> its [B, 1, T, T] mask, built lazily


class DenseCausalBackend(AttentionBackend):
    """Causal attention over whole padded sequences `[B, T]`, with no KV cache.

    Each layer's q/k/v arrive flattened to `[B*T, H, D]` (the engine's token-major layout);
    they are viewed back as `[B, H, T, D]` and attended with one SDPA call under a mask that is
    causal, hides padding keys and, for Mistral, applies the sliding window by position.
    """

    def prepare(self, inputs: StepAttentionInputs) -> Any:
        raise TypeError(
            "DenseCausalBackend attends whole padded sequences; build its metadata with "
            "prepare_dense(attention_mask), not from an engine step batch"
        )

    @staticmethod
    def prepare_dense(attention_mask: torch.Tensor) -> DenseAttentionMeta:
        """Metadata for a `[B, T]` 0/1 attention mask (1 = real token)."""
        b, t = attention_mask.shape
        real = attention_mask.bool()
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        idx = torch.arange(t, device=real.device)
        causal = idx[None, :] <= idx[:, None]  # [T, T]
        allowed = causal[None] & real[:, None, :]  # [B, T, T]
        # A padding query with no real key before it would give softmax an empty row (NaN,
        # which poisons gradients even where the row is masked out later): let it see itself.
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=real.device)[None]
        return DenseAttentionMeta(b, t, allowed[:, None], positions, {})

    @staticmethod
    def _mask(meta: DenseAttentionMeta, window: int | None) -> torch.Tensor:
        if window is None:
            return meta.allowed
        if window not in meta.windowed:
            p = meta.positions
            near = (p[:, :, None] - p[:, None, :]) < window  # [B, T, T]
            meta.windowed[window] = meta.allowed & near[:, None]
        return meta.windowed[window]

    def forward(self, q, k, v, kv_cache, meta: DenseAttentionMeta, scale, sliding_window):
        b, t = meta.batch_size, meta.seq_len

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B*T, H, D] -> [B, H, T, D]
            return x.view(b, t, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads_first(q),
            heads_first(k),
            heads_first(v),
            attn_mask=self._mask(meta, sliding_window),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [B, Hq, T, D]
        return o.transpose(1, 2).reshape(b * t, *q.shape[1:])


@dataclass
class TokenBatch:
    """A padded batch of sequences: `[B, T]` token ids, attention mask and loss mask.

    `loss_mask[b, t] = 1` marks tokens whose log-likelihood counts (a rollout's completion);
    it must lie inside `attention_mask`.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] 0/1
    loss_mask: torch.Tensor  # [B, T] 0/1

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device)
        )

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


def pad_batch(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int = 0,
    side: str = "right",
) -> TokenBatch:
    """Pad `(prompt_ids, completion_ids)` pairs into a `TokenBatch` whose loss mask is the
    completion. `side` is where padding goes ("left" or "right")."""
    if side not in ("left", "right"):
        raise InvalidRequestError(f"padding side must be 'left' or 'right', got {side!r}")
    if not sequences:
        raise InvalidRequestError("pad_batch needs at least one sequence")
    rows = [(list(p), list(c)) for p, c in sequences]
    for p, c in rows:
        if not p or not c:
            raise InvalidRequestError("every sequence needs a non-empty prompt and completion")
    t = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    attn = torch.zeros(len(rows), t, dtype=torch.long)
    loss = torch.zeros(len(rows), t, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        start = t - n if side == "left" else 0
        ids[i, start : start + n] = torch.tensor(p + c)
        attn[i, start : start + n] = 1
        loss[i, start + len(p) : start + n] = 1
    return TokenBatch(ids, attn, loss)


@dataclass
class TrainOutput:
    logits: torch.Tensor  # [B, T, V]
    logprobs: torch.Tensor | None  # [B, T]: log p(targets[b, t] | tokens <= t), when asked


class TrainableModel(nn.Module):
    """`LlamaFamilyForCausalLM` with a dense causal forward over padded batches, autograd on.

    Base weights are frozen; trainable parameters come from adapters attached to `self.model`
    (see `services.trainer.adapters`).
    """

    def __init__(self, model: LlamaFamilyForCausalLM, backend: DenseCausalBackend):
        super().__init__()
        if model.ctx.tp_size != 1 or model.ctx.pp_size != 1:
            raise InvalidRequestError("the trainer runs a whole, unsharded model (tp = pp = 1)")
        self.model = model
        self.backend = backend
        for p in model.parameters():
            p.requires_grad_(False)
        # The engine's Attention asserts that a runner attached a KV cache; the dense backend
        # keeps none, so attach an empty placeholder.
        for attn in model.attention_layers():
            placeholder = model.embed_tokens.weight.new_empty(0)
            attn.kv_cache = (placeholder, placeholder)
        self.train()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> TrainableModel:
        """Build the engine's model for a HF checkpoint directory and load its weights."""
        cfg = load_model_config(model_dir)
        backend = DenseCausalBackend()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaFamilyForCausalLM(cfg, ParallelContext(), backend)
        finally:
            torch.set_default_dtype(prev)
        load_weights(model, model_dir)
        return cls(model, backend)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T] 0/1; None: no padding
        targets: torch.Tensor | None = None,  # [B, T] token whose logprob to return at each t
    ) -> TrainOutput:
        if input_ids.dim() != 2:
            raise InvalidRequestError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise InvalidRequestError("attention_mask must have the shape of input_ids")
        if t > self.model.cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"sequence length {t} exceeds max_position_embeddings "
                f"{self.model.cfg.max_position_embeddings}"
            )
        meta = self.backend.prepare_dense(attention_mask)
        h = self.model(meta.positions.reshape(-1), meta, input_ids=input_ids.reshape(-1))
        logits = self.model.compute_logits(h).view(b, t, -1)
        logprobs = None
        if targets is not None:
            # log_softmax via logsumexp: one [B, T, V] temporary fewer than log_softmax + gather.
            picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            logprobs = picked - torch.logsumexp(logits, dim=-1)
        return TrainOutput(logits, logprobs)

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """`[B, T]`: at each t, log p(input_ids[b, t] | input_ids[b, :t]); 0 at t = 0.

        Aligned with the input so `batch.loss_mask` selects a completion's logprobs directly.
        """
        out = self.forward(
            batch.input_ids, batch.attention_mask, targets=batch.input_ids.roll(-1, 1)
        )
        return F.pad(out.logprobs[:, :-1], (1, 0))

    def sequence_logprob(self, batch: TokenBatch) -> torch.Tensor:
        """`[B]`: the summed log-likelihood of each row's loss-masked tokens."""
        return (self.token_logprobs(batch) * batch.loss_mask).sum(-1)
