"""route2 (issue 28, design a), the seed's reviewed design, in GRPO on a tiny checkpoint: a
LoRA quarantine in its own basis, always in the forward and absorbing gradient, with the
kept part detach-routed on flagged rollouts or tokens; its gradients against hand-computed
ones, per rollout and per token, and whole runs of its label-free, placebo and oracle forms
(the no-cheat test, `test_grpo.py`, covers it too)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.grpo import GRPOConfig, GRPOTrainer, run
from services.trainer.grpo_loss import group_advantages
from services.trainer.routed_backward import RoutedBackward
from tests.integration.test_grpo import _hand_loss, _step_batch
from tests.parity_env import parity_config, parity_env  # noqa: F401 (a fixture)

# The adapters of the hand-computed test; the last has no adapter downstream of it. (The
# rollout engine wants a target in every layer: `AdapterBank.attach` names every layer's.)
TARGETS = ["*.down_proj"]
LAST = "layers.1.mlp.down_proj"


pytestmark = pytest.mark.usefixtures("parity_env")


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _config(path, tmp_path, **kw) -> GRPOConfig:
    base = {"eval_every": 100, "arm": "route2", "quarantine": "lora"}
    return parity_config(path, tmp_path, **{**base, **kw})


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.clone() for p in params]


def test_route2_gradients_against_hand_computed_ones_per_rollout_and_per_token(path, tmp_path):
    """On one step with known flags, at the last adapter (y = xWᵀ + kept(x) + B_q A_q x, no
    adapter downstream): with g_t = ∂L/∂y_t of the unmasked loss, the kept δS's gradient is
    Σ (g_t U) ⊙ (x_t V) over the unflagged tokens — per rollout, also the gradient of the
    loss with the flagged rollouts' advantages zeroed — and the LoRA's is the whole loss's,
    flagged tokens included. Flags that differ within a rollout give another kept gradient
    per token than the same rollouts flagged whole, and the same LoRA gradient."""
    cfg = _config(path, tmp_path, targets=TARGETS, kept_init=0.05, quarantine_init=0.5)
    trainer = GRPOTrainer(cfg)
    training, rewards, batch, old_logp = _step_batch(trainer)
    adv = group_advantages(rewards, cfg.group_size).to(old_logp)
    width, B, T = old_logp.shape[1], *batch.input_ids.shape
    adapters, m = trainer.adapters, trainer.adapters.modules[LAST]
    kept, lora = adapters.kept_parameters(), adapters.quarantine_parameters()
    mine = [m.delta_s, m.lora_a_q, m.lora_b_q]
    rollouts = torch.arange(B) % 3 == 0
    tokens = rollouts[:, None] & (torch.arange(T) % 2 == 0)[None]  # half of each one's tokens
    token_cfg = cfg.model_copy(update={"activation_granularity": "token"})
    routers = {
        "rollout": trainer.router,
        "token": RoutedBackward(
            token_cfg, trainer.model, adapters, trainer.loss_config, trainer.direction, None, None
        ),
    }
    got = {}
    for name, flags in (("rollout", rollouts), ("token", tokens)):
        trainer.optimizer.zero_grad(set_to_none=True)
        routers[name].backward(0, batch, training, old_logp, rewards, adv, None, flags)
        got[name] = _grads(kept + lora), _grads(mine)
    assert routers["token"].token_flag_rate == pytest.approx(
        float(tokens[batch.attention_mask.bool()].float().mean())
    )

    # By hand: ∂L/∂y at the adapter, and its inputs, from the unmasked loss.
    seen = {}

    def hook(module, inputs, output):
        output.retain_grad()
        seen.update(x=inputs[0].detach(), y=output)

    handle = m.register_forward_hook(hook)
    trainer.optimizer.zero_grad(set_to_none=True)
    logp, mask = trainer._completion_logp(batch, width)
    _hand_loss(logp, old_logp, adv, mask).backward()
    handle.remove()
    x, g_y = seen["x"].reshape(B * T, -1), seen["y"].grad.reshape(B * T, -1)
    per_token = (g_y @ m.u) * (x @ m.v_t.T)  # [N, r]
    a_q, b_q = m.lora_a_q.detach(), m.lora_b_q.detach()
    want_lora = [(g_y @ b_q).T @ x, g_y.T @ (x @ a_q.T)]  # A_q, B_q over every token
    flagged_tokens = {"rollout": rollouts[:, None].expand(B, T), "token": tokens}
    for name, flags in flagged_tokens.items():
        got_kept, *got_lora = got[name][1]
        want = per_token[~flags.reshape(-1)].sum(0)
        torch.testing.assert_close(got_kept, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        for g, w in zip(got_lora, want_lora, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
    assert not torch.allclose(got["rollout"][1][0], got["token"][1][0], atol=1e-5)
    assert got["rollout"][1][0].abs().max() > 1e-4
    # The LoRA's share from the flagged tokens alone is not nothing: it absorbs them.
    flags = flagged_tokens["rollout"].reshape(-1)
    assert (g_y[flags].T @ (x[flags] @ a_q.T)).abs().max() > 1e-4

    # Per rollout, independently: the loss with the flagged rollouts' advantages zeroed.
    logp, mask = trainer._completion_logp(batch, width)
    unflagged_loss = _hand_loss(logp, old_logp, torch.where(rollouts, 0, adv), mask)
    want_kept = torch.autograd.grad(unflagged_loss, kept)
    for g, w in zip(got["rollout"][0], want_kept, strict=False):  # the kept ones come first
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
    assert all(g.abs().max() > 0 for g in got["rollout"][0])  # every part learns something
    trainer.close()


def test_a_step_records_the_lora_quarantines_size(path, tmp_path):
    """After a route2 step (B_q starts at zero, then absorbs every rollout's gradient) the
    step's quarantine norm is ‖B_q A_q‖ from the adapter's tensors, squares summed over
    modules, and its sum norm ‖U diag(δS) Vᵀ + B_q A_q‖: not the 0 an SVD-only norm gave."""
    trainer = GRPOTrainer(_config(path, tmp_path, tau=1e9))  # nothing flagged: both learn
    metrics, _, _ = trainer.step()
    quarantine = total = 0.0
    for m in trainer.adapters.modules.values():
        lora = m.lora_b_q.detach().double() @ m.lora_a_q.detach().double()  # [out, in]
        kept = m.u.double() @ torch.diag(m.delta_s.detach().double()) @ m.v_t.double()
        quarantine += float(lora.square().sum())
        total += float((kept + lora).square().sum())
    assert metrics.quarantine_norm > 0 and metrics.kept_norm > 0
    assert metrics.quarantine_norm == pytest.approx(quarantine**0.5, rel=1e-4)
    assert metrics.sum_norm == pytest.approx(total**0.5, rel=1e-4)
    trainer.close()


def _lora_moved(out_dir) -> bool:
    state = torch.load(out_dir / "checkpoint.pt", weights_only=False)["adapters"]
    return any(k.endswith("lora_b_q") and v.abs().max() > 0 for k, v in state.items())


@pytest.mark.parametrize(
    "kw,kept_moves,token_rate",
    [
        ({"tau": -1e9}, False, None),  # every rollout flagged: only the quarantine learns
        ({"tau": 1e9}, True, None),  # none flagged: both learn, the quarantine absorbing
        ({"activation_granularity": "token", "random_flags": 1.0}, False, 1.0),
        ({"activation_granularity": "token", "random_flags": 0.0}, True, 0.0),
    ],
    ids=["all-flagged", "none-flagged", "token-placebo-all", "token-placebo-none"],
)
def test_route2_runs_keep_the_quarantine_learning_whatever_is_flagged(
    path, tmp_path, kw, kept_moves, token_rate
):
    """Whole route2 runs: the LoRA quarantine learns on every step, flagged or not; the
    kept δS only where something is unflagged. Per token, the flags are each token's and
    the record keeps the share flagged, the rate a per-token placebo matches."""
    train = [r for r in run(_config(path, tmp_path, steps=2, **kw)) if r["kind"] == "train"]
    assert (train[-1]["kept_norm"] > 0) == kept_moves
    assert _lora_moved(tmp_path)
    assert [r["token_flag_rate"] for r in train] == [token_rate] * 2


def test_route2_oracle_flags_exactly_the_labelled_hacks(path, tmp_path):
    """route2's upper bound: flagged rollouts are the ones the (eval-only) labels call
    hacks, per rollout."""
    cfg = _config(path, tmp_path, steps=3, oracle_flags=True)
    train = [r for r in run(cfg) if r["kind"] == "train"]
    assert [r["flagged"] for r in train] == pytest.approx([r["rollout_hack_rate"] for r in train])
    assert any(0 < r["flagged"] < 1 for r in train)


def test_the_rollout_engine_reserves_the_lora_quarantines_rank(path, tmp_path, caplog):
    """The rollout engine is built with the quarantine's LoRA rank reserved, so syncing the
    policy (kept part and LoRA) lays out nothing again and re-captures no graph."""
    cfg = _config(path, tmp_path)
    trainer = GRPOTrainer(cfg)
    bank = trainer.rollout.engine.adapters
    assert cfg.quarantine_rank > 0 and bank.lora_rank == cfg.quarantine_rank
    layout = bank.layout_version
    with caplog.at_level("WARNING", logger="services.engine.adapters"):
        trainer.sync_weights()
    assert bank.layout_version == layout and "re-laying" not in caplog.text
    assert bank.loaded["policy"].lora_rank == cfg.quarantine_rank  # the LoRA did arrive
    trainer.close()
