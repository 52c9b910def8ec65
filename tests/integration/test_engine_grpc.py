"""The engine's gRPC services over a real loopback server: a real `EngineService` on a tiny
checkpoint, driven through `CoxswainClient`, checked against offline runs of the same
checkpoint (logprobs, captured tensors, sweep cells), plus auth, errors and cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.client import AsyncCoxswainClient, CoxswainClient
from services.common.auth import ApiKeys
from services.common.errors import (
    GRPC_ERROR_METADATA_KEY,
    DuplicateRequestError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RunNotFoundError,
    UnauthenticatedError,
)
from services.engine import LLM, OutputAccumulator, SamplingParams
from services.engine.outputs import CompletionDelta, RequestDelta, RequestOutput
from services.engine.service import EngineService
from services.engine.sweep import Cell, Sweep, SweepResult, SweepSpec
from services.gateway import grpc_convert as convert
from services.gateway.grpc_server import (
    REQUEST_ID_METADATA_KEY,
    SERVICE_NAMES,
    serve_engine_grpc,
)
from services.patch_store.store import PatchStore
from services.proto.coxswain.v1 import engine_pb2 as pb
from services.proto.coxswain.v1 import engine_pb2_grpc as pb_grpc
from services.proto.coxswain.v1 import steering_pb2 as steering_pb
from services.proto.coxswain.v1 import steering_pb2_grpc as steering_grpc

H = 64
ADMIN_KEY = "admin-secret-000000"
READ_KEY = "read-secret-0000000"
PROMPT = [11, 305, 97, 402, 23, 188, 61, 250, 7, 144]
GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def _vec(seed: int, norm: float = 4.0) -> torch.Tensor:
    v = torch.randn(H, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


class _LoopThread:
    """An asyncio event loop in a daemon thread: the server's home, as in a real process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Served:
    def __init__(self, loop: _LoopThread, service: EngineService, server, port: int):
        self.loop, self.service, self.server, self.port = loop, service, server, port
        self.address = f"127.0.0.1:{port}"

    def client(self, key: str | None = ADMIN_KEY) -> CoxswainClient:
        # A stream deadline too, so a stream that never ends fails instead of hanging.
        return CoxswainClient(self.address, api_key=key, timeout_s=30, stream_timeout_s=120)

    def idle(self, within_s: float = 20.0) -> bool:
        """Whether the engine has no unfinished requests (waiting up to `within_s` for a
        cancellation to reach it)."""
        deadline = time.monotonic() + within_s
        while self.service.engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def offline(path):
    return LLM(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def served(path):
    loop = _LoopThread()
    service = EngineService.from_model(
        path, device="cpu", dtype="float32", patch_store=PatchStore(64 * 2**20)
    )
    keys = ApiKeys.parse(f"ops:admin:{ADMIN_KEY},researcher:read:{READ_KEY}")
    server, port = loop.run(serve_engine_grpc(service, keys))
    yield Served(loop, service, server, port)
    loop.run(server.stop(grace_s=0))
    loop.run(service.shutdown())
    loop.stop()


@pytest.fixture(scope="module")
def client(served):
    with served.client() as c:
        yield c


def _assert_same_logprobs(got: RequestOutput, want: RequestOutput) -> None:
    # The served engine and the offline one batch differently: float32 at the oracle's 1e-4.
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for g, w in zip(got.prompt_logprobs or [], want.prompt_logprobs or [], strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.keys() == w.keys()
            assert [g[t] for t in w] == pytest.approx([w[t] for t in w], abs=1e-4)
    for g, w in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert g.keys() == w.keys()
        assert [g[t] for t in w] == pytest.approx([w[t] for t in w], abs=1e-4)


def _max_logprob_gap(a: RequestOutput, b: RequestOutput) -> float:
    gaps = [
        abs(x[t] - y[t])
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
        for t in x.keys() & y.keys()
    ]
    return max(gaps)


# -- generation --------------------------------------------------------------------------------


def test_model_info_describes_the_served_model(client, path):
    info = client.model_info()
    assert info["id"] == path.name
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (2, H, 512)
    assert info["sites"] == ["pre_attn", "post_attn", "post_block"]
    assert (info["dtype"], info["device"]) == ("float32", "cpu")


def test_the_stream_carries_each_steps_tokens_once_and_adds_up_to_offline(client, offline):
    deltas = list(client.generate(PROMPT, **GREEDY))
    want = offline.generate([PROMPT], SamplingParams(**GREEDY))[0]
    # One message per step, or fewer carrying several tokens when the reader falls behind;
    # each carries only what is new, placed by its offset.
    offsets = [d.samples[0].token_offset for d in deltas]
    sizes = [len(d.samples[0].token_ids) for d in deltas]
    assert all(n >= 1 for n in sizes) and sum(sizes) == 4
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[0].prompt_token_ids == PROMPT
    assert all(d.prompt_token_ids is None for d in deltas[1:])  # the first message only
    totals = OutputAccumulator()
    final = [totals.add(d) for d in deltas][-1]
    _assert_same_logprobs(final, want)
    assert final.outputs[0].text == want.outputs[0].text
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt_logprobs[0] is None and final.captures is None


def test_steered_generation_matches_offline_and_differs_from_unsteered(client, offline):
    steering = {
        "vectors": [
            {"site": "post_block", "layers": [0], "vector": _vec(1), "scale": 2.0},
            {"site": "pre_attn", "layers": [1], "vector": _vec(2).tolist(), "phase": "decode"},
        ]
    }
    got = client.complete(PROMPT, steering=steering, **GREEDY)
    want = offline.generate([PROMPT], SamplingParams(steering=steering, **GREEDY))[0]
    plain = client.complete(PROMPT, **GREEDY)
    _assert_same_logprobs(got, want)
    assert _max_logprob_gap(got, plain) > 1e-2  # the steering reached the model


def test_gates_readouts_and_a_probe_stop_match_offline(client, offline):
    probe = _vec(12, norm=1.0)
    steering = {
        "gates": [
            {
                "when": {"probe": probe, "layer": 1, "threshold": 0.0, "sharpness": 4.0},
                "scope": "rest_of_request",
                "apply": {"add": {"vector": _vec(13), "scale": 2.0}},
            },
            {"when": {"probe": probe, "layer": 0, "site": "pre_attn"}, "apply": {"attenuate": 0.5}},
        ]
    }
    readouts = [{"probe": probe, "layer": 1, "name": "p"}]
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, readouts=readouts)
    want = offline.generate([PROMPT], SamplingParams(steering=steering, **params))[0]
    got = client.complete(PROMPT, steering=steering, **params)
    _assert_same_logprobs(got, want)
    scores = [r["p"] for r in want.outputs[0].readouts]
    assert [r["p"] for r in got.outputs[0].readouts] == pytest.approx(scores, abs=1e-4)

    # Stop where the read-out peaks: the probe fires on the residual of that token.
    stop = {**steering, "abort_when": {"probe": probe, "layer": 1, "threshold": max(scores) - 1e-3}}
    want = offline.generate([PROMPT], SamplingParams(steering=stop, **params))[0]
    got = client.complete(PROMPT, steering=stop, **params)
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason == "probe"
    assert got.outputs[0].stop_reason == want.outputs[0].stop_reason
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(got.outputs[0].token_ids) == scores.index(max(scores))


def test_several_seeded_samples_stream_like_offline(client, offline):
    params = dict(n=2, max_tokens=3, temperature=1.0, seed=7, logprobs=1)
    want = offline.generate([PROMPT], SamplingParams(**params))[0]
    got = client.complete(PROMPT, **params)
    assert [c.index for c in got.outputs] == [0, 1]
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]


