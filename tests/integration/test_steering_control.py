"""Controller tiers inside the engine: actions, sync consumers, monitors, gates, pools, and
the steering-aware prefix cache (float32, CPU, against `transformers` hooks)."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.engine import SamplingParams
from services.engine.interventions.actions import (
    RequestSteeringOverride,
    SteeringMonitorUpdate,
    SteeringScaleUpdate,
    SteeringVectorUpdate,
)
from tests.integration.test_steering import (
    _add,
    _assert_matches,
    _engine,
    _params,
    _prompt,
    _run,
    _vec,
)
from tests.oracle import hf_edited_logprobs, hf_logprobs


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


H = 64


class AtStep:
    """A sync consumer that emits `actions` after step `step` and records what it saw."""

    def __init__(self, step: int, actions, sites=None):
        self.name = "at-step"
        self.sites = sites or {}
        self.step, self.actions = step, actions
        self.views = []

    def on_step(self, view):
        self.views.append(view)
        return self.actions if view.step == self.step else None


def _step_logprobs(out) -> list[dict[int, float]]:
    return out.outputs[0].logprobs


def _assert_close(a: list[dict[int, float]], b: list[dict[int, float]], tol: float = 1e-4) -> None:
    """Same tokens and logprobs within `tol` (batch composition changes float rounding)."""
    assert len(a) == len(b)
    for da, db in zip(a, b, strict=True):
        assert da.keys() == db.keys()
        for t in da:
            assert da[t] == pytest.approx(db[t], abs=tol)


def _no_prompt_logprobs(**kw) -> SamplingParams:
    # prompt logprobs need every prompt position computed, so they bypass the prefix cache
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, **kw)


def test_override_from_a_consumer_applies_exactly_one_step_later(path):
    prompt, v = _prompt(40), _vec(40, H, norm=6.0)
    base = _run(_engine(path), {"t": (prompt, _params())})["t"]
    N = 3  # the consumer sees step N (which produced token N-1) and emits the override
    override = RequestSteeringOverride("t", {"vectors": [{"layers": [1], "vector": v.tolist()}]})
    engine = _engine(path)
    consumer = AtStep(N, [override])
    engine.add_consumer(consumer)
    out = _run(engine, {"t": (prompt, _params())})["t"]
    got, want = _step_logprobs(out), _step_logprobs(base)
    assert got[:N] == want[:N]  # tokens from steps 1..N: untouched
    assert got[N] != want[N]  # the token of step N+1: steered
    # and exactly as a hook adding v from the first position step N+1 computed
    P = len(prompt)
    ids = prompt + out.outputs[0].token_ids
    ref = hf_edited_logprobs(path, ids, {(1, "post_block"): _add(v, from_position=P - 1 + N)})
    _assert_matches(out, ref, prompt)
    snap = engine.steering_snapshot()
    assert snap["queue"]["applied"] == {"at-step": 1}
    assert snap["consumers"]["at-step"]["calls"] == len(consumer.views)
    assert snap["pools"]["dynamic"]["used"] == 0  # released when the request finished


def test_scale_zero_suppresses_exactly_the_target_row(path):
    prompt, v = _prompt(41), _vec(41, H)
    spec = {"vectors": [{"layers": [2], "vector": v.tolist()}]}
    steered = _run(_engine(path), {"a": (prompt, _params(steering=spec))})["a"]
    plain = _run(_engine(path), {"a": (prompt, _params())})["a"]
    engine = _engine(path)
    engine.add_consumer(AtStep(1, [SteeringScaleUpdate(0.0, request_id="b")]))
    # a and b share one row (same config); scaling b must not touch a
    outs = _run(
        engine, {"a": (prompt, _params(steering=spec)), "b": (prompt, _params(steering=spec))}
    )
    _assert_close(_step_logprobs(outs["a"]), _step_logprobs(steered))
    b = _step_logprobs(outs["b"])
    _assert_close(b[:1], _step_logprobs(steered)[:1])  # step 1 (prefill) ran before the action
    P = len(prompt)
    ids = prompt + outs["b"].outputs[0].token_ids
    # prefill steered, decode unsteered from step 2 on
    ref = hf_edited_logprobs(
        path, ids, {(2, "post_block"): lambda h: torch.cat([h[:P] + v, h[P:]])}
    )
    _assert_matches(outs["b"], ref, prompt)
    assert b[1:] != _step_logprobs(plain)[1:]  # its prompt KV is still the steered one


@pytest.mark.parametrize("gate_rows", [False, True])
def test_monitor_threshold_sign_switches_the_gate(path, gate_rows):
    prompt, v, probe = _prompt(42), _vec(42, H), _vec(43, H, norm=1.0)
    P = len(prompt)
    results = {}
    for sign in (+1, -1):
        engine = _engine(path)
        # gate_rows gates the request's own row; otherwise the dynamic tier is gated
        if gate_rows:
            params = _params(
                steering={"vectors": [{"layers": [1], "vector": v.tolist(), "phase": "decode"}]}
            )
        else:
            engine.submit_action(SteeringVectorUpdate("post_block", [1], v.tolist()))
            params = _params()
        engine.submit_action(
            SteeringMonitorUpdate(
                "post_block",
                1,
                probe.tolist(),
                threshold=sign * 1e4,
                sharpness=1.0,
                gate_rows=gate_rows,
            )
        )
        results[sign] = _run(engine, {"m": (prompt, params)})["m"]
        assert engine.steering_snapshot()["monitors"]["1.post_block"]["gate_rows"] is gate_rows
    off, on = results[+1], results[-1]
    _assert_matches(off, hf_logprobs(path, prompt + off.outputs[0].token_ids), prompt)
    ids = prompt + on.outputs[0].token_ids
    _assert_matches(
        on, hf_edited_logprobs(path, ids, {(1, "post_block"): _add(v, from_position=P)}), prompt
    )


def test_dynamic_tier_gain_per_request(path):
    prompt, v = _prompt(44), _vec(44, H)
    P = len(prompt)
    engine = _engine(path)
    engine.submit_action(SteeringVectorUpdate("post_attn", [0], v.tolist()))
    for rid in ("on", "off"):
        engine.add_request(rid, prompt, _params())
    engine.submit_action(SteeringScaleUpdate(0.0, tier="dynamic", request_id="off"), "ctl")
    outs = _run(engine, {})
    assert engine.steering_snapshot()["queue"]["applied"] == {"api": 1, "ctl": 1}
    ids = prompt + outs["on"].outputs[0].token_ids
    ref = hf_edited_logprobs(path, ids, {(0, "post_attn"): _add(v, from_position=P)})
    _assert_matches(outs["on"], ref, prompt)
    _assert_matches(
        outs["off"], hf_logprobs(path, prompt + outs["off"].outputs[0].token_ids), prompt
    )


def test_gate_in_rest_of_request_scope_stays_latched(path):
    prompt, probe, v = _prompt(45), _vec(45, H, norm=1.0), _vec(46, H, norm=8.0)
    P = len(prompt)
    read = [{"probe": probe.tolist(), "layer": 1, "site": "post_attn", "name": "p"}]
    base = _run(_engine(path), {"r": (prompt, _params(readouts=read))})["r"]
    scores = [d["p"] for d in base.outputs[0].readouts]
    k = max(range(1, len(scores) - 1), key=lambda i: scores[i])  # a decode token, not the last
    gate = {
        "when": {
            "probe": probe.tolist(),
            "layer": 1,
            "site": "post_attn",
            "threshold": scores[k] - 1e-3,
            "sharpness": 1e6,
        },
        "scope": "rest_of_request",
        "apply": {"add": {"vector": v.tolist()}},
    }
    out = _run(_engine(path), {"g": (prompt, _params(steering={"gates": [gate]}, readouts=read))})[
        "g"
    ]
    # until the firing token nothing changes; from it on, every decode token is steered
    assert _step_logprobs(out)[:k] == _step_logprobs(base)[:k]
    ids = prompt + out.outputs[0].token_ids
    ref = hf_edited_logprobs(path, ids, {(1, "post_attn"): _add(v, from_position=P - 1 + k)})
    _assert_matches(out, ref, prompt)
    assert any(d["p"] < scores[k] - 1e-3 for d in out.outputs[0].readouts[k + 1 :]), (
        "the probe must drop below threshold later for the latch to be tested"
    )


def test_prefix_cache_keeps_steered_kv_apart(path):
    bs = 16
    prompt, v = _prompt(47, 40), _vec(47, H)
    engine = _engine(path)
    prefill_spec = {"vectors": [{"layers": [1], "vector": v.tolist(), "phase": "prefill"}]}
    decode_spec = {"vectors": [{"layers": [1], "vector": v.tolist(), "phase": "decode"}]}

    def fresh(p, params):
        return _run(_engine(path), {"x": (p, params)})["x"]

    a = _run(engine, {"a": (prompt, _no_prompt_logprobs(steering=prefill_spec))})["a"]
    assert a.num_cached_tokens == 0
    # an unsteered request on the same prompt must not reuse prefill-steered blocks
    b = _run(engine, {"b": (prompt, _no_prompt_logprobs())})["b"]
    assert b.num_cached_tokens == 0
    assert _step_logprobs(b) == _step_logprobs(fresh(prompt, _no_prompt_logprobs()))
    # the same prefill steering again reuses its own blocks
    a2 = _run(engine, {"a2": (prompt, _no_prompt_logprobs(steering=prefill_spec))})["a2"]
    assert a2.num_cached_tokens == (len(prompt) // bs) * bs
    _assert_close(_step_logprobs(a2), _step_logprobs(a))
    # decode steering: a continuation (prompt + generated) by an unsteered request reuses
    # only the blocks made entirely of prompt positions
    gen = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    d = _run(engine, {"d": (prompt, SamplingParams(**{**gen.__dict__, "steering": decode_spec}))})[
        "d"
    ]
    cont = prompt + d.outputs[0].token_ids
    c = _run(engine, {"c": (cont, _no_prompt_logprobs())})["c"]
    assert c.num_cached_tokens == (len(prompt) // bs) * bs
    _assert_close(_step_logprobs(c), _step_logprobs(fresh(cont, _no_prompt_logprobs())))
    # an unsteered continuation of an unsteered request reuses every full block
    u = _run(engine, {"u": (prompt, gen)})["u"]
    cont = prompt + u.outputs[0].token_ids
    c = _run(engine, {"c2": (cont, _no_prompt_logprobs())})["c2"]
    assert c.num_cached_tokens == ((len(cont) - 1) // bs) * bs


def test_full_pool_makes_requests_wait_never_run_unsteered(path):
    prompts = [_prompt(50 + i) for i in range(4)]
    specs = [
        {"vectors": [{"layers": [i % 3], "vector": _vec(50 + i, H).tolist()}]} for i in range(4)
    ]
    alone = [
        _run(_engine(path), {"x": (p, _params(steering=s))})["x"]
        for p, s in zip(prompts, specs, strict=True)
    ]
    engine = _engine(path, steering_request_rows=2)
    outs = _run(
        engine,
        {
            f"r{i}": (p, _params(steering=s))
            for i, (p, s) in enumerate(zip(prompts, specs, strict=True))
        },
    )
    for i in range(4):
        _assert_close(_step_logprobs(outs[f"r{i}"]), _step_logprobs(alone[i]))
    snap = engine.steering_snapshot()
    assert snap["pools"]["admissions_waiting_for_rows"] > 0
    assert snap["pools"]["per_request"] == {"used": 0, "size": 2}


def test_action_queue_drops_newest_when_full_and_counts(path):
    engine = _engine(path, action_queue_size=2)
    a = SteeringScaleUpdate(1.0, tier="global_decode")
    assert engine.submit_action(a, "c1") and engine.submit_action(a, "c1")
    assert not engine.submit_action(a, "c2")
    _run(engine, {"x": (_prompt(0), _params())})
    snap = engine.steering_snapshot()["queue"]
    assert snap["dropped"] == {"c2": 1} and snap["applied"] == {"c1": 2} and snap["depth"] == 0


def test_bad_actions_are_rejected_and_counted(path):
    engine = _engine(path)
    for action in (
        SteeringVectorUpdate("post_block", [9], [0.0] * H),
        SteeringVectorUpdate("nowhere", [0], [0.0] * H),
        SteeringMonitorUpdate("post_block", 0, [0.0] * 3),
        RequestSteeringOverride("ghost", None),
        SteeringScaleUpdate(float("nan"), tier="dynamic"),
    ):
        engine.submit_action(action, "bad")
    out = _run(engine, {"x": (_prompt(1), _params())})["x"]
    assert engine.steering_snapshot()["queue"]["rejected"] == {"bad": 5}
    assert _step_logprobs(out) == _step_logprobs(
        _run(_engine(path), {"x": (_prompt(1), _params())})["x"]
    )


def test_consumer_view_holds_pristine_activations_and_spans(path):
    prompt = _prompt(52)
    consumer = AtStep(-1, [], sites={"post_block": [1], "pre_attn": [0]})
    engine = _engine(path)
    engine.add_consumer(consumer)
    out = _run(
        engine, {"v": (prompt, _params(capture={"sites": {"post_block": [1]}, "positions": "all"}))}
    )["v"]
    first = consumer.views[0]
    assert set(first.activations) == {(1, "post_block"), (0, "pre_attn")}
    (span,) = first.requests
    assert (span.request_id, span.start, span.num_tokens, span.phase) == (
        "v",
        0,
        len(prompt),
        "prefill",
    )
    assert consumer.views[1].requests[0].phase == "decode"
    rows = torch.cat([v.activations[(1, "post_block")] for v in consumer.views])
    torch.testing.assert_close(rows, out.captures["1.post_block"])


def test_unsafe_actions_are_rejected_whole_and_never_reach_the_tables(path):
    """Non-finite values, a half-valid layer list, a malformed field: rejected, nothing changed."""
    engine = _engine(path)
    for action in (
        SteeringVectorUpdate("post_block", [0], [1.0] * H, scale=float("nan")),
        SteeringVectorUpdate("post_block", [0, 99], [1.0] * H),
        SteeringMonitorUpdate("post_block", 0, [1.0] * H, threshold=float("nan")),
        SteeringMonitorUpdate("post_block", "1", None),  # a str layer: TypeError inside
        SteeringScaleUpdate(1.0, tier="bogus"),
    ):
        engine.submit_action(action, "bad")
    with pytest.raises(InvalidRequestError, match="not a steering action"):
        engine.submit_action("scale everything", "bad")
    out = _run(engine, {"x": (_prompt(2), _params())})["x"]
    snap = engine.steering_snapshot()
    assert snap["queue"]["rejected"] == {"bad": 5}
    assert snap["dynamic"]["sites"] == [] and snap["monitors"] == {} and snap["active_sites"] == []
    plain = _run(_engine(path), {"x": (_prompt(2), _params())})["x"]
    assert _step_logprobs(out) == _step_logprobs(plain)


def test_requests_that_could_never_be_served_as_asked_are_refused(path):
    v, w = _vec(60, H), _vec(61, H)
    two_rows = {
        "vectors": [
            {"layers": [0], "vector": v.tolist(), "phase": "prefill"},
            {"layers": [0], "vector": w.tolist(), "phase": "decode"},
        ]
    }
    engine = _engine(path, steering_request_rows=1)
    with pytest.raises(InvalidRequestError, match="per-request pool"):
        engine.add_request("a", _prompt(3), _params(steering=two_rows))
    capture = {"sites": {"post_block": [0]}, "positions": "all"}
    with pytest.raises(InvalidRequestError, match="n=1"):
        engine.add_request("b", _prompt(3), SamplingParams(n=2, capture=capture))
    far = {"sites": {"post_block": [0]}, "positions": [0, 500]}
    with pytest.raises(InvalidRequestError, match="never computed"):
        engine.add_request("c", _prompt(3), SamplingParams(max_tokens=4, capture=far))
    assert not engine.has_unfinished_requests()


def test_overrides_and_scales_that_would_do_nothing_are_rejected(path):
    gate_only = {
        "gates": [
            {"when": {"probe": [1.0] * H, "layer": 0}, "apply": {"add": {"vector": [1.0] * H}}}
        ]
    }
    engine = _engine(path)
    engine.add_request("g", _prompt(4), _params(steering=gate_only))
    engine.add_request("p", _prompt(5), _params())
    engine.submit_action(SteeringScaleUpdate(0.0, request_id="g"), "c")
    prefill_only = {"vectors": [{"layers": [0], "vector": [1.0] * H, "phase": "prefill"}]}
    engine.submit_action(RequestSteeringOverride("p", prefill_only), "c")
    _run(engine, {})
    snap = engine.steering_snapshot()["queue"]
    assert snap["rejected"] == {"c": 2}
    assert "decode tokens only" in snap["last_rejection"]["c"]


def test_latches_belong_to_each_sample(path):
    """With n=2, a gate that latches in one sample leaves the other sample's tokens alone."""
    prompt, probe, v = _prompt(62), _vec(62, H, norm=1.0), _vec(63, H, norm=8.0)
    read = [{"probe": probe.tolist(), "layer": 1, "site": "post_attn", "name": "p"}]
    sampled = dict(n=2, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=1)
    base = _run(_engine(path), {"r": (prompt, SamplingParams(**sampled, readouts=read))})["r"]
    scores = [[d["p"] for d in o.readouts] for o in base.outputs]
    # fire in exactly one sample: a threshold between the two samples' maxima
    hi, lo = (
        max(range(2), key=lambda i: max(scores[i][1:])),
        min(range(2), key=lambda i: max(scores[i][1:])),
    )
    threshold = (max(scores[hi][1:]) + max(scores[lo][1:])) / 2
    gate = {
        "when": {
            "probe": probe.tolist(),
            "layer": 1,
            "site": "post_attn",
            "threshold": threshold,
            "sharpness": 1e6,
        },
        "scope": "rest_of_request",
        "apply": {"add": {"vector": v.tolist()}},
    }
    out = _run(
        _engine(path),
        {"g": (prompt, SamplingParams(**sampled, readouts=read, steering={"gates": [gate]}))},
    )["g"]
    assert out.outputs[lo].token_ids == base.outputs[lo].token_ids
    _assert_close(out.outputs[lo].logprobs, base.outputs[lo].logprobs)
    assert out.outputs[hi].logprobs != base.outputs[hi].logprobs


