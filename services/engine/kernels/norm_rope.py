"""Fused RMSNorm (optionally with the residual add before it) and rotary embedding.

Written as PyTorch ops, each RMSNorm is eight kernels and each rotary call fourteen; in a
decode step of a small model those launches, not the weights, set the time. These do each
in one kernel, and `qk_rope_cache` does a layer's whole way from the qkv projection to the
KV cache in one: the per-head q/k norms (Qwen3), RoPE of q and k, and the K and V writes
into their cache slots (five kernels a layer before). All compute exactly what the PyTorch
references compute, rounding where they round (transformers' order: normalise in float32,
cast to the activation dtype, then multiply by the weight); only the order of the float32
sum of squares differs. `silu_mul` does the MLP's activation, `F.silu(gate) * up` of the
merged gate_up output, in one kernel where PyTorch launches two (silu, then the mul); its
fast exp matches PyTorch exactly in bf16 and within a few ulps in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.kernels.steer import INTERPRET


def rms_norm_reference(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]: normalise x + residual, and return it
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)


def rotary_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [P, D] float32 table
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE, as transformers applies it (table cast to the activation dtype)."""
    c = cos[positions].to(q.dtype).unsqueeze(1)
    s = sin[positions].to(q.dtype).unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def qk_rope_cache_reference(
    q: torch.Tensor,  # [T, Hq, D] (views of the qkv projection's output are fine)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] flat cache slot of each token
    q_weight: torch.Tensor | None = None,  # per-head RMSNorm weights [D] (Qwen3), or None
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Norm q and k per head (with weights), rotate them, write k and v into their slots of
    the cache; returns the rotated q."""
    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    q, k = rotary_reference(q, k, cos, sin, positions)
    hkv, d = k_cache.shape[-2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:  # x: [..., 2N], gate then up
    """The MLP's activation as transformers computes it, in x's dtype: [..., N]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,  # residual (when HAS_RES)
        sum_ptr,  # x + residual, written contiguous (when HAS_RES)
        w_ptr,
        out_ptr,  # written contiguous
        stride_xt,
        stride_xh,  # x is [T, N, H] with any outer strides (N = 1 for a matrix)
        stride_res,
        N,
        H,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        m = cols < H
        x = tl.load(x_ptr + (row // N) * stride_xt + (row % N) * stride_xh + cols, mask=m)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_res + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as x + r is
            tl.store(sum_ptr + row * H + cols, x, mask=m)
        x32 = tl.where(m, x.to(tl.float32), 0.0)
        var = tl.sum(x32 * x32, 0) / H
        normed = (x32 * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * H + cols, y, mask=m)

    @triton.jit
    def _norm_rope_heads(
        src,  # this token's first head
        stride_h,
        dst,  # where its first head goes
        dst_stride_h,
        n,
        w_ptr,
        eps,
        c,
        s,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        HAS_NORM: tl.constexpr,
        ROTATE: tl.constexpr,
    ):
        """Heads [n, 2 * HALF] of one token: RMSNorm each (HAS_NORM), rotate (ROTATE), store;
        rounded where the references round, so the result is theirs."""
        dtype = src.dtype.element_ty
        heads = tl.arange(0, BLOCK_HEADS)
        d = tl.arange(0, HALF)
        ok = heads[:, None] < n
        p = src + heads[:, None] * stride_h + d[None, :]
        x1 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(p + HALF, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
            r = tl.rsqrt(var + eps)[:, None]
            w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
            x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if ROTATE:
            a1 = (x1 * c[None, :]).to(dtype).to(tl.float32)
            b1 = (-x2 * s[None, :]).to(dtype).to(tl.float32)
            a2 = (x2 * c[None, :]).to(dtype).to(tl.float32)
            b2 = (x1 * s[None, :]).to(dtype).to(tl.float32)
            x1, x2 = a1 + b1, a2 + b2
        out = dst + heads[:, None] * dst_stride_h + d[None, :]
        out_dtype = dst.dtype.element_ty
        tl.store(out, x1.to(dtype).to(out_dtype), mask=ok)
        tl.store(out + HALF, x2.to(dtype).to(out_dtype), mask=ok)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, pos_ptr, t, like_ptr, HALF: tl.constexpr):
        """Token t's half-rows of the cos/sin tables, rounded to the activation dtype (that
        `like_ptr` points to) as transformers casts the tables, in float32."""
        dtype = like_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, HALF)
        c = tl.load(cos_ptr + pos * 2 * HALF + d).to(dtype).to(tl.float32)
        s = tl.load(sin_ptr + pos * 2 * HALF + d).to(dtype).to(tl.float32)
        return c, s

    @triton.jit
    def _rotary_kernel(
        q_ptr,
        k_ptr,
        q_out,  # [T, HQ, 2 * HALF] contiguous
        k_out,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
    ):
        # One program per token: every head of q and k.
        t = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin(cos_ptr, sin_ptr, pos_ptr, t, q_out, HALF)
        _norm_rope_heads(
            q_ptr + t * stride_qt, stride_qh, q_out + t * HQ * 2 * HALF, 2 * HALF, HQ, q_ptr,
            0.0, c, s, HALF, BLOCK_HEADS, False, True,
        )  # fmt: skip
        _norm_rope_heads(
            k_ptr + t * stride_kt, stride_kh, k_out + t * HKV * 2 * HALF, 2 * HALF, HKV, k_ptr,
            0.0, c, s, HALF, BLOCK_HEADS, False, True,
        )  # fmt: skip

    @triton.jit
    def _qk_rope_cache_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        q_out,  # [T, HQ, 2 * HALF] contiguous
        k_cache,  # [slots, HKV, 2 * HALF] (flat view of the paged cache)
        v_cache,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        eps,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cs,
        stride_ch,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        # One program per token: every head of q, k and v.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c, s = _cos_sin(cos_ptr, sin_ptr, pos_ptr, t, q_ptr, HALF)
        _norm_rope_heads(
            q_ptr + t * stride_qt, stride_qh, q_out + t * HQ * 2 * HALF, 2 * HALF, HQ, qw_ptr,
            eps, c, s, HALF, BLOCK_HEADS, HAS_NORM, True,
        )  # fmt: skip
        _norm_rope_heads(
            k_ptr + t * stride_kt, stride_kh, k_cache + slot * stride_cs, stride_ch, HKV,
            kw_ptr, eps, c, s, HALF, BLOCK_HEADS, HAS_NORM, True,
        )  # fmt: skip
        _norm_rope_heads(
            v_ptr + t * stride_vt, stride_vh, v_cache + slot * stride_cs, stride_ch, HKV,
            kw_ptr, eps, c, s, HALF, BLOCK_HEADS, False, False,
        )  # fmt: skip

    @triton.jit
    def _silu_mul_kernel(
        x_ptr,  # [T, 2N], gate then up; last dim contiguous
        out_ptr,  # [T, N] contiguous
        stride_xt,
        N,
        BLOCK: tl.constexpr,
    ):
        # One program per row and BLOCK columns of it.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        gate = tl.load(x_ptr + row * stride_xt + cols, mask=m, other=0.0)
        up = tl.load(x_ptr + row * stride_xt + N + cols, mask=m, other=0.0)
        g = gate.to(tl.float32)
        # rounded as F.silu rounds; tl.exp is the fast exp: equal in bf16, float32 within ulps
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        y = act.to(tl.float32) * up.to(tl.float32)  # then the mul, in float32, rounded
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def _use_triton(*tensors: torch.Tensor | None) -> bool:
    """The kernels have no backward: anything autograd must see (the trainer's forward)
    takes the PyTorch path."""
    x = tensors[0]
    if triton is None or not (x.is_cuda or INTERPRET):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def rms_norm_triton(x, weight, eps, residual=None):
    """x: [..., H] whose last dim is contiguous; a [T, N, H] view (per-head norms of a
    fused projection's output) is read in place. The output is contiguous."""
    h = x.shape[-1]
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, h)
    t, n = x3.shape[0], x3.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = residual.reshape(-1, h) if residual is not None else out
    total = torch.empty_like(out) if residual is not None else out
    _rms_norm_kernel[(t * n,)](
        x3,
        res,
        total,
        weight,
        out,
        x3.stride(0),
        x3.stride(1),
        res.stride(0),
        n,
        h,
        eps,
        HAS_RES=residual is not None,
        BLOCK_H=triton.next_power_of_2(h),
        num_warps=4 if h <= 2048 else 8,
    )
    return out if residual is None else (out, total)


def rotary_triton(q, k, cos, sin, positions):
    """Out of place, one kernel for q and k."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    _rotary_kernel[(t,)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        HQ=hq,
        HKV=hkv,
        HALF=d // 2,
        BLOCK_HEADS=triton.next_power_of_2(max(hq, hkv)),
        num_warps=4,
    )
    return q_out, k_out


def qk_rope_cache_triton(
    q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q_weight=None, k_weight=None,
    eps=0.0,
):  # fmt: skip
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    kc = k_cache.view(-1, hkv, d)
    vc = v_cache.view(-1, hkv, d)
    has_norm = q_weight is not None
    _qk_rope_cache_kernel[(t,)](
        q, k, v, q_out, kc, vc, q_weight if has_norm else q, k_weight if has_norm else k,
        cos, sin, positions, slot_mapping, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1),
        HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_HEADS=triton.next_power_of_2(max(hq, hkv)),
        HAS_NORM=has_norm, num_warps=4,
    )  # fmt: skip
    return q_out


def silu_mul_triton(x):
    """x: [..., 2N] whose last dim is contiguous (rows may be strided); the output is a
    contiguous [..., N]."""
    n = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, out, x2.stride(0), n, BLOCK=block, num_warps=4
    )
    return out


def qk_rope_cache(
    q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q_weight=None, k_weight=None,
    eps=0.0,
):  # fmt: skip
    """A layer's q/k norms (with weights; Qwen3), RoPE, and K/V cache writes; returns the
    rotated q. One Triton kernel on CUDA (power-of-two head dims), else the references."""
    half = q.shape[-1] // 2
    if _use_triton(q, k, v, q_weight) and half & (half - 1) == 0:
        return qk_rope_cache_triton(
            q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps
        )
    return qk_rope_cache_reference(
        q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps
    )


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm of x (or of x + residual, returning that sum too); Triton on CUDA."""
    if _use_triton(x, weight, residual):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rotary(q, k, cos, sin, positions):
    """Rotate-half RoPE of q and k; Triton on CUDA (for power-of-two head dims: the kernel
    tiles half a head whole)."""
    half = q.shape[-1] // 2
    if _use_triton(q, k) and half & (half - 1) == 0:
        return rotary_triton(q, k, cos, sin, positions)
    return rotary_reference(q, k, cos, sin, positions)


def silu_mul(x):
    """F.silu(gate) * up of x = [gate, up] on its last dim; one Triton kernel on CUDA."""
    if _use_triton(x):
        return silu_mul_triton(x)
    return silu_mul_reference(x)