def test_captures_come_back_as_tensors_equal_to_offline(client, offline):
    capture = {"sites": {"post_block": "all", "pre_attn": [1]}, "positions": "all_prompt"}
    got = client.complete(PROMPT, capture=capture, **GREEDY)
    want = offline.generate([PROMPT], SamplingParams(capture=capture, **GREEDY))[0]
    assert got.capture_positions == want.capture_positions == list(range(len(PROMPT)))
    assert set(got.captures) == set(want.captures) == {"0.post_block", "1.post_block", "1.pre_attn"}
    for key, t in want.captures.items():
        assert got.captures[key].dtype == torch.float32
        torch.testing.assert_close(got.captures[key], t, rtol=0, atol=1e-4)


def test_a_patched_request_matches_offline(client, offline):
    clean = offline.generate(
        [[*PROMPT[:3], 499, *PROMPT[4:]]],
        SamplingParams(max_tokens=1, capture={"sites": {"post_block": [1]}, "positions": [3]}),
    )[0]
    patch = [
        {"layer": 1, "position": 3, "source": {"vector": clean.captures["1.post_block"][0]}},
        {"layer": 0, "site": "pre_attn", "position": 5, "alpha": 0.5, "source": {"zeros": True}},
    ]
    params = dict(max_tokens=2, temperature=0.0, ignore_eos=True, logprob_token_ids=[17, 42])
    got = client.complete(PROMPT, patch=patch, **params)
    want = offline.generate([PROMPT], SamplingParams(patch=patch, **params))[0]
    plain = client.complete(PROMPT, **params)
    _assert_same_logprobs(got, want)
    assert abs(got.outputs[0].logprobs[0][17] - plain.outputs[0].logprobs[0][17]) > 1e-3


