"""SVD-basis kept/quarantine adapters: exact base at zero, the factored add, deploy, sync."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.trainer.adapters import (
    AdapterConfig,
    SVDBasisCache,
    attach_adapters,
    target_names,
    weight_hash,
)
from services.trainer.model import TrainableModel, pad_batch

SEQS = [([5, 6, 7], [8, 9]), ([11, 12, 13, 14, 15, 16], [17]), ([3], [4, 5, 6, 7, 8, 9, 10])]
TARGETS = ("*.o_proj", "*.down_proj", "layers.1.mlp.gate_up_proj")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def batch():
    return pad_batch(SEQS, side="left")


def _logits(model, batch):
    with torch.no_grad():
        return model(batch.input_ids, batch.attention_mask).logits


def _adapted(ckpt, dtype=torch.float32, **kw):
    model = TrainableModel.from_pretrained(ckpt, dtype=dtype)
    kw.setdefault("targets", TARGETS)
    kw.setdefault("rank", 4)
    return model, attach_adapters(model.model, AdapterConfig(**kw))


def _randomise(adapters, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    state = {
        k: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype) * scale
        for k, v in adapters.adapter_state().items()
    }
    adapters.load_adapter_state(state)
    return state


@pytest.mark.parametrize("quarantine", ["svd", "lora"])
def test_zero_adapters_are_bit_identical_to_the_base(ckpt, batch, quarantine):
    base = _logits(TrainableModel.from_pretrained(ckpt), batch)
    model, adapters = _adapted(ckpt, quarantine=quarantine)
    assert sorted(adapters.modules) == [
        "layers.0.mlp.down_proj",
        "layers.0.self_attn.o_proj",
        "layers.1.mlp.down_proj",
        "layers.1.mlp.gate_up_proj",
        "layers.1.self_attn.o_proj",
    ]
    assert torch.equal(_logits(model, batch), base)
    with adapters.deploy():
        assert torch.equal(_logits(model, batch), base)
    with adapters.gates(3, "scale"):
        assert torch.equal(_logits(model, batch), base)


def test_factored_add_equals_the_dense_low_rank_update(ckpt, batch):
    model, adapters = _adapted(ckpt, dtype=torch.float64)
    _randomise(adapters)
    got = _logits(model, batch)
    # The same update written into dense weights of an unadapted copy.
    dense = TrainableModel.from_pretrained(ckpt, dtype=torch.float64)
    mods = dict(dense.model.named_modules())
    for name, m in adapters.modules.items():
        delta = m.u @ torch.diag(m.delta_s + m.delta_s_q) @ m.v_t
        mods[name].weight.data += delta.detach()
    torch.testing.assert_close(got, _logits(dense, batch), rtol=0, atol=1e-10)


def test_basis_is_the_top_singular_directions_and_is_cached_by_weight_hash(tmp_path):
    w = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    cache = SVDBasisCache(tmp_path)
    basis = cache.get(w, 16)
    torch.testing.assert_close(basis.u @ torch.diag(basis.s) @ basis.v.T, w.double())
    torch.testing.assert_close(basis.v.T @ basis.v, torch.eye(16, dtype=torch.float64))
    top = cache.get(w, 3)
    assert torch.equal(top.s, basis.s[:3]) and (top.s[:-1] >= top.s[1:]).all()
    # A second process (fresh cache object) reads the same basis back from disk.
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"{weight_hash(w)}-r{r}.safetensors" for r in (16, 3))
    again = SVDBasisCache(tmp_path).get(w, 3)
    assert torch.equal(again.u, top.u) and torch.equal(again.v, top.v)
    assert weight_hash(w + 1e-6) != weight_hash(w)
    with pytest.raises(InvalidRequestError, match="exceeds"):
        cache.get(w, 17)


@pytest.mark.parametrize("quarantine", ["svd", "lora"])
def test_deploy_ablates_exactly_the_quarantine(ckpt, batch, quarantine):
    model, adapters = _adapted(ckpt, quarantine=quarantine)
    state = _randomise(adapters)
    trained = _logits(model, batch)
    with adapters.deploy():
        deployed = _logits(model, batch)
    assert (trained - deployed).abs().max() > 1e-3  # the quarantine did something
    # Deployed == the adapter with the quarantine really removed.
    kept_only = {
        k: (v if k.endswith(".delta_s") else torch.zeros_like(v)) for k, v in state.items()
    }
    adapters.load_adapter_state(kept_only)
    assert torch.equal(_logits(model, batch), deployed)
    assert torch.equal(_logits(model, batch), trained) is False
    with adapters.disabled():
        assert torch.equal(
            _logits(model, batch), _logits(TrainableModel.from_pretrained(ckpt), batch)
        )


def test_asymmetric_start(ckpt, batch):
    base = _logits(TrainableModel.from_pretrained(ckpt), batch)
    model, adapters = _adapted(ckpt, quarantine_init=0.05)
    assert all(
        (m.delta_s == 0).all() and (m.delta_s_q == 0.05).all() for m in adapters.modules.values()
    )
    assert (_logits(model, batch) - base).abs().max() > 0
    with adapters.deploy():
        assert torch.equal(_logits(model, batch), base)
    _, lora = _adapted(ckpt, quarantine="lora")
    assert all((m.lora_b_q == 0).all() and (m.lora_a_q != 0).any() for m in lora.modules.values())


def test_adapter_state_is_only_the_delta_vectors_and_round_trips(ckpt, batch):
    model, adapters = _adapted(ckpt)
    state = _randomise(adapters)
    assert set(state) == {
        f"{n}.{leaf}" for n in adapters.modules for leaf in ("delta_s", "delta_s_q")
    }
    assert all(v.shape == (4,) for v in state.values())
    assert set(adapters.adapter_state(include_quarantine=False)) == {
        f"{n}.delta_s" for n in adapters.modules
    }
    other, other_adapters = _adapted(ckpt)
    other_adapters.load_adapter_state(adapters.adapter_state())
    assert torch.equal(_logits(other, batch), _logits(model, batch))
    # An engine that loads only the deployed state serves the deployed model.
    engine, engine_adapters = _adapted(ckpt)
    engine_adapters.load_adapter_state(
        adapters.adapter_state(include_quarantine=False), require_quarantine=False
    )
    with adapters.deploy():
        assert torch.equal(_logits(engine, batch), _logits(model, batch))

    key = "layers.0.self_attn.o_proj.delta_s"
    with pytest.raises(InvalidRequestError, match="unknown"):
        adapters.load_adapter_state({**state, "layers.9.mlp.down_proj.delta_s": state[key]})
    with pytest.raises(InvalidRequestError, match="missing"):
        adapters.load_adapter_state({key: state[key]})
    with pytest.raises(InvalidRequestError, match="shape"):
        adapters.load_adapter_state({**state, key: torch.zeros(5)})


def test_trainable_parameters_are_only_the_adapters(ckpt):
    model, adapters = _adapted(ckpt, quarantine="lora", lora_rank=2)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {
        id(p) for p in adapters.kept_parameters() + adapters.quarantine_parameters()
    }
    assert len(adapters.quarantine_parameters()) == 2 * len(adapters.modules)


def test_targets_that_cannot_be_applied_are_errors(ckpt):
    model = TrainableModel.from_pretrained(ckpt)
    assert target_names(model.model, ["*.o_proj"]) == [
        "layers.0.self_attn.o_proj",
        "layers.1.self_attn.o_proj",
    ]
    with pytest.raises(InvalidRequestError, match="matches no module"):
        attach_adapters(model.model, AdapterConfig(targets=("*.q_proj",)))
    with pytest.raises(InvalidRequestError, match="not a Linear"):
        attach_adapters(model.model, AdapterConfig(targets=("*.input_layernorm",)))
    with pytest.raises(InvalidRequestError, match="not a Linear"):
        attach_adapters(model.model, AdapterConfig(targets=("lm_head",)))
    with pytest.raises(InvalidRequestError, match="exceeds"):
        attach_adapters(model.model, AdapterConfig(targets=("*.o_proj",), rank=65))
    attach_adapters(model.model, AdapterConfig(targets=("*.o_proj",), rank=2))
    with pytest.raises(InvalidRequestError, match="already has an adapter"):
        attach_adapters(model.model, AdapterConfig(targets=("*.o_proj",), rank=2))
    with pytest.raises(InvalidRequestError, match="quarantine"):
        AdapterConfig(quarantine="dense")


def _one_adapter_case(adapters):
    """A hand-computed case at one adapter, its values randomised: the module's name and
    itself, B = 2 rollouts of T = 3 tokens, inputs `x [N, in]`, a loss `(y * w).sum()`'s
    weights `w [N, out]` and the adapter-space activations `z = x V [N, r]`."""
    _randomise(adapters, seed=3)
    name = "layers.1.mlp.down_proj"
    m = adapters.modules[name]
    B, T = 2, 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B * T, m.base.weight.shape[1], generator=g)
    w = torch.randn(B * T, m.base.weight.shape[0], generator=g)
    return name, m, B, T, x, w, x @ m.v_t.detach().T


@pytest.mark.parametrize("mode", ["route", "erase"])
def test_per_token_arm_b_against_a_hand_computed_case(ckpt, mode):
    """`mask_tokens`, the spec's form `where(cos(a, v) > τ, kept.detach(), kept)`: with
    g_t = Uᵀ ∂L/∂y_t and z_t = x_t V, δS's gradient is Σ of z_t ⊙ g_t over the tokens
    not flagged, δS_q's over the flagged ones (route) or nothing (erase); values unchanged."""
    _, adapters = _adapted(ckpt, rank=4)
    name, m, B, T, x, w, z = _one_adapter_case(adapters)
    v = z[1] - z[4]  # token 1 leans along it, token 4 against it
    flags = torch.nn.functional.cosine_similarity(z, v[None], dim=-1) > 0
    assert flags[1] and not flags[4] and 0 < int(flags.sum()) < B * T  # a mixed case
    directions = {n: torch.ones(a.rank) for n, a in adapters.modules.items()} | {name: v}
    plain = m(x)
    with adapters.mask_tokens(directions, B, tau=0.0, mode=mode) as seen:
        y = m(x)
    torch.testing.assert_close(y, plain, rtol=0, atol=0)  # values: the same forward
    assert torch.equal(seen[name], flags.view(B, T))
    (y * w).sum().backward()
    g_t = w @ m.u.detach()  # [N, r]
    per_token = z * g_t
    torch.testing.assert_close(m.delta_s.grad, per_token[~flags].sum(0), rtol=1e-4, atol=1e-4)
    if mode == "route":
        torch.testing.assert_close(m.delta_s_q.grad, per_token[flags].sum(0), rtol=1e-4, atol=1e-4)
    else:
        assert m.delta_s_q.grad is None
    with (
        pytest.raises(InvalidRequestError, match="no per-token direction"),
        adapters.mask_tokens({name: v}, B),
    ):
        pass


