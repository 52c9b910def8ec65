"""The trainer's model: the engine's modules in a dense causal forward, checked against HF."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.errors import InvalidRequestError
from services.trainer.model import DenseCausalBackend, TrainableModel, pad_batch
from tests.oracle import hf_model

# Rows of unequal length so every row but one carries padding.
SEQS = [([5, 6, 7], [8, 9]), ([11, 12, 13, 14, 15, 16], [17]), ([3], [4, 5, 6, 7, 8, 9, 10])]


def _hf_sdpa(model_dir, dtype):
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa"
    ).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_transformers(tiny_checkpoint, arch, side):
    ckpt = tiny_checkpoint(arch)
    model = TrainableModel.from_pretrained(ckpt, dtype=torch.float32)
    hf = _hf_sdpa(ckpt, torch.float32)
    batch = pad_batch(SEQS, side=side)
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions)
        got = model(batch.input_ids, batch.attention_mask).logits
    real = batch.attention_mask.bool()
    assert got.shape == (3, batch.input_ids.shape[1], 512)
    torch.testing.assert_close(got[real], ref.logits[real], rtol=0, atol=1e-4)


def test_each_padded_row_matches_its_unpadded_eager_run_float64(tiny_checkpoint):
    """The stricter oracle: HF eager attention over each sequence alone, no padding at all."""
    ckpt = tiny_checkpoint("llama")
    model = TrainableModel.from_pretrained(ckpt, dtype=torch.float64)
    hf = hf_model(ckpt, torch.float64)
    for side in ("left", "right"):
        batch = pad_batch(SEQS, side=side)
        with torch.no_grad():
            got = model(batch.input_ids, batch.attention_mask).logits
        for i, (prompt, completion) in enumerate(SEQS):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt + completion])).logits[0]
            torch.testing.assert_close(
                got[i][batch.attention_mask[i].bool()], ref, rtol=0, atol=1e-4
            )


def test_sliding_window_matches_transformers(tiny_checkpoint, tmp_path):
    ckpt = tmp_path / "mistral-window"
    shutil.copytree(tiny_checkpoint("mistral"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["sliding_window"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model = TrainableModel.from_pretrained(ckpt, dtype=torch.float32)
    hf = _hf_sdpa(ckpt, torch.float32)
    batch = pad_batch(SEQS, side="left")
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions)
        got = model(batch.input_ids, batch.attention_mask).logits
        unwindowed = TrainableModel.from_pretrained(tiny_checkpoint("mistral"))(
            batch.input_ids, batch.attention_mask
        ).logits
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], ref.logits[real], rtol=0, atol=1e-4)
    assert (got[real] - unwindowed[real]).abs().max() > 1e-3  # the window really bit


def test_token_logprobs_align_with_inputs_and_loss_mask(tiny_checkpoint):
    model = TrainableModel.from_pretrained(tiny_checkpoint("llama"))
    batch = pad_batch(SEQS, side="left")
    with torch.no_grad():
        lp = model.token_logprobs(batch)
        logits = model(batch.input_ids, batch.attention_mask).logits
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp[:, 1:], ref, rtol=0, atol=1e-4)
    assert (lp[:, 0] == 0).all()
    # Row 0 is left-padded by 3: its completion [8, 9] sits at positions 6 and 7.
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    seq = model.sequence_logprob(batch)
    torch.testing.assert_close(seq[0], lp[0, 6] + lp[0, 7])


def test_base_weights_are_frozen_and_autograd_is_on(tiny_checkpoint):
    model = TrainableModel.from_pretrained(tiny_checkpoint("llama"))
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())
    emb = model.model.embed_tokens.weight
    emb.requires_grad_(True)  # a probe leaf, to see that gradients flow through the forward
    try:
        model.sequence_logprob(pad_batch(SEQS)).sum().backward()
        assert emb.grad is not None and emb.grad.abs().sum() > 0
    finally:
        emb.requires_grad_(False)
        emb.grad = None


def test_bad_inputs_are_clear_errors(tiny_checkpoint):
    model = TrainableModel.from_pretrained(tiny_checkpoint("llama"))
    with pytest.raises(InvalidRequestError, match=r"\[B, T\]"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(InvalidRequestError, match="shape of input_ids"):
        model(torch.tensor([[1, 2, 3]]), torch.ones(1, 2))
    with pytest.raises(InvalidRequestError, match="max_position_embeddings"):
        model(torch.ones(1, 513, dtype=torch.long))
    with pytest.raises(InvalidRequestError, match="padding side"):
        pad_batch(SEQS, side="middle")
    with pytest.raises(InvalidRequestError, match="non-empty"):
        pad_batch([([1], [])])
    with pytest.raises(TypeError, match="prepare_dense"):
        DenseCausalBackend().prepare(None)
