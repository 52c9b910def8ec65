"""Engine behaviour a user would notice, on a real tiny checkpoint (CPU, float32)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import pytest

from services.common.errors import (
    CheckpointError,
    InvalidRequestError,
    PromptTooLongError,
    RequestNotFoundError,
    UnsupportedArchitectureError,
)
from services.engine import (
    LLM,
    AsyncLLM,
    EngineConfig,
    LLMEngine,
    OutputAccumulator,
    SamplingParams,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The harbour master kept a log", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens when run by itself: the reference for batch isolation."""
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


# -- bad input --------------------------------------------------------------------------


def _drain(engine: LLMEngine, totals: OutputAccumulator | None = None) -> dict[str, list[int]]:
    """Step until idle; each finished request's tokens (`totals`: what earlier steps gave)."""
    totals = totals or OutputAccumulator()
    done = {}
    while engine.has_unfinished_requests():
        for out in totals.finished(engine.step()):
            done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ("", GREEDY, InvalidRequestError, "empty"),
        ([], GREEDY, InvalidRequestError, "empty"),
        ([1] * 600, GREEDY, PromptTooLongError, "600 tokens"),
        ([1, 10**6], GREEDY, InvalidRequestError, "out of range"),
        (
            "hi",
            SamplingParams(max_tokens=4, logprob_token_ids=[10**6]),
            InvalidRequestError,
            "logprob_token_ids",
        ),
        (3.5, GREEDY, InvalidRequestError, "string or a list of token ids"),
    ],
)
def test_bad_request_is_rejected_and_the_batch_runs_on(
    model_dir, alone, prompt, params, error, message
):
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    totals = OutputAccumulator()
    totals.finished(engine.step())
    totals.finished(engine.step())
    with pytest.raises(error, match=message):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.requests
    done = _drain(engine, totals)
    assert [done[str(i)] for i in range(len(PROMPTS))] == alone


def test_invalid_sampling_values_raise_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError, match="top_p"):
        llm.generate(PROMPTS, SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequestError, match="prompt 1: the prompt is empty"):
        llm.generate(["ok", ""], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_late_in_a_long_call_leaves_nothing_queued(model_dir, alone):
    """A bad prompt after many good ones fails the call by its index, the call's queued
    requests are aborted, and the engine serves the next call as if it never ran."""
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=64)
    prompts = [" ".join(["token"] * 40)] * 30
    with pytest.raises(InvalidRequestError, match="prompt 30: the prompt is empty"):
        llm.generate([*prompts, ""], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_generate_admits_prompts_as_the_engine_reaches_them(model_dir):
    """`LLM.generate` admits one step's token budget of prompts before the first step (so
    it starts as soon as it can) and the rest between steps (on a GPU, while the device
    computes), and every prompt gets what it gets in a call of its own."""
    budget = 64
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=budget)
    prompts = [f"{w} " * (20 + i) for i, w in enumerate(["harbour", "log", "tide"] * 4)]
    want = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    engine, seen, first_wave = llm.engine, [], []

    def step():
        seen.append(len(engine.requests))  # admitted and unfinished, as the step starts
        if len(seen) == 1:  # in the order admitted
            first_wave.extend(len(g.prompt_token_ids) for g in engine.requests.values())
        return type(engine).step(engine)

    engine.step = step
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        del engine.step
    assert [o.outputs[0].token_ids for o in outs] == want
    assert seen[0] < len(prompts), "every prompt was admitted before the first step"
    assert sum(first_wave[:-1]) < budget <= sum(first_wave), first_wave  # one step's worth
    assert max(seen) > seen[0], "no prompt was admitted between steps"


def test_generate_progress_counts_every_prompt_not_the_first_wave(model_dir, capsys):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=64)
    llm.generate([f"{w} " * 30 for w in ["harbour", "log", "tide"] * 3], GREEDY, use_tqdm=True)
    assert "9/9" in capsys.readouterr().err


