"""Attention over the paged KV cache, behind a small backend interface.

The runner describes a step once (`StepAttentionInputs`); the backend turns that into
whatever per-step indices it needs (`prepare`, once per step) and every layer then calls
`forward` with its own q/k/v and KV cache. Two backends: `TritonBackend` (CUDA: kernels
that read the paged cache in place, capturable in a CUDA graph for decode) and
`SdpaBackend` (CPU, and the reference path: keys gathered into dense tensors for SDPA).
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.engine.host_memory import to_device_async
from services.engine.kernels.decode_attention import (
    decode_attention,
    decode_rope_attention,
    prefill_attention,
    prefill_splits_for,
)
from services.engine.kernels.tickets import Tickets


@dataclass
class StepAttentionInputs:
    """The attention-relevant part of one step batch (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64 flat KV slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [R+1] int32 token offsets of each request in the batch
    seq_lens: torch.Tensor  # [R] int32 context length of each request after this step
    block_tables: torch.Tensor  # [R, max_blocks] int32 KV block ids (padding: arbitrary)
    block_size: int
    # The same two on the host, so backends can plan without a device sync.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int = 0

    @property
    def is_decode(self) -> bool:
        """Every request computes one token: the decode kernel (and a CUDA graph) applies."""
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Computes causal attention of this step's queries over each request's cached context."""

    # Whether a decode step's `prepare` output reads only device tensors of fixed shape, so
    # the step can be captured in a CUDA graph and replayed with new inputs.
    supports_graphs = False
    # Whether the layer may write K/V into the cache itself (in its RoPE kernel, at
    # `meta.slot_mapping`) and call `attend`, which reads them from the cache only.
    reads_kv_from_cache = False

    @abstractmethod
    def prepare(self, inputs: StepAttentionInputs) -> Any:
        """Per-step metadata shared by every layer (built once per step)."""

    def attends_raw(self, meta: Any) -> bool:
        """Whether the layer hands this step's raw q, k and v to `attend_raw` (norms, RoPE
        and the cache write inside the attention kernel) rather than doing those first."""
        return False

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
class _SdpaGroup:
    """Requests attended in one SDPA call: all decodes together, or one prefill alone."""

    rows: torch.Tensor  # [Tg] rows of the step batch this group's tokens occupy
    token_dest: torch.Tensor  # [Tg] index of each token in the padded [Rg * Lq] query layout
    num_reqs: int
    max_query_len: int
    gather_slots: torch.Tensor | None  # [Rg, S] flat KV slot per key; None: fresh prefill
    query_pos: torch.Tensor  # [Rg, Lq] absolute position of each padded query (-1: padding)
    valid_keys: torch.Tensor  # [Rg, 1, 1, S]
    masks: dict[int | None, torch.Tensor]  # per sliding window: [Rg, 1, Lq, S] bool


@dataclass
class _SdpaStep:
    slot_mapping: torch.Tensor  # [T]
    groups: list[_SdpaGroup]


class SdpaBackend(AttentionBackend):
    """`scaled_dot_product_attention` over keys gathered from the paged cache.

    Decode tokens of all requests go in one call (one query each, keys padded to the longest
    context); each prefill chunk gets its own call, so padding never multiplies a long chunk
    by the batch size. A prefill with no cached context attends its own fresh K/V with
    `is_causal`, which lets CUDA use a flash kernel. Runs on CPU and CUDA.
    """

    def prepare(self, inputs: StepAttentionInputs) -> _SdpaStep:
        qsl, seq_lens = inputs.query_start_loc_host, inputs.seq_lens_host
        q_lens = [b - a for a, b in itertools.pairwise(qsl)]
        decodes = [r for r, n in enumerate(q_lens) if n == 1]
        groups = [decodes] if decodes else []
        groups += [[r] for r, n in enumerate(q_lens) if n > 1]
        return _SdpaStep(
            inputs.slot_mapping, [self._group(inputs, g, qsl, q_lens, seq_lens) for g in groups]
        )

    @staticmethod
    def _group(inputs, reqs, qsl, q_lens, seq_lens) -> _SdpaGroup:
        device = inputs.query_start_loc.device
        lq = max(q_lens[r] for r in reqs)
        s = max(seq_lens[r] for r in reqs)
        rows = [qsl[r] + i for r in reqs for i in range(q_lens[r])]
        dest = [j * lq + i for j, r in enumerate(reqs) for i in range(q_lens[r])]
        first = [seq_lens[r] - q_lens[r] for r in reqs]
        qpos = [
            [first[j] + i if i < q_lens[r] else -1 for i in range(lq)] for j, r in enumerate(reqs)
        ]
        as_tensor = functools.partial(to_device_async, dtype=torch.long, device=device)
        fresh = len(reqs) == 1 and first[0] == 0
        gather = None
        if not fresh:
            key_pos = torch.arange(s, device=device)
            block_idx = key_pos // inputs.block_size
            tables = inputs.block_tables.long()[as_tensor(reqs)][:, block_idx]  # [Rg, S]
            gather = tables * inputs.block_size + key_pos % inputs.block_size
        lens = as_tensor([seq_lens[r] for r in reqs])
        valid = (torch.arange(s, device=device)[None, :] < lens[:, None])[:, None, None, :]
        return _SdpaGroup(
            as_tensor(rows), as_tensor(dest), len(reqs), lq, gather, as_tensor(qpos), valid, {}
        )

    @staticmethod
    def _mask(g: _SdpaGroup, window: int | None) -> torch.Tensor:
        if window not in g.masks:
            qp = g.query_pos[:, None, :, None]  # [Rg, 1, Lq, 1]
            kp = torch.arange(g.valid_keys.shape[-1], device=qp.device)[None, None, None, :]
            allowed = (kp <= qp) & g.valid_keys
            if window is not None:
                allowed &= (qp - kp) < window
            # Padding queries attend key 0 so softmax has no empty row (their output is dropped).
            allowed[..., 0] |= qp[..., 0] < 0
            g.masks[window] = allowed
        return g.masks[window]

    def forward(self, q, k, v, kv_cache, meta: _SdpaStep, scale, sliding_window):
        k_cache, v_cache = kv_cache
        hkv, d = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, hkv, d)
        v_flat = v_cache.view(-1, hkv, d)
        slots = meta.slot_mapping
        k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.dtype))

        hq = q.shape[1]
        gqa = hq != hkv
        out = torch.empty_like(q)
        for g in meta.groups:
            if g.gather_slots is None and sliding_window is None:
                # A prefill from position 0: its keys are exactly this chunk's k/v.
                qg = q[g.rows].transpose(0, 1)[None]  # [1, Hq, L, D]
                kg = k[g.rows].transpose(0, 1)[None]
                vg = v[g.rows].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(
                    qg, kg, vg, is_causal=True, scale=scale, enable_gqa=gqa
                )
                out[g.rows] = o[0].transpose(0, 1)
                continue
            r, lq = g.num_reqs, g.max_query_len
            gather = g.gather_slots
            if gather is None:  # fresh prefill under a sliding window: keys are its own slots
                gather = slots[g.rows][None, :]
            q_pad = q.new_zeros(r * lq, hq, d)
            q_pad.index_copy_(0, g.token_dest, q[g.rows])
            q_pad = q_pad.view(r, lq, hq, d).transpose(1, 2)  # [Rg, Hq, Lq, D]
            keys = k_flat[gather].transpose(1, 2)  # [Rg, Hkv, S, D]
            values = v_flat[gather].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q_pad,
                keys,
                values,
                attn_mask=self._mask(g, sliding_window),
                scale=scale,
                enable_gqa=gqa,
            )  # [Rg, Hq, Lq, D]
            out[g.rows] = o.transpose(1, 2).reshape(r * lq, hq, d)[g.token_dest]
        return out


def _rows(indices: list[int], device: torch.device) -> slice | torch.Tensor:
    """A run of consecutive indices as a slice (a view, no copy), any others as a tensor."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return slice(indices[0], indices[-1] + 1)
    return to_device_async(indices, torch.int64, device)


