"""A Linear of one row: `y = x Wᵀ (+ b)` for `x` of shape `[1, K]`, the batch-1 decode step.

At one row a Linear is a matrix-vector product bound by reading `W`. cuBLAS runs it as a
GEMM tile: on one H200 (bf16, weights streamed from HBM, in a CUDA graph) it read the
Qwen3-0.6B shape's o_proj (`N = 1024, K = 2048`) at 324 GB/s and its down projection at 850,
as split-K with a second kernel summing the splits, and the Llama-3-8B shape's at 2.3–3.8
TB/s. Here each program owns `BLOCK_N` rows of `W` and walks all of `K` in tiles of
`BLOCK_K`, keeping a `[BLOCK_N, BLOCK_K]` float32 accumulator it reduces once at the end;
nothing is split, so nothing is summed by another launch. On the same GPU it was 1.0–1.2×
cuBLAS on the 8B shape's (one GPU and a TP=2 rank's), 1.1–1.2× on the 0.6B shape's qkv and
gate-up, 1.5–1.7× and 3.6× on its down and o projections; a second sweep on another start
had it lose at two shapes, 0.90× (`benchmarks/README.md`, "Batch 1: a GEMV kernel";
`benchmarks/gemv_sweep.py`).

`EngineConfig.gemv` routes one-row CUDA Linears of the decoder and the LM head here;
anything else (more rows, CPU) keeps `F.linear`. By default it does so only for the weight
shapes at which the kernel measured faster than cuBLAS on this GPU when the model loaded
(`faster_shapes`): which one wins at a shape changed between two starts of one GPU kind,
so it is a measurement of the GPU, not a rule written here.
"""

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.kernels.norm_rope import silu_mul_reference
from services.engine.kernels.skinny_gemm import skinny_linear_reference
from services.engine.kernels.steer import INTERPRET
from services.engine.kernels.timing import timed

BLOCK_N = 4  # rows of W a program owns: 768–7,168 programs at the shapes measured
# `faster_shapes` keeps cuBLAS unless the kernel takes at most this share of its time: a
# tie, within the timing's noise, is not worth a second code path.
MARGIN = 0.97


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`x Wᵀ + b` in float32, rounded once to x's dtype ([1, K] @ [N, K]ᵀ -> [1, N]): the
    skinny kernel's reference, ungated."""
    return skinny_linear_reference(x, weight, bias)


def gemv_gated_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The MLP's gate-up Linear and activation at one row: `silu(x gateᵀ) * (x upᵀ)` of
    `weight = [gate; up]`, each Linear rounded once to x's dtype and the activation rounded
    as the engine's `silu_mul` rounds it ([1, K] -> [1, N/2])."""
    return silu_mul_reference(gemv_reference(x, weight, bias))


