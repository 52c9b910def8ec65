"""The adapted Linears' low-rank expand: the reference's semantics against a per-token
float64 loop, and the Triton kernel against the reference (under TRITON_INTERPRET=1, in a
fresh process, as `test_steer.py` runs its kernel)."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.lowrank import (
    lowrank_expand,
    lowrank_expand_reference,
    lowrank_expand_triton,
)
from tests.interpreted import INTERPRETED, assert_passes_interpreted


def _case(T: int, IN: int, OUT: int, R: int, rows: int = 7, dtype=torch.float32, seed: int = 0):
    """An expand's inputs, from a GEMM of x by `[W; basis_inᵀ]` as the adapted Linear runs
    it; also x, W and basis_in for the oracle."""
    g = torch.Generator().manual_seed(seed)
    coef = torch.randn(rows, R, generator=g)
    coef[0] = 0  # row 0: no adapter
    coef[1, R // 2 :] = 0  # a row that leaves some columns off
    x = torch.randn(T, IN, generator=g)
    w = torch.randn(OUT, IN, generator=g) / IN**0.5
    basis_in = torch.randn(IN, R, generator=g) / IN**0.5
    case = {
        "yz": (x @ torch.cat([w, basis_in.T]).T).to(dtype),
        "basis_out": torch.randn(OUT, R, generator=g).to(dtype),
        "coef": coef.to(dtype),
        "rows": torch.randint(0, rows, (T,), generator=g, dtype=torch.int32),
    }
    return case, (x, w, basis_in)


def test_each_token_adds_its_rows_term_and_row_zero_tokens_keep_the_gemm():
    case, (x, w, basis_in) = _case(T=9, IN=12, OUT=10, R=5)
    case["rows"][:3] = 0
    got = lowrank_expand_reference(**case)
    assert got.shape == (9, 10) and got.is_contiguous()
    c, u = case["coef"].double(), case["basis_out"].double()
    x, w, basis_in = x.double(), w.double(), basis_in.double()
    for t, r in enumerate(case["rows"].tolist()):
        want = x[t] @ w.T + sum(c[r, j] * (x[t] @ basis_in[:, j]) * u[:, j] for j in range(5))
        assert torch.allclose(got[t].double(), want, atol=1e-4)  # float32 against float64
    assert torch.equal(got[:3], case["yz"][:3, :10])  # row 0: the GEMM's bits


def test_an_overflow_in_a_column_a_token_does_not_use_stays_there():
    case, _ = _case(T=4, IN=8, OUT=6, R=4)
    case["yz"][:, 6 + 3] = float("inf")  # every token's z[:, 3]
    case["coef"][:, 3] = 0
    case["rows"][:] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    assert lowrank_expand_reference(**case).isfinite().all()


@pytest.mark.skipif(INTERPRETED, reason="already interpreting: the kernel tests run here")
def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "triton and not under_interpreter")


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "T,IN,OUT,R",
    [(5, 24, 40, 8), (37, 150, 70, 20), (16, 64, 64, 16)],  # ragged tiles, R over 16, exact
)
def test_triton_matches_the_reference(T, IN, OUT, R):
    case, _ = _case(T, IN, OUT, R, seed=T)
    want = lowrank_expand_reference(**case)
    got = lowrank_expand_triton(**case)
    assert torch.allclose(got, want, atol=1e-4)
    untouched = case["rows"] == 0
    assert torch.equal(got[untouched], case["yz"][untouched, :OUT])
    nobody = {**case, "rows": torch.zeros_like(case["rows"])}
    assert torch.equal(lowrank_expand(**nobody), case["yz"][:, :OUT])


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_triton_keeps_an_unused_columns_overflow_out():
    case, _ = _case(T=18, IN=32, OUT=20, R=4)
    case["yz"][:, 20 + 3] = float("inf")
    case["coef"][:, 3] = 0
    assert lowrank_expand_triton(**case).isfinite().all()
