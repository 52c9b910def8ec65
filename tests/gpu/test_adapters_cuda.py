"""Adapters on the GPU fast path (run on the device: `make gpu-test`): the low-rank kernel
in bf16 against its reference, adapted decode steps replaying CUDA graphs equal to eager,
an unadapted request beside adapted ones as in a batch without adapters, greedy
bf16 tokens that are argmaxes of the float32 merged oracle, and a LoRA that outgrows its
reserved columns re-capturing the adapted graphs."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from services.engine.kernels.lowrank import lowrank_expand_reference, lowrank_expand_triton
from tests.adapter_states import merged_hf_model, random_state
from tests.gpu.test_fast_path_cuda import _assert_same
from tests.oracle import bf16_ulp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RANK = 8
PROMPT_LENS = (5, 17, 33, 50, 3, 70, 12, 9)
ADAPTERS = ("svd", "lora", None)  # request i runs under ADAPTERS[i % 3]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(8, 512) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,R", [(128, 8), (37, 8 + 4 * 16), (300, 24)])
def test_lowrank_expand_kernel_matches_reference(dtype, T, R):
    g = torch.Generator().manual_seed(T + R)
    OUT = 1024
    case = {
        "yz": torch.randn(T, OUT + R, generator=g),
        "basis_out": torch.randn(OUT, R, generator=g) / R**0.5,
        "coef": torch.randn(9, R, generator=g),
        "rows": torch.randint(0, 9, (T,), generator=g, dtype=torch.int32),
    }
    case["coef"][0] = 0
    case = {k: v.cuda().to(dtype) if v.is_floating_point() else v.cuda() for k, v in case.items()}
    exact = lowrank_expand_reference(
        **{k: v.double() if v.is_floating_point() else v for k, v in case.items()}
    )
    got = lowrank_expand_triton(**case)
    err = (got.double() - exact).abs().max().item()
    ref_err = (lowrank_expand_reference(**case).double() - exact).abs().max().item()
    # within the reference's own rounding (bf16: a few ulps of values near 4)
    assert err <= max(2 * ref_err, 1e-4), (err, ref_err)
    plain = case["rows"] == 0
    assert torch.equal(got[plain], case["yz"][plain, :OUT])  # the GEMM's bits


def _engine(path, dtype: str, eager: bool, lora_rank: int = 2) -> LLMEngine:
    cfg = EngineConfig(
        device="cuda",
        dtype=dtype,
        enforce_eager=eager,
        max_num_seqs=8,
        adapter_capacity=4,
        adapter_rank=RANK,
        adapter_lora_rank=lora_rank,
    )
    return LLMEngine(path, cfg)


def _load(engine: LLMEngine) -> dict[str, dict]:
    states = {
        "svd": random_state(engine.adapters, 1, scale=2.0),
        "lora": random_state(engine.adapters, 2, scale=2.0, lora=2),
    }
    for name, state in states.items():
        engine.load_adapter(name, state)
    return states


def _params(i: int, adapters=ADAPTERS, **kw) -> SamplingParams:
    name = adapters[i % len(adapters)]
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, adapter=name, **kw)


def _serve(engine: LLMEngine, params_for) -> list:
    """The prompts staggered (batch sizes cross graph buckets); outputs in prompt order."""
    outs, pending = {}, list(enumerate(_prompts()))
    totals = OutputAccumulator()
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params_for(i))
        for out in totals.finished(engine.step()):
            outs[out.request_id] = out.outputs[0]
    return [outs[str(i)] for i in range(len(PROMPT_LENS))]


def test_adapted_graph_replay_equals_eager_float32(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    runs = {}
    for eager in (False, True):
        engine = _engine(path, "float32", eager)
        _load(engine)
        runs[eager] = _serve(engine, lambda i: _params(i, logprobs=2)), engine.stats()
    (graph, gstats), (eager, estats) = runs[False], runs[True]
    assert gstats["num_adapted_graph_steps"] > 10 and estats["num_graph_steps"] == 0
    _assert_same(graph, eager)


def test_unadapted_requests_beside_adapted_ones_match_a_batch_without_adapters_bf16(
    tiny_checkpoint,
):
    """The adapted graph leaves row-0 tokens out of the low-rank kernel, but their GEMM is
    the wider one of `[W; basis_inᵀ]`, which may round differently from W's alone: an
    unadapted request's tokens agree with a batch without adapters until a near-tie flips,
    and their logprobs within bf16 noise until then (on an H100 they are the same bits)."""
    path = tiny_checkpoint("qwen3")
    mixed_engine, plain_engine = _engine(path, "bfloat16", False), _engine(path, "bfloat16", False)
    _load(mixed_engine)
    _load(plain_engine)
    mixed = _serve(mixed_engine, lambda i: _params(i, logprobs=1))
    plain = _serve(plain_engine, lambda i: _params(i, adapters=(None,), logprobs=1))
    assert mixed_engine.stats()["num_adapted_graph_steps"] > 10
    agreed = total = 0
    for i in range(len(PROMPT_LENS)):
        if ADAPTERS[i % 3] is not None:
            continue
        total += len(plain[i].token_ids)
        for tm, tp, dm, dp in zip(
            mixed[i].token_ids, plain[i].token_ids, mixed[i].logprobs, plain[i].logprobs,
            strict=True,
        ):  # fmt: skip
            if tm != tp:
                break
            assert dm[tm] == pytest.approx(dp[tp], abs=0.05)
            agreed += 1
    assert agreed >= 0.8 * total
    changed = sum(mixed[i].token_ids != plain[i].token_ids for i in range(len(PROMPT_LENS)))
    assert changed > 0  # the adapters did change the adapted requests


@torch.inference_mode()
def test_adapted_greedy_bf16_follows_the_float32_merged_oracle(tiny_checkpoint):
    """Each greedy bf16 token of a graph-decoded adapted request is an argmax of transformers
    in float32 with the adapter merged into its weights, within 4 bf16 ulps of the top."""
    path = tiny_checkpoint("llama")
    engine = _engine(path, "bfloat16", False)
    states = _load(engine)
    outs = _serve(engine, _params)
    assert engine.stats()["num_adapted_graph_steps"] > 10
    prompts = _prompts()
    for name in ADAPTERS:
        model = merged_hf_model(path, states.get(name), "trained", RANK, device="cuda")
        for i, out in enumerate(outs):
            if ADAPTERS[i % 3] != name:
                continue
            ids = torch.tensor([prompts[i] + out.token_ids], device="cuda")
            logits = model(ids).logits[0, len(prompts[i]) - 1 : -1].float()
            top = logits.max(-1).values
            ours = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
            assert float(((top - ours) / bf16_ulp(top)).max()) <= 4, (name, i)


def test_a_lora_above_the_reserved_rank_recaptures_the_adapted_graphs(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    graph, eager = _engine(path, "float32", False, lora_rank=0), _engine(path, "float32", True, 0)
    outs = {}
    for engine in (graph, eager):
        engine.load_adapter("svd", random_state(engine.adapters, 1, scale=2.0))
        first = _serve(engine, lambda i: _params(i, adapters=("svd", None), logprobs=1))
        # a rank-3 LoRA: the tables get new buffers; the adapted graphs must follow them
        engine.load_adapter("lora", random_state(engine.adapters, 2, scale=2.0, lora=3))
        outs[engine] = first, _serve(engine, lambda i: _params(i, logprobs=1))
    assert graph.adapters.layout_version == 1
    assert graph.runner._graph_layout == 1  # re-captured
    assert graph.stats()["num_adapted_graph_steps"] > 20
    for (g_first, g_then), (e_first, e_then) in [(outs[graph], outs[eager])]:
        for g, e in zip(g_first + g_then, e_first + e_then, strict=True):
            assert g.token_ids == e.token_ids
            for dg, de in zip(g.logprobs, e.logprobs, strict=True):
                assert dg == pytest.approx(de, abs=1e-4)
