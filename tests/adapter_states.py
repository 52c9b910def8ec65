"""Adapter states for tests, and the transformers oracle with an adapter merged in."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from services.engine.adapters import AdapterBank, svd_basis
from tests.oracle import hf_model


def random_state(
    bank: AdapterBank, seed: int, scale: float = 3.0, quarantine: bool = True, lora: int = 0
) -> dict:
    """Random δ vectors per target module of `bank` (every layer's, on a pipeline stage),
    plus a rank-`lora` LoRA quarantine of the whole weights' shapes when `lora`."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(bank.shapes):
        state[name] = {
            "kept": scale * torch.randn(bank.rank, generator=g),
            "quarantine": (scale * torch.randn(bank.rank, generator=g))
            if quarantine
            else torch.zeros(bank.rank),
        }
        if lora:
            out_f, in_f = bank.shapes[name]
            state[name]["lora_a"] = 0.3 * torch.randn(lora, in_f, generator=g)
            state[name]["lora_b"] = 0.3 * torch.randn(out_f, lora, generator=g)
    return state


def merged_hf_model(
    path: Path,
    state: dict | None,
    variant: str,
    rank: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
):
    """transformers with each target weight edited to W + U·diag(δ)·Vᵀ (plus the LoRA
    `B_q A_q`, for the trained variant of a LoRA quarantine); `state` None: the base."""
    model = copy.deepcopy(hf_model(path))
    if state is not None:
        with torch.no_grad():
            for name, parts in state.items():
                delta = parts["kept"].double()
                if variant == "trained" and "quarantine" in parts:
                    delta = delta + parts["quarantine"].double()
                lin = model.get_submodule(f"model.{name}")
                u, _, v = svd_basis(lin.weight, rank)
                edit = (u * delta) @ v.T
                if variant == "trained" and "lora_a" in parts:
                    edit = edit + parts["lora_b"].double() @ parts["lora_a"].double()
                lin.weight += edit.to(lin.weight.dtype)
    return model.to(device, dtype).eval()
