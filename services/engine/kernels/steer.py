"""The per-site steering op: one fused Triton kernel, its PyTorch reference, a dispatcher.

At one (layer, site) every token's residual gets its global row (prefill or decode), its
request's row and the dynamic tier, both scaled on decode tokens by the in-graph monitor
(the row only when `gate_rows` is set), and its request's declarative gate, which fires on
decode tokens from its own probe. All dot products read the pristine residual. Every switch
is read from tensors, never branched on in Python, so both paths can be captured in a CUDA
graph.

Shapes: T tokens in the flattened batch, H hidden size, R rows in the steering table.
`gate_params` columns: active, threshold, sharpness, scale, attenuate, bit, latch.
`mon_params`: active, threshold, sharpness, gate_rows.

Two optional parts serve read-back without leaving the op (or a CUDA graph):
- read-out probes: the site's probe bank `[C, H]` (float32) with its live column count;
  every token whose `read_rows` entry is ≥ 0 writes its dot product with each live column
  into that row of `scores` (`[S, C]`, row-strided). Tokens at -1 read nothing and cost
  nothing.
- the latch carry: a token whose `carry` entry is ≥ 0 also counts as latched the bits in
  `last_fired[carry]`, the gates its request fired in the step before, which the host has
  not seen yet when steps overlap.

And the in-graph capture (`kernels/capture.py`): a token whose `capture_rows` entry is ≥ 0
writes its pristine residual into its row of the capture buffer at `capture_slot`, and the
op's output at `capture_next` (the next layer's pre_attn), when that is ≥ 0.

And one fusion: with `norm_weight`, the op also returns the RMSNorm of its output (the next
layer's input norm, or the final norm), rounded as `norm_rope.rms_norm` rounds, so a steered
layer costs the plain one's kernel count.
"""

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

# Triton fixes compiled vs interpreted (TRITON_INTERPRET=1: kernels run on CPU tensors) when
# it is imported, so the dispatcher routes by the same setting.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BLOCK_H = 1024


