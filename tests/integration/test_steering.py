"""Steering, capture and read-outs against `transformers` forward hooks (float32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.wire import pack_tensor
from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams
from services.engine.interventions.sites import SITES
from tests.oracle import hf_edited_logprobs, hf_logprobs, hf_model, hf_residuals

GEN = 6


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


@pytest.fixture(scope="module")
def hidden(path):
    return hf_model(path).config.hidden_size


def _prompt(seed: int, n: int = 19) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 500) for _ in range(n)]


def _vec(seed: int, hidden: int, norm: float = 3.0) -> torch.Tensor:
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


def _params(**kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=GEN, temperature=0.0, ignore_eos=True, prompt_logprobs=3, logprobs=3, **kw
    )


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", **kw))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    totals = OutputAccumulator()
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            done[out.request_id] = out
    return done


def _assert_matches(out, ref: torch.Tensor, prompt: list[int]) -> None:
    """Every prompt and generated logprob the engine reported equals the oracle's (1e-4)."""
    for pos in range(1, len(prompt)):
        for t, v in out.prompt_logprobs[pos].items():
            assert v == pytest.approx(float(ref[pos - 1, t]), abs=1e-4), (pos, t)
    for i, d in enumerate(out.outputs[0].logprobs):
        for t, v in d.items():
            assert v == pytest.approx(float(ref[len(prompt) - 1 + i, t]), abs=1e-4), (i, t)


def _add(vec: torch.Tensor, from_position: int = 0):
    def fn(h):
        out = h.clone()
        out[from_position:] += vec.to(h)
        return out

    return fn


@pytest.mark.parametrize("site", SITES)
def test_steering_at_each_site_matches_a_forward_hook(path, hidden, site):
    prompt, v = _prompt(1), _vec(1, hidden)
    spec = {"vectors": [{"site": site, "layers": [1], "vector": v.tolist(), "scale": 2.0}]}
    out = _run(_engine(path), {"s": (prompt, _params(steering=spec))})["s"]
    ids = prompt + out.outputs[0].token_ids
    ref = hf_edited_logprobs(path, ids, {(1, site): _add(2.0 * v)})
    _assert_matches(out, ref, prompt)
    plain = hf_logprobs(path, ids)
    assert (ref - plain).abs().max() > 1e-2  # the vector really moved the model


def test_phases_steer_only_their_tokens(path, hidden):
    prompt, v = _prompt(2), _vec(2, hidden)
    P = len(prompt)
    outs = _run(
        _engine(path),
        {
            phase: (
                prompt,
                _params(
                    steering={"vectors": [{"layers": [0, 2], "vector": v.tolist(), "phase": phase}]}
                ),
            )
            for phase in ("prefill", "decode")
        },
    )
    pre = outs["prefill"]
    ids = prompt + pre.outputs[0].token_ids
    hook = {(0, "post_block"): _add(v), (2, "post_block"): _add(v)}
    # prefill-only: prompt positions steered, generated positions not
    ref = hf_edited_logprobs(
        path, ids, {k: (lambda h, f=f: torch.cat([f(h)[:P], h[P:]])) for k, f in hook.items()}
    )
    _assert_matches(pre, ref, prompt)
    dec = outs["decode"]
    ids = prompt + dec.outputs[0].token_ids
    ref = hf_edited_logprobs(path, ids, {k: _add(v, from_position=P) for k in hook})
    _assert_matches(dec, ref, prompt)


def test_three_vectors_in_one_batch_each_match_their_own_oracle(path, hidden):
    requests, vecs = {}, {}
    for i in range(3):
        vecs[f"r{i}"] = _vec(10 + i, hidden)
        spec = {"vectors": [{"site": SITES[i], "layers": [i], "vector": vecs[f"r{i}"].tolist()}]}
        requests[f"r{i}"] = (_prompt(10 + i, 9 + 7 * i), _params(steering=spec))
    requests["control"] = (_prompt(20), _params())
    outs = _run(_engine(path), requests)
    for i in range(3):
        rid = f"r{i}"
        prompt = requests[rid][0]
        ids = prompt + outs[rid].outputs[0].token_ids
        _assert_matches(
            outs[rid], hf_edited_logprobs(path, ids, {(i, SITES[i]): _add(vecs[rid])}), prompt
        )
    # The control is bit-identical to the same batch with nobody steered ...
    unsteered = {rid: (prompt, _params()) for rid, (prompt, _) in requests.items()}
    control = _run(_engine(path), unsteered)["control"]
    assert outs["control"].outputs[0].token_ids == control.outputs[0].token_ids
    assert outs["control"].outputs[0].logprobs == control.outputs[0].logprobs
    assert outs["control"].prompt_logprobs == control.prompt_logprobs
    # ... and matches the oracle alone.
    prompt = requests["control"][0]
    ids = prompt + outs["control"].outputs[0].token_ids
    _assert_matches(outs["control"], hf_logprobs(path, ids), prompt)


