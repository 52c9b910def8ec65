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


# -- the capture block's rows into their requests' host buffers ----------------------------
#
# Per-token capture brings each decode step's capture block home. `scatter_rows` writes a
# block's rows straight into the requests' own buffers, regions of host chunks: on CUDA the
# chunks are page-locked host memory, which the device addresses directly (unified
# addressing), so the copy is a kernel on the capture copy stream and the host does nothing
# a step but plan where each row goes. `chunks` are the chunks of one dtype; an address is
# an element offset from the start of the lowest of them (`lowest`: so one launch reaches
# every chunk, and no offset is negative, which the interpreter's pointers are not). Row r
# of the block belongs to a request whose keys' rows start at element `dest[r, 0]` (-1: the
# row goes elsewhere), keys `dest[r, 1]` elements apart; `maps[dest[r, 2], c]` is the
# request's key of the block's column c (-1: it did not ask for it). Rows are converted to
# the chunks' dtype on the way.


def lowest(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The chunk at the lowest address: where `scatter_rows` counts addresses from."""
    return min(chunks, key=lambda c: c.data_ptr())


def scatter_rows_reference(
    src: torch.Tensor,  # [R, C, H] a capture block
    chunks: list[torch.Tensor],  # flat host chunks of one dtype
    dest: torch.Tensor,  # [R, 3] int64: (address, key stride, map) of each row
    maps: torch.Tensor,  # [M, C] int64: each map's key of each column, or -1
) -> None:
    """Write `src[r, c]` to the `H` elements at `address + key * stride` (elements from the
    lowest chunk's start) for each row with an address ≥ 0 and each column its map gives a
    key."""
    H, item = src.shape[2], chunks[0].itemsize
    origin = lowest(chunks).data_ptr()
    spans = [((c.data_ptr() - origin) // item, c) for c in chunks]
    for r, (address, stride, m) in enumerate(dest.tolist()):
        if address < 0:
            continue
        for c, key in enumerate(maps[m].tolist()):
            if key >= 0:
                at = address + key * stride
                start, chunk = next((s, t) for s, t in spans if s <= at < s + t.numel())
                chunk[at - start : at - start + H] = src[r, c].to(chunk.dtype)


# Programs a scatter launches. Stores to host memory wait on the PCIe link, and a program
# holds its SM while they do: one program per (row, column) filled every SM and stalled a
# matmul beside it as long as the copy took (an H200: 40 scatters of 67 MB beside 20
# matmuls, 77.6 ms where the matmuls alone took 28). A few programs, each walking a share of
# the block, keep the link busy and leave the rest of the GPU to the next step. 16 is not
# tuned: whether it fills the link for large blocks (the Llama-3-8B shape's three-site rows,
# 201 MB a step) is to be measured (`steering_overhead.py --scatter-programs N`).
SCATTER_PROGRAMS = 16

if triton is not None:

    @triton.jit
    def _scatter_rows_kernel(
        src_ptr,
        dst_ptr,
        dest_ptr,
        maps_ptr,
        R,
        C,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        cols = tl.arange(0, BLOCK_H)
        for item in range(tl.program_id(0), R * C, tl.num_programs(0)):
            r = (item // C).to(tl.int64)
            c = item % C
            offset = tl.load(dest_ptr + 3 * r)
            if offset >= 0:
                stride = tl.load(dest_ptr + 3 * r + 1)
                m = tl.load(dest_ptr + 3 * r + 2)
                key = tl.load(maps_ptr + m * C + c)
                if key >= 0:
                    dst = dst_ptr + offset + key.to(tl.int64) * stride
                    src = src_ptr + (r * C + c) * H
                    for start in range(0, H, BLOCK_H):
                        x = start + cols
                        mask = x < H
                        v = tl.load(src + x, mask=mask, other=0.0)
                        tl.store(dst + x, v.to(dst_ptr.dtype.element_ty), mask=mask)


def scatter_rows_triton(
    src: torch.Tensor,
    chunks: list[torch.Tensor],
    dest: torch.Tensor,
    maps: torch.Tensor,
    programs: int | None = None,
) -> None:
    """`scatter_rows_reference` as one Triton launch of `programs` programs, each walking
    its share of the block's (row, column) pairs, addressing every chunk from the lowest.
    On CUDA `src`, `dest` and `maps` are on the device and the chunks pinned host memory."""
    R, C, H = src.shape
    if R == 0:
        return
    assert src.is_contiguous() and all(c.is_contiguous() for c in chunks)
    assert dest.is_contiguous() and dest.dtype == maps.dtype == torch.int64
    assert maps.shape[1] == C and len({c.dtype for c in chunks}) == 1
    programs = programs or SCATTER_PROGRAMS  # read at the call: a benchmark may set it
    _scatter_rows_kernel[(min(programs, R * C),)](
        src, lowest(chunks), dest, maps, R, C, H=H,
        BLOCK_H=min(triton.next_power_of_2(H), MAX_BLOCK_H),
    )  # fmt: skip


def scatter_rows(
    src: torch.Tensor, chunks: list[torch.Tensor], dest: torch.Tensor, maps: torch.Tensor
) -> None:
    """Triton where `src` is on CUDA or under TRITON_INTERPRET=1, else the reference."""
    use_triton = triton is not None and (src.is_cuda or INTERPRET)
    (scatter_rows_triton if use_triton else scatter_rows_reference)(src, chunks, dest, maps)