def gemv_fused_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a fused launch computes, in float32 with the kernel's roundings: `norm` (an
    RMSNorm's weight `g` and eps) applies the norm before the Linear as `r · ((x ⊙ g) Wᵀ)`,
    `r = rsqrt(mean(x²) + eps)` scaling the finished sums before the bias (the normalised
    row is not rounded to x's dtype, as the unfused norm rounds it: equal up to that
    rounding); `gated` as `gemv_gated_reference`; `residual`: `residual + x Wᵀ`, the
    product rounded to x's dtype first, as the unfused Linear and add round."""
    x32 = x.float()
    if norm is None:
        y = x32 @ weight.float().T
    else:
        g, eps = norm
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        y = ((x32 * g.float()) @ weight.float().T) * r
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if gated:
        return silu_mul_reference(y)
    if residual is not None:
        return (y.float() + residual.float()).to(x.dtype)
    return y


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        g_ptr,
        res_ptr,
        y_ptr,
        N,
        K,
        stride_w,
        eps,
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # GATED: W is [gate; up] (2N rows) and y = silu(x gateᵀ) * (x upᵀ), [N]; a program
        # owns the same BLOCK_N rows of each half. NORM: x is RMSNorm'd first, as
        # r · ((x ⊙ g) Wᵀ) with r = rsqrt(mean(x²) + eps) applied to the finished sums.
        # RESIDUAL: y = residual + (x Wᵀ), each rounded where the unfused add rounds.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rn64 = rn.to(tl.int64)
        rows = w_ptr + rn64[:, None] * stride_w
        up_rows = w_ptr + (rn64 + N)[:, None] * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)  # NORM: x², summed at the end
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                squares += x * x
                x *= tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            mask = n_ok[:, None] & k_ok[None, :]
            # Each weight is read once: leave L2 to what is read again (x, the KV cache).
            w = tl.load(rows + k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                u = tl.load(
                    up_rows + k[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
                )
                acc_up += u.to(tl.float32) * x[None, :]
        y = tl.sum(acc, 1)
        if NORM:
            r = tl.rsqrt(tl.sum(squares, 0) / K + eps)
            y *= r
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        if GATED:
            up = tl.sum(acc_up, 1)
            if NORM:
                up *= r
            if HAS_BIAS:
                up += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
            # Rounded where the unfused path rounds: each Linear's output, then as
            # `silu_mul` rounds (norm_rope._silu_mul_kernel: the activation, then the mul).
            g = y.to(dtype).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype)
            y = act.to(tl.float32) * up.to(dtype).to(tl.float32)
        if RESIDUAL:
            res = tl.load(res_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            y = y.to(dtype).to(tl.float32) + res
        tl.store(y_ptr + rn, y.to(dtype), mask=n_ok)


def block_k(n: int) -> int:
    """K per tile: 1,024 for a narrow W (fewer programs, each with more in flight), else
    512; the best tiles of the sweep (`benchmarks/README.md`) were these."""
    return 1024 if n <= 2048 else 512


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gemv_reference` as one Triton launch (`x` [1, K] contiguous, `weight` [N, K] with
    unit stride along K); `gated`: `gemv_gated_reference`, the gate-up Linear and the
    MLP's activation in that launch ([1, N/2] out), at the tile of the Linear alone, so each
    half sums as the unfused launch would; `norm` (the RMSNorm's weight and eps) and
    `residual`: `gemv_fused_reference`'s, the norm before the Linear or the residual add
    after it in the same launch."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous(), x.shape
    n, k = weight.shape
    assert x.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape)
    out = n // 2 if gated else n
    assert residual is None or (not gated and residual.shape == (1, n)), "y = residual + xWᵀ"
    assert residual is None or residual.is_contiguous()
    y = torch.empty(1, out, device=x.device, dtype=x.dtype)
    launch(x, weight, y, bias, gated, norm, residual, num_warps=8)
    return y


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    tile_k: int | None = None,
    **options: int,
) -> None:
    """One launch of the kernel into `y`, unchecked (`gemv_triton` checks its arguments),
    at `block_n` rows a program and K tiles of `tile_k` (None: `block_k`'s); `options`:
    Triton's launch options (`num_warps`, `num_stages`), for `benchmarks/gemv_sweep.py`'s
    tiles."""
    n, k = weight.shape
    out = y.shape[1]
    _gemv_kernel[(triton.cdiv(out, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # unread without HAS_BIAS
        norm[0] if norm is not None else weight,  # unread without NORM
        residual if residual is not None else weight,  # unread without RESIDUAL
        y,
        out,
        k,
        weight.stride(0),
        norm[1] if norm is not None else 0.0,
        HAS_BIAS=bias is not None,
        GATED=gated,
        NORM=norm is not None,
        RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        BLOCK_K=tile_k or block_k(n),
        **options,
    )


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel takes this Linear's input: one contiguous row on CUDA (or under
    TRITON_INTERPRET=1), with no gradient to carry (the kernel has no backward)."""
    return (
        triton is not None
        and x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and (x.is_cuda or INTERPRET)
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear`, with a one-row input on the GEMV kernel (`takes`)."""
    if takes(x):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


# `faster_shapes`' verdicts in this process, by (GPU, shape, dtype, weights of that shape):
# a second engine of the same model picks the same kernels as the first, so two engines
# compared in one process run the same arithmetic.
_verdicts: dict[tuple, bool] = {}


def faster_shapes(
    weights: list[torch.Tensor], group: Any = None, iters: int = 10
) -> set[tuple[int, int]]:
    """The weight shapes `[N, K]` at which the kernel runs a one-row Linear in at most
    `MARGIN` of cuBLAS's time on this GPU. Each shape is timed over every weight of that
    shape (the model's own, a launch each, so they stream from memory as a decode step
    reads them) as one CUDA graph, cuBLAS's launches and the kernel's. With `group` (a TP
    group) each shape's times are summed over its ranks first, so every rank picks alike;
    without one, a shape measured before in this process keeps its verdict."""
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for w in weights:
        by_shape[tuple(w.shape)].append(w)
    device = weights[0].device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = {s: (gpu, s, ws[0].dtype, len(ws)) for s, ws in by_shape.items()}
    shapes = sorted(s for s in by_shape if group is not None or key[s] not in _verdicts)
    times = torch.zeros(len(shapes), 2, dtype=torch.float64)
    for i, shape in enumerate(shapes):  # the same order on every rank, for the sum
        ws = by_shape[shape]
        x = torch.randn(1, shape[1], device=device, dtype=ws[0].dtype)
        times[i, 0] = timed(lambda ws=ws, x=x: [F.linear(x, w) for w in ws], iters, device)
        times[i, 1] = timed(lambda ws=ws, x=x: [gemv_triton(x, w) for w in ws], iters, device)
    if group is not None:
        summed = times.to(device)
        dist.all_reduce(summed, group=group)
        times = summed.cpu()
    verdicts = {
        s: ours <= MARGIN * cublas for s, (cublas, ours) in zip(shapes, times.tolist(), strict=True)
    }
    if group is None:
        _verdicts.update({key[s]: v for s, v in verdicts.items()})
    return {s for s in by_shape if verdicts.get(s, _verdicts.get(key[s]))}