def test_a_lora_quarantine_lies_outside_the_kept_basis(ckpt):
    """route2's quarantine is a LoRA in a basis of its own: its update `B_q A_q` is almost
    all outside what the kept part can express, `U diag(δ) Vᵀ` (its best fit there leaves
    most of its norm), and its row and column spaces are not inside `V`'s and `U`'s. The
    same-basis δS_q, by contrast, is wholly inside the kept basis."""

    def outside(delta: torch.Tensor, m) -> float:
        """The share of ‖ΔW‖ the kept family's best fit leaves: its diagonal in (U, V)."""
        u, v = m.u.double(), m.v_t.double().T
        fit = u @ torch.diag(torch.diagonal(u.T @ delta @ v)) @ v.T
        return float((delta - fit).norm() / delta.norm())

    def off_span(a: torch.Tensor, basis: torch.Tensor) -> float:
        """The share of ‖a‖ (columns) outside span(basis) (orthonormal columns)."""
        return float((a - basis @ (basis.T @ a)).norm() / a.norm())

    _, lora = _adapted(ckpt, quarantine="lora", lora_rank=4)
    _randomise(lora, seed=7)  # B_q starts at zero: give it a value
    for m in lora.modules.values():
        a, b = m.lora_a_q.detach().double(), m.lora_b_q.detach().double()
        assert outside(b @ a, m) > 0.8
        assert off_span(a.T, m.v_t.double().T) > 0.8  # input side: A_q's rows vs V
        assert off_span(b, m.u.double()) > 0.8  # output side: B_q's columns vs U
    _, same = _adapted(ckpt, quarantine="svd")
    _randomise(same, seed=7)
    for m in same.modules.values():
        delta = m.u.double() @ torch.diag(m.delta_s_q.detach().double()) @ m.v_t.double()
        assert outside(delta, m) < 1e-4  # float32 bases: orthonormal to ~1e-6


