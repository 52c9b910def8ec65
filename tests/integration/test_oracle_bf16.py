"""The oracle tests in bfloat16, on CPU and on CUDA where there is one (`make gpu-test`
runs this file too).

bfloat16 keeps 8 bits of mantissa: logits near 30 are rounded to multiples of 0.125, so
exact token equality with any reference is not a sound test (a near-tie can flip). So:
- prompt logprobs: our bf16 error against the float32 transformers reference must be no
  worse than transformers' own bf16 error (same checkpoint, same GPU) plus a small slack;
- greedy: every token we produce must be an argmax of the float32 reference, teacher-forced
  on our own sequence, within `TOKEN_ULPS` bf16 ulps of the top logit.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.conftest import ARCHS
from tests.oracle import bf16_ulp, hf_model
from tests.staggered import run_staggered

PROMPT_LENS = (5, 17, 33, 50)
GEN = 32
ERROR_SLACK = 1.25  # our mean bf16 error may exceed transformers' by at most 25 %
TOKEN_ULPS = 4
GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int = 512) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in PROMPT_LENS]


@torch.inference_mode()
def _ref_logits(path, ids: list[int], device: str, dtype=torch.float32) -> torch.Tensor:
    model = hf_model(path, dtype, device)
    return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def _assert_greedy_consistent(path, device: str, prompt: list[int], tokens: list[int]) -> float:
    """Largest lag of our token behind the fp32 argmax, in bf16 ulps of the top logit."""
    assert len(tokens) == GEN
    logits = _ref_logits(path, prompt + tokens, device)[len(prompt) - 1 : -1]  # [GEN, V]
    top = logits.max(dim=-1).values
    trail = (top - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]) / bf16_ulp(top)
    assert float(trail.max()) <= TOKEN_ULPS, f"a token trails the fp32 argmax by {trail.max()} ulp"
    return float(trail.max())


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_checkpoint):
    return request.param, tiny_checkpoint(request.param), _prompts()


def test_prompt_logprobs_bf16(case, bf16_device):
    arch, path, prompts = case
    llm = LLM(path, device=bf16_device, dtype="bfloat16")
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    ours, theirs = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        ref = torch.log_softmax(_ref_logits(path, prompt, bf16_device), dim=-1)
        hf16 = torch.log_softmax(_ref_logits(path, prompt, bf16_device, torch.bfloat16), dim=-1)
        for pos in range(1, len(prompt)):
            t = prompt[pos]
            ours.append(abs(out.prompt_logprobs[pos][t] - float(ref[pos - 1, t])))
            theirs.append(abs(float(hf16[pos - 1, t]) - float(ref[pos - 1, t])))
    mean, hf_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
    print(
        f"[{arch}] prompt logprob error vs fp32 reference: coxswain bf16 mean {mean:.4f} "
        f"max {max(ours):.4f}; transformers bf16 mean {hf_mean:.4f} max {max(theirs):.4f}"
    )
    assert mean <= ERROR_SLACK * hf_mean + 0.01


@pytest.mark.parametrize("mode", ["batch", "staggered", "chunked", "preempt"])
def test_greedy_bf16(case, bf16_device, mode):
    arch, path, prompts = case
    if mode == "batch":
        outs = LLM(path, device=bf16_device, dtype="bfloat16").generate(prompts, GREEDY)
        tokens = [o.outputs[0].token_ids for o in outs]
    elif mode == "staggered":
        engine = LLMEngine(path, EngineConfig(device=bf16_device, dtype="bfloat16"))
        tokens = run_staggered(engine, prompts, GREEDY, 3)
    elif mode == "chunked":
        cfg = EngineConfig(device=bf16_device, dtype="bfloat16", max_num_batched_tokens=7)
        tokens = run_staggered(LLMEngine(path, cfg), prompts, GREEDY, 2)
    else:
        llm = LLM(path, device=bf16_device, dtype="bfloat16", block_size=8, num_kv_blocks=12)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.stats()["num_preemptions"] > 0
    trails = [
        _assert_greedy_consistent(path, bf16_device, p, t)
        for p, t in zip(prompts, tokens, strict=True)
    ]
    print(f"[{arch}/{mode}] greedy tokens trail the fp32 argmax by <= {max(trails):.2f} bf16 ulp")


def test_prefix_cache_bf16(tiny_checkpoint, bf16_device):
    path = tiny_checkpoint("llama")
    rng = random.Random(1)
    prefix = [rng.randrange(8, 512) for _ in range(64)]
    llm = LLM(path, device=bf16_device, dtype="bfloat16")
    llm.generate([prefix + [9, 10, 11]], GREEDY)
    hit = llm.generate([prefix + [12, 13]], GREEDY)[0]
    miss = LLM(path, device=bf16_device, dtype="bfloat16", enable_prefix_caching=False).generate(
        [prefix + [12, 13]], GREEDY
    )[0]
    assert hit.num_cached_tokens >= 48 and miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