def test_vector_formats_agree(path, hidden):
    """A float list, a packed base64 tensor, per-layer rows and a registered name are one vector."""
    prompt = _prompt(3)
    a, b = _vec(30, hidden), _vec(31, hidden)
    engine = _engine(path)
    engine.vectors.register("honesty", {0: a, 2: b})
    forms = {
        "lists": [
            {"layers": [0], "vector": a.tolist()},
            {"layers": [2], "vector": b.tolist()},
        ],
        "rows": [{"layers": [0, 2], "vector": [a.tolist(), b.tolist()]}],
        "packed": [{"layers": [0, 2], "vector": pack_tensor(torch.stack([a, b]).half().float())}],
        "named": [{"vector": "honesty"}],
    }
    outs = _run(engine, {k: (prompt, _params(steering={"vectors": v})) for k, v in forms.items()})
    ref = outs["lists"].outputs[0].logprobs
    # One batch, but each request sits at other rows of the matmuls, which may round differently.
    for k in ("rows", "named"):
        for d_ref, d in zip(ref, outs[k].outputs[0].logprobs, strict=True):
            assert d == pytest.approx(d_ref, abs=1e-4), k
    # packed went through float16: close, not identical
    for d_ref, d in zip(ref, outs["packed"].outputs[0].logprobs, strict=True):
        for t in d_ref:
            assert d[t] == pytest.approx(d_ref[t], abs=1e-2)


def test_global_steering_applies_to_every_request_until_cleared(path, hidden):
    prompt, v = _prompt(4), _vec(4, hidden)
    engine = _engine(path)
    engine.set_global_steering(
        {"vectors": [{"site": "post_attn", "layers": [1], "vector": v.tolist()}]}
    )
    out = _run(engine, {"a": (prompt, _params())})["a"]
    ids = prompt + out.outputs[0].token_ids
    _assert_matches(out, hf_edited_logprobs(path, ids, {(1, "post_attn"): _add(v)}), prompt)
    engine.clear_global_steering()
    out = _run(engine, {"b": (prompt, _params())})["b"]
    assert out.num_cached_tokens == 0  # blocks made under global prefill steering stay apart
    _assert_matches(out, hf_logprobs(path, prompt + out.outputs[0].token_ids), prompt)