def steer_reference(
    h: torch.Tensor,  # [T, H] pristine residual; not modified
    rows: torch.Tensor,  # [T] int32 steering row of each token (0 = zero row)
    decode: torch.Tensor,  # [T] float32 1 = decode token, 0 = prefill token
    vec: torch.Tensor,  # [R, H] row 0 zeros, row 1 global prefill, row 2 global decode
    row_scale: torch.Tensor,  # [R] float32
    dyn_vec: torch.Tensor,  # [H]
    dyn_gain: torch.Tensor,  # [T] float32 (prefill tokens already zeroed by the host)
    mon_probe: torch.Tensor,  # [H]
    mon_params: torch.Tensor,  # [4] float32
    gate_probe: torch.Tensor,  # [R, H]
    gate_vec: torch.Tensor,  # [R, H]
    gate_params: torch.Tensor,  # [R, 7] float32
    latched: torch.Tensor,  # [T] int32 latched-gate bitmask of each token's request
    fired: torch.Tensor,  # [T] int32 fired-gate bitmask, OR-ed in place
    base: torch.Tensor | None = None,  # [T, H] what the terms are added to (default: h)
    add: torch.Tensor | None = None,  # [T, H] a residual add still to do: h + add is the residual
    probe_bank: torch.Tensor | None = None,  # [C, H] float32 read-out probes of this site
    probe_count: torch.Tensor | None = None,  # [1] int32 live columns (a prefix of the bank)
    read_rows: torch.Tensor | None = None,  # [T] int32 row of `scores` each token fills, or -1
    scores: torch.Tensor | None = None,  # [S, C] float32, written where read_rows >= 0
    carry: torch.Tensor | None = None,  # [T] int32 row of `last_fired` also latched, or -1
    last_fired: torch.Tensor | None = None,  # [N] int32 gate bits fired by the step before
    norm_weight: torch.Tensor | None = None,  # [H]: also return rms_norm(out) with it
    eps: float = 0.0,
    capture_rows: torch.Tensor | None = None,  # [T] int32 row of `capture_out`, or -1
    capture_out: torch.Tensor | None = None,  # [Rc, S, H] the capture buffer
    capture_slot: int = -1,  # the slot the pristine residual goes to
    capture_next: int = -1,  # the slot the output goes to (-1: none)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The steered residual `[T, H]` in h's dtype (computed in float32); ORs into `fired`,
    and writes read-out `scores` and captures. With `norm_weight`: (residual, its RMSNorm).

    Probes read `h`; the terms are added to `base`, which differs from `h` only where a
    patch replaced rows after the monitor read them (capture → monitor → patch → steer).
    `add` (never with `base`) folds the residual add before the site into the op: the
    residual is `h + add`, rounded to h's dtype as PyTorch's add rounds.
    """
    if add is not None:
        assert base is None, "a patched base is added to after the residual add"
        h = h + add
    x = h.float()
    capturing = None
    if capture_rows is not None:
        capturing = (capture_rows >= 0).nonzero().flatten()
        capture_out[capture_rows[capturing].long(), capture_slot] = h[capturing]
    if probe_bank is not None:
        n = int(probe_count[0])
        reading = (read_rows >= 0).nonzero().flatten()
        if n and len(reading):
            got = x[reading] @ probe_bank[:n].float().t()  # [reading, n]
            scores[read_rows[reading].long(), :n] = got
    if carry is not None:
        prev = last_fired[carry.long().clamp(min=0)]
        latched = torch.where(carry >= 0, latched | prev, latched)
    r = rows.long()
    is_decode = decode != 0
    d = decode.float()
    rg = 1 + is_decode.long()
    one = torch.ones_like(d)

    mon_active, mon_thr, mon_sharp, gate_rows = mon_params.float().unbind()
    gm = torch.where(
        mon_active != 0, torch.sigmoid(mon_sharp * (x @ mon_probe.float() - mon_thr)), one
    )
    gm_d = torch.where(is_decode, gm, one)  # prefill is never gated

    gp = gate_params.float()[r]  # [T, 7]
    g_active, g_thr, g_sharp, g_scale, g_att, g_bit, g_latch = gp.unbind(-1)
    gv = gate_vec.float()[r]  # [T, H]
    p = torch.sigmoid(g_sharp * ((x * gate_probe.float()[r]).sum(-1) - g_thr))
    bit = g_bit.long()
    latched_on = (g_latch != 0) & (((latched.long() >> bit) & 1) != 0)
    g = g_active * d * torch.where(latched_on, one, p)
    fire = (g_active != 0) & is_decode & (p > 0.5)
    fired.bitwise_or_(torch.where(fire, 1 << bit, 0).to(fired.dtype))
    g_coef = g * g_scale * torch.where(g_att != 0, -(x * gv).sum(-1), one)

    scale = row_scale.float()
    row_coef = scale[r] * torch.where(gate_rows != 0, gm_d, one)
    out = (
        (x if base is None else base.float())
        + scale[rg, None] * vec.float()[rg]
        + row_coef[:, None] * vec.float()[r]
        + (dyn_gain.float() * gm_d)[:, None] * dyn_vec.float()
        + g_coef[:, None] * gv
    ).to(h.dtype)
    if capturing is not None and capture_next >= 0:
        capture_out[capture_rows[capturing].long(), capture_next] = out[capturing]
    if norm_weight is None:
        return out
    o32 = out.float()
    normed = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)).to(out.dtype)
    return out, (norm_weight * normed).to(out.dtype)


if triton is not None:

    @triton.jit
    def _steer_kernel(
        h_ptr,
        out_ptr,
        rows_ptr,
        decode_ptr,
        vec_ptr,
        row_scale_ptr,
        dyn_vec_ptr,
        dyn_gain_ptr,
        mon_probe_ptr,
        mon_params_ptr,
        gate_probe_ptr,
        gate_vec_ptr,
        gate_params_ptr,
        latched_ptr,
        fired_ptr,
        base_ptr,
        add_ptr,
        bank_ptr,
        count_ptr,
        read_rows_ptr,
        scores_ptr,
        carry_ptr,
        last_fired_ptr,
        norm_w_ptr,
        normed_ptr,
        cap_rows_ptr,
        cap_ptr,
        cap_slot,
        cap_next,
        eps,
        stride_h,
        stride_base,
        stride_add,
        stride_out,
        stride_scores,
        H: tl.constexpr,  # fixed per model, so specializing on it costs one compile
        BLOCK_H: tl.constexpr,
        HAS_ADD: tl.constexpr,  # the residual is h + add, rounded to h's dtype
        BLOCK_C: tl.constexpr,  # read-out columns (a power of two); 0: no probe bank
        HAS_CARRY: tl.constexpr,
        HAS_NORM: tl.constexpr,  # also write rms_norm(out) * norm_w (row stride H)
        HAS_CAPTURE: tl.constexpr,  # capture rows (row stride S * H = stride_cap)
        HAS_CAPTURE_NEXT: tl.constexpr,  # ... and the output at slot cap_next
        stride_cap,
    ):
        # One program per token: pass 1 takes the three dot products with the pristine x,
        # pass 2 writes x plus every steering term.
        t = tl.program_id(0).to(tl.int64)
        r = tl.load(rows_ptr + t).to(tl.int64)
        d = tl.load(decode_ptr + t)
        is_decode = d != 0
        rg = 1 + is_decode.to(tl.int64)
        cols = tl.arange(0, BLOCK_H)

        if BLOCK_C > 0:
            # Read-outs, behind a branch: a token that reads nothing, or a site whose bank
            # is empty (a reading token meets every site of the graph), pays two loads.
            read_row = tl.load(read_rows_ptr + t)
            num_live = tl.load(count_ptr)
            if (read_row >= 0) & (num_live > 0):
                ccols = tl.arange(0, BLOCK_C)
                live = ccols < num_live  # past the live count: masked, never loaded
                read_acc = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
                for start in range(0, H, BLOCK_H):
                    c = start + cols
                    m = c < H
                    x = tl.load(h_ptr + t * stride_h + c, mask=m, other=0.0)
                    if HAS_ADD:
                        a = tl.load(add_ptr + t * stride_add + c, mask=m, other=0.0)
                        x = (x.to(tl.float32) + a.to(tl.float32)).to(out_ptr.dtype.element_ty)
                    bank = tl.load(
                        bank_ptr + ccols[:, None] * H + c[None, :],
                        mask=live[:, None] & m[None, :],
                        other=0.0,
                    )
                    read_acc += bank * x.to(tl.float32)[None, :]
                tl.store(
                    scores_ptr + read_row.to(tl.int64) * stride_scores + ccols,
                    tl.sum(read_acc, axis=1),
                    mask=live,
                )

        if HAS_CAPTURE:
            # Masked stores: a token at -1 writes nothing (its row is clamped to 0, unused).
            cap_row = tl.load(cap_rows_ptr + t).to(tl.int64)
            capturing = (tl.zeros([BLOCK_H], dtype=tl.int64) + cap_row) >= 0  # [BLOCK_H]
            cap_row = tl.maximum(cap_row, 0)
        mon_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        probe_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        att_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            m = c < H
            x = tl.load(h_ptr + t * stride_h + c, mask=m, other=0.0)
            if HAS_ADD:
                a = tl.load(add_ptr + t * stride_add + c, mask=m, other=0.0)
                x = (x.to(tl.float32) + a.to(tl.float32)).to(out_ptr.dtype.element_ty)
            if HAS_CAPTURE:
                dst = cap_ptr + cap_row * stride_cap + cap_slot * H + c
                tl.store(dst, x.to(cap_ptr.dtype.element_ty), mask=m & capturing)
            x = x.to(tl.float32)
            mp = tl.load(mon_probe_ptr + c, mask=m, other=0.0).to(tl.float32)
            gpr = tl.load(gate_probe_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
            gv = tl.load(gate_vec_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
            mon_acc += x * mp
            probe_acc += x * gpr
            att_acc += x * gv
        mon_dot = tl.sum(mon_acc, axis=0)
        probe_dot = tl.sum(probe_acc, axis=0)
        att_dot = tl.sum(att_acc, axis=0)

        mon_active = tl.load(mon_params_ptr + 0)
        mon_thr = tl.load(mon_params_ptr + 1)
        mon_sharp = tl.load(mon_params_ptr + 2)
        gate_rows = tl.load(mon_params_ptr + 3)
        gm = tl.where(mon_active != 0, tl.sigmoid(mon_sharp * (mon_dot - mon_thr)), 1.0)
        gm_d = tl.where(is_decode, gm, 1.0)  # prefill is never gated

        gp = gate_params_ptr + r * 7
        g_active = tl.load(gp + 0)
        g_thr = tl.load(gp + 1)
        g_sharp = tl.load(gp + 2)
        g_scale = tl.load(gp + 3)
        g_att = tl.load(gp + 4)
        bit = tl.load(gp + 5).to(tl.int32)
        g_latch = tl.load(gp + 6)
        p = tl.sigmoid(g_sharp * (probe_dot - g_thr))
        lat = tl.load(latched_ptr + t)
        if HAS_CARRY:
            src = tl.load(carry_ptr + t)
            prev = tl.load(last_fired_ptr + tl.maximum(src, 0))  # row 0 always exists
            lat = lat | tl.where(src >= 0, prev, 0)
        latched_on = (g_latch != 0) & (((lat >> bit) & 1) != 0)
        g = g_active * d * tl.where(latched_on, 1.0, p)
        fire = (g_active != 0) & is_decode & (p > 0.5)
        fired = tl.load(fired_ptr + t)
        tl.store(fired_ptr + t, fired | tl.where(fire, 1 << bit, 0))
        g_coef = g * g_scale * tl.where(g_att != 0, -att_dot, 1.0)

        global_coef = tl.load(row_scale_ptr + rg)
        row_coef = tl.load(row_scale_ptr + r) * tl.where(gate_rows != 0, gm_d, 1.0)
        dyn_coef = tl.load(dyn_gain_ptr + t) * gm_d
        sq_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            m = c < H
            x = tl.load(base_ptr + t * stride_base + c, mask=m, other=0.0)
            if HAS_ADD:
                a = tl.load(add_ptr + t * stride_add + c, mask=m, other=0.0)
                x = (x.to(tl.float32) + a.to(tl.float32)).to(out_ptr.dtype.element_ty)
            x = x.to(tl.float32)
            v_global = tl.load(vec_ptr + rg * H + c, mask=m, other=0.0).to(tl.float32)
            v_row = tl.load(vec_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
            v_dyn = tl.load(dyn_vec_ptr + c, mask=m, other=0.0).to(tl.float32)
            gv = tl.load(gate_vec_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
            y = x + global_coef * v_global + row_coef * v_row + dyn_coef * v_dyn + g_coef * gv
            y = y.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + t * stride_out + c, y, mask=m)
            if HAS_CAPTURE_NEXT:
                dst = cap_ptr + cap_row * stride_cap + cap_next * H + c
                tl.store(dst, y.to(cap_ptr.dtype.element_ty), mask=m & capturing)
            if HAS_NORM:  # the norm reads the output as rounded
                y32 = tl.where(m, y.to(tl.float32), 0.0)
                sq_acc += y32 * y32
        if HAS_NORM:
            # Pass 3: each thread reads back what it stored (same layout), now scaled.
            rstd = tl.rsqrt(tl.sum(sq_acc, axis=0) / H + eps)
            for start in range(0, H, BLOCK_H):
                c = start + cols
                m = c < H
                y = tl.load(out_ptr + t * stride_out + c, mask=m, other=0.0)
                normed = (y.to(tl.float32) * rstd).to(out_ptr.dtype.element_ty)
                w = tl.load(norm_w_ptr + c, mask=m, other=0.0)
                z = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
                tl.store(normed_ptr + t * H + c, z, mask=m)


def steer_triton(
    h: torch.Tensor,
    rows: torch.Tensor,
    decode: torch.Tensor,
    vec: torch.Tensor,
    row_scale: torch.Tensor,
    dyn_vec: torch.Tensor,
    dyn_gain: torch.Tensor,
    mon_probe: torch.Tensor,
    mon_params: torch.Tensor,
    gate_probe: torch.Tensor,
    gate_vec: torch.Tensor,
    gate_params: torch.Tensor,
    latched: torch.Tensor,
    fired: torch.Tensor,
    base: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    probe_bank: torch.Tensor | None = None,
    probe_count: torch.Tensor | None = None,
    read_rows: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    carry: torch.Tensor | None = None,
    last_fired: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    capture_rows: torch.Tensor | None = None,
    capture_out: torch.Tensor | None = None,
    capture_slot: int = -1,
    capture_next: int = -1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`steer_reference` as one fused Triton launch over the flattened batch."""
    T, H = h.shape
    if T == 0:
        out = h.clone() if add is None else h + add
        return out if norm_weight is None else (out, out.clone())
    block_c = 0
    if probe_bank is not None:
        assert probe_bank.dtype == torch.float32 and probe_bank.is_contiguous()
        assert probe_bank.shape[1] == H and scores.stride(1) == 1
        assert read_rows.is_contiguous() and probe_count.is_contiguous()
        block_c = triton.next_power_of_2(probe_bank.shape[0])
        assert block_c == probe_bank.shape[0], "the probe bank's width must be a power of two"
    if carry is not None:
        assert carry.is_contiguous() and last_fired.is_contiguous()
    if capture_rows is not None:
        assert capture_rows.is_contiguous() and capture_out.is_contiguous()
        assert capture_out.shape[2] == H and 0 <= capture_slot < capture_out.shape[1]
        assert capture_next < capture_out.shape[1]
    assert add is None or base is None, "a patched base is added to after the residual add"
    base = h if base is None else base
    assert base.shape == h.shape and base.stride(1) == 1
    assert add is None or (add.shape == h.shape and add.stride(1) == 1)
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    normed = torch.empty_like(out) if norm_weight is not None else None
    assert norm_weight is None or (norm_weight.shape == (H,) and norm_weight.is_contiguous())
    # The kernel indexes every operand but h with its packed strides.
    packed = [rows, decode, vec, row_scale, dyn_vec, dyn_gain, mon_probe, mon_params]
    packed += [gate_probe, gate_vec, gate_params, latched, fired]
    assert h.stride(1) == 1 and all(a.is_contiguous() for a in packed)
    block_h = min(triton.next_power_of_2(H), MAX_BLOCK_H)
    num_warps = 4
    if norm_weight is not None:
        # The next norm reduces over one tile with the RMSNorm kernel's shape and warps
        # (`norm_rope.rms_norm_triton`), so it sums in the same order: an unsteered row's
        # norm is bit-identical to the plain path's.
        block_h = triton.next_power_of_2(H)
        num_warps = 4 if H <= 2048 else 8
    _steer_kernel[(T,)](
        h,
        out,
        rows,
        decode,
        vec,
        row_scale,
        dyn_vec,
        dyn_gain,
        mon_probe,
        mon_params,
        gate_probe,
        gate_vec,
        gate_params,
        latched,
        fired,
        base,
        h if add is None else add,
        probe_bank if probe_bank is not None else h,  # unread when BLOCK_C == 0
        probe_count if probe_count is not None else rows,
        read_rows if read_rows is not None else rows,
        scores if scores is not None else h,
        carry if carry is not None else rows,  # unread without HAS_CARRY
        last_fired if last_fired is not None else rows,
        norm_weight if norm_weight is not None else h,  # unread without HAS_NORM
        normed if normed is not None else h,
        capture_rows if capture_rows is not None else rows,  # unread without HAS_CAPTURE
        capture_out if capture_out is not None else h,
        capture_slot,
        max(capture_next, 0),
        eps,
        h.stride(0),
        base.stride(0),
        h.stride(0) if add is None else add.stride(0),
        out.stride(0),
        scores.stride(0) if scores is not None else 0,
        H=H,
        BLOCK_H=block_h,
        HAS_ADD=add is not None,
        BLOCK_C=block_c,
        HAS_CARRY=carry is not None,
        HAS_NORM=norm_weight is not None,
        HAS_CAPTURE=capture_rows is not None,
        HAS_CAPTURE_NEXT=capture_rows is not None and capture_next >= 0,
        stride_cap=capture_out.stride(0) if capture_out is not None else 0,
        num_warps=num_warps,
    )
    return out if normed is None else (out, normed)


def steer(
    h: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`steer_reference` (its arguments and result): Triton on CUDA or under
    TRITON_INTERPRET=1, else the reference."""
    fn = steer_triton if triton is not None and (h.is_cuda or INTERPRET) else steer_reference
    return fn(h, *args, **kwargs)
