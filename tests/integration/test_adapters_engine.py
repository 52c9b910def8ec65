"""Adapters in the engine's step batch: `W + U·diag(δ)·Vᵀ` per target Linear, per request.

The oracle is transformers with the same edit merged into its weights. Requests under the
trained variant (δS + δS_q, or δS plus a LoRA quarantine `B_q A_q`), the deploy variant (δS)
and no adapter share one batch and each match their own oracle; zero δ is bit-identical to the
base; reloading an adapter (weight sync) changes later logprobs and never reuses prefix blocks
computed under the old weights; a LoRA never leaks into another adapter's rows or a reused slot.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.common.errors import InvalidRequestError, NotFoundError
from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from tests.adapter_states import merged_hf_model, random_state

RANK = 4
PROMPT = [17, 250, 33, 401, 98, 12, 77, 305, 150, 61, 9, 44, 300, 21, 7, 88, 120]
CONFIG = dict(device="cpu", dtype="float32", adapter_capacity=2, adapter_rank=RANK)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _state(
    engine: LLMEngine, seed: int, scale: float = 3.0, quarantine: bool = True, lora: int = 0
) -> dict:
    return random_state(engine.adapters, seed, scale, quarantine, lora)


def _oracle_logprobs(path, state: dict | None, variant: str, ids: list[int]) -> torch.Tensor:
    """HF log-softmax over `ids` with the adapter's edit merged into its weights."""
    model = merged_hf_model(path, state, variant, RANK)
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
    totals = OutputAccumulator()
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            done[out.request_id] = out
    return [done[f"r{i}-{id(p)}"] for i, p in enumerate(params)]


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True, **kw)


