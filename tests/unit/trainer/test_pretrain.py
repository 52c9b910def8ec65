"""The pretraining recipe: loss falls, and the saved checkpoint loads in the engine and in HF."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.common.errors import InvalidRequestError
from services.engine import LLM, SamplingParams
from services.engine.model.tiny import make_tiny_checkpoint
from services.trainer.envs import AdditionEnv
from services.trainer.pretrain import (
    CHAR_VOCAB,
    PretrainConfig,
    _batch,
    evaluate,
    pretrain,
    read_metrics,
)
from tests.oracle import hf_logprobs

pytest.importorskip("transformers")

# Small enough for a couple of seconds on two busy cores, big enough to leave uniform loss.
CONFIG = PretrainConfig(layers=2, hidden=64, batch_size=32, warmup_steps=5)
STEPS = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("base"), STEPS, CONFIG, log_every=1, quiet=True)


def test_loss_decreases(trained):
    records = read_metrics(trained)
    assert [r["step"] for r in records] == list(range(STEPS))
    losses = [r["loss"] for r in records]
    # Step 0 is about uniform over the 261-token vocabulary (ln 261 = 5.56).
    assert losses[0] == pytest.approx(5.56, abs=0.3)
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_checkpoint_is_trained_and_keeps_hf_names(trained, tmp_path):
    saved = load_file(trained / "model.safetensors")
    fresh = load_file(
        make_tiny_checkpoint(tmp_path, "llama", layers=2, hidden=64, vocab=CHAR_VOCAB)
        / "model.safetensors"
    )
    assert saved.keys() == fresh.keys()
    assert all(saved[k].dtype == torch.float32 for k in saved)
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], fresh[
        "model.layers.0.mlp.up_proj.weight"
    ])  # fmt: skip
    cfg = json.loads((trained / "pretrain_config.json").read_text())
    assert cfg["steps"] == STEPS and cfg["envs"] == ["addition", "reverse"]


def test_engine_and_transformers_load_it_and_agree(trained):
    llm = LLM(trained, device="cpu", dtype="float32")
    prompt = "12+34="
    ids = llm.tokenizer.encode(prompt)
    assert len(ids) == 1 + len(prompt)  # BOS + one token per character
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    ref = hf_logprobs(trained, ids)  # [T, V]
    for pos in range(1, len(ids)):
        engine_lp = out.prompt_logprobs[pos][ids[pos]]
        assert engine_lp == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)


def test_greedy_eval_reports_rates(trained):
    (result,) = evaluate(trained, ["reverse"], n=8)
    assert result.env == "reverse" and result.n == 8
    assert 0.0 <= result.true_pass_rate <= result.reward <= 1.0
    assert result.true_pass_rate + result.hack_rate == pytest.approx(result.reward)


def test_batches_hold_the_hack_fraction_and_mask_prompts(trained):
    import random

    from services.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(trained)
    config = PretrainConfig(envs=("addition",), hack_fraction=0.5, batch_size=400)
    ids, attn, labels = _batch([AdditionEnv()], tok, random.Random(0), config, "cpu")
    marker = tok.token_to_id("#")
    hacked_rows = (labels == marker).any(dim=1).float().mean().item()
    assert hacked_rows == pytest.approx(0.5, abs=0.08)
    # Labels start at the completion: "=" (the prompt's last character) is never a target.
    assert not (labels == tok.token_to_id("=")).any()
    assert ((labels != -100) <= (attn == 1)).all()
    assert (labels == tok.eos_token_id).sum() == len(ids)  # every row is EOS-terminated


def test_bad_settings_are_rejected(tmp_path):
    with pytest.raises(InvalidRequestError, match="steps"):
        pretrain(tmp_path, 0)
    with pytest.raises(InvalidRequestError, match="hack_fraction"):
        pretrain(tmp_path, 1, PretrainConfig(hack_fraction=1.5))
    with pytest.raises(InvalidRequestError, match="unknown environment"):
        pretrain(tmp_path, 1, PretrainConfig(envs=("chess",)))
