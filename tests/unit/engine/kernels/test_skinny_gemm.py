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
    k_splits,
    skinny_linear,
    skinny_linear_reference,
    skinny_linear_triton,
    skinny_norm_linear_reference,
    skinny_norm_linear_triton,
)
from services.engine.kernels.tickets import Tickets
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
@pytest.mark.parametrize(
    "M,K,N,bias,gated,splits",
    [
        (1, 1024, 64, False, False, 4),  # batch 1, whole tiles
        (3, 1000, 70, True, False, 3),  # ragged K (its last split short), N and rows
        (MAX_ROWS, 700, 2 * 40, False, True, 2),  # gated: both halves' partials summed
        (7, 900, 2 * 33, True, True, None),  # the launch's own choice (`k_splits`)
        (2, 300, 48, False, False, 16),  # more splits asked than K has tiles: fewer
    ],
)
def test_split_k_sums_as_one_program_does(M, K, N, bias, gated, splits):
    """Split over K with tickets: the last program of each column block sums the partials
    in order, then the epilogue (bias, activation) runs once, on the sum. The reference's
    answer (float32 sums in another order), and every ticket zeroed after, ready for the
    next launch, which gives the same."""
    x, w, b = _case(M, K, N, bias, seed=M + K)
    tickets = Tickets()
    want = skinny_linear_reference(x, w, b, gated)
    for _ in range(2):
        got = skinny_linear_triton(x, w, b, gated, tickets, splits)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert not tickets.get(1, x.device).any()


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "M,K,N,bias,gated,res,splits",
    [
        (1, 512, 64, False, False, True, None),  # batch 1, one program down K
        (3, 1000, 70, True, False, True, 3),  # split: the squares' partials summed too
        (MAX_ROWS, 700, 2 * 40, False, True, False, 2),  # the first layer: no residual
        (7, 900, 2 * 33, True, True, True, 4),  # gated with biases, split
    ],
)
def test_the_norm_before_the_linear_folds_into_its_launch(M, K, N, bias, gated, res, splits):
    """RMSNorm(x + residual) then the Linear, in the Linear's launch: the reference's
    output and stream (x + residual, bit for bit: the same rounding), split or not, and
    the tickets zeroed after."""
    x, w, b = _case(M, K, N, bias, seed=M + K)
    g = torch.Generator().manual_seed(K)
    residual = torch.randn(M, K, generator=g) if res else None
    norm_weight = torch.rand(K, generator=g) + 0.5
    want, want_stream = skinny_norm_linear_reference(x, residual, norm_weight, 1e-6, w, b, gated)
    tickets = Tickets() if splits else None
    got, stream = skinny_norm_linear_triton(
        x, residual, norm_weight, 1e-6, w, b, gated, tickets, splits
    )
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(stream, want_stream)
    assert tickets is None or not tickets.get(1, x.device).any()


def test_k_splits_fill_the_gpu_without_splitting_short_ks():
    assert k_splits(programs=64, k=2048, sms=132) == 8  # Qwen3-0.6B o_proj: 64 column blocks
    assert k_splits(programs=192, k=4096, sms=132) == 2  # Llama-3-8B qkv: 2.75 rounds down
    assert k_splits(programs=896, k=4096, sms=132) == 1  # the columns alone fill the GPU
    assert k_splits(programs=4, k=200, sms=132) == 1  # too short to split
    assert k_splits(programs=1, k=1 << 20, sms=132) == 16  # never more than 16


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_triton_refuses_more_rows_than_a_tile():
    x, w, _ = _case(MAX_ROWS + 1, 32, 16, False)
    with pytest.raises(AssertionError, match="at most"):
        skinny_linear_triton(x, w)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "rows,split", [(3, False), (3, True), (MAX_ROWS + 1, False)]
)  # the kernel, split over K as a model with tickets runs it, and cuBLAS's fallback
def test_triton_in_the_decoder_layers_linears_and_mlp(monkeypatch, rows, split):
    """A skinny MLP (gate-up with its activation in the kernel, then down) and qkv/o
    projections give what the plain modules give, split over K where the modules hold
    tickets (as `LlamaFamilyForCausalLM` gives them); more rows than a tile take F.linear."""
    import services.engine.kernels.skinny_gemm as skinny_gemm
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
    h, n = (512, 520) if split else (48, 40)  # K long enough to split (two tiles a split)
    monkeypatch.setattr(skinny_gemm, "INTERPRETER_SMS", 132)  # as many programs as an H100
    cfg = parse_model_config(
        {
            "architectures": ["Qwen2ForCausalLM"],  # qkv bias
            "hidden_size": h,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "vocab_size": 64,
            "intermediate_size": n,
            "mlp_bias": True,
        }
    )
    q, kv = h, h // 2
    torch.manual_seed(0)
    plain = torch.nn.ModuleList(
        [
            llama.MLP(cfg, SINGLE_PROCESS),
            layers.MergedColumnParallelLinear(h, [q, kv, kv], True, SINGLE_PROCESS),
        ]
    )
    for p in plain.parameters():
        p.data.normal_(0, 0.2 if not split else 0.05)
    skinny = torch.nn.ModuleList(
        [
            llama.MLP(cfg, SINGLE_PROCESS, skinny=True),
            layers.MergedColumnParallelLinear(h, [q, kv, kv], True, SINGLE_PROCESS, skinny=True),
        ]
    )
    skinny.load_state_dict(plain.state_dict())
    drawn = []  # launches split over K draw tickets (`skinny_linear_triton`)
    if split:
        tickets = Tickets()
        for module in skinny.modules():
            if getattr(module, "skinny", False):
                module.tickets = tickets
        get = tickets.get
        monkeypatch.setattr(tickets, "get", lambda *a: drawn.append(a) or get(*a))
    x = torch.randn(rows, h)
    for a, b in zip(skinny, plain, strict=True):
        assert torch.allclose(a(x), b(x), atol=1e-4, rtol=1e-4)
    assert bool(drawn) == split, "a model with tickets splits its long-K launches"
    assert calls == ([True, False, False] if rows <= MAX_ROWS else [])


