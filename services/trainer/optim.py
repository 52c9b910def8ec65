"""Muon: Newton–Schulz-orthogonalised momentum for matrix parameters, AdamW for the rest.

After Keller Jordan's Muon (kellerjordan.github.io/posts/muon): each 2-D parameter's
momentum is replaced by an approximation of its orthogonal polar factor `U·Vᵀ`, so every
update moves all singular directions by the same amount. Embeddings, the LM head, norms,
biases and the trainer's δ vectors are not hidden-layer matrices and go to AdamW (use
`muon_param_groups`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from services.common.errors import InvalidRequestError

# Keller Jordan's quintic: pushes singular values in (0, 1] into roughly [0.7, 1.2] in
# 5 steps, trading exact convergence for speed (the update direction is what matters).
QUINTIC = (3.4445, -4.7750, 2.0315)
# The classic cubic (1.5x − 0.5x³): converges to the exact polar factor, more slowly.
CUBIC = (1.5, -0.5, 0.0)


def newton_schulz(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = QUINTIC,
    eps: float = 1e-7,
) -> torch.Tensor:
    """An approximation of the orthogonal polar factor `U·Vᵀ` of `g = U·S·Vᵀ` (2-D).

    Iterates `X ← a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`, on the wide orientation so `A` is the
    small Gram matrix, after scaling `X` to Frobenius norm 1 (singular values ≤ 1).
    """
    if g.ndim != 2:
        raise InvalidRequestError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(torch.float32) if g.dtype in (torch.float16, torch.bfloat16) else g.clone()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.T
    return x.to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for parameter groups with `use_muon=True` (2-D only), AdamW for the others.

    Muon groups: `lr`, `momentum`, `nesterov`, `ns_steps`, `weight_decay` (decoupled). The
    orthogonalised update is scaled by `sqrt(max(1, rows/cols))` so tall matrices get
    per-element steps like square ones. AdamW groups: `lr`, `betas`, `eps`, `weight_decay`.
    Without explicit groups every 2-D parameter uses Muon; `muon_param_groups` keeps
    embeddings and the LM head on AdamW as Muon's authors recommend.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ):
        if lr <= 0 or adamw_lr <= 0:
            raise InvalidRequestError(f"learning rates must be > 0, got {lr}, {adamw_lr}")
        if not 0 <= momentum < 1:
            raise InvalidRequestError(f"momentum must lie in [0, 1), got {momentum}")
        given: list[Any] = list(params)
        if given and not isinstance(given[0], dict):
            flat: list[nn.Parameter] = given
            given = [
                {"params": [p for p in flat if p.ndim == 2], "use_muon": True},
                {"params": [p for p in flat if p.ndim != 2], "use_muon": False},
            ]
        groups = []
        for group in given:
            group = dict(group)
            group["params"] = list(group["params"])
            use_muon = group.setdefault("use_muon", False)
            if use_muon:
                bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
                if bad:
                    raise InvalidRequestError(f"Muon groups take 2-D parameters only, got {bad}")
                group.setdefault("lr", lr)
                group.setdefault("weight_decay", weight_decay)
            else:
                group.setdefault("lr", adamw_lr)
                group.setdefault("weight_decay", adamw_weight_decay)
            if group["params"]:
                groups.append(group)
        defaults = {
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "betas": adamw_betas,
            "eps": adamw_eps,
        }
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One update of every parameter with a gradient; returns `closure()` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            update = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
            update = newton_schulz(update, steps=group["ns_steps"])
            scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"]
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            m_hat = state["exp_avg"] / (1 - beta1**t)
            v_hat = state["exp_avg_sq"] / (1 - beta2**t)
            if wd:
                p.mul_(1 - lr * wd)
            p.addcdiv_(m_hat, v_hat.sqrt_().add_(eps), value=-lr)


def muon_param_groups(
    model: nn.Module, adamw_patterns: tuple[str, ...] = ("embed", "lm_head")
) -> list[dict[str, Any]]:
    """Parameter groups for `Muon`: hidden 2-D matrices on Muon, everything else on AdamW.

    Parameters whose name contains one of `adamw_patterns` (embeddings and the output head by
    default) stay on AdamW even though they are 2-D. Frozen parameters are left out.
    """
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and not any(pat in name for pat in adamw_patterns):
            muon.append(p)
        else:
            adamw.append(p)
    return [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]
