"""The adapted Linears' batched low-rank op: every token adds its own adapter's term.

An adapted Linear (`services/engine/adapters.py`) keeps one set of shared directions: the
columns of `basis_in [IN, R]` and `basis_out [OUT, R]` (its SVD basis, then every loaded
LoRA's factors side by side). Each adapter variant is a row of the coefficient table
`coef [rows, R]` (its δ in the SVD columns, 1 in a LoRA trained row's own columns), and a
token on row r = `rows[t]` gets

    y[t] = x[t] Wᵀ + Σ_j c[r, j] · (x[t] · basis_in[:, j]) · basis_out[:, j].

The bases are shared by every adapter, so unlike Punica's SGMV (a gather of each adapter's
own factors) the op is two skinny matmuls with a per-token scale between them: shrink
(`x @ basis_in`) and expand. The shrink rides along the Linear's own GEMM: its weight is
stored with `basis_inᵀ` appended as R more output rows, so one GEMM gives `yz = [x Wᵀ | z]`
(a decode step's GEMM is bound by reading W, and R is tiny next to OUT). This module is the
expand: one launch that turns `yz` into `y`, adding `where(c ≠ 0, z·c, 0) @ basis_outᵀ` to
each adapted token's row. A column whose coefficient is 0 adds an exact 0 (a `where`, not a
product, so an overflow in another adapter's column stays there), and a token on row 0 (no
adapter) gets its `x Wᵀ` as the GEMM gave it. Every switch is a tensor (the rows), so a CUDA
graph captured over it serves any mix of adapters.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

from services.engine.kernels.steer import INTERPRET

BLOCK_T = 16  # tokens per program: tl.dot's smallest tile
BLOCK_O = 64  # output columns per program (the fastest of 64/128 on an H100)


def lowrank_expand_reference(
    yz: torch.Tensor,  # [T, OUT + R] the GEMM's output: x Wᵀ, then z = x basis_in
    basis_out: torch.Tensor,  # [OUT, R]
    coef: torch.Tensor,  # [rows, R] row 0 zero (no adapter)
    rows: torch.Tensor,  # [T] int32 each token's coefficient row
) -> torch.Tensor:  # [T, OUT]
    """`y` = the first OUT columns of `yz` plus each adapted token's low-rank term."""
    out_f = basis_out.shape[0]
    y, z = yz[:, :out_f], yz[:, out_f:]
    c = coef.index_select(0, rows.long())  # [T, R]
    z = torch.where(c != 0, z * c, 0)
    return torch.where((rows != 0)[:, None], y + z @ basis_out.T, y)


if triton is not None:

    @triton.jit
    def _expand_kernel(
        yz_ptr,
        y_ptr,
        bout_ptr,
        coef_ptr,
        rows_ptr,
        T,
        OUT,
        R,
        stride_yz,
        stride_y,
        stride_bout,
        stride_coef,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_O: tl.constexpr,
    ):
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = toks < T
        rows = tl.load(rows_ptr + toks, mask=t_ok, other=0)
        active = rows != 0
        t64 = toks.to(tl.int64)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = o < OUT
        m = t_ok[:, None] & o_ok[None, :]
        yv = tl.load(yz_ptr + t64[:, None] * stride_yz + o[None, :], mask=m, other=0.0)
        if tl.max(active.to(tl.int32), axis=0) > 0:  # a block of unadapted tokens: a copy
            rs = tl.arange(0, BLOCK_R)
            r_ok = rs < R
            z = tl.load(
                yz_ptr + t64[:, None] * stride_yz + OUT + rs[None, :],
                mask=t_ok[:, None] & r_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            c = tl.load(
                coef_ptr + rows.to(tl.int64)[:, None] * stride_coef + rs[None, :],
                mask=active[:, None] & r_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            # the scaled term in the model dtype, as the reference's matmul takes it
            zc = tl.where(c != 0.0, z * c, 0.0).to(yv.dtype)
            bo = tl.load(  # [BLOCK_R, BLOCK_O]: basis_outᵀ's tile
                bout_ptr + o[None, :] * stride_bout + rs[:, None],
                mask=r_ok[:, None] & o_ok[None, :],
                other=0.0,
            )
            dy = tl.dot(zc, bo, input_precision="ieee")
            yv = tl.where(active[:, None], (yv.to(tl.float32) + dy).to(yv.dtype), yv)
        tl.store(y_ptr + t64[:, None] * stride_y + o[None, :], yv, mask=m)


def lowrank_expand_triton(
    yz: torch.Tensor, basis_out: torch.Tensor, coef: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """`lowrank_expand_reference` as one Triton launch over (token block, column block)."""
    T = yz.shape[0]
    OUT, R = basis_out.shape
    assert yz.shape[1] == OUT + R and coef.shape[1] == R and rows.shape == (T,)
    assert yz.stride(1) == 1 and basis_out.is_contiguous() and coef.is_contiguous()
    y = yz.new_empty(T, OUT)
    if T == 0:
        return y
    _expand_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(OUT, BLOCK_O))](
        yz,
        y,
        basis_out,
        coef,
        rows,
        T,
        OUT,
        R,
        yz.stride(0),
        y.stride(0),
        basis_out.stride(0),
        coef.stride(0),
        BLOCK_T=BLOCK_T,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_O=BLOCK_O,
    )
    return y


def lowrank_expand(
    yz: torch.Tensor, basis_out: torch.Tensor, coef: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Triton on CUDA or under TRITON_INTERPRET=1, else the reference."""
    use_triton = triton is not None and (yz.is_cuda or INTERPRET)
    fn = lowrank_expand_triton if use_triton else lowrank_expand_reference
    return fn(yz, basis_out, coef, rows)
