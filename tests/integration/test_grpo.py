"""The GRPO loop end to end on a tiny checkpoint: rollouts from the engine, weight sync of
δ vectors, the routing arms' effect on the kept and quarantine parameters, the no-cheat
guard, checkpoints and the metrics log."""

from __future__ import annotations

import dataclasses
import gc
import random
import types

import pydantic
import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine import SamplingParams
from services.trainer.envs import EvalLabelAccessError, EvalLabels, Grade
from services.trainer.grpo import GRPOConfig, GRPOTrainer, auroc, read_log, run
from services.trainer.grpo_loss import group_advantages, subset_advantages
from services.trainer.pretrain import CHAR_VOCAB
from services.trainer.probe import HackProbe
from services.trainer.rollouts import TrainingRollout
from tests.parity_env import parity_config, parity_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("parity_env")


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _config(path, tmp_path, **kw) -> GRPOConfig:
    return parity_config(path, tmp_path, **kw)


def _deltas(trainer: GRPOTrainer) -> tuple[torch.Tensor, torch.Tensor]:
    mods = trainer.adapters.modules.values()
    kept = torch.cat([m.delta_s.detach().clone() for m in mods])
    quarantine = torch.cat([m.delta_s_q.detach().clone() for m in mods])
    return kept, quarantine


@pytest.mark.parametrize(
    "arm,tau,kept_moves,quarantine_moves",
    [
        ("none", 0.0, True, False),  # vanilla: everything into δS
        ("route", -2.0, False, True),  # every rollout flagged (cos > -2): all into δS_q
        ("erase", -2.0, False, False),  # every rollout flagged and erased: nothing learns
        ("activation", -1e9, False, True),  # Arm B, every rollout flagged
        ("route", 2.0, True, False),  # nothing flagged (cos <= 1): as vanilla
        ("kept-ablated", -2.0, False, True),  # every rollout flagged: the kept part has none
        ("kept-ablated", 2.0, True, False),  # none flagged: the quarantine gets exactly 0
    ],
)
def test_routing_arms_move_the_kept_or_the_quarantine(
    path, tmp_path, arm, tau, kept_moves, quarantine_moves
):
    trainer = GRPOTrainer(_config(path, tmp_path, arm=arm, tau=tau))
    kept0, q0 = _deltas(trainer)
    metrics, grades, _ = trainer.step()
    rewards = [g.training_view().reward for g in grades]
    assert 0 < sum(rewards) < len(rewards), "the test needs reward variance"
    kept1, q1 = _deltas(trainer)
    assert (not torch.equal(kept0, kept1)) == kept_moves
    assert (not torch.equal(q0, q1)) == quarantine_moves
    if arm != "none":
        assert metrics.flagged == (1.0 if tau < 0 else 0.0)
    if quarantine_moves and arm == "route":
        assert metrics.leakage == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"arm": "activation", "tau": -1e9, "quarantine": "lora"},  # LoRA quarantine learns
        {"arm": "route", "tau": -2.0, "optimizer": "routed_adamw"},
    ],
    ids=["vanilla", "lora-quarantine", "routed-adamw"],
)
def test_rollouts_use_the_synced_weights(path, tmp_path, kw):
    """After a step, the engine's logprobs of a rollout under the policy equal the trainer's
    (with a LoRA quarantine the engine serves B_q·A_q on the trained variant's rows)."""
    trainer = GRPOTrainer(_config(path, tmp_path, **kw))
    trainer.step()
    if kw.get("quarantine") == "lora":
        assert any(m.lora_b_q.abs().max() > 0 for m in trainer.adapters.modules.values())
    version = trainer.sync_weights()
    assert version == trainer.engine.adapters.loaded["policy"].version > 1
    rolled = trainer.rollouts(["12+34="])
    assert len(rolled) == trainer.cfg.group_size
    batch, old_logp = trainer._batch([r.for_training() for r in rolled])
    with torch.no_grad():
        logp, mask = trainer._completion_logp(batch, old_logp.shape[1])
    torch.testing.assert_close(logp[mask], old_logp[mask], atol=1e-4, rtol=0)


def test_a_lora_quarantine_cannot_take_svd_basis_routing(path, tmp_path):
    for arm in ("route", "placebo"):
        with pytest.raises(pydantic.ValidationError, match="needs quarantine 'svd'"):
            _config(path, tmp_path, arm=arm, quarantine="lora")
    with pytest.raises(pydantic.ValidationError, match="routed_adamw"):
        _config(path, tmp_path, optimizer="routed_adamw", quarantine="lora")