def test_duplicate_and_unknown_request_ids(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(device="cpu"))
    engine.add_request("x", "hello", GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", "hello", GREEDY)
    with pytest.raises(RequestNotFoundError, match="nope"):
        engine.abort("nope")


def test_missing_and_broken_checkpoints(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    with pytest.raises(CheckpointError, match=r"does not exist|no config\.json"):
        LLM(tmp_path / "nowhere", device="cpu")

    no_weights = tmp_path / "no_weights"
    shutil.copytree(src, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        LLM(no_weights, device="cpu")

    sharded = tiny_checkpoint("llama", shards=3)
    lost_shard = tmp_path / "lost_shard"
    shutil.copytree(sharded, lost_shard)
    victim = sorted(lost_shard.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        LLM(lost_shard, device="cpu")

    missing_tensor = tmp_path / "missing_tensor"
    shutil.copytree(src, missing_tensor)
    from safetensors.torch import load_file, save_file

    tensors = load_file(missing_tensor / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, missing_tensor / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(missing_tensor, device="cpu")

    unknown = tmp_path / "unknown_arch"
    shutil.copytree(src, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3ForCausalLM"):
        LLM(unknown, device="cpu")


def test_sharded_and_bf16_checkpoints_load_to_the_same_model(tiny_checkpoint):
    ref = LLM(tiny_checkpoint("llama"), device="cpu").generate(PROMPTS, GREEDY)
    sharded = LLM(tiny_checkpoint("llama", shards=3), device="cpu").generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in ref]
    # A bf16 checkpoint upcast to float32 runs; the weights differ only by rounding.
    bf16 = LLM(tiny_checkpoint("llama", dtype="bfloat16"), device="cpu", dtype="float32")
    out = bf16.generate(PROMPTS[:1], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


# -- sampling features ------------------------------------------------------------------


def test_stop_strings_token_ids_and_eos(model_dir, llm, alone, tmp_path):
    ids = alone[0]
    text = llm.tokenizer.decode(ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < len(ids)

    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[4]], ignore_eos=True),
    )
    got = out[0].outputs[0]
    assert got.token_ids == ids[: ids.index(ids[4]) + 1]
    assert got.finish_reason == "stop" and got.stop_reason == ids[4]

    # EOS comes from generation_config.json; ignore_eos runs past it.
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    gen = json.loads((eos_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [ids[3]]
    (eos_dir / "generation_config.json").write_text(json.dumps(gen))
    eos_llm = LLM(eos_dir, device="cpu")
    stopped = eos_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))
    assert stopped[0].outputs[0].token_ids == ids[: ids.index(ids[3]) + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"
    assert eos_llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == ids


def test_seeds_are_reproducible_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=42)
    solo = llm.generate([PROMPTS[0]], p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=1.0)
    batched = llm.generate(PROMPTS, [p, others, others])[0].outputs[0].token_ids
    assert solo == batched
    other_seed = (
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=1.0, seed=43))[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != solo


def test_streamed_text_equals_a_full_decode(llm):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"text-{i}", p, params)
    totals = OutputAccumulator()
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = totals.add(out).outputs[0]
            full = llm.tokenizer.decode(c.token_ids)
            # Incremental text is the full decode, less at most an incomplete character.
            assert full.startswith(c.text)
            held_back = full[len(c.text) :]
            assert held_back == "" or "\ufffd" in held_back, (c.text, full)


def test_n_samples_share_prompt_blocks(model_dir, alone):
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", enable_prefix_caching=False))
    prompt = " ".join(PROMPTS * 3)  # > 2 blocks
    engine.add_request("r", prompt, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1))
    seqs = engine.requests["r"].seqs
    totals = OutputAccumulator()
    while seqs[0].num_generated == 0:  # steps overlap: the first token may come a call later
        # prefill of sample 0; once it has its token, 1 and 2 fork off it
        totals.finished(engine.step())
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert all(engine.block_manager.ref_counts[b] == 3 for b in shared)
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = totals.add(out)
    assert final.finished and len(final.outputs) == 3
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent samples
    greedy = LLMEngine(model_dir, EngineConfig(device="cpu"))
    greedy.add_request(
        "g", PROMPTS[0], SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    done = []
    totals = OutputAccumulator()
    while greedy.has_unfinished_requests():
        done += totals.finished(greedy.step())
    assert [c.token_ids for c in done[0].outputs] == [alone[0], alone[0]]


def test_prompt_logprobs_are_complete_even_on_a_cache_hit(llm):
    p = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    long = " ".join(PROMPTS * 4)
    first = llm.generate([long], p)[0]
    second = llm.generate([long], p)[0]
    assert len(second.prompt_logprobs) == len(second.prompt_token_ids)
    assert second.prompt_logprobs == first.prompt_logprobs


def test_abort_frees_every_block(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", enable_prefix_caching=False))
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    out = engine.abort("a")
    assert out.finished and out.samples[0].finish_reason == "abort"
    _drain(engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_chat_template_encoding_matches_transformers(model_dir, llm):
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    expected = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert llm.tokenizer.encode_chat(msgs) == list(expected)
    out = llm.chat(msgs, GREEDY)[0]
    assert out.prompt_token_ids == list(expected)


def test_async_llm_streams_and_matches_offline(model_dir, alone):
    async def main():
        llm = AsyncLLM(model_dir, device="cpu")
        try:

            async def collect(p):
                seen, totals = [], OutputAccumulator()
                async for delta in llm.generate(p, GREEDY):
                    seen.append(len(delta.samples[0].token_ids))
                    out = totals.add(delta)
                return seen, out

            results = await asyncio.gather(*(collect(p) for p in PROMPTS))
            # Closing a stream early aborts the request and frees its blocks.
            long = SamplingParams(max_tokens=100, ignore_eos=True)
            async with contextlib.aclosing(llm.generate(PROMPTS[0], long)) as stream:
                async for _ in stream:
                    break
            with pytest.raises(InvalidRequestError):
                async for _ in llm.generate("", GREEDY):
                    pass
            for _ in range(1000):  # the abort applies between steps, in the engine thread
                if not llm.stats()["num_running"]:
                    break
                await asyncio.sleep(0.01)
            return results, llm.stats()
        finally:
            llm.shutdown()

    results, stats = asyncio.run(main())
    for (lengths, final), ref in zip(results, alone, strict=True):
        assert sum(lengths) == len(ref) and len(lengths) > 1  # each delta: its steps' tokens
        assert final.finished and final.outputs[0].token_ids == ref
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


# -- admission resolved off the engine thread ---------------------------------------------


def _steered_logprobs(engine: LLMEngine, rid: str) -> list[float]:
    """Run to completion; the request's chosen tokens' logprobs."""
    totals, out = OutputAccumulator(), None
    while engine.has_unfinished_requests():
        for o in totals.finished(engine.step()):
            if o.request_id == rid:
                out = o
    assert out is not None
    return [next(iter(lp.values())) for lp in out.outputs[0].logprobs]


def test_a_request_resolved_before_a_global_steering_change_runs_under_the_new_one(
    model_dir,
):
    """`prepare_request` (which `AsyncLLM` runs off the engine thread) resolves a request;
    `add_prepared` queues it under the global steering of that moment. A request resolved
    before a change and queued after it runs exactly as one added after it, even with the
    unsteered prompt already in the prefix cache (whose signature must not match)."""
    hidden = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    H = hidden.model_config.hidden_size
    steer = {"vectors": [{"site": "post_block", "layers": [0], "vector": [0.5] * H, "scale": 4.0}]}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = list(range(5, 45))  # whole KV blocks, cacheable

    def warm_engine() -> LLMEngine:
        engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32"))
        engine.add_request("plain", prompt, params)
        _drain(engine)  # the unsteered prompt's blocks are cached now
        return engine

    engine = warm_engine()
    plain = engine.prepare_request("early", prompt, params)
    engine.set_global_steering(steer)
    engine.step()  # the update lands at the top of a step
    engine.add_prepared(plain)
    early = _steered_logprobs(engine, "early")

    reference = warm_engine()
    reference.set_global_steering(steer)
    reference.step()
    reference.add_request("late", prompt, params)
    late = _steered_logprobs(reference, "late")

    unsteered = warm_engine()
    unsteered.add_request("none", prompt, params)
    assert early == late
    assert early != _steered_logprobs(unsteered, "none")
