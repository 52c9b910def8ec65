"""Activation patching against `transformers` forward hooks (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequestError, TooLargeError
from services.engine import SamplingParams
from services.engine.interventions.sites import SITES
from tests.integration.test_steering import _engine, _prompt, _run, _vec
from tests.oracle import hf_edited_logprobs, hf_residuals


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


N = 17
CLEAN, CORRUPT = _prompt(80, N), _prompt(81, N)
ALL_KEYS = [(L, s) for L in range(3) for s in SITES]


@pytest.fixture(scope="module")
def clean_acts(path) -> dict:
    """The clean prompt's residual at every (layer, site), captured by the engine."""
    capture = {"sites": {s: "all" for s in SITES}, "positions": "all_prompt"}
    out = _run(_engine(path), {"c": (CLEAN, SamplingParams(max_tokens=1, capture=capture))})["c"]
    return {(L, s): out.captures[f"{L}.{s}"] for L, s in ALL_KEYS}


def _params(patch=None, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=5, prompt_logprobs=5, patch=patch, **kw
    )


def _patch(layer, site, position, vec, alpha=1.0) -> dict:
    return {
        "layer": layer,
        "site": site,
        "position": position,
        "alpha": alpha,
        "source": {"vector": vec.tolist()},
    }


def _replace(position: int, target: torch.Tensor, alpha: float = 1.0):
    def fn(h):
        out = h.clone()
        out[position] = (1 - alpha) * h[position] + alpha * target
        return out

    return fn


def _last_logprobs(out) -> dict[int, float]:
    return out.outputs[0].logprobs[0]


def test_captured_clean_activations_match_transformers(path, clean_acts):
    ref = hf_residuals(path, CLEAN, ALL_KEYS)
    for key in ALL_KEYS:
        torch.testing.assert_close(clean_acts[key], ref[key], atol=1e-4, rtol=1e-4)


def test_a_batch_of_cells_matches_one_hooked_forward_each(path, clean_acts):
    cells = [(L, s, p) for L in range(3) for s in SITES for p in (0, 7, N - 1)]
    outs = _run(
        _engine(path),
        {
            f"{L}.{s}.{p}": (CORRUPT, _params([_patch(L, s, p, clean_acts[(L, s)][p])]))
            for L, s, p in cells
        },
    )
    for L, s, p in cells:
        ref = hf_edited_logprobs(path, CORRUPT, {(L, s): _replace(p, clean_acts[(L, s)][p])})
        out = outs[f"{L}.{s}.{p}"]
        for t, v in _last_logprobs(out).items():
            assert v == pytest.approx(float(ref[N - 1, t]), abs=1e-4), (L, s, p)
        for pos in range(1, N):
            for t, v in out.prompt_logprobs[pos].items():
                assert v == pytest.approx(float(ref[pos - 1, t]), abs=1e-4), (L, s, p, pos)


def test_alpha_zero_is_a_no_op_and_own_activations_are_the_identity(path, clean_acts):
    plain = _run(_engine(path), {"zero": (CLEAN, _params()), "own": (CLEAN, _params())})["zero"]
    zero = [_patch(1, "post_attn", p, torch.zeros(64), alpha=0.0) for p in range(N)]
    own = [_patch(2, "pre_attn", p, clean_acts[(2, "pre_attn")][p]) for p in range(N)]
    outs = _run(_engine(path), {"zero": (CLEAN, _params(zero)), "own": (CLEAN, _params(own))})
    assert _last_logprobs(outs["zero"]) == _last_logprobs(plain)
    for t, v in _last_logprobs(outs["own"]).items():
        assert v == pytest.approx(_last_logprobs(plain)[t], abs=1e-4)


def test_patching_every_position_with_the_clean_run_gives_the_clean_result(path, clean_acts):
    clean = _run(_engine(path), {"c": (CLEAN, _params())})["c"]
    for L in range(3):
        entries = [_patch(L, "post_block", p, clean_acts[(L, "post_block")][p]) for p in range(N)]
        out = _run(_engine(path), {"x": (CORRUPT, _params(entries))})["x"]
        for t, v in _last_logprobs(clean).items():
            assert _last_logprobs(out)[t] == pytest.approx(v, abs=1e-4), L


def test_results_are_monotone_in_alpha_at_a_denoising_site(path, clean_acts):
    clean = _run(_engine(path), {"c": (CLEAN, _params())})["c"]
    answer = clean.outputs[0].token_ids[0]
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0]
    L = 2
    outs = _run(
        _engine(path),
        {
            str(a): (
                CORRUPT,
                _params(
                    [
                        _patch(L, "post_block", p, clean_acts[(L, "post_block")][p], a)
                        for p in range(N)
                    ],
                    logprob_token_ids=[answer],
                ),
            )
            for a in alphas
        },
    )
    scores = [_last_logprobs(outs[str(a)])[answer] for a in alphas]
    assert scores == sorted(scores) and scores[-1] > scores[0] + 0.1, scores


def test_a_patched_request_never_poisons_the_cache(path, clean_acts):
    engine = _engine(path)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
    patch = [_patch(1, "post_block", 12, clean_acts[(1, "post_block")][12])]
    long = CORRUPT + _prompt(82, 20)  # 37 tokens: blocks [0,16) and [16,32) are full
    first = _run(engine, {"p": (long, SamplingParams(max_tokens=4, temperature=0.0, patch=patch))})[
        "p"
    ]
    assert first.num_cached_tokens == 0
    after = _run(engine, {"u": (long, params)})["u"]
    assert after.num_cached_tokens == 0  # block 0 holds the patched position 12: not shared
    fresh = _run(_engine(path), {"u": (long, params)})["u"]
    assert after.outputs[0].logprobs == fresh.outputs[0].logprobs
    # a patch at position 20 re-forwards from block 1: block 0 (unpatched) comes from the cache
    later = [_patch(1, "post_block", 20, clean_acts[(1, "post_block")][3])]
    again = _run(engine, {"q": (long, SamplingParams(max_tokens=1, patch=later))})["q"]
    assert again.num_cached_tokens == 16