def test_a_chat_prompt_is_rendered_with_the_chat_template(client, offline):
    chat = [{"role": "user", "content": "Where is the tower?"}]
    got = client.complete(chat, **GREEDY)
    want = offline.chat(chat, SamplingParams(**GREEDY))[0]
    _assert_same_logprobs(got, want)


def test_a_capture_to_the_patch_store_can_be_dropped_by_an_admin(client):
    capture = {"sites": {"post_block": "all"}, "positions": "all_prompt"}
    capture |= {"sink": "patch_store", "run": "clean-grpc"}
    out = client.complete(PROMPT, capture=capture, max_tokens=1)
    assert out.capture_run == "clean-grpc" and out.capture_error is None
    dropped = client.drop_patch_source("clean-grpc")
    assert dropped["run"] == "clean-grpc" and dropped["bytes_freed"] == 2 * len(PROMPT) * H * 4
    with pytest.raises(RunNotFoundError):
        client.drop_patch_source("clean-grpc")


# -- sweeps ------------------------------------------------------------------------------------


def test_a_streamed_sweep_equals_an_offline_sweep(client, offline):
    corrupt = [*PROMPT[:3], 499, *PROMPT[4:]]
    spec = SweepSpec(
        corrupt_prompt=corrupt,
        clean_prompt=PROMPT,
        answer_token=17,
        foil_token=42,
        metric="logit_diff",
        positions=[2, 3, 4],
    )
    want = Sweep(offline.engine, spec).run()
    events = list(client.sweep(spec))
    *cells, result = events
    assert all(isinstance(c, Cell) for c in cells) and isinstance(result, SweepResult)
    assert len(cells) == len(want.cells) == 2 * 3
    expected = {(c.site, c.layer, c.position): c for c in want.cells}
    for c in cells:
        w = expected[(c.site, c.layer, c.position)]
        assert c.void is None
        assert (c.value, c.logprob_answer, c.logprob_foil) == pytest.approx(
            (w.value, w.logprob_answer, w.logprob_foil), abs=1e-4
        )
    np.testing.assert_allclose(result.grid, want.grid, rtol=0, atol=1e-4)
    assert (result.layers, result.positions, result.sites) == (
        want.layers,
        want.positions,
        want.sites,
    )
    assert result.clean == pytest.approx(want.clean, abs=1e-4)
    assert result.corrupt == pytest.approx(want.corrupt, abs=1e-4)
    assert (result.argmax.layer, result.argmax.position) == (
        want.argmax.layer,
        want.argmax.position,
    )
    assert result.tokens == want.tokens and result.alignment == want.alignment
    assert result.cells == cells


def test_a_bad_sweep_is_refused_before_any_cell(client):
    with pytest.raises(InvalidRequestError, match="layers out of range"):
        list(client.sweep(corrupt_prompt=PROMPT, clean_prompt=PROMPT, answer_token=3, layers=[7]))
    with pytest.raises(InvalidRequestError, match="non-empty"):  # never a silent "all layers"
        client.sweep(corrupt_prompt=PROMPT, clean_prompt=PROMPT, answer_token=3, layers=[])
    with pytest.raises(RunNotFoundError):
        list(client.sweep(corrupt_prompt=PROMPT, source_run="never-stored", answer_token=3))


# -- steering administration -------------------------------------------------------------------