def _reaches_labels(*roots) -> bool:
    """Whether an oracle label (`EvalLabels`, or a `Grade` holding one) is reachable from
    `roots` through the objects they refer to (classes, modules and functions are not
    followed: they lead to the whole program)."""
    seen, todo = set(), list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        if isinstance(obj, EvalLabels | Grade):
            return True
        todo += gc.get_referents(obj)
    return False


QUANTILE = {"gate_calibration": "quantile", "gate_quantile": 0.25}
MIDPOINT = {"gate_calibration": "midpoint"}
ROUTE2 = {"arm": "route2", "quarantine": "lora"}
ROUTE2_TOKEN = {**ROUTE2, "activation_granularity": "token"}
LABEL_FREE = {
    "vanilla": {},
    "erase": {"arm": "erase"},
    "route": {"arm": "route"},
    "route~placebo": {"arm": "route", "random_flags": 0.3},
    "placebo": {"arm": "placebo"},
    "activation": {"arm": "activation"},
    "token": {"arm": "activation", "activation_granularity": "token"},
    "kept-ablated": {"arm": "kept-ablated"},
    "kept-ablated~placebo": {"arm": "kept-ablated", "random_flags": 0.3, "route_split": "recentre"},
    "route-dropout": {"arm": "route-dropout", "quarantine_dropout": 0.5},
    "dropout~placebo": {"arm": "route-dropout", "quarantine_dropout": 0.5, "random_flags": 0.3},
    # route2: the LoRA quarantine in its own basis, per rollout and per token
    "route2": ROUTE2,
    "route2~placebo": {**ROUTE2, "random_flags": 0.3},
    "route2-token": ROUTE2_TOKEN,
    "route2-token~placebo": {**ROUTE2_TOKEN, "random_flags": 0.3},
    # calibrated gates: τ from the step's own scores, or from the hack pairs
    "route-quantile": {"arm": "route", **QUANTILE},
    "route-midpoint": {"arm": "route", "route_split": "recentre", **MIDPOINT},
    "activation-quantile": {"arm": "activation", **QUANTILE},
    "activation-midpoint": {"arm": "activation", **MIDPOINT},
    "kept-ablated-midpoint": {"arm": "kept-ablated", **MIDPOINT},
    "dropout-quantile": {"arm": "route-dropout", "quarantine_dropout": 0.5, **QUANTILE},
    "route2-midpoint": {**ROUTE2, **MIDPOINT},
    # expand-route-ablate: route2 with a wider quarantine, then label-free coherence steps
    # (the run at the end takes them; test_grpo_era.py spies on their update)
    "expand-route-ablate": {
        "arm": "expand-route-ablate",
        "quarantine": "lora",
        "quarantine_extra_rank": 2,
        "coherence_steps": 1,
    },
}


@pytest.mark.parametrize("kw", list(LABEL_FREE.values()), ids=list(LABEL_FREE))
def test_training_cannot_reach_the_oracle_labels(path, tmp_path, monkeypatch, kw):
    """By construction: the update is given rollouts of a type with no label field, and no
    label is reachable from anything it is given, in every label-free arm (its own flags,
    calibrated or not, or a rate-matched placebo's). The training scope still catches a read
    through any other path; the flag quality logged beside a step reads the labels after
    it, outside that scope."""
    trainer = GRPOTrainer(_config(path, tmp_path, **kw))
    trainer.sync_weights()
    assert _reaches_labels(trainer.rollouts(["12+34="]))  # the walk does find them
    given = []
    real_update = trainer._update

    def spying_update(rolled, rewards, oracle=None):
        given.append((rolled, rewards, oracle))
        return real_update(rolled, rewards, oracle)

    monkeypatch.setattr(trainer, "_update", spying_update)
    trainer.step()  # reading a label in the training scope would raise here
    rolled, rewards, oracle = given[0]
    assert oracle is None  # only the marked upper bound (`oracle_flags`) is given labels
    assert rolled and all(type(r) is TrainingRollout for r in rolled)
    assert {f.name for f in dataclasses.fields(TrainingRollout)} == {
        "prompt_token_ids", "token_ids", "logprobs", "reward", "policy_version", "readouts"
    }  # fmt: skip
    assert not _reaches_labels(rolled, rewards)

    def cheating_update(rolled, rewards, oracle=None):
        cheat = trainer.rollouts(["12+34="])[0].grade.eval_only.hacked  # by another path
        assert cheat is not None
        return real_update(rolled, rewards, oracle)

    monkeypatch.setattr(trainer, "_update", cheating_update)
    with pytest.raises(EvalLabelAccessError, match="hacked"):
        trainer.step()
    monkeypatch.setattr(trainer, "_update", real_update)
    trainer.close()
    records = run(trainer.cfg.model_copy(update={"out_dir": str(tmp_path / "run")}))
    assert ("flag_recall" in records[1]) == (trainer.cfg.arm != "none")


