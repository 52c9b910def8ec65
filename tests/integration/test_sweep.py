"""Causal-tracing sweeps against `transformers` forward hooks (float32, CPU)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from services.common.errors import InvalidRequestError, RunNotFoundError
from services.engine import SamplingParams
from services.engine.sweep import StepDriver, Sweep, SweepSpec
from services.engine.sweep_plan import align
from tests.integration.test_steering import _engine, _prompt, _run
from tests.oracle import hf_edited_logprobs, hf_logprobs, hf_residuals


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


N = 11
CLEAN, CORRUPT = _prompt(90, N), _prompt(91, N)
ANSWER, FOIL = 17, 42
SITES = ["post_block", "pre_attn"]


def _replace(position, target, alpha=1.0):
    def fn(h):
        out = h.clone()
        out[position] = (1 - alpha) * h[position] + alpha * target
        return out

    return fn


def _spec(**kw) -> SweepSpec:
    base = dict(
        corrupt_prompt=CORRUPT,
        clean_prompt=CLEAN,
        answer_token=ANSWER,
        foil_token=FOIL,
        metric="logit_diff",
    )
    return SweepSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def full(path):
    return Sweep(_engine(path), _spec(sites=SITES)).run()


def test_the_grid_matches_one_hooked_forward_per_cell(path, full):
    assert full.grid.shape == (2, 3, N) and full.positions == list(range(N))
    assert not full.void and not full.skipped and not np.isnan(full.grid).any()
    clean = hf_residuals(path, CLEAN, [(L, s) for L in range(3) for s in SITES])
    for i, s in enumerate(SITES):
        for L in range(3):
            for p in range(N):
                ref = hf_edited_logprobs(path, CORRUPT, {(L, s): _replace(p, clean[(L, s)][p])})
                want = float(ref[N - 1, ANSWER] - ref[N - 1, FOIL])
                assert full.grid[i, L, p] == pytest.approx(want, abs=1e-4), (s, L, p)
    best = full.argmax
    assert best.value == np.nanmax(full.grid)
    assert full.tokens and len(full.tokens) == N


def test_baselines_equal_unpatched_requests_and_the_noise_floor_is_tiny(path, full):
    params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[ANSWER, FOIL])
    outs = _run(_engine(path), {"c": (CLEAN, params)})
    outs.update(_run(_engine(path), {"x": (CORRUPT, params)}))
    for rid, value in (("c", full.clean), ("x", full.corrupt)):
        lp = outs[rid].outputs[0].logprobs[0]
        assert value == pytest.approx(lp[ANSWER] - lp[FOIL], abs=1e-4)  # batched with each other
    ref = hf_logprobs(path, CORRUPT)
    assert full.corrupt == pytest.approx(float(ref[N - 1, ANSWER] - ref[N - 1, FOIL]), abs=1e-4)
    assert 0 <= full.noise_floor < 1e-4


def test_alpha_zero_and_self_patching_give_the_corrupt_value(path):
    zero = Sweep(_engine(path), _spec(alpha=0.0, layers=[0, 2])).run()
    assert np.allclose(zero.grid, zero.corrupt, atol=1e-4, rtol=0)
    own = Sweep(_engine(path), _spec(clean_prompt=CORRUPT, sites=SITES)).run()
    assert own.clean == pytest.approx(own.corrupt, abs=1e-4)
    assert np.allclose(own.grid, own.corrupt, atol=1e-4, rtol=0)


def test_recovered_is_zero_at_corrupt_and_one_at_clean(path, full):
    res = Sweep(_engine(path), _spec(metric="recovered", layers=[2], positions=[N - 1])).run()
    assert res.clean == 1.0 and res.corrupt == 0.0
    # patching the last position after the last layer copies the clean output exactly
    want = (full.grid[0, 2, N - 1] - full.corrupt) / (full.clean - full.corrupt)
    assert res.grid[0, 0, 0] == pytest.approx(want, abs=1e-4)
    assert res.grid[0, 0, 0] == pytest.approx(1.0, abs=1e-4)


def test_unequal_lengths_align_prefix_and_suffix_and_skip_the_middle(path):
    head, tail = [100, 101, 102, 103], [200, 201, 202]
    clean, corrupt = [*head, 300, 301, 302, *tail], [*head, 400, *tail]
    a = align(clean, corrupt)
    assert a == {"prefix_len": 4, "suffix_len": 3, "skipped": [4], "offset": 2}
    res = Sweep(
        _engine(path),
        SweepSpec(
            corrupt_prompt=corrupt,
            clean_prompt=clean,
            answer_token=ANSWER,
            layers=[1],
        ),
    ).run()
    assert res.skipped == [4] and res.alignment == a
    assert np.isnan(res.grid[0, 0, 4]) and not np.isnan(np.delete(res.grid[0, 0], 4)).any()
    assert {c.position for c in res.cells} == {0, 1, 2, 3, 5, 6, 7}
    rows = hf_residuals(path, clean, [(1, "post_block")])[(1, "post_block")]
    for p, q in ((2, 2), (6, 8)):  # prefix by identity, suffix shifted by 2
        ref = hf_edited_logprobs(path, corrupt, {(1, "post_block"): _replace(p, rows[q])})
        assert res.grid[0, 0, p] == pytest.approx(float(ref[-1, ANSWER]), abs=1e-4)


def test_a_stored_run_sweeps_like_the_captured_clean_prompt(path, full):
    from services.engine import LLMEngine
    from services.engine.config import EngineConfig
    from services.patch_store.store import PatchStore

    store = PatchStore(budget_bytes=16 << 20)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32"), patch_store=store)
    capture = {"sites": {"post_block": "all"}, "positions": "all_prompt"}
    capture |= {"sink": "patch_store", "run": "clean"}
    _run(engine, {"c": (CLEAN, SamplingParams(max_tokens=1, capture=capture))})
    res = Sweep(engine, _spec(clean_prompt=None, source_run="clean", layers=[0, 1])).run()
    assert res.clean == pytest.approx(full.clean, abs=1e-4)
    assert np.allclose(res.grid[0], full.grid[0, :2], atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match="length mismatch"):
        Sweep(engine, _spec(clean_prompt=None, source_run="clean", corrupt_prompt=CORRUPT[:-1]))
    assert not engine.has_unfinished_requests()
    # a run dropped after the sweep was built: every cell is void, none reads as unpatched
    late = Sweep(engine, _spec(clean_prompt=None, source_run="clean", layers=[1], positions=[2, 7]))
    store.drop_run("clean")
    res = late.run()
    assert len(res.void) == 2 and all("clean" in c.void for c in res.void)
    assert np.isnan(res.grid).all() and res.argmax is None
    assert not engine.has_unfinished_requests()


def _stored_clean(path, **config):
    """An engine with a store holding the clean prompt's post_block rows as run "clean"."""
    from services.engine import LLMEngine
    from services.engine.config import EngineConfig
    from services.patch_store.store import PatchStore

    store = PatchStore(budget_bytes=16 << 20)
    config = EngineConfig(device="cpu", dtype="float32", **config)
    engine = LLMEngine(path, config, patch_store=store)
    capture = {"sites": {"post_block": "all"}, "positions": "all_prompt"}
    capture |= {"sink": "patch_store", "run": "clean"}
    _run(engine, {"c": (CLEAN, SamplingParams(max_tokens=1, capture=capture))})
    return engine, store


