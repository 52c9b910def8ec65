"""The engine's outputs are per-step deltas: each carries only what its step added, they add
up to the whole output, and no delta ever takes back text an earlier one sent."""

from __future__ import annotations

import copy

import pytest

from services.engine import EngineConfig, LLMEngine, OutputAccumulator, SamplingParams

PROMPTS = ["The harbour master kept a log", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _deltas(model_dir, params: SamplingParams, **config) -> list[list]:
    """Every step's deltas of PROMPTS run together, in step order."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", **config))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def _totals(steps: list[list]) -> dict:
    totals = OutputAccumulator()
    return {out.request_id: out for step in steps for out in totals.finished(step)}


@pytest.mark.parametrize("overlap", [True, False])
def test_each_delta_carries_only_its_steps_tokens(model_dir, overlap):
    params = SamplingParams(
        n=2, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, logprobs=2
    )
    steps = _deltas(model_dir, params, async_scheduling=overlap)
    sent: dict[tuple[str, int], int] = {}
    for step in steps:
        for delta in step:
            assert len({s.index for s in delta.samples}) == len(delta.samples)
            for s in delta.samples:
                key = (delta.request_id, s.index)
                # one decode step accepts at most one token per sample, placed by its offset
                assert len(s.token_ids) <= 1 and s.token_offset == sent.get(key, 0)
                assert len(s.logprobs) == len(s.token_ids)
                sent[key] = s.token_offset + len(s.token_ids)
    assert sorted(sent.values()) == [10] * 6
    finals = _totals(steps)
    assert sorted(finals) == ["0", "1", "2"]
    assert all(
        len(c.token_ids) == len(c.logprobs) == 10 for o in finals.values() for c in o.outputs
    )


def test_deltas_add_up_to_the_same_output_with_and_without_overlap(model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    overlapped = _totals(_deltas(model_dir, params))
    stepwise = _totals(_deltas(model_dir, params, async_scheduling=False))
    for rid, out in stepwise.items():
        got = overlapped[rid].outputs[0]
        assert (got.token_ids, got.text) == (out.outputs[0].token_ids, out.outputs[0].text)
        assert got.logprobs[-1] == pytest.approx(out.outputs[0].logprobs[-1], abs=1e-4)


def test_text_a_stop_string_cuts_is_never_sent(model_dir):
    """A stop string that spans several tokens is held back while it may still form: the
    streamed text is exactly the final text, with nothing sent and then taken back."""
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = _totals(_deltas(model_dir, plain))["1"].outputs[0].text
    # A stop string that starts in the middle of the text and spans a token boundary.
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    assert len(stop) == 6
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    streamed, finished = "", None
    for step in _deltas(model_dir, params):
        for delta in step:
            if delta.request_id == "1":
                for s in delta.samples:
                    streamed += s.text
                    finished = s.finish_reason or finished
                    assert stop not in streamed
    assert finished == "stop"
    assert streamed == text[: text.index(stop)]


def test_the_longest_of_several_stop_strings_sets_how_much_is_held_back(model_dir):
    """With stop strings of unequal length, text is held back by the longest one's length:
    a short stop string that never matches must not let the start of a long one stream."""
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = _totals(_deltas(model_dir, plain))["1"].outputs[0].text
    long_stop = text[len(text) // 2 : len(text) // 2 + 12]
    assert len(long_stop) == 12
    short_stop = next(c for c in "xqz#~" if c not in text)
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=[short_stop, long_stop]
    )
    steps = _deltas(model_dir, params)
    streamed = "".join(
        s.text for step in steps for delta in step if delta.request_id == "1" for s in delta.samples
    )
    final = _totals(steps)["1"].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", long_stop)
    assert streamed == final.text == text[: text.index(long_stop)]


def test_merged_deltas_say_what_the_deltas_did(model_dir):
    """A slow reader's waiting deltas merge into one; adding it equals adding each."""
    params = SamplingParams(
        n=2, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    steps = _deltas(model_dir, params)
    one_by_one = _totals(steps)
    delivered = copy.deepcopy(steps)
    merged: dict = {}
    for step in steps:
        for delta in step:
            if delta.request_id in merged:
                merged[delta.request_id].merge(delta)
            else:
                merged[delta.request_id] = delta.detached()
    assert steps == delivered  # merging changed no delta a listener may still hold
    totals = OutputAccumulator()
    for rid, delta in merged.items():
        assert delta.finished and sorted(s.index for s in delta.samples) == [0, 1]
        assert totals.add(delta) == one_by_one[rid]
