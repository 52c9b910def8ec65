"""Decoding text outside the engine (`services/engine/detokenizer.py`): deltas the engine sent
without text (`detokenize=False`), filled in by `DeltaDetokenizer`, carry the text the engine
would have decoded, delta by delta, whatever the sampling, the samples and the merging."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequestError
from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.detokenizer import DeltaDetokenizer, detokenize_here
from services.engine.outputs import RequestDelta

PROMPTS = ["the quick brown fox", "héllo wörld ✓", "1 2 3", "a"]


def _deltas(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[RequestDelta]]:
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    out: dict[str, list[RequestDelta]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    return out


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(tiny_checkpoint("llama"), EngineConfig(device="cpu", dtype="float32"))


@pytest.mark.parametrize("skip_special", [True, False])
def test_deltas_filled_outside_the_engine_carry_the_engines_text(engine, skip_special):
    """Sampled at temperature 1 over a byte-level vocabulary, the tokens end mid-character
    often; two samples a request, each with its own window."""
    params = [
        SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=i, ignore_eos=True,
                       skip_special_tokens=skip_special)
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    want = _deltas(engine, params)
    split = 0  # tokens that end inside a character: their text waits for the next
    for deltas in want.values():
        for index in (0, 1):
            ids = [t for d in deltas for s in d.samples if s.index == index for t in s.token_ids]
            text = "".join(s.text for d in deltas for s in d.samples if s.index == index)
            full = engine.tokenizer.decode(ids, skip_special)
            assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}
            split += sum("\ufffd" in engine.tokenizer.decode([t], skip_special) for t in ids)
    assert split > 0
    sent = [detokenize_here(p, engine.tokenizer) for p in params]
    assert all(not s.detokenize and d is not None for s, d in sent)
    got = _deltas(engine, [s for s, _ in sent])
    assert got.keys() == want.keys()
    texts = 0
    for (rid, deltas), (_, detokenizer) in zip(sorted(got.items()), sent, strict=True):
        assert all(s.text == "" for d in deltas for s in d.samples)  # the engine decoded none
        for g, w in zip(deltas, want[rid], strict=True):
            detokenizer.fill(g)
            for gs, ws in zip(g.samples, w.samples, strict=True):
                assert gs.token_ids == ws.token_ids and gs.text == ws.text
                texts += bool(ws.text)
    assert texts > 0


def test_merged_deltas_fill_to_the_same_text(engine):
    """A slow reader's stream merges the deltas it has not taken: filled after merging, a
    sample's text is still the engine's."""
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    want = _deltas(engine, params)
    sent = [detokenize_here(p, engine.tokenizer) for p in params]
    got = _deltas(engine, [s for s, _ in sent])
    for (rid, deltas), (_, detokenizer) in zip(sorted(got.items()), sent, strict=True):
        merged = deltas[0].detached()
        for d in deltas[1:4]:
            merged.merge(d)
        text = detokenizer.fill(merged).samples[0].text
        text += "".join(detokenizer.fill(d).samples[0].text for d in deltas[4:])
        assert text == "".join(d.samples[0].text for d in want[rid])


def test_the_engine_keeps_the_text_that_stop_strings_are_matched_in(engine):
    stop = SamplingParams(max_tokens=8, stop=["zz"])
    sent, detokenizer = detokenize_here(stop, engine.tokenizer)
    assert sent is stop and detokenizer is None
    assert detokenize_here(SamplingParams(), None)[1] is None  # no tokenizer here
    with pytest.raises(InvalidRequestError, match=r"stop strings .* need detokenize"):
        SamplingParams(stop=["zz"], detokenize=False)


def test_a_caller_that_wants_ids_only_gets_no_text(engine):
    [got] = _deltas_one(engine, SamplingParams(max_tokens=6, temperature=0, detokenize=False))
    [want] = _deltas_one(engine, SamplingParams(max_tokens=6, temperature=0))
    assert got.token_ids == want.token_ids and want.text and got.text == ""


def _deltas_one(engine: LLMEngine, params: SamplingParams):
    engine.add_request("one", PROMPTS[0], params)
    samples = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            samples += d.samples
    text = "".join(s.text for s in samples)
    ids = [t for s in samples for t in s.token_ids]
    return [type(samples[0])(index=0, token_offset=0, token_ids=ids, text=text)]


def test_a_stop_token_ends_the_text_alike(engine):
    """A stop token id is matched on ids, so the front end may decode its request: the text
    up to and with the stop token is the engine's."""
    [greedy] = _deltas_one(engine, SamplingParams(max_tokens=8, temperature=0))
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[greedy.token_ids[3]])
    want = _deltas(engine, [params] * len(PROMPTS))
    sent, _ = detokenize_here(params, engine.tokenizer)
    got = _deltas(engine, [sent] * len(PROMPTS))
    assert want["r0"][-1].samples[0].finish_reason == "stop"
    for rid, deltas in want.items():
        filler = DeltaDetokenizer(engine.tokenizer, params.skip_special_tokens)
        texts = [s.text for d in got[rid] for s in filler.fill(d).samples]
        assert texts == [s.text for d in deltas for s in d.samples]
