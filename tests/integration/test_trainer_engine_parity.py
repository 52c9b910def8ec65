"""The trainer's forward and the engine agree on the same adapter: weight sync moves only the
δ vectors (and a LoRA quarantine's two factors), and the engine's logprobs (trained and deploy
variants, with an SVD or a LoRA quarantine) equal the trainer's, also with trained, deploy and
no-adapter requests in one batch."""

from __future__ import annotations

import pytest
import torch

from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from services.trainer.adapters import AdapterConfig, attach_adapters
from services.trainer.model import TrainableModel, pad_batch
from services.trainer.weight_sync import engine_adapter_state

RANK = 4
PROMPT = [17, 250, 33, 401, 98, 12, 77]
COMPLETION = [305, 150, 61, 9, 44]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


VARIANTS = [{"adapter": "policy"}, {"adapter": "policy", "adapter_variant": "deploy"}, {}]


def _engine_prompt_logprobs(engine: LLMEngine, ids: list[int], kws: list[dict]):
    """Prompt logprobs of `ids` for one request per `kws`, all admitted before the first step
    (so they share every step's batch)."""
    for i, kw in enumerate(kws):
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=1, prompt_logprobs=0, **kw))
    final = {}
    totals = OutputAccumulator()
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            final[out.request_id] = out
    # prompt_logprobs[j] holds the actual token j's logprob (None at position 0)
    return [
        [final[f"p{i}"].prompt_logprobs[j][t] for j, t in enumerate(ids) if j > 0]
        for i in range(len(kws))
    ]


@pytest.mark.parametrize("together", [False, True], ids=["apart", "one-batch"])
@pytest.mark.parametrize("quarantine", ["svd", "lora"])
def test_engine_logprobs_of_a_trained_adapter_match_the_trainer(path, quarantine, together):
    trainer = TrainableModel.from_pretrained(path)
    adapters = attach_adapters(
        trainer.model, AdapterConfig(rank=RANK, quarantine=quarantine, lora_rank=3)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as if trained: every part nonzero
        for m in adapters.modules.values():
            m.delta_s.copy_(3 * torch.randn(RANK, generator=g))
            if quarantine == "svd":
                m.delta_s_q.copy_(3 * torch.randn(RANK, generator=g))
            else:
                m.lora_a_q.copy_(0.5 * torch.randn(m.lora_a_q.shape, generator=g))
                m.lora_b_q.copy_(0.5 * torch.randn(m.lora_b_q.shape, generator=g))
    batch = pad_batch([(PROMPT, COMPLETION)])
    with torch.no_grad():
        trained = trainer.token_logprobs(batch)[0, 1:].tolist()
        with adapters.deploy():
            deployed = trainer.token_logprobs(batch)[0, 1:].tolist()
        with adapters.disabled():
            base = trainer.token_logprobs(batch)[0, 1:].tolist()
    assert trained != pytest.approx(deployed, abs=1e-3)  # the quarantine matters

    engine = LLMEngine(
        path, EngineConfig(device="cpu", dtype="float32", adapter_capacity=1, adapter_rank=RANK)
    )
    assert sorted(engine.adapters.modules) == sorted(adapters.modules)
    state = engine_adapter_state(adapters)  # δ vectors (and a LoRA's factors) only
    parts = {"svd": {"kept", "quarantine"}, "lora": {"kept", "lora_a", "lora_b"}}[quarantine]
    assert all(set(p) == parts for p in state.values())
    engine.load_adapter("policy", state)
    ids = PROMPT + COMPLETION
    if together:  # trained, deploy and no-adapter tokens in every step's batch
        got = _engine_prompt_logprobs(engine, ids, VARIANTS)
    else:
        got = [_engine_prompt_logprobs(engine, ids, [kw])[0] for kw in VARIANTS]
    assert got[0] == pytest.approx(trained, abs=1e-4)
    assert got[1] == pytest.approx(deployed, abs=1e-4)
    assert got[2] == pytest.approx(base, abs=1e-4)
