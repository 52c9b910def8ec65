"""Linear layers at decode batch sizes: `y = x Wᵀ (+ b)` for at most `MAX_ROWS` rows of x in
one launch, optionally with the gated MLP's activation as its epilogue.

At batch 1 a decoder step is bound by kernel launches on a small model, not by reading its
weights: the Qwen3-0.6B shape runs about 460 kernels a step at 2–3 µs each, against a
weight-copy floor of about 0.3 ms. cuBLAS runs some of these GEMMs as split-K, a second
kernel summing the splits, and the gated MLP adds an activation kernel after its gate-up
GEMM. Here each program owns `BLOCK_N` output columns for every row and walks all of K,
so one launch gives the finished rows:

- `gated=False`: `y = x Wᵀ + b` (`W [N, K]`);
- `gated=True`: `W` is the merged gate-up weight `[2N, K]` (a rank's gate shard, then its
  up shard) and `y = silu(x W_gᵀ + b_g) · (x W_uᵀ + b_u)`, `[M, N]`: the gate-up GEMM and
  `silu_mul` in one kernel, with no rounding of the pre-activations to the model dtype
  between them (the reference computes in float32 the same way).

A program that walks all of K alone for its 16 or 32 columns streams its weights with too
little in flight: on one H200 that read the Llama-3-8B shape's weights about 10% slower
than cuBLAS. With `tickets` (`kernels/tickets.py`; a model gives its Linears one set) the
launch is also split over K, about four programs an SM (`k_splits`): each stores its
float32 partial, and the last program of each column block to finish sums the partials in
order and runs the epilogue (bias, activation) on the sum, in the same launch. cuBLAS's
split-K needs a second, reducing kernel for that.

`skinny_norm_linear` also folds the RMSNorm before the Linear (and the residual add before
the norm) into its launch: `RMSNorm(x) Wᵀ = r · ((x ⊙ g) Wᵀ)` with `r` a row's scalar, so
each program weights its tiles of x by the norm's weight, sums their squares, and scales
the finished sums by `r`. So a decoder layer launches no norm kernel of its own
(`DecoderLayer.forward_fused`).

Off unless `EngineConfig.skinny_gemm` is set (CUDA only), until its speed against cuBLAS
has been measured on the GPUs we serve on (`benchmarks/decode.py --systems
coxswain,coxswain-skinny`).
"""

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.kernels.norm_rope import rms_norm_reference
from services.engine.kernels.steer import INTERPRET
from services.engine.kernels.tickets import Tickets

MAX_ROWS = 16  # rows of x a launch takes: tl.dot's smallest tile
BLOCK_K = 128
INTERPRETER_SMS = 8  # what `k_splits` fills when the interpreter runs the kernel on CPU


