"""Weight sync: the trainer's adapters → an engine's `load_adapter` state (δ vectors only).

The engine computes the same SVD basis from its own copy of each weight
(`services.engine.adapters.svd_basis`), so only the `r`-vectors δS and δS_q travel, or for a
LoRA quarantine δS and the LoRA's two small factors `A_q [k, in]`, `B_q [out, k]`.
"""

from __future__ import annotations

import torch

from services.trainer.adapters import AdapterSet


def engine_adapter_state(adapters: AdapterSet) -> dict[str, dict[str, torch.Tensor]]:
    """`{module: {"kept": δS, "quarantine": δS_q}}` (SVD quarantine) or `{module: {"kept": δS,
    "lora_a": A_q, "lora_b": B_q}}` (LoRA quarantine), detached CPU copies, for
    `LLMEngine.load_adapter`: the engine serves both variants (`adapter_variant="trained"`
    adds the quarantine, `"deploy"` ablates it)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in adapters.modules.items():
        parts = {"kept": m.delta_s.detach().to("cpu", torch.float64).clone()}
        if m.delta_s_q is not None:
            parts["quarantine"] = m.delta_s_q.detach().to("cpu", torch.float64).clone()
        if m.lora_a_q is not None and m.lora_b_q is not None:
            # in the trainer's dtype: the engine casts to its own and checks finiteness there
            parts["lora_a"] = m.lora_a_q.detach().to("cpu").clone()
            parts["lora_b"] = m.lora_b_q.detach().to("cpu").clone()
        state[name] = parts
    return state
