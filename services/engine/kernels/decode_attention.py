"""Attention over the paged KV cache, read in place: split-K decode and varlen prefill.

One query per request attends every cached key of its request. Work is split three ways:
request × KV head × split of the context, so a single request still spreads over many SMs.
Each program packs the query heads that share its KV head (GQA) into the rows of one
`tl.dot`, walks its share of the context in tiles of `BLOCK_N` keys gathered across pages
(a tile may span several pages), and keeps an online softmax; a second small kernel merges
the splits by their log-sum-exp. Or, one kernel a layer (`kernels/tickets.py`,
`EngineConfig.fused_decode_attention`): each program draws a ticket once its partial is
stored, and the one that draws its request × KV head's last ticket merges the splits (the
split-K "last block reduces" pattern); a launch of one split writes its answer directly.
That kernel can also start from the qkv projection's raw q, k and v
(`decode_rope_attention_triton`, TensorRT-LLM's masked-MHA recipe): each program norms and
rotates its own query heads, and the one whose share of the context holds the new position
writes the step's k and v to the cache before it reads its keys, so a decode layer's whole
way from the projection to the attention output is one launch.
Every bound is read from device tensors (each row's length decides its own split size), so
the launch depends only on shapes and a CUDA graph can capture it. Rows with length 0
(graph padding) give zeros.

Prefill (eager, host metadata at hand): one program per request × tile of 64 queries ×
query head × split of the keys; a chunk attends its cached context plus itself causally,
all read from the cache after the chunk's own K/V were written, skipping key tiles past its
last query or before its window. A tile past its request's chunk does nothing (a short
chunk beside a long one costs its own tiles only). Where a step's tiles are too few to fill
the GPU (a short chunk over a long cached prefix), the keys are split as in decode and the
same merge kernel combines the splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.kernels.norm_rope import qk_rope_cache_reference
from services.engine.kernels.steer import INTERPRET

BLOCK_N = 64  # keys per tile
MAX_SPLITS = 64


def decode_attention_reference(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32 (0: padding row, output zeros)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [B, Hq, D] in q's dtype
    """Plain PyTorch: gather each request's keys, masked softmax in float32."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_tables[i].long()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, hkv, d)[slots].float()  # [n, Hkv, D]
        v = v_cache.reshape(-1, hkv, d)[slots].float()
        k = k.repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if sliding_window is not None:
            scores[:, pos <= n - 1 - sliding_window] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_for(batch: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, never more than the tiles of the longest
    possible context."""
    sms = _num_sms(device) if device.type == "cuda" else 8
    want = -(-2 * sms // max(1, batch * kv_heads))
    return max(1, min(want, MAX_SPLITS, -(-max_keys // BLOCK_N)))


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr,  # [B, Hq, D]; with ROPE the qkv projection's raw q (any row/head strides)
        k_ptr,  # [N * bs, Hkv, D] (flat slots)
        v_ptr,
        tables_ptr,  # [B, W]
        lens_ptr,  # [B]
        part_out_ptr,  # [B, Hq, S, D] float32
        part_lse_ptr,  # [B, Hq, S] float32
        out_ptr,  # [B, Hq, D]: written here only with MERGE
        tickets_ptr,  # [B * Hkv] int32, zero between launches: only with MERGE
        new_k_ptr,  # with ROPE: this step's raw k and v [B, Hkv, D] (any row/head strides)
        new_v_ptr,
        qw_ptr,  # with ROPE and HAS_NORM: the per-head q and k RMSNorm weights [D]
        kw_ptr,
        cos_ptr,  # with ROPE: the [P, D] cos and sin tables, and each row's position
        sin_ptr,
        pos_ptr,
        slot_ptr,  # with ROPE: each row's cache slot for this step's k and v
        scale,
        eps,
        window,  # 0: none
        stride_qb,
        stride_qh,
        stride_kslot,
        stride_kh,
        stride_vslot,
        stride_vh,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_nkb,
        stride_nkh,
        stride_nvb,
        stride_nvh,
        num_splits,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,  # >= 16, power of two
        D: tl.constexpr,
        PAGE: tl.constexpr,  # block_size
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no silent TF32
        MERGE: tl.constexpr,  # the last split to finish merges (no `_merge_kernel` launch)
        SPLITS_PAD: tl.constexpr,  # with MERGE: num_splits to a power of two
        ROPE: tl.constexpr,  # q/k norms, RoPE and the K/V cache write here, not before
        HAS_NORM: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        num_tiles = tl.cdiv(seq_len - first, BLOCK)
        per_split = tl.cdiv(num_tiles, num_splits)
        t0 = split * per_split
        t1 = tl.minimum(t0 + per_split, num_tiles)

        g = tl.arange(0, GROUP_PAD)
        dd = tl.arange(0, D)
        heads = kvh * GROUP + g
        g_ok = g < GROUP
        q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        if ROPE:
            # Each program norms and rotates its own heads' q (a few hundred flops); the
            # one whose tiles hold this step's position writes its k and v to the cache
            # first, then reads them back with the rest of its tiles.
            position = tl.load(pos_ptr + b).to(tl.int64)
            dtype = q_ptr.dtype.element_ty
            cos = tl.load(cos_ptr + position * D + dd).to(dtype).to(tl.float32)
            sin = tl.load(sin_ptr + position * D + dd).to(dtype).to(tl.float32)
            q = _norm_rope(q_at, dd, g_ok[:, None], qw_ptr, eps, cos, sin, D, HAS_NORM)
            last = (seq_len - 1 - first) // BLOCK
            if (seq_len > 0) & (t0 <= last) & (last < t1):
                at = tl.load(slot_ptr + b).to(tl.int64)
                k_row = new_k_ptr + b * stride_nkb + kvh * stride_nkh
                k_new = _norm_rope(k_row, dd, dd < D, kw_ptr, eps, cos, sin, D, HAS_NORM)
                v_new = tl.load(new_v_ptr + b * stride_nvb + kvh * stride_nvh + dd)
                k_dst = k_ptr + at * stride_kslot + kvh * stride_kh + dd
                tl.store(k_dst, k_new.to(k_ptr.dtype.element_ty))
                v_dst = v_ptr + at * stride_vslot + kvh * stride_vh + dd
                tl.store(v_dst, v_new.to(v_ptr.dtype.element_ty))
                tl.debug_barrier()  # every thread's writes in place before any reads them
        else:
            q = tl.load(q_at + dd[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        offs = tl.arange(0, BLOCK)
        for t in range(t0, t1):
            pos = first + t * BLOCK + offs
            ok = pos < seq_len
            page = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=ok, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            k = tl.load(
                k_ptr + slot[:, None] * stride_kslot + kvh * stride_kh + dd[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + slot[:, None] * stride_vslot + kvh * stride_vh + dd[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m = m_new
        # An empty split (past the row's length) leaves lse = -inf and is ignored when merged.
        lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        if MERGE and num_splits == 1:  # the whole context: the answer itself
            dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dd[None, :]
            tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            rows = b * tl.num_programs(1) * GROUP + heads
            base = rows * num_splits + split
            tl.store(part_lse_ptr + base, lse, mask=g_ok)
            tl.store(part_out_ptr + base[:, None] * D + dd[None, :], o, mask=g_ok[:, None])
            if MERGE:
                # Every thread's stores before the ticket; the ticket's release publishes
                # them, and the program that draws the last one acquires all the splits'.
                tl.debug_barrier()
                ticket_ptr = tickets_ptr + b * tl.num_programs(1) + kvh
                ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
                if ticket == num_splits - 1:
                    _merge_splits(
                        part_out_ptr, part_lse_ptr, out_ptr, b, kvh, num_splits, stride_ob,
                        stride_oh, GROUP, D, SPLITS_PAD,
                    )  # fmt: skip
                    tl.store(ticket_ptr, 0)  # zero again for the next launch (or replay)

    @triton.jit
    def _norm_rope(at, dd, ok, w_ptr, eps, cos, sin, D: tl.constexpr, HAS_NORM: tl.constexpr):
        """Heads of one token (`at`: a pointer per head, [..., 1], or the one head's; `ok`
        masks heads), RMSNorm'd with weights (HAS_NORM) and rotate-half rotated by `cos`
        and `sin` ([D], at the token's position), rounded where
        `norm_rope.qk_rope_cache_reference` rounds: [..., D] in the input's dtype. The
        other half of each head comes from a second load, not a shuffle."""
        dtype = at.dtype.element_ty
        other = (dd + D // 2) % D  # rotate_half(x)[d] = -x[d + D/2], or x[d - D/2]
        x = tl.load(at + dd, mask=ok, other=0.0).to(tl.float32)
        xo = tl.load(at + other, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
            w, wo = tl.load(w_ptr + dd).to(tl.float32), tl.load(w_ptr + other).to(tl.float32)
            x = (w * (x * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            xo = (wo * (xo * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        sign = tl.where(dd < D // 2, -1.0, 1.0)
        y = (x * cos).to(dtype).to(tl.float32) + (sign * xo * sin).to(dtype).to(tl.float32)
        return y.to(dtype)

    @triton.jit
    def _merge_splits(
        part_out_ptr, part_lse_ptr, out_ptr, b, kvh, num_splits, stride_ob, stride_oh,
        GROUP: tl.constexpr, D: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        """The splits of one KV head's query heads merged into `out`, as `_merge_kernel`
        merges one head's (the heads' loads independent of each other). Loads bypass L1
        (`.cg`): the other programs' partials are in L2, not in this SM's cache."""
        for g in tl.static_range(GROUP):
            h = kvh * GROUP + g
            row = b * tl.num_programs(1) * GROUP + h
            _merge_head(
                part_out_ptr, part_lse_ptr, out_ptr + b * stride_ob + h * stride_oh, row,
                num_splits, D, SPLITS_PAD, ".cg",
            )  # fmt: skip

    @triton.jit
    def _merge_head(
        part_out_ptr, part_lse_ptr, out_at, row, num_splits,
        D: tl.constexpr, SPLITS_PAD: tl.constexpr, CACHE: tl.constexpr,
    ):  # fmt: skip
        """One head's splits (partials `row` of `part_out`, `part_lse`) merged by their
        log-sum-exp into `out_at` [D], each read as one tile; `CACHE`: the loads' cache
        modifier ("" the default)."""
        sp = tl.arange(0, SPLITS_PAD)
        ok = sp < num_splits
        dd = tl.arange(0, D)
        lse = tl.load(
            part_lse_ptr + row * num_splits + sp,
            mask=ok,
            other=float("-inf"),
            cache_modifier=CACHE,
        )
        top = tl.max(lse, 0)
        w = tl.where(ok & (lse > float("-inf")), tl.exp(lse - top), 0.0)
        total = tl.sum(w, 0)
        parts = tl.load(
            part_out_ptr + (row * num_splits + sp)[:, None] * D + dd[None, :],
            mask=ok[:, None],
            other=0.0,
            cache_modifier=CACHE,
        )
        o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_at + dd, o.to(out_at.dtype.element_ty))

    @triton.jit
    def _merge_kernel(
        part_out_ptr,  # [B, Hq, S, D]
        part_lse_ptr,  # [B, Hq, S]
        out_ptr,  # [B, Hq, D]
        stride_ob,
        stride_oh,
        num_splits,
        D: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        row = b * tl.num_programs(1) + h
        out_at = out_ptr + b * stride_ob + h * stride_oh
        _merge_head(part_out_ptr, part_lse_ptr, out_at, row, num_splits, D, SPLITS_PAD, "")


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """With `tickets` (`Tickets.get`), one kernel: the last split of each request ×
    KV head to finish merges them, and one split writes its answer straight out. Without,
    a second kernel merges every split."""
    return _launch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, num_splits, out,
        tickets, None,
    )  # fmt: skip


@dataclass
class _NewTokens:
    """What the one-kernel decode (`decode_rope_attention_triton`) does before attending:
    this step's raw k and v, the per-head norm weights (or None), the RoPE tables, each
    row's position and cache slot."""

    k: torch.Tensor  # [B, Hkv, D]
    v: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor  # [P, D]
    sin: torch.Tensor
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]


