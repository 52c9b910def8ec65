"""Adapters in the engine's step batch: `W + U·diag(δ)·Vᵀ` per target Linear, per request.

The oracle is transformers with the same edit merged into its weights. Requests under the
trained variant (δS + δS_q), the deploy variant (δS) and no adapter share one batch and each
match their own oracle; zero δ is bit-identical to the base; reloading an adapter (weight
sync) changes later logprobs and never reuses prefix blocks computed under the old weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.common.errors import InvalidRequestError, NotFoundError
from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.adapters import svd_basis
from tests.oracle import hf_model

RANK = 4
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61, 9, 44, 300, 21, 7, 88, 120]
CONFIG = dict(device="cpu", dtype="float32", adapter_capacity=2, adapter_rank=RANK)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _state(engine: LLMEngine, seed: int, scale: float = 3.0, quarantine: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        name: {
            "kept": scale * torch.randn(RANK, generator=g),
            "quarantine": (scale * torch.randn(RANK, generator=g))
            if quarantine
            else torch.zeros(RANK),
        }
        for name in sorted(engine.adapters.modules)
    }


def _oracle_logprobs(path, state: dict | None, variant: str, ids: list[int]) -> torch.Tensor:
    """HF log-softmax over `ids` with each target weight edited to W + U·diag(δ)·Vᵀ."""
    model = copy.deepcopy(hf_model(path))
    if state is not None:
        with torch.no_grad():
            for name, parts in state.items():
                delta = parts["kept"].double()
                if variant == "trained":
                    delta = delta + parts["quarantine"].double()
                lin = model.get_submodule(f"model.{name}")
                u, _, v = svd_basis(lin.weight, RANK)
                lin.weight += ((u * delta) @ v.T).to(lin.weight.dtype)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _generated_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [c.logprobs[i][t] for i, t in enumerate(c.token_ids)]


def _want(path, state, variant, out) -> list[float]:
    ids = PROMPT + out.outputs[0].token_ids
    lp = _oracle_logprobs(path, state, variant, ids)
    P = len(PROMPT)
    return [float(lp[P - 1 + i, t]) for i, t in enumerate(out.outputs[0].token_ids)]


def _run(engine, params: list[SamplingParams]):
    for i, p in enumerate(params):
        engine.add_request(f"r{i}-{id(p)}", PROMPT, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}-{id(p)}"] for i, p in enumerate(params)]


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True, **kw)


def test_zero_adapter_is_bit_identical_to_the_base(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    base = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"))
    engine.load_adapter("zero", _state(engine, 0, scale=0.0))
    got = _run(engine, [_params(adapter="zero"), _params()])
    want = _run(base, [_params(), _params()])[0]  # the same batch shape: the same matmuls
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert _generated_logprobs(got[0]) == _generated_logprobs(want)  # exact
    assert _generated_logprobs(got[1]) == _generated_logprobs(want)


def test_trained_deploy_and_base_in_one_batch_each_match_their_oracle(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    assert sorted(engine.adapters.modules) == [
        f"layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "self_attn.o_proj")
    ]
    state = _state(engine, 1)
    engine.load_adapter("policy", state)
    trained, deploy, plain = _run(
        engine,
        [_params(adapter="policy"), _params(adapter="policy", adapter_variant="deploy"), _params()],
    )
    for out, st, variant in ((trained, state, "trained"), (deploy, state, "deploy"),
                             (plain, None, "trained")):  # fmt: skip
        assert _generated_logprobs(out) == pytest.approx(_want(path, st, variant, out), abs=1e-4)
    assert _generated_logprobs(trained) != pytest.approx(_generated_logprobs(deploy), abs=1e-3)


def test_reloading_an_adapter_changes_outputs_and_never_reuses_old_blocks(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG, block_size=4))
    engine.load_adapter("policy", _state(engine, 2))
    first = _run(engine, [_params(adapter="policy")])[0]
    again = _run(engine, [_params(adapter="policy")])[0]
    assert again.num_cached_tokens == 16  # same weights: the prompt's full blocks are reused
    new_state = _state(engine, 3)
    engine.load_adapter("policy", new_state)  # weight sync: only the δ vectors
    after = _run(engine, [_params(adapter="policy")])[0]
    assert after.num_cached_tokens == 0  # blocks made under the old version are not reused
    assert _generated_logprobs(after) == pytest.approx(
        _want(path, new_state, "trained", after), abs=1e-4
    )
    assert _generated_logprobs(after) != pytest.approx(_generated_logprobs(first), abs=1e-3)
    unadapted = _run(engine, [_params()])[0]
    assert unadapted.num_cached_tokens == 0  # adapter blocks never serve the base model


def test_bad_adapter_use_is_a_clear_error(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    with pytest.raises(InvalidRequestError, match="unknown adapter 'ghost'"):
        engine.add_request("x", PROMPT, _params(adapter="ghost"))
    with pytest.raises(InvalidRequestError, match="adapter_variant"):
        _params(adapter="policy", adapter_variant="ablated")
    with pytest.raises(InvalidRequestError, match="exactly the target modules"):
        engine.load_adapter("bad", {"layers.0.mlp.down_proj": {"kept": torch.zeros(RANK)}})
    state = _state(engine, 4)
    state["layers.0.mlp.down_proj"]["kept"][0] = float("nan")
    with pytest.raises(InvalidRequestError, match="NaN"):
        engine.load_adapter("nan", state)
    engine.load_adapter("a", _state(engine, 5))
    engine.load_adapter("b", _state(engine, 6))
    with pytest.raises(InvalidRequestError, match="bank is full"):
        engine.load_adapter("c", _state(engine, 7))
    engine.add_request("busy", PROMPT, _params(adapter="a"))
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.unload_adapter("a")
    engine.abort("busy")
    engine.unload_adapter("a")
    with pytest.raises(NotFoundError):
        engine.unload_adapter("a")
    plain = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"))
    with pytest.raises(InvalidRequestError, match="serves no adapters"):
        plain.add_request("y", PROMPT, _params(adapter="a"))
