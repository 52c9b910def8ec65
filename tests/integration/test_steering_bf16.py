"""Steering and capture in bfloat16: on CPU (the reference kernels, the tables' casts) and
on CUDA where there is one, through the Triton kernel (`make gpu-test` runs this file too).

Same tolerance logic as `test_oracle_bf16.py`: our bf16 error against the float32
transformers-hooks reference must be no worse than transformers' own bf16 error with the
same hooks, plus a small slack. Where nothing is added (an in-batch control, a closed
monitor) the result must be bit-identical to the unsteered run.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.interventions.actions import SteeringMonitorUpdate, SteeringVectorUpdate
from services.engine.interventions.sites import SITES
from tests.integration.test_steering import _add, _prompt, _run, _vec
from tests.oracle import hf_edited_logprobs, hf_model, hf_residuals

ERROR_SLACK = 1.25
PARAMS = dict(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=5)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


def _engine(path, device: str) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device=device, dtype="bfloat16"))


def _prompt_error(out, ref: torch.Tensor, prompt: list[int]) -> float:
    errs = [
        abs(v - float(ref[pos - 1, t]))
        for pos in range(1, len(prompt))
        for t, v in out.prompt_logprobs[pos].items()
    ]
    return sum(errs) / len(errs)


def _hf_error(path, prompt, edits, device: str) -> float:
    ref = hf_edited_logprobs(path, prompt, edits, torch.float32, device)
    bf = hf_edited_logprobs(path, prompt, edits, torch.bfloat16, device)
    return float((bf[:-1] - ref[:-1]).abs().mean())


def test_three_sites_in_one_batch_match_hooks_and_the_control_is_untouched(path, bf16_device):
    hidden = hf_model(path).config.hidden_size
    requests, edits = {}, {}
    for i, site in enumerate(SITES):
        v = _vec(60 + i, hidden)
        spec = {"vectors": [{"site": site, "layers": [i], "vector": v.tolist()}]}
        requests[site] = (_prompt(60 + i, 20 + 9 * i), SamplingParams(**PARAMS, steering=spec))
        edits[site] = {(i, site): _add(v)}
    requests["control"] = (_prompt(70), SamplingParams(**PARAMS))
    outs = _run(_engine(path, bf16_device), requests)
    for site in SITES:
        prompt = requests[site][0]
        ref = hf_edited_logprobs(path, prompt, edits[site], torch.float32, bf16_device)
        ours = _prompt_error(outs[site], ref, prompt)
        theirs = _hf_error(path, prompt, edits[site], bf16_device)
        assert ours <= ERROR_SLACK * theirs + 1e-3, (site, ours, theirs)
    plain = {rid: (p, SamplingParams(**PARAMS)) for rid, (p, _) in requests.items()}
    control = _run(_engine(path, bf16_device), plain)["control"]
    assert outs["control"].prompt_logprobs == control.prompt_logprobs
    assert outs["control"].outputs[0].token_ids == control.outputs[0].token_ids


def test_closed_monitor_is_bit_identical_to_unsteered(path, bf16_device):
    hidden = hf_model(path).config.hidden_size
    prompt, v, probe = _prompt(71), _vec(71, hidden), _vec(72, hidden, norm=1.0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    engine = _engine(path, bf16_device)
    engine.submit_action(SteeringVectorUpdate("post_block", [1], v.tolist()))
    engine.submit_action(SteeringMonitorUpdate("post_block", 1, probe.tolist(), threshold=1e4))
    closed = _run(engine, {"m": (prompt, params)})["m"]
    plain = _run(_engine(path, bf16_device), {"m": (prompt, params)})["m"]
    assert closed.outputs[0].logprobs == plain.outputs[0].logprobs
    engine.submit_action(SteeringMonitorUpdate("post_block", 1, probe.tolist(), threshold=-1e4))
    opened = _run(engine, {"o": (prompt, params)})["o"]
    assert opened.outputs[0].logprobs != plain.outputs[0].logprobs


def test_captures_match_transformers_bf16(path, bf16_device):
    prompt = _prompt(73)
    capture = {"sites": {"post_block": "all", "pre_attn": [1]}, "positions": "all_prompt"}
    out = _run(
        _engine(path, bf16_device), {"c": (prompt, SamplingParams(max_tokens=1, capture=capture))}
    )["c"]
    keys = [(0, "post_block"), (1, "post_block"), (2, "post_block"), (1, "pre_attn")]
    ref = hf_residuals(path, prompt, keys, torch.float32, bf16_device)
    bf = hf_residuals(path, prompt, keys, torch.bfloat16, bf16_device)
    for L, s in keys:
        got = out.captures[f"{L}.{s}"]
        ours = float((got - ref[(L, s)].cpu()).abs().mean())
        theirs = float((bf[(L, s)].float().cpu() - ref[(L, s)].cpu()).abs().mean())
        assert ours <= ERROR_SLACK * theirs + 1e-3, (L, s, ours, theirs)
