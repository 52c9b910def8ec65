"""Attention over the paged KV cache, behind a small backend interface.

The runner describes a step once (`StepAttentionInputs`); the backend turns that into
whatever per-step indices it needs (`prepare`, once per step) and every layer then calls
`forward` with its own q/k/v and KV cache. A fused GPU kernel plugs in here later without
touching the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class StepAttentionInputs:
    """The attention-relevant part of one step batch (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] flat KV slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [R+1] token offsets of each request in the batch
    seq_lens: torch.Tensor  # [R] context length of each request after this step
    block_tables: torch.Tensor  # [R, max_blocks] KV block ids (padding: 0)
    max_query_len: int
    max_seq_len: int
    block_size: int


class AttentionBackend(ABC):
    """Computes causal attention of this step's queries over each request's cached context."""

    @abstractmethod
    def prepare(self, inputs: StepAttentionInputs) -> Any:
        """Per-step metadata shared by every layer (built once per step)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, D]
        meta: Any,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write k/v into the cache, then attend."""


@dataclass
class _SdpaMeta:
    inputs: StepAttentionInputs
    token_dest: torch.Tensor  # [T] index of each token in the padded [R * Lq] query layout
    gather_slots: torch.Tensor  # [R, S] flat KV slot of each request's key position
    query_pos: torch.Tensor  # [R, Lq] absolute position of each padded query (-1: padding)
    key_pos: torch.Tensor  # [S]
    valid_keys: torch.Tensor  # [R, 1, 1, S]
    masks: dict[int | None, torch.Tensor]  # per sliding window: [R, 1, Lq, S] bool


class SdpaBackend(AttentionBackend):
    """Pads the step's requests into [R, Lq] queries and [R, S] gathered keys, then one
    `scaled_dot_product_attention` call per layer. Runs on CPU and CUDA."""

    def prepare(self, inputs: StepAttentionInputs) -> _SdpaMeta:
        qsl = inputs.query_start_loc
        device = qsl.device
        r = qsl.numel() - 1
        lq, s = inputs.max_query_len, inputs.max_seq_len
        q_lens = qsl[1:] - qsl[:-1]  # [R]
        t = int(qsl[-1])
        req_of_token = torch.repeat_interleave(torch.arange(r, device=device), q_lens)
        offset_in_req = torch.arange(t, device=device) - qsl[:-1][req_of_token]
        token_dest = req_of_token * lq + offset_in_req

        key_pos = torch.arange(s, device=device)
        block_idx = (key_pos // inputs.block_size).clamp(max=inputs.block_tables.shape[1] - 1)
        gather_slots = inputs.block_tables[:, block_idx] * inputs.block_size + (
            key_pos % inputs.block_size
        )  # [R, S]
        first_q = inputs.seq_lens - q_lens  # absolute position of each request's first query
        i = torch.arange(lq, device=device)
        query_pos = torch.where(
            i[None, :] < q_lens[:, None], first_q[:, None] + i[None, :], torch.full_like(i, -1)
        )
        valid_keys = (key_pos[None, :] < inputs.seq_lens[:, None])[:, None, None, :]
        return _SdpaMeta(inputs, token_dest, gather_slots, query_pos, key_pos, valid_keys, {})

    @staticmethod
    def _mask(meta: _SdpaMeta, window: int | None) -> torch.Tensor:
        if window not in meta.masks:
            qp = meta.query_pos[:, None, :, None]  # [R, 1, Lq, 1]
            kp = meta.key_pos[None, None, None, :]
            allowed = (kp <= qp) & meta.valid_keys
            if window is not None:
                allowed &= (qp - kp) < window
            # Padding queries attend key 0 so softmax has no empty row (their output is dropped).
            allowed[..., 0] |= qp[..., 0] < 0
            meta.masks[window] = allowed
        return meta.masks[window]

    def forward(self, q, k, v, kv_cache, meta: _SdpaMeta, scale, sliding_window):
        k_cache, v_cache = kv_cache
        hkv, d = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, hkv, d)
        v_flat = v_cache.view(-1, hkv, d)
        slots = meta.inputs.slot_mapping
        k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.dtype))

        r = meta.gather_slots.shape[0]
        lq = meta.query_pos.shape[1]
        hq = q.shape[1]
        q_pad = q.new_zeros(r * lq, hq, d)
        q_pad.index_copy_(0, meta.token_dest, q)
        q_pad = q_pad.view(r, lq, hq, d).transpose(1, 2)  # [R, Hq, Lq, D]
        keys = k_flat[meta.gather_slots].transpose(1, 2)  # [R, Hkv, S, D]
        values = v_flat[meta.gather_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad,
            keys,
            values,
            attn_mask=self._mask(meta, sliding_window),
            scale=scale,
            enable_gqa=hq != hkv,
        )  # [R, Hq, Lq, D]
        return out.transpose(1, 2).reshape(r * lq, hq, d)[meta.token_dest]