def test_a_skinny_model_gives_every_skinny_linear_its_one_set_of_tickets():
    """`skinny_gemm`: each decoder Linear splits over K with the model's tickets (one set:
    its launches run one after another); without it, none holds any."""
    from services.engine.attention import SdpaBackend
    from services.engine.model.config import parse_model_config
    from services.engine.model.layers import ColumnParallelLinear, RowParallelLinear
    from services.engine.model.llama import LlamaFamilyForCausalLM
    from services.engine.parallel import SINGLE_PROCESS

    cfg = parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 64,
            "intermediate_size": 48,
        }
    )
    for skinny in (True, False):
        model = LlamaFamilyForCausalLM(cfg, SINGLE_PROCESS, SdpaBackend(), skinny_gemm=skinny)
        linears = [
            m
            for m in model.layers.modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        ]
        assert len(linears) == 2 * 4  # qkv, o, gate-up, down
        held = {id(m.tickets) for m in linears}
        if skinny:
            assert len(held) == 1 and isinstance(linears[0].tickets, Tickets)
        else:
            assert held == {id(None)}


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1")
def test_triton_engine_folds_its_norms_into_the_skinny_linears(tiny_checkpoint, monkeypatch):
    """An engine whose decoder Linears run the skinny kernel (forced on CPU: the kernels
    interpreted) runs each decode layer's two norms inside qkv and gate-up, K split with
    the model's tickets, requests arriving a step apart; the tokens and float32 logprobs
    are the plain engine's."""
    import services.engine.model.layers as layers
    import services.engine.model.llama as llama
    import services.engine.model_runner as model_runner
    from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams

    # K splits at 512; two layers, so the second adds its residual inside qkv
    path = tiny_checkpoint("qwen3", hidden=512, intermediate=1024, layers=2)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[11, 12, 13, 14], [21, 22], [31]]

    def serve() -> list:
        engine = LLMEngine(path, EngineConfig(device="cpu", max_num_batched_tokens=64))
        pending, totals, done = list(enumerate(prompts)), OutputAccumulator(), {}
        while pending or engine.has_unfinished_requests():
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, params)
            for out in totals.finished(engine.step()):
                done[out.request_id] = out.outputs[0]
        return [done[str(i)] for i in range(len(prompts))]

    plain = serve()
    on_cpu = lambda x: x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1  # noqa: E731
    monkeypatch.setattr(layers, "takes", on_cpu)
    monkeypatch.setattr(llama, "takes", on_cpu)
    model = model_runner.LlamaFamilyForCausalLM
    monkeypatch.setattr(
        model_runner, "LlamaFamilyForCausalLM", lambda c, ctx, b, *_: model(c, ctx, b, True)
    )
    folded = []
    fold = llama.skinny_norm_linear
    monkeypatch.setattr(
        llama, "skinny_norm_linear", lambda *a, **kw: folded.append(kw["tickets"]) or fold(*a, **kw)
    )
    skinny = serve()
    assert folded and all(isinstance(t, Tickets) for t in folded)
    for a, b in zip(skinny, plain, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert [la[t] for t in la] == pytest.approx([lb[t] for t in la], abs=1e-4)