def test_steering_adds_onto_the_patched_residual(path, clean_acts):
    v, target = _vec(83, 64), clean_acts[(1, "post_block")][5]
    steering = {"vectors": [{"site": "post_block", "layers": [1], "vector": v.tolist()}]}
    out = _run(
        _engine(path),
        {"x": (CORRUPT, _params([_patch(1, "post_block", 5, target)], steering=steering))},
    )["x"]

    def patch_then_steer(h):
        return _replace(5, target)(h) + v

    ref = hf_edited_logprobs(path, CORRUPT, {(1, "post_block"): patch_then_steer})
    for t, val in _last_logprobs(out).items():
        assert val == pytest.approx(float(ref[N - 1, t]), abs=1e-4)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"layer": 0, "position": N, "source": {"zeros": True}}, "not in the prompt"),
        ({"layer": 3, "position": 0, "source": {"zeros": True}}, "out of range"),
        ({"layer": 0, "position": 0, "source": {"vector": [1.0] * 63}}, "hidden size"),
        ({"layer": 0, "position": 0, "source": {"run": "r1", "position": 0}}, "patch-source store"),
        ({"layer": 0, "position": 0, "source": {"run": "r1"}}, "position"),
        ({"layer": 0, "position": 0, "source": {"zeros": True, "vector": [1.0]}}, "exactly one"),
        ({"layer": 0, "position": 0, "alpha": float("nan"), "source": {"zeros": True}}, "finite"),
    ],
)
def test_bad_patches_are_clear_errors(path, entry, message):
    engine = _engine(path)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("x", CORRUPT, SamplingParams(patch=[entry]))
    twice = [{"layer": 0, "position": 1, "source": {"zeros": True}}] * 2
    with pytest.raises(InvalidRequestError, match="twice"):
        engine.add_request("y", CORRUPT, SamplingParams(patch=twice))
    assert not engine.has_unfinished_requests()


# -- with a patch-source store: in process, and over gRPC on loopback --------------------


@pytest.fixture(params=["in-process", "grpc"])
def store(request):
    from services.patch_store.client import PatchStoreClient
    from services.patch_store.server import serve
    from services.patch_store.store import PatchStore

    local = PatchStore(budget_bytes=64 << 20)
    if request.param == "in-process":
        yield local
        return
    server = serve(local, "127.0.0.1", 0)
    client = PatchStoreClient(server.address)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def test_a_captured_run_patches_like_the_inline_vector(path, clean_acts, store):
    from services.engine import LLMEngine
    from services.engine.config import EngineConfig

    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"), patch_store=store)
    capture = {
        "sites": {"post_block": "all"},
        "positions": "all_prompt",
        "sink": "patch_store",
        "run": "clean",
    }
    out = _run(engine, {"c": (CLEAN, SamplingParams(max_tokens=1, capture=capture))})["c"]
    assert out.capture_run == "clean" and out.capture_error is None
    (manifest,) = store.manifests(["clean"])
    assert list(manifest.positions) == list(range(N)) and manifest.hidden_size == 64
    with pytest.raises(InvalidRequestError, match="already exists"):
        engine.add_request("again", CLEAN, SamplingParams(capture=capture))
    from_run = [{"layer": 1, "position": 7, "source": {"run": "clean", "position": 7}}]
    inline = [_patch(1, "post_block", 7, clean_acts[(1, "post_block")][7])]
    outs = _run(engine, {"run": (CORRUPT, _params(from_run)), "vec": (CORRUPT, _params(inline))})
    assert _last_logprobs(outs["run"]) == pytest.approx(_last_logprobs(outs["vec"]), abs=1e-4)
    from services.common.errors import RunNotFoundError

    missing = [{"layer": 1, "position": 7, "source": {"run": "nope", "position": 7}}]
    with pytest.raises(RunNotFoundError):
        engine.add_request("m", CORRUPT, _params(missing))
    absent_row = [{"layer": 1, "position": 7, "source": {"run": "clean", "position": N + 3}}]
    with pytest.raises(InvalidRequestError):
        engine.add_request("r", CORRUPT, _params(absent_row))
    assert not engine.has_unfinished_requests()


def test_runs_read_by_patches_are_leased_once_per_half_ttl(path, clean_acts):
    from services.engine import LLMEngine
    from services.engine.config import EngineConfig
    from services.patch_store.store import PatchStore

    store = PatchStore(budget_bytes=1 << 20)
    rows = {(1, "post_block"): clean_acts[(1, "post_block")]}
    store.put_run("clean", rows, list(range(N)))
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"), patch_store=store)
    src = [{"layer": 1, "position": 3, "source": {"run": "clean", "position": 3}}]
    _run(engine, {f"c{i}": (CORRUPT, _params(src)) for i in range(3)})
    (manifest,) = store.manifests(["clean"])
    assert manifest.holders == (engine.interventions.lease_holder,)
    stats = store.stats()
    assert stats["leases_granted"] == 1 and stats["leases_refreshed"] == 0  # 3 requests, 1 lease
    # a leased run is never evicted: a put that fits only by evicting it is refused
    with pytest.raises(TooLargeError, match="leased runs hold"):
        store.put_run("big", {(0, "post_block"): torch.zeros(4090, 64)}, list(range(4090)))
    assert {m.run_id for m in store.manifests()} == {"clean"}
    assert store.stats()["puts_refused"] == 1
