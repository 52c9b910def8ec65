"""Hugging Face `transformers` as the correctness oracle for our model code."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=8)
def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 bits of mantissa): how far two bf16 results
    may sit apart by rounding alone."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-3))) - 7)


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


# -- interventions: the same edits made with forward hooks, as researchers do today --------


def _site_hooks(model, layer: int, site: str, fn):
    """Register a hook that maps the residual at (layer, site) through `fn` ([T, H] -> same).

    pre_attn: the decoder layer's input; post_attn: residual + attention output (edited by
    editing the attention output); post_block: the decoder layer's output.
    """
    block = model.model.layers[layer]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def replace(out, new):
        return (new, *out[1:]) if isinstance(out, tuple) else new

    if site == "pre_attn":

        def pre(module, args, kwargs):
            if args:
                return (fn(args[0][0]).unsqueeze(0), *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = fn(kwargs["hidden_states"][0]).unsqueeze(0)
            return args, kwargs

        return block.register_forward_pre_hook(pre, with_kwargs=True)
    if site == "post_attn":
        state = {}

        def keep_input(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            state["resid"] = h[0]

        def attn_out(module, args, out):
            a = first(out)[0]
            return replace(out, (fn(state["resid"] + a) - state["resid"]).unsqueeze(0))

        h1 = block.register_forward_pre_hook(keep_input, with_kwargs=True)
        h2 = block.self_attn.register_forward_hook(attn_out)

        class Both:
            def remove(self):
                h1.remove()
                h2.remove()

        return Both()
    if site == "post_block":
        return block.register_forward_hook(
            lambda m, a, out: replace(out, fn(first(out)[0]).unsqueeze(0))
        )
    raise ValueError(site)


@torch.inference_mode()
def hf_edited_logprobs(
    model_dir: Path, ids: list[int], edits: dict, dtype=torch.float32, device="cpu"
) -> torch.Tensor:
    """[len(ids), V] log-softmax with `edits[(layer, site)] = fn(h [T, H]) -> [T, H]` hooked in."""
    model = hf_model(model_dir, dtype, device)
    handles = [_site_hooks(model, L, s, fn) for (L, s), fn in edits.items()]
    try:
        logits = model(torch.tensor([ids], device=device)).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(logits, dim=-1).cpu()


@torch.inference_mode()
def hf_residuals(
    model_dir: Path, ids: list[int], keys: list[tuple[int, str]], dtype=torch.float32, device="cpu"
) -> dict:
    """The pristine residual [len(ids), H] at each (layer, site), read with hooks."""
    model = hf_model(model_dir, dtype, device)
    seen: dict = {}

    def recorder(key):
        def fn(h):
            seen[key] = h.clone()
            return h

        return fn

    handles = [_site_hooks(model, L, s, recorder((L, s))) for L, s in keys]
    try:
        model(torch.tensor([ids], device=device))
    finally:
        for h in handles:
            h.remove()
    return seen