def test_a_vector_updates_scale_multiplies_its_vector(path):
    """`SteeringVectorUpdate(v, scale=3)` steers exactly as `3v` at scale 1, and not as `v`."""
    prompt, v = _prompt(64), _vec(64, H, norm=2.0)

    def steered(vector: torch.Tensor, scale: float) -> list[dict[int, float]]:
        engine = _engine(path)
        engine.submit_action(SteeringVectorUpdate("post_block", [1], vector.tolist(), scale))
        return _step_logprobs(_run(engine, {"s": (prompt, _params())})["s"])

    scaled, tripled, unscaled = steered(v, 3.0), steered(3 * v, 1.0), steered(v, 1.0)
    _assert_close(scaled, tripled)
    assert scaled != unscaled


def test_capture_reaches_exactly_the_last_position_fed_through_the_model(path):
    """With max_tokens 4 the model is fed the prompt and 3 generated tokens (the 4th is only
    sampled): a capture at that last fed position is served, one past it refused."""
    prompt = _prompt(65)
    last = len(prompt) + 4 - 2
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    at_last = {"sites": {"post_block": [0]}, "positions": [last]}
    engine = _engine(path)
    out = _run(engine, {"c": (prompt, SamplingParams(**params, capture=at_last))})["c"]
    assert out.capture_positions == [last]
    assert out.captures["0.post_block"].shape == (1, H)
    past = {"sites": {"post_block": [0]}, "positions": [last + 1]}
    with pytest.raises(InvalidRequestError, match="never computed"):
        engine.add_request("d", prompt, SamplingParams(**params, capture=past))