def _recapture(store, seed: int) -> int:
    """Overwrite run "clean" with other rows (a re-capture under the same id); its version."""
    (m,) = store.manifests(["clean"])
    g = torch.Generator().manual_seed(seed)
    rows = {key: torch.randn(N, m.hidden_size, generator=g) * 5 for key in m.keys}
    new = store.put_run("clean", rows, list(range(N)), token_ids=CLEAN, overwrite=True)
    return new.version


class RecapturingDriver(StepDriver):
    """Runs the sweep like the default driver, and overwrites the sweep's run once it has
    sent `after_cells` cells (as requests, or in passes): the race a served sweep has with a
    re-capture of its run id."""

    def __init__(self, engine, store, after_cells: int):
        super().__init__(engine)
        self.store, self.after_cells, self.cells_added = store, after_cells, 0
        self.new_version: int | None = None

    def _sent(self, cells: int) -> None:
        self.cells_added += cells
        if self.new_version is None and self.cells_added >= self.after_cells:
            self.new_version = _recapture(self.store, seed=5)

    def add(self, request_id, prompt_ids, params):
        super().add(request_id, prompt_ids, params)
        if params.patch:
            self._sent(1)

    def run_pass(self, job):
        result = super().run_pass(job)
        self._sent(len(job.cells))
        return result


