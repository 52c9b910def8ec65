"""The engine against Hugging Face transformers on the same tiny checkpoint (float32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.conftest import ARCHS
from tests.oracle import hf_greedy, hf_logprobs
from tests.staggered import run_staggered

PROMPT_LENS = (5, 17, 33, 50)
GEN = 32


def _prompts(seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    prompts = _prompts()
    expected = [hf_greedy(path, p, GEN) for p in prompts]
    return request.param, path, prompts, expected


GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def test_prompt_logprobs_match_transformers(arch_case):
    _, path, prompts, _ = arch_case
    llm = LLM(path, device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(path, prompt)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            got = out.prompt_logprobs[pos]
            row = ref[pos - 1]
            assert got[prompt[pos]] == pytest.approx(float(row[prompt[pos]]), abs=1e-4)
            top_vals, top_ids = row.topk(5)
            for t, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True):
                assert got[t] == pytest.approx(v, abs=1e-4)


def test_greedy_batch_at_once(arch_case):
    _, path, prompts, expected = arch_case
    llm = LLM(path, device="cpu", dtype="float32")
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_generated_logprobs_match_transformers(arch_case):
    _, path, prompts, _ = arch_case
    llm = LLM(path, device="cpu", dtype="float32")
    probe = [3, 7, 100]
    out = llm.generate(
        [prompts[1]],
        SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, logprob_token_ids=probe
        ),
    )[0]
    full = prompts[1] + out.outputs[0].token_ids
    ref = hf_logprobs(path, full)
    for step, d in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompts[1]) - 1 + step]
        for t in [*probe, out.outputs[0].token_ids[step], *row.topk(3).indices.tolist()]:
            assert d[t] == pytest.approx(float(row[t]), abs=1e-4)


def test_greedy_staggered(arch_case):
    _, path, prompts, expected = arch_case
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"))
    assert run_staggered(engine, prompts, GREEDY, gap=3) == expected


def test_greedy_chunked_prefill(arch_case):
    _, path, prompts, expected = arch_case
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=7))
    assert run_staggered(engine, prompts, GREEDY, gap=2) == expected
    assert engine.stats()["num_steps"] > sum(PROMPT_LENS) // 7  # prompts really were chunked


def test_prompt_logprobs_under_chunked_prefill_equal_the_unchunked_ones(tiny_checkpoint):
    """Each chunk scores its own prompt positions: chunked, every position's top-5 and the
    actual token's logprob come out as from one whole-prompt prefill."""
    path = tiny_checkpoint("llama")
    prompts = _prompts()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    whole = LLM(path, device="cpu", dtype="float32").generate(prompts, params)
    chunked_llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=7)
    chunked = chunked_llm.generate(prompts, params)
    assert sum(PROMPT_LENS) == 105  # so at most 7 a step, the prompts take 15 steps
    assert chunked_llm.engine.stats()["num_steps"] >= 15
    for prompt, got, want in zip(prompts, chunked, whole, strict=True):
        assert got.prompt_logprobs[0] is None
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            g, w = got.prompt_logprobs[pos], want.prompt_logprobs[pos]
            assert g.keys() == w.keys() and prompt[pos] in g, pos
            for t in w:
                assert g[t] == pytest.approx(w[t], abs=1e-4), (pos, t)


def test_greedy_under_preemption(arch_case):
    _, path, prompts, expected = arch_case
    # 12 blocks of 8 tokens = 96 slots; the four requests need 50+32 tokens at most each.
    llm = LLM(path, device="cpu", dtype="float32", block_size=8, num_kv_blocks=12)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats()["num_preemptions"] > 0


def test_prefix_cache_hit_same_tokens(arch_case):
    _, path, _, _ = arch_case
    rng = random.Random(1)
    prefix = [rng.randrange(8, 512) for _ in range(64)]
    a = prefix + [rng.randrange(8, 512) for _ in range(9)]
    b = prefix + [rng.randrange(8, 512) for _ in range(5)]
    cached = LLM(path, device="cpu", dtype="float32")
    cached.generate([a], GREEDY)
    hit = cached.generate([b], GREEDY)[0]
    assert hit.num_cached_tokens >= 48
    uncached = LLM(path, device="cpu", dtype="float32", enable_prefix_caching=False)
    miss = uncached.generate([b], GREEDY)[0]
    assert miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert torch.equal(
        torch.tensor(hit.outputs[0].token_ids), torch.tensor(miss.outputs[0].token_ids)
    )


def test_mistral_sliding_window_matches_transformers(tiny_checkpoint, tmp_path):
    import json
    import shutil

    src = tiny_checkpoint("mistral")
    path = tmp_path / "mistral-window8"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(seed=2)
    # Chunked prefill and prefix caching both cross the window boundary here.
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=13)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    windowed_differs = False
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(path, prompt)
        full = hf_logprobs(src, prompt)
        for pos in range(1, len(prompt)):
            t = prompt[pos]
            assert out.prompt_logprobs[pos][t] == pytest.approx(float(ref[pos - 1, t]), abs=1e-4)
            windowed_differs |= abs(float(ref[pos - 1, t]) - float(full[pos - 1, t])) > 1e-3
    assert windowed_differs  # the window really changed the model's output
    greedy = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in greedy] == [hf_greedy(path, p, GEN) for p in prompts]