def _dense_updates(m) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's kept and quarantine weight updates as dense `[out, in]` float64."""
    u, v_t = m.u.double(), m.v_t.double()
    kept = u @ torch.diag(m.delta_s.detach().double()) @ v_t
    if m.delta_s_q is not None:
        return kept, u @ torch.diag(m.delta_s_q.detach().double()) @ v_t
    return kept, m.lora_b_q.detach().double() @ m.lora_a_q.detach().double()


@pytest.mark.parametrize("quarantine", ["svd", "lora"])
def test_norms_are_the_dense_updates_frobenius_norms(ckpt, quarantine):
    """`AdapterSet.norms` gives ‖kept‖, ‖quarantine‖ and ‖kept + quarantine‖ of the weight
    updates, squares summed over modules, as the dense matrices would: a LoRA quarantine
    is sized too (‖B_q A_q‖), and zero while B_q is."""
    _, adapters = _adapted(ckpt, quarantine=quarantine, kept_init=0.1)
    assert adapters.norms().quarantine == 0
    _randomise(adapters, seed=3)
    dense = [_dense_updates(m) for m in adapters.modules.values()]

    def norm(mats) -> float:
        return float(sum(d.square().sum() for d in mats)) ** 0.5

    got = adapters.norms()
    assert got.kept == pytest.approx(norm(k for k, _ in dense), rel=1e-4)
    assert got.quarantine == pytest.approx(norm(q for _, q in dense), rel=1e-4)
    assert got.total == pytest.approx(norm(k + q for k, q in dense), rel=1e-4)
    assert got.quarantine > 0 and got.total not in (got.kept, got.quarantine)