def test_global_steering_set_get_clear_changes_logprobs(client, offline):
    spec = {"vectors": [{"site": "post_attn", "layers": [0, 1], "vector": _vec(3), "scale": 1.5}]}
    before = client.complete(PROMPT, **GREEDY)
    try:
        state = client.set_global_steering(spec)
        assert state["global_spec"]["vectors"][0]["layers"] == [0, 1]
        assert client.steering_state()["global_spec"] == state["global_spec"]
        steered = client.complete(PROMPT, **GREEDY)
    finally:
        cleared = client.clear_global_steering()
    assert cleared["global_spec"] is None
    after = client.complete(PROMPT, **GREEDY)

    offline.engine.set_global_steering(spec)
    try:
        want = offline.generate([PROMPT], SamplingParams(**GREEDY))[0]
    finally:
        offline.engine.clear_global_steering()
    _assert_same_logprobs(steered, want)
    assert _max_logprob_gap(steered, before) > 1e-2
    _assert_same_logprobs(after, before)
    assert set(client.dynamic_state()) >= {"dynamic", "monitors", "queue", "steps"}


def test_the_vector_registry_round_trips_and_names_steer(client, offline):
    per_layer = {0: _vec(4), 1: _vec(5)}
    info = client.register_vector("grpc-honesty", per_layer)
    assert info == {"name": "grpc-honesty", "hidden_size": H, "layers": [0, 1], "source": "api"}
    single = client.register_vector("grpc-single", _vec(6).tolist())
    assert single["layers"] is None
    with pytest.raises(InvalidRequestError, match="already registered"):
        client.register_vector("grpc-single", _vec(7))
    assert {"grpc-honesty", "grpc-single"} <= {v["name"] for v in client.list_vectors()}
    got = client.get_vector("grpc-honesty")
    torch.testing.assert_close(got["value"], torch.stack([per_layer[0], per_layer[1]]))

    steering = {"vectors": [{"vector": "grpc-honesty", "scale": 2.0}]}
    named = client.complete(PROMPT, steering=steering, **GREEDY)
    offline.engine.vectors.register("grpc-honesty", per_layer, overwrite=True)
    want = offline.generate([PROMPT], SamplingParams(steering=steering, **GREEDY))[0]
    _assert_same_logprobs(named, want)

    for name in ("grpc-honesty", "grpc-single"):
        assert client.unregister_vector(name)["name"] == name
    with pytest.raises(NotFoundError):
        client.get_vector("grpc-honesty")
    with pytest.raises(InvalidRequestError, match="unknown vector name"):
        client.complete(PROMPT, steering=steering, max_tokens=1)


# -- auth, health, reflection ------------------------------------------------------------------


def test_calls_without_a_valid_key_are_unauthenticated(served):
    for key in (None, "not-a-key-0000000000"):
        with served.client(key) as c, pytest.raises(UnauthenticatedError):
            c.model_info()
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt=pb.Prompt(text="hi")), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(err.value.trailing_metadata())[GRPC_ERROR_METADATA_KEY] == "UnauthenticatedError"


def test_a_read_key_reads_but_may_not_administer(served):
    with served.client(READ_KEY) as c:
        assert c.complete(PROMPT, max_tokens=1).finished
        assert "global_spec" in c.steering_state()
        for admin in (
            lambda: c.set_global_steering({"vectors": [{"layers": [0], "vector": _vec(8)}]}),
            c.clear_global_steering,
            lambda: c.register_vector("nope", _vec(9)),
            lambda: c.unregister_vector("nope"),
            lambda: c.drop_patch_source("nope"),
        ):
            with pytest.raises(PermissionDeniedError, match="read-only"):
                admin()
    with served.client() as admin_client:
        assert admin_client.steering_state()["global_spec"] is None


def test_health_and_reflection_need_no_key(served):
    with served.client(None) as c:
        assert c.health() == "SERVING"
        for name in SERVICE_NAMES:
            assert c.health(name) == "SERVING"
    with grpc.insecure_channel(served.address) as channel:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in reply.list_services_response.service}
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert {*SERVICE_NAMES, "grpc.health.v1.Health"} <= names
    assert status == health_pb2.HealthCheckResponse.SERVING


# -- bad input, cancellation, abort ------------------------------------------------------------