def test_captures_match_transformers_hidden_states(path):
    prompt = _prompt(5)
    P = len(prompt)
    capture = {
        "sites": {"pre_attn": "all", "post_attn": [1], "post_block": [0, 2]},
        "positions": "all",
    }
    out = _run(_engine(path), {"c": (prompt, _params(capture=capture))})["c"]
    ids = prompt + out.outputs[0].token_ids
    assert out.capture_positions == list(range(len(ids) - 1))  # the last token is never fed
    keys = [(L, "pre_attn") for L in range(3)] + [
        (1, "post_attn"),
        (0, "post_block"),
        (2, "post_block"),
    ]
    assert sorted(out.captures) == sorted(f"{L}.{s}" for L, s in keys)
    ref = hf_residuals(path, ids[:-1], keys)
    for L, s in keys:
        got = out.captures[f"{L}.{s}"]
        assert got.shape == (len(ids) - 1, ref[(L, s)].shape[-1])
        torch.testing.assert_close(got, ref[(L, s)], atol=1e-4, rtol=1e-4)
    # independent of our hooks: HF's own hidden_states[L] is the input of layer L
    with torch.inference_mode():
        hs = hf_model(path)(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.captures["1.pre_attn"], hs[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.captures["0.post_block"], hs[1][0], atol=1e-4, rtol=1e-4)
    # position selections
    for positions, want in (
        ("last_prompt", [P - 1]),
        ("all_prompt", list(range(P))),
        ("all_generated", list(range(P, len(ids) - 1))),
        ([2, 5, P + 1], [2, 5, P + 1]),
    ):
        o = _run(
            _engine(path),
            {
                "c": (
                    prompt,
                    _params(capture={"sites": {"post_block": [2]}, "positions": positions}),
                )
            },
        )["c"]
        assert o.capture_positions == want
        torch.testing.assert_close(
            o.captures["2.post_block"], ref[(2, "post_block")][want], atol=1e-4, rtol=1e-4
        )


def test_captures_past_the_block_are_copied_back_by_their_step(path, hidden):
    """A step whose captures outgrow the capture block (a prompt's every position, here
    with a block of 4 rows) copies them eagerly: one copy of every site's rows, which the
    step's own result brings home (`Readback.copy_eager`), not one per site in the
    observer. Two prompts in one step, with different sites: the rows are the ones the
    block path gives, and transformers' residuals."""
    capture = {"sites": {"post_block": [0, 2], "pre_attn": [1]}, "positions": "all_prompt"}
    other = {"sites": {"post_attn": [2]}, "positions": "all_prompt"}
    requests = {
        "a": (_prompt(11), _params(capture=capture)),
        "b": (_prompt(12, 9), _params(capture=other)),
    }
    engine = _engine(path, graph_capture_rows=4)
    seen = []
    collect = engine.runner.readback.copy_eager

    def copy_eager(captured):
        seen.append(sorted(captured))
        return collect(captured)

    engine.runner.readback.copy_eager = copy_eager
    eager = _run(engine, requests)
    assert seen and engine.interventions.observer.num_eager_captures == 19 + 9
    assert sorted(seen[0]) == [(0, "post_block"), (1, "pre_attn"), (2, "post_attn"),
                               (2, "post_block")]  # fmt: skip
    block = _run(_engine(path), requests)  # the default block holds them
    for rid, (prompt, _) in requests.items():
        keys = sorted(eager[rid].captures)
        assert keys == sorted(block[rid].captures) and eager[rid].capture_positions == list(
            range(len(prompt))
        )
        ref = hf_residuals(path, prompt, [(int(k.split(".")[0]), k.split(".")[1]) for k in keys])
        for k in keys:
            got = eager[rid].captures[k]
            torch.testing.assert_close(got, block[rid].captures[k], atol=1e-4, rtol=1e-4)
            L, site = k.split(".")
            torch.testing.assert_close(got, ref[(int(L), site)], atol=1e-4, rtol=1e-4)


def test_captures_are_pristine_under_steering_at_the_same_site(path, hidden):
    prompt, v = _prompt(6), _vec(6, hidden)
    spec = {"vectors": [{"site": "post_block", "layers": [1], "vector": v.tolist()}]}
    capture = {"sites": {"post_block": [1]}, "positions": "all_prompt"}
    out = _run(_engine(path), {"c": (prompt, _params(steering=spec, capture=capture))})["c"]
    ref = hf_residuals(path, prompt, [(1, "post_block")])[(1, "post_block")]
    torch.testing.assert_close(out.captures["1.post_block"], ref, atol=1e-4, rtol=1e-4)


def test_readouts_report_probe_scores_per_generated_token(path, hidden):
    prompt, probe = _prompt(7), _vec(7, hidden, norm=1.0)
    readouts = [{"probe": probe.tolist(), "site": "post_attn", "layer": 2, "name": "p"}]
    out = _run(_engine(path), {"r": (prompt, _params(readouts=readouts))})["r"]
    ids = prompt + out.outputs[0].token_ids
    h = hf_residuals(path, ids, [(2, "post_attn")])[(2, "post_attn")]
    got = [d["p"] for d in out.outputs[0].readouts]
    want = (h[len(prompt) - 1 : len(ids) - 1] @ probe).tolist()
    assert got == pytest.approx(want, abs=1e-3)


def test_probe_banks_share_columns_make_full_ones_wait_and_reject_what_cannot_fit(path, hidden):
    """A site's bank holds `readout_probes_per_site` distinct probes: requests reading the
    same probe share its column, one that needs a column a full bank lacks waits for it
    (its read-outs are then what it reads alone), and one that needs more than a bank
    holds is refused when added."""
    probes = [_vec(70 + i, hidden, norm=1.0).tolist() for i in range(4)]

    def reads(*which: int) -> list[dict]:
        return [{"probe": probes[i], "layer": 1, "name": f"p{i}"} for i in which]

    prompt = _prompt(9)
    alone = _run(_engine(path), {"c": (prompt, _params(readouts=reads(2, 3)))})["c"]
    engine = _engine(path, readout_probes_per_site=2)
    for rid, which in (("a", (0, 1)), ("b", (1, 0))):  # the same two probes: shared
        engine.add_request(rid, _prompt(10), _params(readouts=reads(*which)))
    engine.add_request("c", prompt, _params(readouts=reads(2, 3)))  # a full bank: waits
    engine.step()
    pools = engine.steering_snapshot()["pools"]
    assert pools["probes_used"] == {"1.post_block": 2}
    assert pools["admissions_waiting_for_probes"] >= 1
    assert [s.seq_id for s in engine.scheduler.waiting] != []
    done = _run(engine, {})
    assert done.keys() == {"a", "b", "c"}
    for a, b in zip(done["a"].outputs[0].readouts, done["b"].outputs[0].readouts, strict=True):
        assert a == pytest.approx(b, abs=1e-4)  # one column, read from two rows of the batch
    for got, want in zip(done["c"].outputs[0].readouts, alone.outputs[0].readouts, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    assert engine.steering_snapshot()["pools"]["probes_used"] == {}
    with pytest.raises(InvalidRequestError, match="probe bank holds 2"):
        engine.add_request("d", prompt, _params(readouts=reads(0, 1, 2)))


def test_abort_when_stops_with_finish_reason_probe(path, hidden):
    prompt, probe = _prompt(8), _vec(8, hidden, norm=1.0)
    scores = [
        d["p"]
        for d in _run(
            _engine(path),
            {"r": (prompt, _params(readouts=[{"probe": probe.tolist(), "layer": 1, "name": "p"}]))},
        )["r"]
        .outputs[0]
        .readouts
    ]
    k = max(range(len(scores)), key=lambda i: scores[i])
    cond = {"probe": probe.tolist(), "layer": 1, "threshold": scores[k] - 1e-3, "sharpness": 10.0}
    out = _run(_engine(path), {"a": (prompt, _params(steering={"abort_when": cond}))})["a"]
    assert out.outputs[0].finish_reason == "probe"
    assert (
        len(out.outputs[0].token_ids) == k
    )  # token k would have been sampled from the firing state


BAD = {
    "unknown site": {"vectors": [{"site": "resid_top", "layers": [0], "vector": "x"}]},
    "layer out of range": {"vectors": [{"layers": [3], "vector": [0.0] * 64}]},
    "wrong vector length": {"vectors": [{"layers": [0], "vector": [0.0] * 63}]},
    "unknown vector name": {"vectors": [{"layers": [0], "vector": "nope"}]},
    "nan": {"vectors": [{"layers": [0], "vector": [float("nan")] + [0.0] * 63}]},
    "inf scale": {"vectors": [{"layers": [0], "vector": [0.0] * 64, "scale": float("inf")}]},
    "rows for layers": {"vectors": [{"layers": [0, 1, 2], "vector": [[0.0] * 64] * 2}]},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_steering_is_a_clear_error_and_others_run_on(path, hidden, case):
    assert hidden == 64
    engine = _engine(path)
    prompt = _prompt(9)
    engine.add_request("ok", prompt, _params())
    totals = OutputAccumulator()
    done = {o.request_id: o for o in totals.finished(engine.step())}
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, _params(steering=BAD[case]))
    assert str(err.value)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in totals.finished(engine.step())})
    assert set(done) == {"ok"}
    plain = _run(_engine(path), {"ok": (prompt, _params())})["ok"]
    assert done["ok"].outputs[0].logprobs == plain.outputs[0].logprobs


