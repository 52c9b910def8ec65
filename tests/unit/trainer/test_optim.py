"""Muon: the Newton–Schulz iteration approximates the polar factor; the optimiser learns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common.errors import InvalidRequestError
from services.trainer.optim import CUBIC, Muon, RoutedAdamW, muon_param_groups, newton_schulz


def _polar(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 32)])
def test_quintic_newton_schulz_flattens_singular_values(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = newton_schulz(g)
    sv = torch.linalg.svdvals(x)
    # The quintic trades exactness for speed: singular values land near 1, not on it ...
    assert sv.min() > 0.6 and sv.max() < 1.25, sv
    # ... while the singular vectors are those of g: x is close to the polar factor in direction.
    cos = (x * _polar(g)).sum() / (x.norm() * _polar(g).norm())
    assert cos > 0.98
    assert x.shape == g.shape


def test_cubic_newton_schulz_converges_to_the_polar_factor():
    gen = torch.Generator().manual_seed(1)
    # A well-conditioned tall matrix: singular values in [0.5, 2].
    u, _ = torch.linalg.qr(torch.randn(24, 12, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(12, 12, generator=gen, dtype=torch.float64))
    s = torch.linspace(0.5, 2.0, 12, dtype=torch.float64)
    g = u @ torch.diag(s) @ v.T
    x = newton_schulz(g, steps=40, coefficients=CUBIC)
    torch.testing.assert_close(x, u @ v.T, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.linalg.svdvals(x), torch.ones(12, dtype=torch.float64))


def test_newton_schulz_rejects_non_matrices():
    with pytest.raises(InvalidRequestError, match="2-D"):
        newton_schulz(torch.ones(3))


def test_muon_reduces_a_regression_loss():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    target = x @ torch.randn(16, 8, generator=gen) + 0.5
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    torch.manual_seed(0)
    for m in model:
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    opt = Muon(model.parameters(), lr=0.02, adamw_lr=1e-2)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]  # weights / biases

    def loss() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), target)

    first = loss().item()
    for _ in range(100):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.2 * first


def test_muon_update_is_orthogonalised_momentum():
    # One step from zero momentum: Δ = -lr · scale · NS(g (1 + μ)) for nesterov, with NS
    # invariant to scaling its input, so Δ = -lr · scale · NS(g).
    w = nn.Parameter(torch.randn(12, 6, dtype=torch.float64))
    before = w.detach().clone()
    g = torch.randn(12, 6, dtype=torch.float64)
    w.grad = g.clone()
    Muon([{"params": [w], "use_muon": True}], lr=0.1).step()
    scale = (12 / 6) ** 0.5
    torch.testing.assert_close(
        w.detach(), before - 0.1 * scale * newton_schulz(g), atol=1e-6, rtol=0
    )


def test_muon_param_groups_keep_embeddings_and_head_on_adamw():
    model = nn.ModuleDict(
        {"embed_tokens": nn.Embedding(10, 4), "proj": nn.Linear(4, 4), "lm_head": nn.Linear(4, 10)}
    )
    groups = muon_param_groups(model)
    muon = {id(p) for p in groups[0]["params"]}
    assert muon == {id(model["proj"].weight)}
    assert {id(p) for p in groups[1]["params"]} == {
        id(p) for p in model.parameters() if id(p) not in muon
    }


def test_muon_rejects_vectors_in_a_muon_group():
    with pytest.raises(InvalidRequestError, match="2-D parameters only"):
        Muon([{"params": [nn.Parameter(torch.ones(3))], "use_muon": True}])


def _pair(n: int = 6) -> tuple[nn.Parameter, nn.Parameter]:
    return (
        nn.Parameter(torch.zeros(n, dtype=torch.float64)),
        nn.Parameter(torch.zeros(n, dtype=torch.float64)),
    )


def _grads(steps: int, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        total = torch.randn(n, generator=g, dtype=torch.float64)
        share = torch.rand(n, generator=g, dtype=torch.float64) * (torch.rand(1, generator=g) < 0.5)
        out.append((total * (1 - share), total * share))  # a routed split of one gradient
    return out


def test_routed_adamw_without_routing_is_adamw():
    kept, quarantine = _pair()
    ref = nn.Parameter(torch.zeros(6, dtype=torch.float64))
    ours = RoutedAdamW([(kept, quarantine)], lr=0.05, weight_decay=0.1)
    theirs = torch.optim.AdamW([ref], lr=0.05, weight_decay=0.1)
    for g_k, _ in _grads(8):
        kept.grad, quarantine.grad, ref.grad = g_k.clone(), None, g_k.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(kept, ref, atol=1e-12, rtol=1e-10)
    assert torch.equal(quarantine, torch.zeros(6, dtype=torch.float64))


def test_routed_adamw_sum_follows_adamw_on_the_total_and_banks_nothing():
    """δS + δS_q takes exactly AdamW's steps on the unrouted gradient, and δS's momentum is
    the average of its own (kept) gradients only: routed mass is never banked in it."""
    kept, quarantine = _pair()
    total = nn.Parameter(torch.zeros(6, dtype=torch.float64))
    ours = RoutedAdamW([(kept, quarantine)], lr=0.05)
    ref = torch.optim.AdamW([total], lr=0.05, weight_decay=0.0)
    kept_ema = torch.zeros(6, dtype=torch.float64)
    for g_k, g_q in _grads(10):
        kept.grad, quarantine.grad, total.grad = g_k, g_q, g_k + g_q
        ours.step()
        ref.step()
        kept_ema = 0.9 * kept_ema + 0.1 * g_k
    torch.testing.assert_close(kept + quarantine, total, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(ours.state[kept]["exp_avg"], kept_ema, atol=1e-14, rtol=0)


def test_a_small_routed_share_moves_the_quarantine_a_little():
    """5% of every gradient routed: plain AdamW per part moves δS_q as far as δS (it
    normalises each part's scale away); RoutedAdamW moves it 5/95 as far."""
    runs = {}
    for name in ("adamw", "routed"):
        kept, quarantine = _pair()
        opt = (
            RoutedAdamW([(kept, quarantine)], lr=0.05)
            if name == "routed"
            else torch.optim.AdamW([kept, quarantine], lr=0.05, weight_decay=0.0)
        )
        for g, _ in _grads(10):
            kept.grad, quarantine.grad = 0.95 * g, 0.05 * g
            opt.step()
        runs[name] = float(quarantine.detach().norm() / kept.detach().norm())
    assert runs["adamw"] == pytest.approx(1.0, rel=1e-6)
    assert runs["routed"] == pytest.approx(0.05 / 0.95, rel=1e-6)


def test_routed_adamw_rejects_mismatched_pairs():
    with pytest.raises(InvalidRequestError, match="same shape"):
        RoutedAdamW([(nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4)))])