def test_run_logs_evaluates_checkpoints_and_resumes(path, tmp_path):
    cfg = _config(path, tmp_path, steps=2, eval_every=1, arm="route", tau=0.0)
    records = run(cfg)
    kinds = [r["kind"] for r in records]
    assert kinds == ["eval", "train", "eval", "train", "eval"]
    assert {"trained_true_pass", "deploy_true_pass", "trained_hack_rate"} <= set(records[0])
    assert read_log(tmp_path / "metrics.jsonl") == records
    assert (tmp_path / "rates.png").stat().st_size > 1000
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["step"] == 2
    more = run(cfg.model_copy(update={"steps": 3}))  # resumes at step 2
    assert [r["step"] for r in more] == [3, 3]
    trainer = GRPOTrainer(cfg.model_copy(update={"steps": 3}))
    trainer.load(tmp_path / "checkpoint.pt")
    assert trainer.step_index == 3


def test_auroc():
    assert auroc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auroc([0.1, 0.9], [True, False]) == 0.0
    assert auroc([0.5, 0.5], [True, False]) == 0.5
    assert auroc([0.5], [True]) is None
    rng = random.Random(0)
    assert 0.0 <= auroc([rng.random() for _ in range(20)], [i % 2 == 0 for i in range(20)]) <= 1


def test_random_flags_make_a_rate_matched_placebo(path, tmp_path):
    """`random_flags` replaces the arm's decision with coin flips at that rate: at 0 the
    quarantine never moves, at 1 every rollout's gradient goes to it, and in between the
    measured flag rate follows the coin."""

    def train(rate: float, name: str, steps: int = 2) -> list[dict]:
        cfg = _config(path, tmp_path / name, steps=steps, arm="route", random_flags=rate)
        return [r for r in run(cfg) if r["kind"] == "train"]

    never = train(0.0, "never")
    assert all(r["flagged"] == 0 and r["quarantine_norm"] == 0 for r in never)
    assert never[-1]["kept_norm"] > 0
    always = train(1.0, "always")
    assert all(r["flagged"] == 1 for r in always)
    assert always[-1]["kept_norm"] == 0 and always[-1]["quarantine_norm"] > 0
    some = train(0.5, "some", steps=3)
    assert 0 < sum(r["flagged"] for r in some) / len(some) < 1
    with pytest.raises(pydantic.ValidationError, match="random_flags"):
        _config(path, tmp_path, random_flags=0.5)  # arm "none" has no decision to replace


@pytest.mark.parametrize(
    "kw",
    [
        {"arm": "route"},
        {"arm": "kept-ablated"},
        {"arm": "route-dropout", "quarantine_dropout": 0.5},
    ],
    ids=["route", "kept-ablated", "route-dropout"],
)
def test_oracle_flags_route_exactly_the_labelled_hacks(path, tmp_path, kw):
    """The upper-bound arm: every rollout the oracle labels a hack is flagged, no other, so
    each step's flagged share is its (eval-only) rollout hack rate; a config that asks for
    it without an arm, or beside random flags, is refused."""
    cfg = _config(path, tmp_path, steps=3, oracle_flags=True, tau=2.0, **kw)
    train = [r for r in run(cfg) if r["kind"] == "train"]
    # (flagged is a float32 mean, the hack rate a Python one)
    assert [r["flagged"] for r in train] == pytest.approx([r["rollout_hack_rate"] for r in train])
    assert any(0 < r["flagged"] < 1 for r in train)  # the labels, not all or nothing
    for bad in ({}, {"arm": "route", "random_flags": 0.5}):
        with pytest.raises(pydantic.ValidationError, match="oracle_flags"):
            _config(path, tmp_path, oracle_flags=True, **bad)


