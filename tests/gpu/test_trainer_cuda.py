"""The GRPO trainer on CUDA: the gate identity in float64 on the GPU, and a routed GRPO run
whose engine rollouts carry exactly the trainer's logprobs after weight sync (float32)."""

from __future__ import annotations

import pytest
import torch

from services.engine.model.tiny import make_tiny_checkpoint
from services.trainer.adapters import AdapterConfig, attach_adapters
from services.trainer.envs import ENVS
from services.trainer.grpo import GRPOConfig, GRPOTrainer
from services.trainer.model import TrainableModel, pad_batch
from services.trainer.routing import per_sequence_gradients
from tests.parity_env import ParityEnv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROLLOUTS = [([5, 6, 7], [8, 9, 10]), ([5, 6, 7], [30, 31]), ([11, 12, 13, 14], [15, 16])]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", layers=2, hidden=64)


def test_gate_identity_on_cuda_float64(ckpt):
    model = TrainableModel.from_pretrained(ckpt, device="cuda", dtype=torch.float64)
    adapters = attach_adapters(model.model, AdapterConfig(rank=4, kept_init=0.3))
    batch = pad_batch(ROLLOUTS).to(model.device)
    together = per_sequence_gradients(model, adapters, batch)
    for b, row in enumerate(ROLLOUTS):
        alone = per_sequence_gradients(model, adapters, pad_batch([row]).to(model.device))
        for name, g in together.items():
            torch.testing.assert_close(g[b], alone[name][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arm", ["route", "activation"])
def test_routed_run_on_cuda_rolls_out_under_the_synced_weights(ckpt, tmp_path, arm, monkeypatch):
    monkeypatch.setitem(ENVS, ParityEnv.name, ParityEnv)  # rewards vary from the first step
    trainer = GRPOTrainer(
        GRPOConfig(
            model=str(ckpt),
            env=ParityEnv.name,
            arm=arm,
            steps=2,
            prompts_per_step=4,
            group_size=4,
            eval_prompts=4,
            hack_pairs=8,
            lr=0.2,
            optimizer="routed_adamw",
            device="cuda",
            out_dir=str(tmp_path),
        )
    )
    before = {n: m.delta_s.detach().clone() for n, m in trainer.adapters.modules.items()}
    trainer.step()
    trainer.step()
    assert any(
        not torch.equal(before[n], m.delta_s.detach()) for n, m in trainer.adapters.modules.items()
    )
    trainer.sync_weights()
    rolled = trainer.rollouts(["12+34=", "5+6="])
    batch, old_logp = trainer._batch(rolled)
    with torch.no_grad():
        logp, mask = trainer._completion_logp(batch, old_logp.shape[1])
    torch.testing.assert_close(logp[mask], old_logp[mask], atol=1e-4, rtol=0)