def test_bad_capture_and_readouts_are_clear_errors(path):
    engine = _engine(path)
    for kw in (
        {"capture": {"sites": {"post_block": [7]}}},
        {"capture": {"sites": {"bogus": [0]}}},
        {"capture": {"sites": {"post_block": [0]}, "positions": "middle"}},
        {"readouts": [{"probe": "nope", "layer": 0}]},
        {"readouts": [{"probe": [1.0] * 64, "layer": 0}, {"probe": [1.0] * 64, "layer": 0}]},
    ):
        with pytest.raises(InvalidRequestError):
            engine.add_request("x", _prompt(0), SamplingParams(**kw))
    assert not engine.has_unfinished_requests()


def test_one_params_for_a_batch_resolves_its_steering_once(path, hidden, monkeypatch):
    """`LLM.generate` with one SamplingParams for every prompt resolves its steering spec
    once and shares it; the outputs are those of resolving it per prompt. The sharing ends
    with the call: a vector registered again afterwards steers the next call."""
    from dataclasses import replace

    from services.engine import LLM

    llm = LLM(engine=_engine(path))
    resolver = llm.engine.interventions.resolver
    calls = []
    real = resolver._steering
    monkeypatch.setattr(resolver, "_steering", lambda spec: calls.append(spec) or real(spec))
    llm.engine.vectors.register("v", _vec(1, hidden))
    steering = {"vectors": [{"site": "post_block", "layers": [0, 2], "vector": "v"}]}
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, steering=steering)
    prompts = [_prompt(s) for s in range(4)]
    shared = llm.generate(prompts, params)
    assert len(calls) == 1
    apart = llm.generate(
        prompts, [replace(params, steering=params.steering.model_copy(deep=True)) for _ in prompts]
    )
    assert len(calls) == 5
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in apart]
    assert resolver._memo is None
    llm.engine.vectors.register("v", _vec(2, hidden, norm=30.0), overwrite=True)
    again = llm.generate(prompts, params)
    assert len(calls) == 6  # resolved anew: the registry changed between the calls
    fresh = llm.generate(prompts, replace(params, steering=params.steering.model_copy()))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]
    assert [o.outputs[0].token_ids for o in again] != [o.outputs[0].token_ids for o in shared]
