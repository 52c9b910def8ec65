"""The one-row Linear (`kernels/gemv.py`): the reference against `F.linear`, and the Triton
kernel against the reference under TRITON_INTERPRET=1, in a fresh process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels import gemv
from tests.interpreted import INTERPRETED, assert_passes_interpreted


def _case(n: int, k: int, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def test_the_reference_is_f_linear():
    x, w, b = _case(9, 33, bias=True)
    want = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(gemv.gemv_reference(x, w, b), want, rtol=1e-4, atol=1e-4)
    bf16 = _case(9, 33, bias=False, dtype=torch.bfloat16)
    assert gemv.gemv_reference(*bf16).dtype == torch.bfloat16  # rounded once, to x's dtype


def test_only_one_contiguous_row_is_taken():
    x = torch.randn(2, 8)
    assert not gemv.takes(x) and not gemv.takes(x[:1, ::2])
    assert not gemv.takes(torch.randn(8))  # a Linear's input is [rows, K]
    assert not gemv.takes(torch.randn(1, 8, requires_grad=True))  # no backward
    # Anything the kernel does not take is F.linear's: the same numbers bit for bit.
    w = torch.randn(5, 8)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))


@pytest.mark.skipif(INTERPRETED, reason="already interpreting: the kernel tests run here")
def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "triton and not under_interpreter")


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "n,k,bias",
    [
        (6, 40, False),  # a partial block of rows and a partial K tile
        (13, 1100, True),  # narrow W: K tiles of 1,024, the second one partial
        (2050, 520, False),  # wide W: K tiles of 512, ragged row blocks
    ],
)
def test_triton_matches_the_reference(n, k, bias):
    x, w, b = _case(n, k, bias)
    assert gemv.takes(x)
    got = gemv.gemv_triton(x, w, b)
    want = gemv.gemv_reference(x, w, b)
    assert got.shape == (1, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # A view of W's rows (a TP shard, say) reads with its own stride.
    wide = torch.cat([w, torch.randn(n, 8)], dim=1)[:, :k]
    torch.testing.assert_close(gemv.gemv_triton(x, wide, b), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "n,k,bias",
    [
        (6, 40, False),  # a partial block of rows of each half, a partial K tile
        (2 * 1030, 520, True),  # wide: K tiles of 512, ragged row blocks, a bias
    ],
)
def test_triton_gated_matches_the_reference(n, k, bias):
    """The gate-up Linear with the MLP's activation in its launch: `[1, n/2]` out, as the
    reference (and as the unfused kernel followed by the activation) computes it."""
    from services.engine.kernels.norm_rope import silu_mul_reference

    x, w, b = _case(n, k, bias)
    got = gemv.gemv_triton(x, w, b, gated=True)
    want = gemv.gemv_gated_reference(x, w, b)
    assert got.shape == (1, n // 2) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    unfused = silu_mul_reference(gemv.gemv_triton(x, w, b))
    torch.testing.assert_close(got, unfused, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "n,k,bias,gated,norm,residual",
    [
        (6, 40, False, False, True, False),  # the norm: a partial row block and K tile
        (13, 1100, True, False, True, False),  # two K tiles of the norm's sums, a bias
        (2 * 1030, 520, True, True, True, False),  # the norm, gate-up and activation
        (13, 1100, False, False, False, True),  # the residual add after the Linear
    ],
)
def test_triton_folded_norm_and_residual_match_the_reference(n, k, bias, gated, norm, residual):
    """The RMSNorm before a Linear (`norm`) and the residual add after it (`residual`) in
    the Linear's launch: as the reference computes them, and as the norm kernel's
    reference followed by the plain launch (and the add) within float32 rounding."""
    from services.engine.kernels.norm_rope import rms_norm_reference

    x, w, b = _case(n, k, bias)
    w = w / k**0.5  # outputs of about one, as a model's: float32's error is relative to them
    gen = torch.Generator().manual_seed(5)
    g = (torch.rand(k, generator=gen) + 0.5, 1e-6) if norm else None
    res = torch.randn(1, n, generator=gen) if residual else None
    got = gemv.gemv_triton(x, w, b, gated=gated, norm=g, residual=res)
    want = gemv.gemv_fused_reference(x, w, b, gated=gated, norm=g, residual=res)
    assert got.shape == want.shape == (1, n // 2 if gated else n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    normed = rms_norm_reference(x, g[0], g[1]) if norm else x
    unfused = gemv.gemv_triton(normed, w, b, gated=gated)
    unfused = unfused + res if residual else unfused
    torch.testing.assert_close(got, unfused, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch,gated", [("llama", False), ("qwen3", True)])
def test_triton_engine_folds_norms_and_adds_into_the_gemv_launches(
    tiny_checkpoint, monkeypatch, arch, gated
):
    """`use_gemv(fold_norms=True)` (`EngineConfig.gemv_fold_norms`; forced here on CPU, the
    kernel interpreted): a batch-1 decode layer runs no norm of its own, its norms and
    residual adds inside the GEMV launches, and the tokens and float32 logprobs are the
    unfolded engine's (every Linear on the kernel in both)."""
    from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams

    path = tiny_checkpoint(arch, layers=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[11, 12, 13, 14], [21]]

    def serve(fold: bool) -> tuple[list, int]:
        engine = LLMEngine(path, EngineConfig(device="cpu", max_num_batched_tokens=64))
        model = engine.runner.model
        names = model.use_gemv(gated=gated, fold_norms=fold)
        assert all(model.get_submodule(n).gemv for n in names)
        assert all(layer.gemv_folds == fold for layer in model.layers.values())
        norms = []  # the layers' own norm calls
        for layer in model.layers.values():
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                real = norm.forward
                monkeypatch.setattr(norm, "forward", lambda *a, f=real: norms.append(1) or f(*a))
        totals, done = OutputAccumulator(), {}
        for i, prompt in enumerate(prompts):  # one at a time: every decode step is one row
            engine.add_request(str(i), prompt, params)
            while engine.has_unfinished_requests():
                for out in totals.finished(engine.step()):
                    done[out.request_id] = out.outputs[0]
        return [done[str(i)] for i in range(len(prompts))], len(norms)

    folded, folded_norms = serve(fold=True)
    plain, plain_norms = serve(fold=False)
    # Only the four-token prefill (two layers, two norms each) norms on its own: the
    # one-token prompt's prefill is a row the kernel takes
    assert folded_norms == 2 * 2 < plain_norms
    for a, b in zip(folded, plain, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert [la[t] for t in la] == pytest.approx([lb[t] for t in la], abs=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_triton_linears_with_gemv_on_route_one_row_to_the_kernel(monkeypatch):
    """`gemv` on a Linear (what `use_gemv` sets): a one-row input runs the kernel in the
    column- and row-parallel Linears (the latter's unreduced partial too) and the LM head,
    with the same numbers as F.linear; more rows keep F.linear."""
    from services.engine.model.layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
    )
    from services.engine.parallel import ParallelContext

    ctx = ParallelContext()
    col = ColumnParallelLinear(40, 24, bias=True, ctx=ctx)
    row = RowParallelLinear(40, 24, bias=False, ctx=ctx)
    head = ParallelLMHead(30, 40, ctx)
    g = torch.Generator().manual_seed(0)
    for p in [*col.parameters(), *row.parameters(), *head.parameters()]:
        p.data.copy_(torch.randn(p.shape, generator=g))
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a: calls.append(a[1].shape) or real(*a))
    x, xs = torch.randn(1, 40, generator=g), torch.randn(3, 40, generator=g)
    for m in (col, row, head):
        m.gemv = True
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(col(x), F.linear(x, col.weight, col.bias), **close)
    torch.testing.assert_close(row(x, reduce=False), F.linear(x, row.weight), **close)
    torch.testing.assert_close(head(x), F.linear(x, head.weight), **close)
    assert calls == [col.weight.shape, row.weight.shape, head.weight.shape]
    assert torch.equal(col(xs), F.linear(xs, col.weight, col.bias)) and len(calls) == 3


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_faster_shapes_keeps_the_shapes_the_kernel_wins_by_the_margin(monkeypatch):
    """`faster_shapes` (what `EngineConfig.gemv=None` picks by at load) times each weight
    shape once over all its weights, cuBLAS's launches against the kernel's, and keeps a
    shape only where the kernel's time is within `MARGIN` of cuBLAS's; a shape it has
    judged in this process keeps its verdict."""
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(*s, generator=g) for s in [(6, 40), (6, 40), (10, 24)]]
    timed = []
    real = gemv.timed
    monkeypatch.setattr(gemv, "timed", lambda step, *a: timed.append(step) or real(step, *a))
    monkeypatch.setattr(gemv, "_verdicts", {})
    monkeypatch.setattr(gemv, "MARGIN", 1e9)  # any time the kernel takes wins
    assert gemv.faster_shapes(weights, iters=1) == {(6, 40), (10, 24)}
    assert len(timed) == 4  # two shapes, two systems each
    # The same weights again keep their verdicts, untimed: a second engine runs the same
    # kernels as the first.
    monkeypatch.setattr(gemv, "MARGIN", 0.0)  # nothing beats cuBLAS in no time
    assert gemv.faster_shapes(weights, iters=1) == {(6, 40), (10, 24)} and len(timed) == 4
    assert gemv.faster_shapes(weights[:2] + [weights[2].T.contiguous()], iters=1) == {(6, 40)}
    assert len(timed) == 6  # only the new shape was timed


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_gemv_activation_runs_the_mlp_gate_up_and_activation_in_one_launch(tmp_path, monkeypatch):
    """`use_gemv(gated=True)` (`EngineConfig.gemv_activation`): an MLP whose gate-up Linear
    runs the GEMV kernel takes a one-row input through one gated launch, with the unfused
    MLP's output; more rows keep the GEMM and the activation apart."""
    from services.engine.model.config import load_model_config
    from services.engine.model.tiny import make_tiny_checkpoint
    from services.engine.model_runner import ModelRunner
    from services.engine.parallel import ParallelContext

    path = make_tiny_checkpoint(tmp_path, "qwen3", intermediate=96)
    cpu = torch.device("cpu")
    runner = ModelRunner(
        path, load_model_config(path), cpu, torch.float32, 16, ParallelContext(), gemv=True,
        gemv_activation=True,
    )  # fmt: skip
    mlp = runner.model.layers["0"].mlp
    assert mlp.gemv_gated and mlp.gate_up_proj.gemv
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(
        gemv, "gemv_triton", lambda *a, **kw: calls.append(kw.get("gated")) or real(*a, **kw)
    )
    g = torch.Generator().manual_seed(3)
    x, xs = torch.randn(1, 64, generator=g), torch.randn(3, 64, generator=g)
    got, many = mlp(x), mlp(xs)
    assert calls == [True, None]  # the gated launch, then the down projection's
    mlp.gemv_gated = mlp.gate_up_proj.gemv = mlp.down_proj.gemv = False
    torch.testing.assert_close(got, mlp(x), rtol=1e-4, atol=1e-4)
    assert torch.equal(many, mlp(xs))