def decode_rope_attention_reference(
    q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
    scale, sliding_window=None, q_weight=None, k_weight=None, eps=0.0,
):  # fmt: skip
    """A decode step's attention from the qkv projection's raw q, k and v: the q/k norms,
    RoPE and K/V cache writes (`qk_rope_cache_reference`), then `decode_attention_reference`."""
    q = qk_rope_cache_reference(
        q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps
    )
    return decode_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window
    )


def decode_rope_attention_triton(
    q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
    scale, sliding_window=None, q_weight=None, k_weight=None, eps=0.0, num_splits=None,
    out=None, tickets=None,
):  # fmt: skip
    """`decode_rope_attention_reference` in one kernel (with `tickets`; else two, the
    merge apart): every program norms and rotates its query heads, and the one whose
    share of the context holds this step's position writes the step's k and v to the
    cache before reading it. Graph padding rows (length 0) write nothing."""
    assert q.shape[-1] % 2 == 0 and cos.shape[-1] == q.shape[-1]
    assert cos.is_contiguous() and sin.is_contiguous(), "the kernel reads rows at position * D"
    new = _NewTokens(k, v, q_weight, k_weight, eps, cos, sin, positions, slot_mapping)
    return _launch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, num_splits, out,
        tickets, new,
    )  # fmt: skip


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None,
    out: torch.Tensor | None,
    tickets: torch.Tensor | None,
    new: _NewTokens | None,
) -> torch.Tensor:
    b, hq, d = q.shape
    n_blocks, page, hkv, _ = k_cache.shape
    group = hq // hkv
    if num_splits is None:
        num_splits = num_splits_for(b, hkv, block_tables.shape[1] * page, q.device)
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    merge = tickets is not None
    assert not merge or (tickets.numel() >= b * hkv and tickets.dtype == torch.int32)
    part_out = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    k_flat = k_cache.view(n_blocks * page, hkv, d)
    v_flat = v_cache.view(n_blocks * page, hkv, d)
    rope = new is not None
    has_norm = rope and new.q_weight is not None
    unused = seq_lens  # a pointer for the arguments a variant never reads
    _split_kernel[(b, hkv, num_splits)](
        q,
        k_flat,
        v_flat,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        out,
        tickets if merge else unused,
        new.k if rope else unused,
        new.v if rope else unused,
        new.q_weight if has_norm else unused,
        new.k_weight if has_norm else unused,
        new.cos if rope else unused,
        new.sin if rope else unused,
        new.positions if rope else unused,
        new.slot_mapping if rope else unused,
        scale,
        new.eps if rope else 0.0,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        new.k.stride(0) if rope else 0,
        new.k.stride(1) if rope else 0,
        new.v.stride(0) if rope else 0,
        new.v.stride(1) if rope else 0,
        num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=d,
        PAGE=page,
        BLOCK=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MERGE=merge,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        ROPE=rope,
        HAS_NORM=has_norm,
        num_warps=4,
    )
    if merge:
        return out
    _merge_kernel[(b, hq)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        D=d,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out


def decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, out=None,
    tickets=None,
):  # fmt: skip
    """Triton on CUDA (and under TRITON_INTERPRET=1), the reference elsewhere."""
    if triton is None or not (q.is_cuda or INTERPRET):
        got = decode_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window
        )
        return got if out is None else out.copy_(got)
    return decode_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out=out,
        tickets=tickets,
    )  # fmt: skip


