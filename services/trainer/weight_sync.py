"""Weight sync: the trainer's adapters → an engine's `load_adapter` state (δ vectors only).

The engine computes the same SVD basis from its own copy of each weight
(`services.engine.adapters.svd_basis`), so only the `r`-vectors δS and δS_q travel.
"""

from __future__ import annotations

import torch

from services.common.errors import InvalidRequestError
from services.trainer.adapters import AdapterSet


def engine_adapter_state(adapters: AdapterSet) -> dict[str, dict[str, torch.Tensor]]:
    """`{module: {"kept": δS, "quarantine": δS_q}}` (detached, CPU) for `LLMEngine.load_adapter`.

    A LoRA quarantine has no SVD-basis form, so this raises for one: engines serve such an
    adapter as deployed only (`deploy_adapter_state`, `adapter_variant="deploy"`).
    """
    if adapters.config.quarantine != "svd":
        raise InvalidRequestError(
            "engines apply SVD-basis quarantines only: sync a LoRA-quarantine adapter with "
            "deploy_adapter_state() and request adapter_variant='deploy'"
        )
    return {
        name: {
            "kept": m.delta_s.detach().to("cpu", torch.float64).clone(),
            "quarantine": m.delta_s_q.detach().to("cpu", torch.float64).clone(),
        }
        for name, m in adapters.modules.items()
    }


def deploy_adapter_state(adapters: AdapterSet) -> dict[str, dict[str, torch.Tensor]]:
    """The deployed adapter only (quarantine ablated), for any quarantine kind."""
    return {
        name: {"kept": m.delta_s.detach().to("cpu", torch.float64).clone()}
        for name, m in adapters.modules.items()
    }