@dataclass
class _MixedStep:
    """A step with prefill chunks, cut in two: requests computing one token (decodes, or a
    chunk's last token) go to the split-K decode kernel, the chunks to the prefill kernel,
    so a decode at a long context costs what it costs in a decode step. Each part is a
    slice of the step's tokens where its requests sit together, else an index."""

    slot_mapping: torch.Tensor
    decode_tokens: slice | torch.Tensor | None  # None: no decode in this step
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    chunk_tokens: slice | torch.Tensor
    chunk_block_tables: torch.Tensor
    chunk_query_start_loc: torch.Tensor
    chunk_seq_lens: torch.Tensor
    chunk_max_query_len: int
    chunk_q_lens: list[int]
    chunk_context_lens: list[int]
    # Key splits of the prefill launch, sized by the first layer's heads (`prefill_splits_for`).
    chunk_splits: int | None = None


def _take(x: torch.Tensor, idx: slice | torch.Tensor) -> torch.Tensor:
    return x[idx] if isinstance(idx, slice) else x.index_select(0, idx)


class TritonBackend(AttentionBackend):
    """Triton kernels over the paged cache in place (`kernels/decode_attention.py`).

    The kernels tile a head whole, so the head dimension must be a power of two.

    A decode step (one query per request) runs the split-K decode kernel, which reads only
    device tensors, so the step can be captured in a CUDA graph. Padding rows of a graph
    batch have `seq_len == 0` (output zeros) and write their K/V to a scratch slot the
    block manager never hands out. A step with prefill chunks (`_MixedStep`) sends its
    one-token requests to the decode kernel and its chunks to the varlen prefill kernel,
    where each chunk attends its cached context plus itself, its keys split when its tiles
    alone cannot fill the GPU.
    """

    supports_graphs = True
    reads_kv_from_cache = True

    def __init__(self, fused_decode: bool = False) -> None:
        # One-kernel decode attention (`EngineConfig.fused_decode_attention`): this
        # engine's tickets for the splits' merge.
        self.tickets = Tickets() if fused_decode else None

    def _tickets(self, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
        if self.tickets is None:
            return None
        return self.tickets.get(q.shape[0] * k_cache.shape[-2], q.device)

    def attends_raw(self, meta: Any) -> bool:
        return self.tickets is not None and isinstance(meta, StepAttentionInputs)

    def attend_raw(
        self, q, k, v, cos, sin, positions, kv_cache, meta, scale, sliding_window,
        q_weight=None, k_weight=None, eps=0.0,
    ):  # fmt: skip
        """A decode step's attention from the qkv projection's raw q, k and v, in one
        kernel: the per-head norms (with weights), RoPE, the K/V cache writes at
        `meta.slot_mapping`, attention, the merge (`decode_rope_attention`)."""
        k_cache, v_cache = kv_cache
        return decode_rope_attention(
            q, k, v, cos, sin, positions, k_cache, v_cache, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, scale, sliding_window, q_weight, k_weight, eps,
            tickets=self._tickets(q, k_cache),
        )  # fmt: skip

    def prepare(self, inputs: StepAttentionInputs) -> StepAttentionInputs | _MixedStep:
        if inputs.is_decode:
            return inputs
        qsl, seq_lens = inputs.query_start_loc_host, inputs.seq_lens_host
        q_lens = [b - a for a, b in itertools.pairwise(qsl)]
        device = inputs.query_start_loc.device
        decodes = [r for r, n in enumerate(q_lens) if n == 1]
        chunks = [r for r, n in enumerate(q_lens) if n > 1]
        dec_rows, chunk_rows = _rows(decodes, device), _rows(chunks, device)
        if isinstance(chunk_rows, slice):  # the step's own offsets, shifted: no copy
            bounds = slice(chunk_rows.start, chunk_rows.stop + 1)
            chunk_qsl = inputs.query_start_loc[bounds] - qsl[chunk_rows.start]
        else:
            offsets = [0, *itertools.accumulate(q_lens[r] for r in chunks)]
            chunk_qsl = to_device_async(offsets, torch.int32, device)
        return _MixedStep(
            slot_mapping=inputs.slot_mapping,
            decode_tokens=_rows([qsl[r] for r in decodes], device) if decodes else None,
            decode_block_tables=_take(inputs.block_tables, dec_rows) if decodes else None,
            decode_seq_lens=_take(inputs.seq_lens, dec_rows) if decodes else None,
            chunk_tokens=(
                slice(qsl[chunk_rows.start], qsl[chunk_rows.stop])
                if isinstance(chunk_rows, slice)
                else _rows([t for r in chunks for t in range(qsl[r], qsl[r + 1])], device)
            ),
            chunk_block_tables=_take(inputs.block_tables, chunk_rows),
            chunk_query_start_loc=chunk_qsl,
            chunk_seq_lens=_take(inputs.seq_lens, chunk_rows),
            chunk_max_query_len=max(q_lens[r] for r in chunks),
            chunk_q_lens=[q_lens[r] for r in chunks],
            chunk_context_lens=[seq_lens[r] for r in chunks],
        )

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window):
        k_cache, v_cache = kv_cache
        hkv, d = k_cache.shape[-2:]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        return self.attend(q, kv_cache, meta, scale, sliding_window)

    def attend(self, q, kv_cache, meta, scale, sliding_window):
        """Attention of `q` over the cache, which already holds this step's K/V."""
        k_cache, v_cache = kv_cache
        if isinstance(meta, StepAttentionInputs):  # a decode step
            return decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
                tickets=self._tickets(q, k_cache),
            )  # fmt: skip
        out = torch.empty_like(q)
        for tokens, attend in (
            (meta.decode_tokens, self._decode_part),
            (meta.chunk_tokens, self._chunk_part),
        ):
            if tokens is None:
                continue
            part_q = _take(q, tokens)
            if isinstance(tokens, slice):  # the kernel writes straight into its rows
                attend(part_q, k_cache, v_cache, meta, scale, sliding_window, out[tokens])
            else:
                got = attend(part_q, k_cache, v_cache, meta, scale, sliding_window, None)
                out.index_copy_(0, tokens, got)
        return out

    def _decode_part(self, q, k_cache, v_cache, meta: _MixedStep, scale, window, out):
        return decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
            window, out=out, tickets=self._tickets(q, k_cache),
        )  # fmt: skip

    @staticmethod
    def _chunk_part(q, k_cache, v_cache, meta: _MixedStep, scale, window, out):
        if meta.chunk_splits is None:
            meta.chunk_splits = prefill_splits_for(
                meta.chunk_q_lens, meta.chunk_context_lens, q.shape[1], q.device
            )
        return prefill_attention(
            q, k_cache, v_cache, meta.chunk_block_tables, meta.chunk_query_start_loc,
            meta.chunk_seq_lens, meta.chunk_max_query_len, scale, window,
            num_splits=meta.chunk_splits, out=out,
        )  # fmt: skip
