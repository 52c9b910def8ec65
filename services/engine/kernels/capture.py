"""The in-graph capture op: copy capturing tokens' residual rows into a fixed buffer.

A decode step that captures gives each capturing token a row of the capture buffer
`out [R, S, H]`, whose slots are every (layer, site): `slot = 3 * layer + site index`. At a
site, each token whose `capture_rows` entry is ≥ 0 writes its residual into its row at that
site's slot; a token at -1 writes nothing, behind a branch. Every switch is a tensor, so the
op can be captured in a CUDA graph. The fused steer op writes the same way at post_block,
where it runs, so this op serves the sites where no steer op runs: the model's input
(layer 0's pre_attn) and each layer's post_attn.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.interventions.sites import SITES
from services.engine.kernels.steer import INTERPRET, MAX_BLOCK_H


def capture_slot(layer: int, site: str) -> int:
    """The slot of (layer, site) in a capture buffer row."""
    return len(SITES) * layer + SITES.index(site)


def capture_reference(
    h: torch.Tensor,  # [T, H] the residual at the site
    capture_rows: torch.Tensor,  # [T] int32 each token's row of `out`, or -1
    out: torch.Tensor,  # [R, S, H] the capture buffer, written in place
    slot: int,
) -> None:
    """Write each capturing token's row of `h` into `out[capture_rows[t], slot]`."""
    tokens = (capture_rows >= 0).nonzero().flatten()
    out[capture_rows[tokens].long(), slot] = h[tokens].to(out.dtype)


if triton is not None:

    @triton.jit
    def _capture_kernel(
        h_ptr,
        rows_ptr,
        out_ptr,
        slot,
        stride_h,
        stride_row,  # elements between rows of `out` (S * H)
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + t)
        if row >= 0:
            # (no .to on `slot`: Triton passes a 1 as a plain int)
            dst = out_ptr + row.to(tl.int64) * stride_row + slot * H
            cols = tl.arange(0, BLOCK_H)
            for start in range(0, H, BLOCK_H):
                c = start + cols
                m = c < H
                x = tl.load(h_ptr + t * stride_h + c, mask=m, other=0.0)
                tl.store(dst + c, x.to(out_ptr.dtype.element_ty), mask=m)


def capture_triton(h: torch.Tensor, capture_rows: torch.Tensor, out: torch.Tensor, slot: int):
    """`capture_reference` as one Triton launch over the batch."""
    T, H = h.shape
    if T == 0:
        return
    assert h.stride(1) == 1 and capture_rows.is_contiguous() and out.is_contiguous()
    assert out.shape[2] == H and 0 <= slot < out.shape[1]
    _capture_kernel[(T,)](
        h,
        capture_rows,
        out,
        slot,
        h.stride(0),
        out.stride(0),
        H=H,
        BLOCK_H=min(triton.next_power_of_2(H), MAX_BLOCK_H),
    )


def capture(h: torch.Tensor, capture_rows: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    """Triton on CUDA or under TRITON_INTERPRET=1, else the reference."""
    fn = capture_triton if triton is not None and (h.is_cuda or INTERPRET) else capture_reference
    fn(h, capture_rows, out, slot)