@pytest.mark.parametrize("flags_of", ["rollouts", "tokens", "token directions"])
def test_route2_absorbs_every_token_in_the_lora_and_detaches_the_flagged_kept_part(ckpt, flags_of):
    """route2 at one adapter, against a hand-computed case: with g_t = ∂L/∂y_t, z_t = x_t V
    and a_t = x_t A_qᵀ, δS's gradient is Σ z_t ⊙ (g_t U) over the tokens not flagged, while
    the LoRA, always in the forward, takes Σ g_tᵀ a_t (B_q) and Σ (g_t B_q)ᵀ x_t (A_q) over
    every token, flagged or not; values unchanged. Flags per rollout (`[B]`), per token
    given in advance (`[B, T]`), or per token by a direction's cosine."""
    _, adapters = _adapted(ckpt, rank=4, quarantine="lora", kept_init=0.1)
    name, m, B, T, x, w, z = _one_adapter_case(adapters)
    v = z[1] - z[4]
    if flags_of == "rollouts":
        given = torch.tensor([True, False])
        flags = given[:, None].expand(B, T).reshape(-1)
        mask = adapters.mask_rollouts(given, mode="absorb", stop="activation")
    elif flags_of == "tokens":
        flags = torch.tensor([True, False, False, False, True, True])
        mask = adapters.mask_rollouts(flags.view(B, T), mode="absorb", stop="activation")
    else:
        flags = torch.nn.functional.cosine_similarity(z, v[None], dim=-1) > 0
        directions = {n: torch.ones(a.rank) for n, a in adapters.modules.items()} | {name: v}
        mask = adapters.mask_tokens(directions, B, tau=0.0, mode="absorb")
    assert 0 < int(flags.sum()) < B * T  # a mixed case
    plain = m(x)
    with mask:
        y = m(x)
    torch.testing.assert_close(y, plain, rtol=0, atol=0)
    (y * w).sum().backward()
    per_token = z * (w @ m.u.detach())  # [N, r]
    torch.testing.assert_close(m.delta_s.grad, per_token[~flags].sum(0), rtol=1e-4, atol=1e-4)
    a_q, b_q = m.lora_a_q.detach(), m.lora_b_q.detach()
    torch.testing.assert_close(m.lora_b_q.grad, w.T @ (x @ a_q.T), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m.lora_a_q.grad, (w @ b_q).T @ x, rtol=1e-4, atol=1e-4)
    flagged_part = w[flags].T @ (x[flags] @ a_q.T)  # the LoRA learns from flagged tokens too
    assert flagged_part.abs().max() > 1e-3