def test_bad_input_is_invalid_argument_and_the_next_call_still_works(served, client):
    metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
    good_tensor = pb.VectorValue(tensor=convert.tensor_to_proto(_vec(10)))
    bad_tensor = pb.VectorValue(tensor=convert.tensor_to_proto(_vec(10)))
    bad_tensor.tensor.data = bad_tensor.tensor.data[:-4]  # one float short of its shape
    requests = [
        pb.GenerateRequest(),  # no prompt
        pb.GenerateRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[]))),
        pb.GenerateRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[10**9]))),
        pb.GenerateRequest(prompt=pb.Prompt(text="hi"), params=pb.SamplingParams(top_p=2.0)),
        pb.GenerateRequest(
            prompt=pb.Prompt(text="hi"),
            params=pb.SamplingParams(
                steering=pb.SteeringSpec(
                    vectors=[pb.SteerVector(site="nowhere", vector=good_tensor)]
                )
            ),
        ),
        pb.GenerateRequest(
            prompt=pb.Prompt(text="hi"),
            params=pb.SamplingParams(
                steering=pb.SteeringSpec(vectors=[pb.SteerVector(layers=[0], vector=bad_tensor)])
            ),
        ),
    ]
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.EngineStub(channel)
        for request in requests:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            trailing = dict(err.value.trailing_metadata())
            assert trailing[GRPC_ERROR_METADATA_KEY] in (
                "InvalidRequestError",
                "PromptTooLongError",
            )
    with pytest.raises(InvalidRequestError, match="out of range"):  # checked by the engine
        client.complete(PROMPT, steering={"vectors": [{"layers": [5], "vector": _vec(11)}]})
    assert served.idle()
    _assert_same_logprobs(client.complete(PROMPT, **GREEDY), client.complete(PROMPT, **GREEDY))


def test_closing_a_generate_stream_aborts_the_request(served, client):
    stream = client.generate(PROMPT, max_tokens=400, temperature=0.0, ignore_eos=True)
    first = next(stream)
    assert not first.finished and served.service.engine.has_unfinished_requests()
    stream.close()
    assert served.idle()  # the cancellation reached the engine: no request left behind
    assert served.service.stats()["num_running"] == 0


def test_abort_from_another_call_ends_the_stream_with_finish_reason_abort(served, client):
    stream = client.generate(PROMPT, request_id="grpc-abort-me", max_tokens=400, ignore_eos=True)
    assert next(stream).request_id == "grpc-abort-me"
    client.abort("grpc-abort-me")
    *_, last = stream
    assert last.finished and last.samples[0].finish_reason == "abort"
    assert last.samples[0].token_offset + len(last.samples[0].token_ids) < 400
    assert served.idle()


def test_the_request_id_arrives_in_the_initial_metadata(served):
    metadata = (("authorization", f"Bearer {READ_KEY}"),)
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT)),
        params=pb.SamplingParams(max_tokens=1),
    )
    with grpc.insecure_channel(served.address) as channel:
        call = pb_grpc.EngineStub(channel).Generate(request, metadata=metadata, timeout=10)
        rid = dict(call.initial_metadata())[REQUEST_ID_METADATA_KEY]
        (only,) = list(call)
    assert rid.startswith("grpc-") and only.request_id == rid and only.finished


# -- the asyncio client ------------------------------------------------------------------------


def test_the_async_client_gives_the_same_results(served, client):
    async def run():
        async with AsyncCoxswainClient(served.address, api_key=ADMIN_KEY) as c:
            out = await c.complete(PROMPT, **GREEDY)
            info = await c.model_info()
            with pytest.raises(InvalidRequestError, match="out of range"):
                await c.complete(PROMPT, steering={"vectors": [{"layers": [5], "vector": _vec(1)}]})
            return out, info

    out, info = served.loop.run(run())
    assert info == client.model_info()
    _assert_same_logprobs(out, client.complete(PROMPT, **GREEDY))


# -- deltas: one engine delta is one message -------------------------------------------------