def test_persona_pairs_are_the_base_models_own_answers(path, tmp_path):
    """`hack_pairs_from: persona`: each pair is a plain prompt with what the base model
    answers (greedy) when the same problem asks for the shortcut and for honest work: no
    oracle solution, no label. An env without personas is refused."""
    cfg = _config(path, tmp_path, env="checksum", arm="activation", hack_pairs_from="persona")
    trainer = GRPOTrainer(cfg)
    assert trainer.direction is not None and trainer.direction.kind == "activation"
    pairs = trainer._persona_pairs(random.Random(cfg.seed + 7))
    assert len(pairs) >= 2
    greedy = SamplingParams(max_tokens=trainer.max_new, temperature=0.0)
    for pair in pairs:
        trainer.env.check_prompt(pair.prompt)
        assert pair.prompt[0].isdigit()  # read after the plain prompt, as rollouts are
        outs = trainer.rollout.generate(["lazy:" + pair.prompt, "care:" + pair.prompt], greedy)
        lazy, care = (o.outputs[0].text for o in outs)
        assert (pair.hacking, pair.clean) == (lazy, care) and lazy.strip() != care.strip()
    with pytest.raises(InvalidRequestError, match="no personas"):
        GRPOTrainer(_config(path, tmp_path, arm="activation", hack_pairs_from="persona"))


def test_the_recentred_split_does_not_drift(path, tmp_path):
    """`route_split: recentre` with zero-sum advantages: δS takes the unflagged rollouts'
    own GRPO gradient (advantages re-centred among them), δS_q the rest, each under AdamW's
    own moments. With no flags δS is vanilla's, bit for bit, and δS_q never moves; with a
    third of the rollouts flagged at random, ‖δS‖ and ‖δS_q‖ stay within 2x of vanilla's
    ‖δS‖. Under `routed_adamw` (one second moment, the total's) the same split runs away:
    the total is a small difference of the parts."""

    def last(name: str, optimizer: str = "adamw", **kw) -> dict:
        cfg = _config(path, tmp_path / name, steps=8, optimizer=optimizer, **kw)
        return [r for r in run(cfg) if r["kind"] == "train"][-1]

    vanilla = last("vanilla")
    assert vanilla["kept_norm"] > 0
    none = last("none", arm="route", route_split="recentre", random_flags=0.0)
    assert none["quarantine_norm"] == 0 and none["kept_norm"] == vanilla["kept_norm"]
    third = last("third", arm="route", route_split="recentre", random_flags=0.33)
    assert third["quarantine_norm"] > 0
    assert third["kept_norm"] <= 2 * vanilla["kept_norm"]
    assert third["quarantine_norm"] <= 2 * vanilla["kept_norm"]
    # One second moment shared with the (small) total is what lets the parts run away.
    shared = last("shared", "routed_adamw", arm="route", route_split="recentre", random_flags=0.33)
    assert shared["kept_norm"] > 4 * vanilla["kept_norm"]


def test_one_hack_probe_at_train_and_serve_time(tiny_checkpoint, tmp_path):
    """`probe_layer`: the run's hack pairs give a residual-stream probe (difference of the
    mean residual over hacking and honest answers), registered in the rollout engine,
    written to hack_probe.json (a `PUT /v1/vectors` body), read out while rollouts are
    sampled, and with `activation_space: residual` Arm B flags exactly the rollouts whose
    mean read-out clears the offset; evaluations report the probe's monitor AUROC."""
    path = tiny_checkpoint("llama", vocab=CHAR_VOCAB)  # one token per character, as pretrained
    cfg = _config(
        path, tmp_path, env="checksum", arm="activation", hack_pairs_from="persona",
        probe_layer=1, activation_space="residual", steps=2, eval_every=1,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg)
    probe = trainer.probe
    assert probe is not None and (probe.layer, probe.site) == (1, "post_block")
    assert torch.equal(trainer.engine.vectors.get("hack").vector.flatten(), probe.vector)
    loaded = HackProbe.load(tmp_path / "hack_probe.json")
    assert (loaded.name, loaded.layer, loaded.site) == ("hack", 1, "post_block")
    torch.testing.assert_close(loaded.vector, probe.vector)
    assert loaded.offset == pytest.approx(probe.offset)
    # The same direction from explicit capture positions (another path through capture).
    tok = trainer.tokenizer

    def mean_residual(prompt: str, answer: str) -> torch.Tensor:
        start, n = len(tok.encode(prompt)), len(tok.encode(answer, add_special_tokens=False))
        positions = list(range(start, start + n))
        params = SamplingParams(
            max_tokens=1, capture={"sites": {"post_block": [1]}, "positions": positions}
        )
        (out,) = trainer.rollout.generate([prompt + answer], params)
        return out.captures["1.post_block"].mean(0)

    hack = torch.stack([mean_residual(p.prompt, p.hacking.strip()) for p in trainer.pairs])
    clean = torch.stack([mean_residual(p.prompt, p.clean.strip()) for p in trainer.pairs])
    diff = hack.mean(0) - clean.mean(0)
    torch.testing.assert_close(probe.vector, diff / diff.norm(), rtol=1e-4, atol=1e-4)
    # Arm B by the probe: its scores are the read-outs' mean less the offset.
    trainer.sync_weights()
    rolled = trainer.rollouts(["12+34=", "5+67="])
    assert all(r.readouts and len(r.readouts) == len(r.token_ids) for r in rolled)
    training = [r.for_training() for r in rolled]
    scores = trainer.router._probe_scores(training)
    expected = [sum(x["hack"] for x in r.readouts) / len(r.readouts) - probe.offset for r in rolled]
    torch.testing.assert_close(scores, torch.tensor(expected))
    trainer.close()
    evals = [
        r
        for r in run(cfg.model_copy(update={"out_dir": str(tmp_path / "run"), "steps": 1}))
        if r["kind"] == "eval"
    ]
    assert all("probe_auroc" in r for r in evals)
    with pytest.raises(pydantic.ValidationError, match="probe_layer"):
        _config(path, tmp_path, arm="activation", activation_space="residual")