@pytest.mark.parametrize("executor", ["requests", "patch_pass"])
def test_a_run_re_captured_mid_sweep_leaves_every_cell_on_the_version_it_leased(
    path, full, executor
):
    # A small token budget splits the passes, so most cells run after the overwrite.
    engine, store = _stored_clean(path, max_num_batched_tokens=64)
    leased = store.manifests(["clean"])[0]
    driver = RecapturingDriver(engine, store, after_cells=3)
    spec = _spec(clean_prompt=None, source_run="clean", layers=[0, 1, 2])
    res = Sweep(engine, spec, driver, executor=executor).run()
    assert res.executor == executor
    assert driver.new_version is not None and driver.new_version > leased.version
    # Most cells were sent after the overwrite (a pass does not run the last layer's rows
    # before the last: they cannot move the answer).
    assert driver.cells_added == (3 * N if executor == "requests" else 2 * N + 1)
    if executor == "patch_pass":
        assert engine.num_patch_passes > 2
    # Every cell read the version the sweep leased: the clean grid, to the last cell.
    assert res.run_ref == leased.ref and not res.void
    assert np.allclose(res.grid[0], full.grid[0], atol=1e-4, rtol=0)
    # The re-capture is the run now; the sweep released its lease on the old version (which
    # lives on only while the engine's own lease on it, from patching, runs).
    assert store.manifests(["clean"])[0].version == driver.new_version
    if executor == "requests":
        assert store.manifests([leased.ref])[0].holders == (engine.interventions.lease_holder,)
    else:  # the sweep's lease was the only one on it: released, the old version is gone
        with pytest.raises(RunNotFoundError, match="overwritten"):
            store.manifests([leased.ref])
    assert not engine.has_unfinished_requests()


def test_a_version_overwritten_before_the_sweep_leased_it_voids_its_cells(path):
    engine, store = _stored_clean(path)
    sweep = Sweep(engine, _spec(clean_prompt=None, source_run="clean", layers=[1]))
    new_version = _recapture(store, seed=6)  # after the sweep chose its version, unleased
    res = sweep.run()
    assert len(res.void) == N and np.isnan(res.grid).all() and res.argmax is None
    assert all(f"overwritten by version {new_version}" in c.void for c in res.void)
    assert not engine.has_unfinished_requests()