def test_every_field_of_a_delta_round_trips_through_its_message():
    captures = {"0.post_block": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    full = RequestDelta(
        request_id="r",
        samples=[
            CompletionDelta(0, 3, [5, 6], "ab", [{5: -0.5}, {6: -1.0, 2: -2.0}], [{"p": 0.25}] * 2),
            CompletionDelta(1, 0, [7], "c", finish_reason="stop", stop_reason=7),
            CompletionDelta(2, 4, [], "", [], [], finish_reason="probe", stop_reason="hack"),
        ],
        finished=True,
        num_cached_tokens=16,
        prompt="hi",
        prompt_token_ids=[1, 2],
        prompt_logprobs=[None, {2: -0.75}],
        captures=captures,
        capture_positions=[0, 1],
        capture_run="run-1",
        capture_error="why not",
        conversation_id="c-1",
    )
    bare = RequestDelta("r", [CompletionDelta(0, 9, [8], "d")], finished=False)
    for want in (full, bare):
        msg = pb.GenerateResponse.FromString(convert.delta_to_proto(want).SerializeToString())
        got = convert.delta_from_proto(msg)
        if want.captures is not None:
            assert got.captures.keys() == want.captures.keys()
            assert all(torch.equal(got.captures[k], v) for k, v in want.captures.items())
            got.captures = want.captures
        assert got == want


# -- a reused request id, Abort, oversized identifiers -------------------------------------------

LONG = "a" * 10_000


def test_a_reused_request_id_is_refused_and_abort_still_ends_the_original(served, client):
    stream = client.generate(PROMPT, request_id="held", max_tokens=400, ignore_eos=True)
    assert next(stream).request_id == "held"
    with pytest.raises(DuplicateRequestError, match="'held' is already in use"):
        client.complete(PROMPT, request_id="held", max_tokens=2)
    client.abort("held")
    *_, last = stream
    assert last.finished and last.samples[0].finish_reason == "abort"
    assert last.samples[0].token_offset + len(last.samples[0].token_ids) < 400
    assert served.idle()
    # the id is free again once its request ended
    assert client.complete(PROMPT, request_id="held", max_tokens=2).finished


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@pytest.mark.parametrize(
    "what",
    ["request_id", "drop_patch_source", "vector_name", "patch_run", "conversation_id"],
)
def test_an_oversized_identifier_is_invalid_argument_with_our_message(served, client, what):
    metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
    prompt = pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT))
    generate = {
        "request_id": pb.GenerateRequest(prompt=prompt, request_id=LONG),
        "vector_name": pb.GenerateRequest(
            prompt=prompt,
            params=pb.SamplingParams(
                steering=pb.SteeringSpec(
                    vectors=[pb.SteerVector(layers=[0], vector=pb.VectorValue(name=LONG))]
                )
            ),
        ),
        "patch_run": pb.GenerateRequest(
            prompt=prompt,
            params=pb.SamplingParams(
                patch=[
                    pb.PatchEntry(
                        layer=0,
                        position=0,
                        source=pb.PatchSource(run=pb.RunPosition(run=LONG, position=0)),
                    )
                ]
            ),
        ),
        "conversation_id": pb.GenerateRequest(
            prompt=prompt, params=pb.SamplingParams(conversation_id=LONG)
        ),
    }
    with grpc.insecure_channel(served.address) as channel:
        if what == "drop_patch_source":
            stub = steering_grpc.SteeringStub(channel)
            request = steering_pb.DropPatchSourceRequest(run=LONG)
            err = _refusal(lambda: stub.DropPatchSource(request, metadata=metadata, timeout=10))
        else:
            stub = pb_grpc.EngineStub(channel)
            call = lambda: list(stub.Generate(generate[what], metadata=metadata, timeout=10))  # noqa: E731
            err = _refusal(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert dict(err.trailing_metadata())[GRPC_ERROR_METADATA_KEY] == "InvalidRequestError"
    assert "10000 characters long; at most 256" in err.details()
    assert len(err.details()) < 300 and "metadata" not in err.details()
    # and through the client: the same class, and the server goes on serving
    if what == "drop_patch_source":
        with pytest.raises(InvalidRequestError, match="at most 256"):
            client.drop_patch_source(LONG)
    assert client.complete(PROMPT, max_tokens=1).finished


def test_an_adapter_reaches_the_engine_instead_of_being_dropped(client):
    # This engine serves no adapters: a request naming one must say so, never run unadapted.
    with pytest.raises(InvalidRequestError, match="serves no adapters"):
        client.complete(PROMPT, max_tokens=1, adapter="policy", adapter_variant="deploy")