def test_zero_adapter_matches_the_base(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    base = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"))
    engine.load_adapter("zero", _state(engine, 0, scale=0.0))
    got = _run(engine, [_params(adapter="zero"), _params()])
    want = _run(base, [_params(), _params()])[0]
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids
    # Not bit-identical: the adapted engine's wrapped Linears compute W·x plus a (zero) δ term
    # through other kernels, which may round differently on other CPUs.
    assert _generated_logprobs(got[0]) == pytest.approx(_generated_logprobs(want), abs=1e-4)
    assert _generated_logprobs(got[1]) == pytest.approx(_generated_logprobs(want), abs=1e-4)


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


def test_lora_quarantines_each_match_their_merged_oracle_in_one_batch(path):
    engine = LLMEngine(path, EngineConfig(**{**CONFIG, "adapter_capacity": 3}))
    bank = engine.adapters
    states = {
        "lora2": _state(engine, 10, quarantine=False, lora=2),
        "svd": _state(engine, 11),  # no LoRA: its trained row must get none of the others'
        "lora3": _state(engine, 12, lora=3),  # both quarantines; grows the buffers from k 2
    }
    for name, state in states.items():
        engine.load_adapter(name, state)
    assert bank.lora_rank == 3
    requests = [
        ("lora2", "trained"), ("lora3", "trained"), ("lora3", "deploy"), ("svd", "trained"),
        (None, "trained"),
    ]  # fmt: skip
    outs = _run(
        engine,
        [
            _params(adapter=name, adapter_variant=variant) if name else _params()
            for name, variant in requests
        ],
    )
    for (name, variant), out in zip(requests, outs, strict=True):
        want = _want(path, states.get(name), variant, out)
        assert _generated_logprobs(out) == pytest.approx(want, abs=1e-4), (name, variant)
    # the LoRA is what separates lora2's variants (its SVD quarantine is zero)
    deploy2 = _run(engine, [_params(adapter="lora2", adapter_variant="deploy")])[0]
    assert _generated_logprobs(outs[0]) != pytest.approx(_generated_logprobs(deploy2), abs=1e-3)
    # a LoRA term is its trained row's alone: every other row's LoRA coefficients are 0
    for m in bank.modules.values():
        want = torch.zeros_like(m.coef)
        want[:, :RANK] = m.coef[:, :RANK]
        for name in ("lora2", "lora3"):
            entry = bank.loaded[name]
            cols = m.lora_columns(entry.slot, bank.lora_rank)
            want[entry.rows["trained"], cols.start : cols.start + entry.lora_rank] = 1
        assert torch.equal(m.coef, want)


def test_bad_lora_quarantines_are_clear_errors_and_change_nothing(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    good = _state(engine, 20, lora=2)
    version = engine.load_adapter("policy", good)
    before = _run(engine, [_params(adapter="policy")])[0]
    module = "layers.0.mlp.down_proj"
    out_f, in_f = engine.adapters.modules[module].weight.shape

    def broken(**parts) -> dict:
        state = copy.deepcopy(good)
        state[module].update(parts)
        return {m: {k: v for k, v in p.items() if v is not None} for m, p in state.items()}

    cases = {
        "lora_a \\[k, ": broken(lora_a=torch.zeros(2, in_f + 1)),
        "lora_b \\[": broken(lora_b=torch.zeros(out_f + 1, 2)),
        "with 1 <= k": broken(lora_a=torch.zeros(3, in_f)),  # A and B disagree on k
        "both lora_a and lora_b": broken(lora_b=None),
        "one rank": broken(lora_a=torch.zeros(3, in_f), lora_b=torch.zeros(out_f, 3)),
        "NaN/Inf": broken(lora_b=torch.full((out_f, 2), float("nan"))),
        "NaN/Inf.*float32": broken(lora_a=torch.full((2, in_f), 1e39, dtype=torch.float64)),
        "takes": broken(lora_c=torch.zeros(2, in_f)),
    }
    for match, state in cases.items():
        with pytest.raises(InvalidRequestError, match=match):
            engine.load_adapter("policy", state)
    partial = copy.deepcopy(good)
    del partial[module]["lora_a"], partial[module]["lora_b"]
    with pytest.raises(InvalidRequestError, match="every target module or none"):
        engine.load_adapter("policy", partial)
    assert engine.adapters.loaded["policy"].version == version
    after = _run(engine, [_params(adapter="policy")])[0]
    # nothing changed (not bit-exact: the second run reuses the first's prefix blocks)
    assert _generated_logprobs(after) == pytest.approx(_generated_logprobs(before), abs=1e-4)


def test_an_unloaded_loras_slot_serves_the_next_adapter_without_leakage(path):
    engine = LLMEngine(path, EngineConfig(**CONFIG))
    engine.load_adapter("old", _state(engine, 30, lora=3))
    slot = engine.adapters.row("old", "trained")
    _run(engine, [_params(adapter="old")])
    engine.unload_adapter("old")
    for m in engine.adapters.modules.values():  # unload zeros the slot's LoRA and its rows
        assert not m.basis_in[:, RANK:].any() and not m.basis_out[:, RANK:].any()
        assert not m.coef.any()
    svd_only = _state(engine, 31)
    engine.load_adapter("new", svd_only)
    assert engine.adapters.row("new", "trained")[0] == slot[0]  # the same slot, reused
    fresh = LLMEngine(path, EngineConfig(**CONFIG))
    fresh.load_adapter("new", svd_only)
    batch = [_params(adapter="new"), _params(adapter="new", adapter_variant="deploy"), _params()]
    got, want = _run(engine, batch), _run(fresh, batch)
    for g, w in zip(got, want, strict=True):
        # Not bit for bit: this engine's tables keep the (zeroed) LoRA columns, so its
        # low-rank matmul sums over more columns than the fresh one's.
        assert _generated_logprobs(g) == pytest.approx(_generated_logprobs(w), abs=1e-4)
    for m in engine.adapters.modules.values():  # nothing left over: the LoRA columns are 0
        assert not m.basis_in[:, RANK:].any() and not m.coef[:, RANK:].any()
    # a smaller LoRA in the same slot gets none of the old one's extra columns
    engine.unload_adapter("new")
    small = _state(engine, 32, lora=1)
    engine.load_adapter("small", small)
    out = _run(engine, [_params(adapter="small")])[0]
    assert _generated_logprobs(out) == pytest.approx(_want(path, small, "trained", out), abs=1e-4)


def test_a_deploy_request_never_reuses_blocks_the_trained_variant_computed(path):
    """The two variants of one adapter compute different KV for the same prompt, so the
    prefix cache keeps them apart: deploy after trained is a miss, and equals a fresh run."""
    engine = LLMEngine(path, EngineConfig(**CONFIG, block_size=4))
    state = _state(engine, 40)
    engine.load_adapter("policy", state)
    _run(engine, [_params(adapter="policy")])
    deploy = _run(engine, [_params(adapter="policy", adapter_variant="deploy")])[0]
    assert deploy.num_cached_tokens == 0
    fresh = LLMEngine(path, EngineConfig(**CONFIG, block_size=4))
    fresh.load_adapter("policy", state)
    want = _run(fresh, [_params(adapter="policy", adapter_variant="deploy")])[0]
    assert deploy.outputs[0].token_ids == want.outputs[0].token_ids
    assert _generated_logprobs(deploy) == pytest.approx(_generated_logprobs(want), abs=1e-5)
    again = _run(engine, [_params(adapter="policy", adapter_variant="deploy")])[0]
    assert again.num_cached_tokens == 16  # the same variant still hits its own blocks


def test_targets_naming_one_layer_adapt_that_layer_alone(path):
    """A target pattern that names one layer's module (not `*.o_proj`) adapts that module
    only: a state for it alone loads, and the adapter changes that layer's output and
    matches the merged oracle."""
    target = "layers.0.self_attn.o_proj"
    engine = LLMEngine(path, EngineConfig(**CONFIG, adapter_targets=(target,)))
    assert sorted(engine.adapters.shapes) == [target]
    state = _state(engine, 5)
    assert sorted(state) == [target]
    engine.load_adapter("one", state)
    out = _run(engine, [_params(adapter="one")])[0]
    assert _generated_logprobs(out) == pytest.approx(_want(path, state, "trained", out), abs=1e-4)