def test_cells_stream_as_they_finish(path):
    sweep = Sweep(_engine(path), _spec(layers=[1], positions=[0, 5]))
    seen = list(sweep.iter_cells())
    assert sorted(c.position for c in seen) == [0, 5] and all(c.void is None for c in seen)

    async def collect():
        return [c async for c in Sweep(_engine(path), _spec(layers=[1], positions=[3])).cells()]

    (cell,) = asyncio.run(collect())
    assert cell.position == 3 and math.isfinite(cell.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer_token": "the quick brown fox jumps"}, "multi-token"),
        ({"layers": [3]}, "out of range"),
        ({"positions": [N]}, "out of range"),
        ({"sites": ["mlp_out"]}, "unknown site"),
        ({"alpha": float("nan")}, "finite"),
        ({"foil_token": None}, "needs a foil"),
        ({"foil_token": 10**6}, "token id"),
        ({"source_run": "r"}, "exactly one"),
    ],
)
def test_bad_sweeps_are_errors_before_anything_runs(path, change, message):
    engine = _engine(path)
    with pytest.raises(InvalidRequestError, match=message):
        Sweep(engine, _spec(**change))
    assert engine.num_steps == 0 and not engine.has_unfinished_requests()


def test_a_sweep_refuses_an_engine_with_other_requests(path):
    engine = _engine(path)
    engine.add_request("other", CORRUPT, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="unfinished requests"):
        Sweep(engine, _spec(layers=[0], positions=[0])).run()
    assert "other" in engine.requests


def test_text_spans_select_the_tokens_that_cover_them(path):
    engine = _engine(path)
    clean, corrupt = (
        "The quick brown fox jumps over the dog",
        "The quick brown cat jumps over the dog",
    )
    spec = SweepSpec(
        corrupt_prompt=corrupt, clean_prompt=clean, answer_token=ANSWER, positions=[" cat", 0]
    )
    sweep = Sweep(engine, spec)
    ids = engine.tokenizer.encode(corrupt)
    span = [p for p in sweep.plan.positions if p != 0]
    assert span and " cat" in engine.tokenizer.decode([ids[p] for p in span])
    assert sweep.plan.positions[-1] == 0
    res = sweep.run()
    assert res.positions == sweep.plan.positions and not np.isnan(res.grid).all()
    missing = SweepSpec(
        corrupt_prompt=corrupt, clean_prompt=clean, answer_token=ANSWER, positions=["zebra"]
    )
    with pytest.raises(InvalidRequestError, match="not in the corrupt prompt"):
        Sweep(engine, missing)
    ids_prompt = SweepSpec(
        corrupt_prompt=ids, clean_prompt=clean, answer_token=ANSWER, positions=[" cat"]
    )
    with pytest.raises(InvalidRequestError, match="as a string"):
        Sweep(engine, ids_prompt)


# -- the layered patching pass against one patched request per cell ----------------------


def _windowed(tiny_checkpoint, tmp_path_factory, window: int):
    """The tiny Mistral with a sliding window shorter than the prompts."""
    import json
    import shutil

    src = tiny_checkpoint("mistral", layers=3)
    path = tmp_path_factory.mktemp("mistral-window") / "model"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = window
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window4"])
def test_the_pass_and_patched_requests_give_one_grid_at_every_site(
    tiny_checkpoint, tmp_path_factory, family
):
    if family == "mistral-window4":
        model = _windowed(tiny_checkpoint, tmp_path_factory, 4)
    else:
        model = tiny_checkpoint(family, layers=3)
    # alpha 0.3, not 0.5: an inverted blend, alpha·h + (1 − alpha)·clean, is the same at 0.5
    spec = dict(sites=["pre_attn", "post_attn", "post_block"], alpha=0.3)
    by_pass = Sweep(_engine(model), _spec(**spec), executor="patch_pass").run()
    by_requests = Sweep(_engine(model), _spec(**spec), executor="requests").run()
    assert (by_pass.executor, by_requests.executor) == ("patch_pass", "requests")
    assert not np.isnan(by_pass.grid).any() and not by_pass.void
    np.testing.assert_allclose(by_pass.grid, by_requests.grid, atol=1e-4, rtol=0)
    assert by_pass.clean == pytest.approx(by_requests.clean, abs=1e-4)
    assert by_pass.corrupt == pytest.approx(by_requests.corrupt, abs=1e-4)
    # The grid moves: a pass that patched nothing would be the corrupt value everywhere.
    assert np.abs(by_pass.grid - by_pass.corrupt).max() > 0.1
    # One cell per site against transformers with the same partial edit hooked in.
    clean = hf_residuals(model, CLEAN, [(1, s) for s in spec["sites"]])
    for i, s in enumerate(spec["sites"]):
        ref = hf_edited_logprobs(model, CORRUPT, {(1, s): _replace(5, clean[(1, s)][5], 0.3)})
        want = float(ref[N - 1, ANSWER] - ref[N - 1, FOIL])
        assert by_pass.grid[i, 1, 5] == pytest.approx(want, abs=1e-4), s


