"""Hugging Face `transformers` as the correctness oracle for our model code."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="eager"
    )
    return model.to(device).eval()


@torch.inference_mode()
def hf_logprobs(model_dir: Path, ids: list[int], dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[len(ids), V] float32 log-softmax of HF's logits at every position."""
    model = hf_model(model_dir, dtype, device)
    logits = model(torch.tensor([ids], device=device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


@torch.inference_mode()
def hf_greedy(
    model_dir: Path, ids: list[int], n: int, dtype=torch.float32, device="cpu"
) -> list[int]:
    """n greedy tokens by full re-forward each step: slow, and obviously right."""
    model = hf_model(model_dir, dtype, device)
    seq = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([seq], device=device)).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(ids) :]
