"""The per-site patch op: replace chosen rows of the residual, one Triton launch per site.

Row `rows[i]` becomes `targets[i]` when `alpha[i] == 1` (a bit-exact copy: the target in
h's dtype), else `(1 − α)·h + α·t` computed in float32. Rows not listed are untouched.
Out of place: the pristine residual stays readable (captures, probes).
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.kernels.steer import INTERPRET, MAX_BLOCK_H


def patch_reference(
    h: torch.Tensor,  # [T, H]
    rows: torch.Tensor,  # [P] int64 rows of h to patch (distinct)
    targets: torch.Tensor,  # [P, H] replacement activations
    alpha: torch.Tensor,  # [P] float32
) -> torch.Tensor:
    """The patched residual `[T, H]` in h's dtype."""
    out = h.clone()
    if rows.numel() == 0:
        return out
    a = alpha.float()[:, None]
    x = h[rows].float()
    t = targets.float()
    mixed = ((1 - a) * x + a * t).to(h.dtype)
    out[rows] = torch.where(a == 1, targets.to(h.dtype), mixed)
    return out


if triton is not None:

    @triton.jit
    def _patch_kernel(
        out_ptr,
        rows_ptr,
        targets_ptr,
        alpha_ptr,
        stride_out,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per patched row; `out` starts as a copy of h.
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + i).to(tl.int64)
        a = tl.load(alpha_ptr + i)
        cols = tl.arange(0, BLOCK_H)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            m = c < H
            x = tl.load(out_ptr + row * stride_out + c, mask=m, other=0.0)
            t = tl.load(targets_ptr + i * H + c, mask=m, other=0.0)
            mixed = ((1 - a) * x.to(tl.float32) + a * t.to(tl.float32)).to(x.dtype)
            y = tl.where(a == 1, t.to(x.dtype), mixed)
            tl.store(out_ptr + row * stride_out + c, y, mask=m)


def patch_triton(
    h: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """`patch_reference` as one Triton launch over the patched rows."""
    out = h.clone(memory_format=torch.contiguous_format)
    P, H = targets.shape
    if P == 0:
        return out
    assert rows.is_contiguous() and targets.is_contiguous() and alpha.is_contiguous()
    _patch_kernel[(P,)](
        out,
        rows,
        targets,
        alpha,
        out.stride(0),
        H=H,
        BLOCK_H=min(triton.next_power_of_2(H), MAX_BLOCK_H),
        num_warps=4,
    )
    return out


def patch(
    h: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """The patched residual: Triton on CUDA or under TRITON_INTERPRET=1, else the reference."""
    fn = patch_triton if triton is not None and (h.is_cuda or INTERPRET) else patch_reference
    return fn(h, rows, targets, alpha)