def test_per_token_arm_b_trains_both_parts_and_is_checked(path, tmp_path):
    """`activation_granularity: token` runs Arm B in the spec's per-token form: with τ = -2
    every token is flagged (cos > -2), so only the quarantine learns; with τ = 2 none is,
    so only the kept δS does. Per-rollout-only settings are refused beside it."""

    def last(name: str, tau: float) -> dict:
        cfg = _config(
            path, tmp_path / name, arm="activation", activation_granularity="token", tau=tau,
            steps=2,
        )  # fmt: skip
        return [r for r in run(cfg) if r["kind"] == "train"][-1]

    every = last("every", -2.0)
    assert every["flagged"] == 1 and every["kept_norm"] == 0 and every["quarantine_norm"] > 0
    none = last("none", 2.0)
    assert none["flagged"] == 0 and none["kept_norm"] > 0 and none["quarantine_norm"] == 0
    for bad in ({"arm": "route"}, {"arm": "activation", "random_flags": 0.5}):
        with pytest.raises(pydantic.ValidationError, match="activation_granularity"):
            _config(path, tmp_path, activation_granularity="token", **bad)


def _hand_loss(logp, old_logp, adv, mask, eps=0.2):
    """GRPO's clipped surrogate by hand (token mean, no KL): −Σ min(ρA, clip(ρ)A) / Σ mask."""
    ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    return (per_token * mask).sum() / mask.sum()


def _step_batch(trainer):
    """One step's rollouts under the synced policy, as the update gets them."""
    trainer.sync_weights()
    rolled = trainer.rollouts(trainer.env.sample_prompts(trainer.cfg.prompts_per_step, trainer.rng))
    training = [r.for_training() for r in rolled]
    rewards = torch.tensor([r.reward for r in training])
    assert 0 < rewards.sum() < len(rewards), "the test needs reward variance"
    batch, old_logp = trainer._batch(training)
    return training, rewards, batch, old_logp


class _QuarantineZeroed:
    """The quarantine's parameters written to zero (δS_q, or the LoRA's B_q) and restored:
    an ablation by hand, not through `AdapterSet.deploy`."""

    def __init__(self, trainer):
        mods = trainer.adapters.modules.values()
        self.params = [m.delta_s_q if m.delta_s_q is not None else m.lora_b_q for m in mods]

    def __enter__(self):
        self.saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.zero_()

    def __exit__(self, *exc):
        with torch.no_grad():
            for p, v in zip(self.params, self.saved, strict=True):
                p.copy_(v)


