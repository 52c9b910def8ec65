"""`EngineService`: the seam the HTTP and gRPC front ends call, over a real tiny engine."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from services.common.errors import (
    InvalidRequestError,
    NotFoundError,
    PromptTooLongError,
    RunNotFoundError,
    TooLargeError,
)
from services.common.wire import unpack_tensor
from services.engine import OutputAccumulator, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.service import (
    MAX_PROMPT_BYTES,
    MIN_PROMPT_BYTES,
    PROMPT_BYTES_PER_TOKEN,
    EngineService,
    _Throughput,
    default_max_prompt_bytes,
)
from services.engine.sweep import Sweep, SweepSpec
from services.patch_store.store import PatchStore

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256)
PROMPT = [21, 300, 45, 99, 180, 7, 64, 410]
H = 64


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def service(path):
    svc = EngineService.from_model(path, model_id="tiny", **ENGINE)
    yield svc
    svc.llm.shutdown()


def _run(coro):
    return asyncio.run(coro)


async def _collect(agen) -> list:
    return [x async for x in agen]


def _idle(svc: EngineService, timeout_s: float = 10.0) -> bool:
    """Whether the engine has no unfinished requests (aborts apply between steps: wait)."""
    deadline = time.monotonic() + timeout_s
    while svc.llm.call(lambda e: bool(e.requests)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_model_card_and_health(service):
    card = service.model_card()
    assert card["id"] == "tiny" and card["hidden_size"] == H and card["num_layers"] == 2
    assert card["sites"] == ["pre_attn", "post_attn", "post_block"]
    assert card["dtype"] == "float32" and card["device"] == "cpu"
    assert service.health()["status"] == "ok"


def test_generate_streams_to_the_offline_result(service, path):
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1)
    deltas = _run(_collect(service.generate(PROMPT, params)))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    totals = OutputAccumulator()
    got = [totals.add(d) for d in deltas][-1].outputs[0]
    want = LLM(path, **ENGINE).generate([PROMPT], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs[-1] == pytest.approx(want.logprobs[-1], abs=1e-4)


def test_bad_requests_raise_before_anything_is_yielded(service):
    async def first(prompt, params):
        async for out in service.generate(prompt, params):
            return out

    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        _run(first(PROMPT, SamplingParams(n=1000)))
    with pytest.raises(InvalidRequestError, match="out of range"):
        _run(first([10**6], SamplingParams()))
    assert _idle(service)


def test_closing_a_stream_early_aborts_its_request(service):
    async def one_step():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        agen = service.generate(PROMPT, params, request_id="early")
        out = await anext(agen)
        await agen.aclose()
        return out

    assert not _run(one_step()).finished
    assert _idle(service)


def test_global_steering_is_checked_now_and_recorded(service):
    vec = torch.ones(H).tolist()
    try:
        state = _run(service.set_global_steering({"vectors": [{"layers": [0], "vector": vec}]}))
        assert state["global_spec"]["vectors"][0]["vector"] == vec
        with pytest.raises(InvalidRequestError, match="no gates/aborts"):
            _run(service.set_global_steering({"abort_when": {"probe": vec, "layer": 0}}))
        assert service.steering_state()["global_spec"]["vectors"][0]["layers"] == [0]
    finally:
        cleared = _run(service.clear_global_steering())
    assert cleared["global_spec"] is None


def test_vector_registry(service):
    per_layer = {0: torch.full((H,), 0.5), 1: torch.full((H,), -1.0)}
    info = service.register_vector("pl", per_layer)
    assert info == {"name": "pl", "hidden_size": H, "layers": [0, 1], "source": "api"}
    got = service.get_vector("pl")
    torch.testing.assert_close(unpack_tensor(got["value"]), torch.stack(list(per_layer.values())))
    assert [v["name"] for v in service.list_vectors()] == ["pl"]
    with pytest.raises(InvalidRequestError, match="already registered"):
        service.register_vector("pl", per_layer)
    assert service.unregister_vector("pl")["name"] == "pl"
    with pytest.raises(NotFoundError):
        service.get_vector("pl")
    with pytest.raises(NotFoundError):
        service.unregister_vector("pl")


def test_drop_patch_source_needs_a_store_and_a_known_run(service, path):
    with pytest.raises(InvalidRequestError, match="no patch-source store"):
        service.drop_patch_source("r")
    store = PatchStore(budget_bytes=2**20)
    with_store = EngineService.from_model(path, patch_store=store, **ENGINE)
    try:
        capture = {"sites": {"post_block": [1]}, "positions": "all_prompt"}
        params = SamplingParams(max_tokens=1, capture=capture | {"sink": "patch_store", "run": "r"})
        out = _run(_collect(with_store.generate(PROMPT, params)))[-1]
        assert out.capture_run == "r"
        assert with_store.drop_patch_source("r")["bytes_freed"] == len(PROMPT) * H * 4
        with pytest.raises(RunNotFoundError):
            with_store.drop_patch_source("r")
    finally:
        with_store.llm.shutdown()


SPEC = SweepSpec(
    corrupt_prompt=[*PROMPT[:3], 222, *PROMPT[4:]],
    clean_prompt=PROMPT,
    answer_token=17,
    foil_token=42,
    metric="logit_diff",
    layers=[0, 1],
    positions=[2, 3, 5],
)


def test_a_sweep_runs_as_traffic_beside_other_requests(service, path):
    async def both():
        side = asyncio.ensure_future(
            _collect(service.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)))
        )
        events = await _collect(service.patch_sweep(SPEC))
        return events, await side

    events, side = _run(both())
    assert side[-1].finished and sum(len(d.samples[0].token_ids) for d in side) == 40
    assert [e["event"] for e in events] == ["cell"] * 6 + ["summary"]
    ref = Sweep(LLMEngine(path, EngineConfig(**ENGINE)), SPEC).run()
    summary = events[-1]
    got = torch.tensor(summary["grid"], dtype=torch.float64)
    torch.testing.assert_close(got, torch.from_numpy(ref.grid), atol=1e-4, rtol=0)
    assert summary["argmax"]["value"] == pytest.approx(ref.argmax.value, abs=1e-4)
    assert summary["alignment"] == ref.alignment and summary["void"] == []


def test_closing_a_sweep_early_aborts_its_cells(service):
    async def first_cell():
        agen = service.patch_sweep(SPEC)
        event = await anext(agen)
        await agen.aclose()
        return event

    assert _run(first_cell())["event"] == "cell"
    assert _idle(service)


def test_a_cell_aborted_by_someone_else_is_void_not_a_value(path):
    # A token budget smaller than a prompt: every cell spans several steps, so after some
    # step one is live (not yet finished) for the listener to abort.
    svc = EngineService.from_model(path, max_num_batched_tokens=4, **ENGINE)
    aborted: list[str] = []

    def abort_one_cell(_outputs) -> None:  # the engine thread, after a step (lock released)
        live = [r for r in svc.engine.requests if ".post_block." in r]  # cells, not baselines
        if live and not aborted:
            aborted.append(live[0])
            svc.llm.abort(live[0])

    svc.llm.add_listener(abort_one_cell)
    try:
        events = _run(_collect(svc.patch_sweep(SPEC)))
        assert _idle(svc)
    finally:
        svc.llm.shutdown()
    summary = events[-1]
    assert len(aborted) == 1 and len(summary["void"]) == 1
    assert "abort" in summary["void"][0]["void"]
    grid = summary["grid"][0]
    assert sum(v is None for row in grid for v in row) == 1  # never a value for it
    assert sum(e["event"] == "cell" for e in events) == 6


def test_throughput_is_averaged_over_the_window(path):
    engine = LLMEngine(path, EngineConfig(**ENGINE))
    now = [100.0]
    rates = _Throughput(engine, window_s=10.0, clock=lambda: now[0])
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    calls = 0
    while engine.has_unfinished_requests():
        engine.step()
        now[0] += 0.5
        rates.on_step([])
        calls += 1
    got = rates.rates()  # 5 tokens and the 8-token prompt over the time since the start
    assert got["generation_tokens_per_s"] == pytest.approx(5 / (0.5 * calls))
    assert got["prompt_tokens_per_s"] == pytest.approx(len(PROMPT) / (0.5 * calls))
    now[0] += 30.0  # nothing happened for longer than the window
    assert rates.rates()["generation_tokens_per_s"] == 0.0
    assert not math.isnan(rates.rates()["prompt_tokens_per_s"])


# -- limits before work: prompt size, context, Unicode ---------------------------------------


def test_the_prompt_size_limit_defaults_from_the_context_and_is_configurable(service, path):
    assert service.max_prompt_bytes == default_max_prompt_bytes(256) == MIN_PROMPT_BYTES
    assert service.model_card()["max_prompt_bytes"] == service.max_prompt_bytes
    assert default_max_prompt_bytes(131072) == PROMPT_BYTES_PER_TOKEN * 131072
    assert default_max_prompt_bytes(10**7) == MAX_PROMPT_BYTES  # the hard cap
    svc = EngineService.from_model(path, model_id="tiny", max_prompt_bytes=1000, **ENGINE)
    try:
        with pytest.raises(TooLargeError, match="limit of 1000 bytes") as exc:
            _run(_collect(svc.generate("é" * 501, SamplingParams(max_tokens=1))))  # 1002 bytes
        assert exc.value.http_status == 413 and "1002 bytes" in str(exc.value)
        out = _run(_collect(svc.generate("é" * 100, SamplingParams(max_tokens=1))))
        assert out[-1].finished
    finally:
        svc.llm.shutdown()


def test_a_huge_prompt_is_refused_before_it_is_tokenized(service):
    # 32 MB: tokenizing it would take minutes and then fail on the context; refused unread.
    huge = "word " * (32 * 2**20 // 5)
    with pytest.raises(TooLargeError, match=f"limit of {service.max_prompt_bytes} bytes"):
        _run(_collect(service.generate(huge, SamplingParams(max_tokens=1))))
    with pytest.raises(TooLargeError, match="max_prompt_bytes"):
        service.encode_chat([{"role": "user", "content": huge}])
    assert _idle(service)


def test_a_long_prompt_is_tokenized_while_other_requests_step(path):
    """Tokenizing runs in a worker thread that releases the GIL, so a prompt that takes
    long to tokenize (and then does not fit the context) never holds up another request:
    a short request started first finishes before the long prompt is even refused."""
    svc = EngineService.from_model(path, model_id="tiny", max_prompt_bytes=2**23, **ENGINE)
    long_prompt = "a few words " * (2**19 // 12)  # ~512 KB, ~300k tokens
    events: list[str] = []

    async def short() -> None:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        async for out in svc.generate(PROMPT, params):
            # The first delta carries one token, or more if the reader fell behind.
            if out.samples[0].token_ids and "short started" not in events:
                events.append("short started")
        events.append("short finished")

    async def long() -> None:
        with pytest.raises(PromptTooLongError, match="the model's context is 256"):
            await _collect(svc.generate(long_prompt, SamplingParams(max_tokens=1)))
        events.append("long refused")

    async def both() -> None:
        task = asyncio.create_task(short())
        while "short started" not in events:
            await asyncio.sleep(0)
        await asyncio.gather(long(), task)

    try:
        _run(both())
    finally:
        svc.llm.shutdown()
    assert events == ["short started", "short finished", "long refused"]


def test_max_tokens_past_the_context_is_refused_like_vllm(service):
    with pytest.raises(PromptTooLongError) as exc:
        _run(_collect(service.generate(PROMPT, SamplingParams(max_tokens=250))))
    msg = str(exc.value)
    assert "max_tokens is too large: 250" in msg and "context length is 256 tokens" in msg
    assert f"{len(PROMPT)} input tokens" in msg
    fits = _run(_collect(service.generate(PROMPT, SamplingParams(max_tokens=248))))  # 8 + 248
    assert fits[-1].finished
    with pytest.raises(PromptTooLongError, match="the prompt has 300 tokens"):
        _run(_collect(service.generate([5] * 300, SamplingParams(max_tokens=None))))
    assert _idle(service)


@pytest.mark.parametrize("prompt", ["", "a\ud800b"])
def test_empty_and_invalid_unicode_prompts_are_bad_requests(service, prompt):
    message = "is empty" if not prompt else r"not valid Unicode: a lone surrogate \(U\+D800\)"
    with pytest.raises(InvalidRequestError, match=message) as exc:
        _run(_collect(service.generate(prompt, SamplingParams(max_tokens=1))))
    assert exc.value.http_status == 400
    assert _idle(service)


def test_a_lone_surrogate_is_a_bad_request_wherever_text_is_tokenized(service):
    bad = "a\ud800b"
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content is not valid"):
        service.encode_chat([{"role": "user", "content": "hi"}, {"role": "user", "content": bad}])
    with pytest.raises(InvalidRequestError, match="corrupt_prompt is not valid Unicode"):
        _run(_collect(service.patch_sweep(SweepSpec(corrupt_prompt=bad, answer_token=5))))
    with pytest.raises(InvalidRequestError, match="lone surrogate"):  # the tokenizer itself
        service.engine.tokenizer.encode(bad)
    # a prompt tokenized off the engine thread keeps its text in the outputs (the first)
    out = _run(_collect(service.generate("hello there", SamplingParams(max_tokens=1))))
    assert out[0].prompt == "hello there"