def decode_rope_attention(
    q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
    scale, sliding_window=None, q_weight=None, k_weight=None, eps=0.0, out=None, tickets=None,
):  # fmt: skip
    """`decode_rope_attention_triton` on CUDA (and under TRITON_INTERPRET=1), the
    reference elsewhere."""
    if triton is None or not (q.is_cuda or INTERPRET):
        got = decode_rope_attention_reference(
            q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, block_tables,
            seq_lens, scale, sliding_window, q_weight, k_weight, eps,
        )  # fmt: skip
        return got if out is None else out.copy_(got)
    return decode_rope_attention_triton(
        q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
        scale, sliding_window, q_weight, k_weight, eps, out=out, tickets=tickets,
    )  # fmt: skip


# -- varlen prefill: chunks over prefix-cached context ---------------------------------------


def prefill_attention_reference(
    q: torch.Tensor,  # [T, Hq, D] the queries of R requests, concatenated
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, W] int32
    query_start_loc: torch.Tensor,  # [R+1] int32
    seq_lens: torch.Tensor,  # [R] int32: request r's queries are its last q_len positions
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Plain PyTorch: each chunk attends its cached context plus itself, causally."""
    _, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for r, n in enumerate(seq_lens.tolist()):
        a, b = qsl[r], qsl[r + 1]
        if b == a:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_tables[r].long()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache.reshape(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
        qpos = torch.arange(n - (b - a), n, device=q.device)
        scores = torch.einsum("qhd,nhd->hqn", q[a:b].float(), k) * scale
        visible = pos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            visible &= qpos[:, None] - pos[None, :] < sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[a:b] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _prefill_kernel(
        q_ptr,  # [T, Hq, D]
        k_ptr,  # [N * bs, Hkv, D]
        v_ptr,
        out_ptr,  # [T, Hq, D]
        part_out_ptr,  # [T, Hq, S, D] float32 (SPLIT only)
        part_lse_ptr,  # [T, Hq, S] float32 (SPLIT only)
        tables_ptr,
        qsl_ptr,
        lens_ptr,
        scale,
        window,  # 0: none
        num_splits,
        stride_qt,
        stride_qh,
        stride_kslot,
        stride_kh,
        stride_vslot,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_tb,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
        SPLIT: tl.constexpr,  # write each split's partial output and lse for the merge
    ):
        # One program per (request, tile of BLOCK_M queries, query head × key split).
        r = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        h = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        kvh = h // GROUP
        q0 = tl.load(qsl_ptr + r)
        q_len = tl.load(qsl_ptr + r + 1) - q0
        seq_len = tl.load(lens_ptr + r)
        ctx = seq_len - q_len  # cached positions before the chunk
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < q_len
        qpos = ctx + m
        dd = tl.arange(0, D)
        q = tl.load(
            q_ptr + (q0 + m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + dd[None, :],
            mask=m_ok[:, None],
            other=0.0,
        )
        # Keys this tile can see: up to its last query (causal), from the window's start.
        hi = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
        lo = tl.where(window > 0, tl.maximum(ctx + tile * BLOCK_M - window + 1, 0), 0)
        lo = (lo // BLOCK) * BLOCK
        hi = tl.where(tile * BLOCK_M < q_len, hi, lo)  # a tile past this chunk: no keys
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK), num_splits) * BLOCK
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)
        mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        offs = tl.arange(0, BLOCK)
        for start in range(lo, hi, BLOCK):
            pos = start + offs
            ok = pos < seq_len
            page = tl.load(tables_ptr + r * stride_tb + pos // PAGE, mask=ok, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            k = tl.load(
                k_ptr + slot[:, None] * stride_kslot + kvh * stride_kh + dd[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            visible = ok[None, :] & (pos[None, :] <= qpos[:, None])
            visible &= (window <= 0) | (qpos[:, None] - pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(mx, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(mx - m_safe)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + slot[:, None] * stride_vslot + kvh * stride_vh + dd[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            mx = m_new
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        if SPLIT:
            # A split with no visible key leaves lse = -inf: the merge ignores it.
            lse = tl.where(l > 0, mx + tl.log(l), float("-inf"))
            base = ((q0 + m).to(tl.int64) * tl.num_programs(2) + h * num_splits) + split
            tl.store(part_lse_ptr + base, lse, mask=m_ok)
            tl.store(part_out_ptr + base[:, None] * D + dd[None, :], o, mask=m_ok[:, None])
        else:
            tl.store(
                out_ptr + (q0 + m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + dd[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=m_ok[:, None],
            )


PREFILL_BLOCK_M = 64
MIN_KEYS_PER_SPLIT = 4 * BLOCK_N  # a split shorter than this costs more to merge than it saves


def prefill_splits_for(
    q_lens: list[int], seq_lens: list[int], heads: int, device: torch.device
) -> int:
    """Key splits for a prefill launch: 1 where its query tiles fill about two programs per
    SM, else enough to (a short chunk over a long cached prefix walks its keys in parallel),
    never so many that a split gets fewer than `MIN_KEYS_PER_SPLIT` keys."""
    sms = _num_sms(device) if device.type == "cuda" else 8
    tiles = heads * sum(-(-n // PREFILL_BLOCK_M) for n in q_lens)
    want = -(-2 * sms // max(1, tiles))
    return max(1, min(want, MAX_SPLITS, max(seq_lens, default=0) // MIN_KEYS_PER_SPLIT))


def prefill_attention_triton(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale,
    sliding_window=None, num_splits=1, out=None,
):  # fmt: skip
    t, hq, d = q.shape
    n_blocks, page, hkv, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if num_splits > 1:
        part_out = torch.empty(t, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never written
    k_flat = k_cache.view(n_blocks * page, hkv, d)
    v_flat = v_cache.view(n_blocks * page, hkv, d)
    r = seq_lens.shape[0]
    grid = (r, triton.cdiv(max_query_len, PREFILL_BLOCK_M), hq * num_splits)
    _prefill_kernel[grid](
        q, k_flat, v_flat, out, part_out, part_lse, block_tables, query_start_loc, seq_lens,
        scale, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), k_flat.stride(0), k_flat.stride(1), v_flat.stride(0),
        v_flat.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=hq // hkv, D=d, PAGE=page, BLOCK_M=PREFILL_BLOCK_M, BLOCK=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=num_splits > 1,
        num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(t, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            D=d, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )  # fmt: skip
    return out


def prefill_attention(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale,
    sliding_window=None, num_splits=1, out=None,
):  # fmt: skip
    """Triton on CUDA (and under TRITON_INTERPRET=1), the reference elsewhere."""
    if triton is None or not (q.is_cuda or INTERPRET):
        got = prefill_attention_reference(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window
        )
        return got if out is None else out.copy_(got)
    return prefill_attention_triton(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale,
        sliding_window, num_splits, out,
    )  # fmt: skip
