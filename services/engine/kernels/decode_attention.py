"""Decode attention over the paged KV cache, read in place: split-K (flash-decoding).

One query per request attends every cached key of its request. Work is split three ways:
request × KV head × split of the context, so a single request still spreads over many SMs.
Each program packs the query heads that share its KV head (GQA) into the rows of one
`tl.dot`, walks its share of the context in tiles of `BLOCK_N` keys gathered across pages
(a tile may span several pages), and keeps an online softmax; a second small kernel merges
the splits by their log-sum-exp. Every bound is read from device tensors (each row's length
decides its own split size), so the launch depends only on shapes and a CUDA graph can
capture it. Rows with length 0 (graph padding) give zeros.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

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
        q_ptr,  # [B, Hq, D]
        k_ptr,  # [N * bs, Hkv, D] (flat slots)
        v_ptr,
        tables_ptr,  # [B, W]
        lens_ptr,  # [B]
        part_out_ptr,  # [B, Hq, S, D] float32
        part_lse_ptr,  # [B, Hq, S] float32
        scale,
        window,  # 0: none
        stride_qb,
        stride_qh,
        stride_kslot,
        stride_kh,
        stride_vslot,
        stride_vh,
        stride_tb,
        num_splits,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,  # >= 16, power of two
        D: tl.constexpr,
        PAGE: tl.constexpr,  # block_size
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no silent TF32
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
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + dd[None, :],
            mask=g_ok[:, None],
            other=0.0,
        )
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
        base = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_lse_ptr + base, lse, mask=g_ok)
        tl.store(part_out_ptr + base[:, None] * D + dd[None, :], o, mask=g_ok[:, None])

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
        sp = tl.arange(0, SPLITS_PAD)
        ok = sp < num_splits
        lse = tl.load(part_lse_ptr + row * num_splits + sp, mask=ok, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.where(ok & (lse > float("-inf")), tl.exp(lse - top), 0.0)
        total = tl.sum(w, 0)
        dd = tl.arange(0, D)
        parts = tl.load(
            part_out_ptr + (row * num_splits + sp)[:, None] * D + dd[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + dd, o.to(out_ptr.dtype.element_ty))


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
) -> torch.Tensor:
    b, hq, d = q.shape
    n_blocks, page, hkv, _ = k_cache.shape
    group = hq // hkv
    if num_splits is None:
        num_splits = num_splits_for(b, hkv, block_tables.shape[1] * page, q.device)
    out = torch.empty_like(q) if out is None else out
    part_out = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    k_flat = k_cache.view(n_blocks * page, hkv, d)
    v_flat = v_cache.view(n_blocks * page, hkv, d)
    _split_kernel[(b, hkv, num_splits)](
        q,
        k_flat,
        v_flat,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        block_tables.stride(0),
        num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=d,
        PAGE=page,
        BLOCK=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
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


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None):
    """Triton on CUDA (and under TRITON_INTERPRET=1), the reference elsewhere."""
    if triton is None or not (q.is_cuda or INTERPRET):
        return decode_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window
        )
    return decode_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window
    )