def skinny_linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], or [2N, K] gated
    bias: torch.Tensor | None = None,  # [N] or [2N]
    gated: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """The GEMM (and the gated activation) in float32, rounded once to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if gated:
        n = y.shape[1] // 2
        y = F.silu(y[:, :n]) * y[:, n:]
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        ws_ptr,  # with SPLIT: float32 partials [splits, 1 or 2 (GATED), BLOCK_M, N]
        tickets_ptr,  # with SPLIT: one counter per block of output columns, zero
        res_ptr,  # with HAS_RES: the residual stream [M, K], added to x first
        sum_ptr,  # with HAS_RES: x + residual written here [M, K] (by column block 0)
        g_ptr,  # with NORM: the RMSNorm weight [K]
        ss_ptr,  # with NORM and SPLIT: float32 partial sums of squares [splits, BLOCK_M]
        eps,
        M,
        N,  # output columns (per half of W when GATED)
        K,
        k_per_split,  # a multiple of BLOCK_K
        stride_x,
        stride_w,
        stride_y,
        stride_res,
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,
        IEEE: tl.constexpr,  # float32 inputs: full-precision products (no TF32)
        SPLIT: tl.constexpr,  # K split over the launch's second axis (`Tickets` sum it)
        NORM: tl.constexpr,  # y = RMSNorm(x (+ residual)) Wᵀ: the norm before the Linear
        HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        w_rows = rn.to(tl.int64) * stride_w
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        ss = tl.zeros((BLOCK_M,), tl.float32)  # with NORM: the rows' sums of squares
        k_end = tl.minimum(K, (pid_k + 1) * k_per_split)
        for k0 in range(pid_k * k_per_split, k_end, BLOCK_K):
            k = k0 + rk
            k_ok = k < k_end
            x_ok = m_ok[:, None] & k_ok[None, :]
            xt = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=x_ok, other=0.0)
            if HAS_RES:  # rounded as x + residual is, and kept for the next add
                rt = tl.load(res_ptr + rm[:, None] * stride_res + k[None, :], mask=x_ok, other=0.0)
                xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(xt.dtype)
                if pid_n == 0:
                    tl.store(sum_ptr + rm[:, None] * K + k[None, :], xt, mask=x_ok)
            if NORM:
                # RMSNorm(x) Wᵀ = r · ((x ⊙ g) Wᵀ), r = rsqrt(mean(x²) + eps) a row's scalar:
                # the weight here, r once the whole row's squares are summed (below).
                x32 = xt.to(tl.float32)
                ss += tl.sum(x32 * x32, 1)
                g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                xt = (x32 * g[None, :]).to(xt.dtype)
            # Wᵀ's tile [BLOCK_K, BLOCK_N]: contiguous along K in memory
            w_mask = k_ok[:, None] & n_ok[None, :]
            wt = tl.load(w_ptr + w_rows[None, :] + k[:, None], mask=w_mask, other=0.0)
            if IEEE:
                acc += tl.dot(xt, wt, input_precision="ieee")
            else:
                acc += tl.dot(xt, wt)
            if GATED:  # the up rows: N rows further down W
                up = tl.load(
                    w_ptr + N * stride_w + w_rows[None, :] + k[:, None], mask=w_mask, other=0.0
                )
                if IEEE:
                    acc_up += tl.dot(xt, up, input_precision="ieee")
                else:
                    acc_up += tl.dot(xt, up)
        tile = rm[:, None] * N + rn[None, :]  # a partial's [BLOCK_M, BLOCK_N] in ws
        ok = m_ok[:, None] & n_ok[None, :]
        last = True
        if SPLIT:
            halves = 1 + GATED
            part = ws_ptr + pid_k * halves * BLOCK_M * N
            tl.store(part + tile, acc, mask=ok)
            if GATED:
                tl.store(part + BLOCK_M * N + tile, acc_up, mask=ok)
            if NORM:  # (every column block stores the same sums: they read the same x)
                tl.store(ss_ptr + pid_k * BLOCK_M + rm, ss)
            # Every thread's partial stored before the ticket (`kernels/tickets.py`).
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            last = ticket == tl.num_programs(1) - 1
            if last:  # sum the splits in order (the same sum whichever finished last)
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                ss = tl.zeros((BLOCK_M,), tl.float32)
                for sp in range(tl.num_programs(1)):
                    at = ws_ptr + sp * halves * BLOCK_M * N
                    acc += tl.load(at + tile, mask=ok, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(
                            at + BLOCK_M * N + tile, mask=ok, other=0.0, cache_modifier=".cg"
                        )
                    if NORM:
                        ss += tl.load(ss_ptr + sp * BLOCK_M + rm, cache_modifier=".cg")
                tl.store(tickets_ptr + pid_n, 0)  # zero again for the next launch
        if last:
            if NORM:
                r = tl.rsqrt(ss / K + eps)[:, None]
                acc = acc * r
                acc_up = acc_up * r
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    up_bias = tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
                    acc_up += up_bias[None, :]
            if GATED:
                acc = acc * tl.sigmoid(acc) * acc_up
            y = y_ptr + rm[:, None] * stride_y + rn[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _block_n(n: int) -> int:
    """Output columns per program: 32, or 16 where 32 would leave fewer than 128 programs
    (an H100 has 132 SMs, and a program streams only its own columns of W)."""
    return 32 if triton.cdiv(n, 32) >= 128 else 16


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_splits(programs: int, k: int, sms: int) -> int:
    """Splits of K for a launch of `programs` column blocks: up to four programs an SM,
    rounded down (one program streaming its columns alone cannot keep an SM's loads in
    flight; a partial wave more than four an SM only lengthens the tail), each at least two
    `BLOCK_K` tiles long (shorter ones cost their partial's round trip for little reading),
    at most 16; 1 where the columns alone fill the GPU."""
    want = 4 * sms // programs
    return max(1, min(want, 16, k // (2 * BLOCK_K)))


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    tickets: Tickets | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """`skinny_linear_reference` as one Triton launch over blocks of output columns; with
    `tickets`, split over K too (`k_splits`, or `splits`), the last program of each
    column block to finish summing the partials (`kernels/tickets.py`)."""
    return _launch(x, None, None, 0.0, weight, bias, gated, tickets, splits)[0]


def skinny_norm_linear_reference(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K], or None: normalise x alone
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm before a Linear, then the Linear: (`skinny_linear_reference` of
    RMSNorm(x + residual), x + residual), or of RMSNorm(x), and x, without a residual."""
    if residual is None:
        normed, stream = rms_norm_reference(x, norm_weight, eps), x
    else:
        normed, stream = rms_norm_reference(x, norm_weight, eps, residual)
    return skinny_linear_reference(normed, weight, bias, gated), stream


def skinny_norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    tickets: Tickets | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`skinny_norm_linear_reference` in the Linear's launch: each program adds the
    residual to its tiles of x (column block 0 writes the sum out), weights them by the
    norm's weight and sums their squares; the row's scale `rsqrt(mean(x²) + eps)`
    multiplies the finished sums (after the split's partials are summed, where K is split),
    before the bias. The same as normalising first up to rounding: the normalised row is
    not rounded to the model's dtype before the products."""
    return _launch(x, residual, norm_weight, eps, weight, bias, gated, tickets, splits)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    tickets: Tickets | None,
    splits: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    rows = weight.shape[0]
    assert M <= MAX_ROWS, f"{M} rows: at most {MAX_ROWS} a launch"
    assert weight.shape[1] == K and weight.stride(1) == 1 and x.stride(1) == 1
    assert not gated or rows % 2 == 0, "a gated weight stacks gate and up rows"
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    N = rows // 2 if gated else rows
    y = x.new_empty(M, N)
    stream = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if M == 0:
        return y, stream
    block_n = _block_n(N)
    programs = triton.cdiv(N, block_n)
    assert splits is None or tickets is not None, "a split launch sums its partials by ticket"
    if tickets is None:
        splits = 1
    elif splits is None:
        sms = _num_sms(x.device) if x.is_cuda else INTERPRETER_SMS
        splits = k_splits(programs, K, sms)
    k_per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)  # none left empty
    split = splits > 1
    norm = norm_weight is not None
    ws = ss = counters = y  # (unread without SPLIT)
    if split:
        assert tickets is not None
        ws = torch.empty(
            splits, 2 if gated else 1, MAX_ROWS, N, dtype=torch.float32, device=x.device
        )
        if norm:
            ss = torch.empty(splits, MAX_ROWS, dtype=torch.float32, device=x.device)
        counters = tickets.get(programs, x.device)
    _skinny_kernel[(programs, splits)](
        x,
        weight,
        bias if bias is not None else weight,  # (unread without HAS_BIAS)
        y,
        ws,
        counters,
        residual if residual is not None else x,  # (unread without HAS_RES)
        stream,
        norm_weight if norm else weight,  # (unread without NORM)
        ss,
        eps,
        M,
        N,
        K,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_BIAS=bias is not None,
        GATED=gated,
        IEEE=x.dtype == torch.float32,
        SPLIT=split,
        NORM=norm,
        HAS_RES=residual is not None,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=4,
    )
    return y, stream


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    tickets: Tickets | None = None,
) -> torch.Tensor:
    """Triton on CUDA or under TRITON_INTERPRET=1 (split over K with `tickets`), else the
    reference."""
    if triton is not None and (x.is_cuda or INTERPRET):
        return skinny_linear_triton(x, weight, bias, gated, tickets)
    return skinny_linear_reference(x, weight, bias, gated)


def skinny_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    tickets: Tickets | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA or under TRITON_INTERPRET=1 (split over K with `tickets`), else the
    reference."""
    if triton is not None and (x.is_cuda or INTERPRET):
        return skinny_norm_linear_triton(
            x, residual, norm_weight, eps, weight, bias, gated, tickets
        )
    return skinny_norm_linear_reference(x, residual, norm_weight, eps, weight, bias, gated)


def takes(x: torch.Tensor) -> bool:
    """Whether a layer switched to this kernel runs it for `x`: a CUDA batch of at most
    `MAX_ROWS` rows, contiguous along its features."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1
