"""The decode-size Linear kernel: the reference against F.linear (and the gated MLP's
`silu_mul` of it) in float64, and the Triton kernel against the reference under
TRITON_INTERPRET=1 (in a fresh process, as `test_steer.py` runs its kernel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels.norm_rope import silu_mul_reference
from services.engine.kernels.skinny_gemm import (
    MAX_ROWS,
    skinny_linear,
    skinny_linear_reference,
    skinny_linear_triton,
)
from tests.interpreted import INTERPRETED, assert_passes_interpreted


def _case(M: int, K: int, N: int, bias: bool, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
def test_the_reference_is_the_linear_layer(bias):
    x, w, b = _case(3, 40, 24, bias)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert torch.allclose(skinny_linear_reference(x, w, b).double(), want, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_gated_is_silu_of_the_gate_rows_times_the_up_rows(bias):
    x, w, b = _case(5, 32, 2 * 12, bias)
    gate_up = F.linear(x.double(), w.double(), None if b is None else b.double())
    want = silu_mul_reference(gate_up)
    got = skinny_linear_reference(x, w, b, gated=True)
    assert got.shape == (5, 12)
    assert torch.allclose(got.double(), want, atol=1e-4)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs Triton on CPU tensors")
def test_cpu_tensors_take_the_reference():
    x, w, b = _case(2, 16, 8, True)
    assert torch.equal(skinny_linear(x, w, b), skinny_linear_reference(x, w, b))


@pytest.mark.skipif(INTERPRETED, reason="already interpreting: the kernel tests run here")
def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "triton and not under_interpreter")


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "M,K,N,bias,gated",
    [
        (1, 256, 64, False, False),  # batch 1, whole tiles
        (3, 200, 70, True, False),  # ragged K, N and rows, with a bias
        (MAX_ROWS, 130, 2 * 40, False, True),  # a full tile of rows, gated
        (7, 64, 2 * 33, True, True),  # gated with a bias on both halves
    ],
)
def test_triton_matches_the_reference(M, K, N, bias, gated):
    x, w, b = _case(M, K, N, bias, seed=M + K)
    want = skinny_linear_reference(x, w, b, gated)
    got = skinny_linear_triton(x, w, b, gated)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_triton_refuses_more_rows_than_a_tile():
    x, w, _ = _case(MAX_ROWS + 1, 32, 16, False)
    with pytest.raises(AssertionError, match="at most"):
        skinny_linear_triton(x, w)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows", [3, MAX_ROWS + 1])  # the kernel, and cuBLAS's fallback
def test_triton_in_the_decoder_layers_linears_and_mlp(monkeypatch, rows):
    """A skinny MLP (gate-up with its activation in the kernel, then down) and qkv/o
    projections give what the plain modules give; more rows than a tile take F.linear."""
    import services.engine.model.layers as layers
    import services.engine.model.llama as llama
    from services.engine.model.config import parse_model_config
    from services.engine.parallel import SINGLE_PROCESS

    on_cpu = lambda x: x.shape[0] <= MAX_ROWS  # noqa: E731 (the CUDA check, for the interpreter)
    monkeypatch.setattr(layers, "takes", on_cpu)
    monkeypatch.setattr(llama, "takes", on_cpu)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("gated", False))
        return skinny_linear(*args, **kwargs)

    monkeypatch.setattr(layers, "skinny_linear", counted)
    monkeypatch.setattr(llama, "skinny_linear", counted)
    cfg = parse_model_config(
        {
            "architectures": ["Qwen2ForCausalLM"],  # qkv bias
            "hidden_size": 48,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "vocab_size": 64,
            "intermediate_size": 40,
            "mlp_bias": True,
        }
    )
    torch.manual_seed(0)
    plain = torch.nn.ModuleList(
        [
            llama.MLP(cfg, SINGLE_PROCESS),
            layers.MergedColumnParallelLinear(48, [48, 24, 24], True, SINGLE_PROCESS),
        ]
    )
    for p in plain.parameters():
        p.data.normal_(0, 0.2)
    skinny = torch.nn.ModuleList(
        [
            llama.MLP(cfg, SINGLE_PROCESS, skinny=True),
            layers.MergedColumnParallelLinear(48, [48, 24, 24], True, SINGLE_PROCESS, skinny=True),
        ]
    )
    skinny.load_state_dict(plain.state_dict())
    x = torch.randn(rows, 48)
    for a, b in zip(skinny, plain, strict=True):
        assert torch.allclose(a(x), b(x), atol=1e-4, rtol=1e-4)
    # gate-up with its activation, down, qkv: each in the kernel, or none past a tile
    assert calls == ([True, False, False] if rows <= MAX_ROWS else [])
