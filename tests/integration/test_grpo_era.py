"""expand-route-ablate (issue 28, design d) in GRPO on a tiny checkpoint: route2's routing
into a LoRA quarantine widened beyond the kept rank, then K label-free coherence steps on the
kept part alone after the ablation (`coherence.py`). Its training step is route2's
(`test_grpo_route2.py`); here the extra rank, what the coherence steps move and read, and
K = 0 being no phase at all (the no-cheat test, `test_grpo.py`, covers the arm too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.trainer.coherence import CoherencePhase
from services.trainer.envs import EvalLabelAccessError
from services.trainer.grpo import GRPOConfig, GRPOTrainer, run
from services.trainer.rollouts import TrainingRollout
from tests.integration.test_grpo import _reaches_labels
from tests.parity_env import parity_config, parity_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("parity_env")


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _config(path, tmp_path, **kw) -> GRPOConfig:
    base = {
        "eval_every": 100, "arm": "expand-route-ablate", "quarantine": "lora", "rank": 4,
        "quarantine_extra_rank": 3, "quarantine_init": 0.5,
    }  # fmt: skip
    return parity_config(path, tmp_path, **{**base, **kw})


def _params(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_quarantine_has_the_kept_rank_plus_the_extra_rank(path, tmp_path):
    trainer = GRPOTrainer(_config(path, tmp_path))
    for m in trainer.adapters.modules.values():
        assert m.delta_s.shape == (4,)
        assert m.lora_a_q.shape[0] == m.lora_b_q.shape[1] == 4 + 3
    trainer.step()  # the engine serves the wider LoRA too
    trainer.close()


def test_coherence_steps_move_the_kept_part_alone_and_read_no_label(path, tmp_path, monkeypatch):
    """The phase samples from the deployed policy and updates in a training scope: its update
    is given only `TrainingRollout`s, from which no label is reachable, a label read by
    another path inside it raises, and only the kept δS moves (the quarantine is ablated:
    no gradient, and the phase's optimiser holds the kept part alone)."""
    trainer = GRPOTrainer(_config(path, tmp_path, coherence_steps=2, temperature=2.0))
    trainer.step()
    kept, quarantine = trainer.adapters.kept_parameters(), trainer.adapters.quarantine_parameters()
    kept0, quarantine0 = _params(kept), _params(quarantine)
    for p in quarantine:
        p.grad = None  # the GRPO step's
    phase = CoherencePhase(trainer)
    given, records = [], []
    real_update = phase.update

    def spying_update(rolled):
        given.append(rolled)
        return real_update(rolled)

    monkeypatch.setattr(phase, "update", spying_update)
    phase.run(records.append)
    assert [r["kind"] for r in records] == ["coherence", "coherence", "eval"]
    assert records[-1]["coherence_steps"] == 2 and "deploy_true_pass" in records[-1]
    assert any(r["loss"] is not None for r in records[:2])  # some samples were rewarded
    assert all(type(r) is TrainingRollout for rolled in given for r in rolled)
    assert {f.name for f in dataclasses.fields(TrainingRollout)} == {
        "prompt_token_ids", "token_ids", "logprobs", "reward", "policy_version", "readouts"
    }  # fmt: skip
    assert not _reaches_labels(given)
    assert not _same(_params(kept), kept0)
    assert _same(_params(quarantine), quarantine0)
    assert all(p.grad is None for p in quarantine)

    def cheating_update(rolled):
        cheat = trainer.rollouts(["12+34="])[0].grade.eval_only.hacked  # by another path
        assert cheat is not None
        return real_update(rolled)

    monkeypatch.setattr(phase, "update", cheating_update)
    with pytest.raises(EvalLabelAccessError, match="hacked"):
        phase.run(records.append)
    trainer.close()


def test_zero_coherence_steps_is_no_phase_and_k_steps_only_append_one(path, tmp_path):
    """K = 0 logs what a run without the phase logs; K = 2 the same training and evaluations,
    then its K coherence records and one more evaluation (the run's last, the one a study
    reads), once: a resumed run that finished the phase does not repeat it."""
    strip = ("seconds",)

    def logged(records):
        return [{k: v for k, v in r.items() if k not in strip} for r in records]

    none = run(_config(path, tmp_path / "k0", steps=2))
    some = run(_config(path, tmp_path / "k2", steps=2, coherence_steps=2))
    assert "coherence" not in {r["kind"] for r in none}
    assert logged(some[: len(none)]) == logged(none)
    tail = some[len(none) :]
    assert [r["kind"] for r in tail] == ["coherence", "coherence", "eval"]
    assert tail[-1]["coherence_steps"] == 2 and tail[-1]["step"] == 2
    assert run(_config(path, tmp_path / "k2", steps=2, coherence_steps=2)) == []


def test_a_quarantine_wider_than_a_module_is_capped_at_its_full_rank(path, tmp_path, caplog):
    """The study's expand-route-ablate on a small model asks for more LoRA rank than a
    module's smaller side (here 48 + 48 on 64-wide weights): each LoRA is capped at
    min(out, in), which already expresses any update, the cap is logged, and the rollout
    engine serves it (it refused a wider one, ending the run at its first sync)."""
    cfg = _config(path, tmp_path, rank=48, quarantine_extra_rank=48)
    with caplog.at_level("WARNING", logger="services.trainer.adapters"):
        trainer = GRPOTrainer(cfg)
    assert "LoRA quarantine rank 96 exceeds min(out, in)" in caplog.text
    for m in trainer.adapters.modules.values():
        full = min(m.base.weight.shape)
        assert m.lora_a_q.shape[0] == m.lora_b_q.shape[1] == min(96, full) == 64
    trainer.step()
    lora = trainer.rollout.engine.adapters.loaded["policy"].lora_rank
    assert lora == 64
    trainer.close()