@pytest.mark.parametrize(
    "quarantine,split", [("svd", "partition"), ("lora", "recentre")], ids=["svd", "lora"]
)
def test_kept_ablated_update_is_the_gradient_with_the_quarantine_zeroed(
    path, tmp_path, quarantine, split
):
    """Design (b): the kept δS's gradient is the gradient of the unflagged rollouts' GRPO
    loss computed with the quarantine's parameters zeroed by hand, and the quarantine's is
    the flagged rollouts' loss with it present; the quarantine is large enough here that
    the kept gradient with it present would be another one."""
    cfg = _config(
        path, tmp_path, arm="kept-ablated", quarantine=quarantine, route_split=split,
        kept_init=0.05, quarantine_init=0.5,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg)
    _, rewards, batch, old_logp = _step_batch(trainer)
    adv = group_advantages(rewards, cfg.group_size).to(old_logp)
    flagged = torch.arange(batch.batch_size) % 3 == 0
    kept_adv = torch.where(flagged, 0, adv)
    if split == "recentre":
        kept_adv = subset_advantages(rewards, cfg.group_size, ~flagged).to(old_logp)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.router._kept_ablated_backward(batch, old_logp, rewards, adv, flagged, None)
    adapters, width = trainer.adapters, old_logp.shape[1]
    kept_params, q_params = adapters.kept_parameters(), adapters.quarantine_parameters()
    got_kept = [p.grad.clone() for p in kept_params]
    got_q = [p.grad.clone() for p in q_params]

    def grads(adv, params):
        logp, mask = trainer._completion_logp(batch, width)
        return torch.autograd.grad(_hand_loss(logp, old_logp, adv, mask), params)

    with _QuarantineZeroed(trainer):
        want_kept = grads(kept_adv, kept_params)
    for got, want in zip(got_kept, want_kept, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert any(g.abs().max() > 1e-4 for g in got_kept)
    present = grads(kept_adv, kept_params)
    assert any(not torch.allclose(p, w, atol=1e-5) for p, w in zip(present, want_kept, strict=True))
    want_q = grads(torch.where(flagged, adv, 0), q_params)
    for got, want in zip(got_q, want_q, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert any(g.abs().max() > 1e-4 for g in got_q)


@pytest.mark.parametrize("split", ["partition", "recentre"])
def test_quarantine_dropout_of_one_trains_the_kept_part_in_the_ablated_forward(
    path, tmp_path, split
):
    """Design (c) at p = 1: every step runs the forward as deployed (its loss is the loss
    with the quarantine zeroed by hand, not the one with it present), and the quarantine,
    though it holds a value and some rollouts are flagged, gets no gradient."""
    cfg = _config(
        path, tmp_path, arm="route-dropout", quarantine_dropout=1.0, route_split=split,
        random_flags=0.3, quarantine_init=0.5, seed=3,  # unflagged rewards differ
    )  # fmt: skip
    trainer = GRPOTrainer(cfg)
    training, rewards, batch, old_logp = _step_batch(trainer)
    adv = group_advantages(rewards, cfg.group_size).to(old_logp)
    with torch.no_grad():
        logp, mask = trainer._completion_logp(batch, old_logp.shape[1])
        present = float(_hand_loss(logp, old_logp, adv, mask))
        with _QuarantineZeroed(trainer):
            logp, mask = trainer._completion_logp(batch, old_logp.shape[1])
            ablated = float(_hand_loss(logp, old_logp, adv, mask))
    assert ablated != pytest.approx(present, abs=1e-4)
    kept0, q0 = _deltas(trainer)
    metrics, _ = trainer._update(training, rewards)
    assert metrics.quarantine_dropped and 0 < metrics.flagged < 1
    assert metrics.loss == pytest.approx(ablated, abs=1e-4)
    kept1, q1 = _deltas(trainer)
    assert torch.equal(q0, q1) and not torch.equal(kept0, kept1)
    assert all(p.grad is None for p in trainer.adapters.quarantine_parameters())


def test_quarantine_dropout_of_zero_is_route(path, tmp_path):
    """Design (c) at p = 0 never drops the quarantine: bit for bit the `route` arm."""

    def trained(name: str, **kw) -> dict:
        cfg = _config(path, tmp_path / name, steps=2, random_flags=0.5, **kw)
        records = [r for r in run(cfg) if r["kind"] == "train"]
        assert not any(r["quarantine_dropped"] for r in records)
        return torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["adapters"]

    route = trained("route", arm="route")
    dropout = trained("dropout", arm="route-dropout", quarantine_dropout=0.0)
    assert route.keys() == dropout.keys()
    assert all(torch.equal(route[k], dropout[k]) for k in route)
    assert any(k.endswith("delta_s_q") and route[k].abs().max() > 0 for k in route)