def test_a_pass_runs_each_cell_from_its_site_and_copies_unchanged_cells(path):
    shared = 4  # the prompts' common prefix
    corrupt = CLEAN[:shared] + CORRUPT[shared:]
    engine = _engine(path)
    spec = _spec(corrupt_prompt=corrupt, sites=["post_block", "pre_attn"])
    res = Sweep(engine, spec, executor="patch_pass").run()
    ref = Sweep(_engine(path), spec, executor="requests").run()
    np.testing.assert_allclose(res.grid, ref.grid, atol=1e-4, rtol=0)
    # Cells of the common prefix, and last-layer outputs other than the last row, cannot
    # move the answer: they are the corrupt value itself, not a re-run near it.
    assert (res.grid[:, :, :shared] == res.corrupt).all()
    assert (res.grid[0, 2, : N - 1] == res.corrupt).all()
    # Every other cell starts at its site: (N - p) rows, plus the corrupt prompt, the
    # in-pass control and the clean prompt once each.
    computed = [(s, L, p) for s in spec.sites for L in range(3) for p in range(shared, N)]
    computed = [c for c in computed if c[:2] != ("post_block", 2) or c[2] == N - 1]
    stats = engine.stats()
    assert stats["num_patch_passes"] == 1 and stats["num_steps"] == 0
    assert stats["num_patch_pass_tokens"] == 3 * N + sum(N - p for *_, p in computed)


def test_passes_split_by_the_token_budget_give_the_one_pass_grid(path, full):
    engine = _engine(path, max_num_batched_tokens=3 * N + N + 2)  # about one cell per pass
    res = Sweep(engine, _spec(sites=SITES), executor="patch_pass").run()
    assert engine.num_patch_passes > 10
    np.testing.assert_allclose(res.grid, full.grid, atol=1e-4, rtol=0)
    assert 0 <= res.noise_floor < 1e-4  # later passes' corrupt re-runs count towards it
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens=40"):
        Sweep(_engine(path, max_num_batched_tokens=40), _spec(), executor="patch_pass")
    small = Sweep(_engine(path, max_num_batched_tokens=40), _spec(layers=[1], positions=[5]))
    assert small.executor == "requests"  # "auto" runs what a pass cannot hold as requests


def test_global_prefill_steering_runs_the_cells_as_steered_requests(path, full):
    from tests.integration.test_steering import _vec

    engine = _engine(path)
    steer = {"vectors": [{"layers": [1], "site": "post_block", "vector": _vec(3, 64).tolist()}]}
    engine.set_global_steering(steer)  # queued: applies at the top of the next step or pass
    spec = _spec(layers=[1, 2], positions=[3, N - 1])
    res = Sweep(engine, spec).run()
    assert res.executor == "requests"  # a pass applies no steering: it is never taken
    steered = Sweep(_engine(path), spec, executor="requests")
    steered.engine.set_global_steering(steer)
    want = steered.run()
    np.testing.assert_allclose(res.grid, want.grid, atol=1e-4, rtol=0)
    assert np.abs(res.grid - full.grid[0][[1, 2]][:, [3, N - 1]]).max() > 1e-2
    with pytest.raises(InvalidRequestError, match="global prefill steering"):
        Sweep(engine, spec, executor="patch_pass")
