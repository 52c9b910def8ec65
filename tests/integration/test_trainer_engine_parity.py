"""The trainer's forward and the engine agree on the same adapter: weight sync moves only the
δ vectors, and the engine's logprobs (trained and deploy variants) equal the trainer's."""

from __future__ import annotations

import pytest
import torch

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.trainer.adapters import AdapterConfig, attach_adapters
from services.trainer.model import TrainableModel, pad_batch
from services.trainer.weight_sync import engine_adapter_state

RANK = 4
PROMPT = [17, 250, 33, 401, 98, 12, 77]
COMPLETION = [305, 150, 61, 9, 44]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _engine_prompt_logprobs(engine: LLMEngine, ids: list[int], **kw) -> list[float]:
    engine.add_request("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0, **kw))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    # prompt_logprobs[i] holds the actual token i's logprob (None at position 0)
    return [final.prompt_logprobs[i][t] for i, t in enumerate(ids) if i > 0]


def test_engine_logprobs_of_a_trained_adapter_match_the_trainer(path):
    trainer = TrainableModel.from_pretrained(path)
    adapters = attach_adapters(trainer.model, AdapterConfig(rank=RANK))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as if trained: both parts nonzero
        for m in adapters.modules.values():
            m.delta_s.copy_(3 * torch.randn(RANK, generator=g))
            m.delta_s_q.copy_(3 * torch.randn(RANK, generator=g))
    batch = pad_batch([(PROMPT, COMPLETION)])
    with torch.no_grad():
        trained = trainer.token_logprobs(batch)[0, 1:].tolist()
        with adapters.deploy():
            deployed = trainer.token_logprobs(batch)[0, 1:].tolist()
        with adapters.disabled():
            base = trainer.token_logprobs(batch)[0, 1:].tolist()

    engine = LLMEngine(
        path, EngineConfig(device="cpu", dtype="float32", adapter_capacity=1, adapter_rank=RANK)
    )
    assert sorted(engine.adapters.modules) == sorted(adapters.modules)
    engine.load_adapter("policy", engine_adapter_state(adapters))  # δ vectors only
    ids = PROMPT + COMPLETION
    assert _engine_prompt_logprobs(engine, ids, adapter="policy") == pytest.approx(
        trained, abs=1e-5
    )
    assert _engine_prompt_logprobs(
        engine, ids, adapter="policy", adapter_variant="deploy"
    ) == pytest.approx(deployed, abs=1e-5)
    assert _engine_prompt_logprobs(engine, ids) == pytest.approx(base, abs=1e-5)
    assert trained != pytest.approx(deployed, abs=1e-3)  # the quarantine mattered
