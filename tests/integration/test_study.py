"""PatchStudy over a tiny real checkpoint: sweeps, zoom, top cells, heatmaps, stored clean runs."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidRequestError, RunExistsError
from services.engine import EngineConfig, LLMEngine
from services.engine.study import PatchStudy, StudyResult
from services.engine.sweep import Sweep, SweepSpec
from services.patch_store.store import PatchStore
from tests.integration.test_steering import _engine
from tests.integration.test_sweep import ANSWER, CLEAN, CORRUPT, FOIL, SITES, N

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", layers=3)


HEAD, TAIL = [100, 101, 102, 103], [200, 201, 202]
LONG_CLEAN, SHORT_CORRUPT = [*HEAD, 300, 301, 302, *TAIL], [*HEAD, 400, *TAIL]


@pytest.fixture(scope="module")
def study(path):
    return PatchStudy(_engine(path))


@pytest.fixture(scope="module")
def full(study):
    return study.sweep(CORRUPT, ANSWER, FOIL, sites=SITES, clean_prompt=CLEAN)


@pytest.fixture(scope="module")
def unaligned(study):
    return study.sweep(SHORT_CORRUPT, ANSWER, FOIL, layers=[0, 2], clean_prompt=LONG_CLEAN)


def _stored_engine(path) -> tuple[LLMEngine, PatchStore]:
    store = PatchStore(budget_bytes=16 << 20)
    config = EngineConfig(device="cpu", dtype="float32")
    return LLMEngine(path, config, patch_store=store), store


def test_a_study_sweep_is_the_sweep_grid(path, full):
    spec = SweepSpec(
        corrupt_prompt=CORRUPT,
        clean_prompt=CLEAN,
        answer_token=ANSWER,
        foil_token=FOIL,
        sites=SITES,
        metric="logit_diff",
    )
    ref = Sweep(_engine(path), spec).run()
    assert isinstance(full, StudyResult) and full.source == "clean prompt"
    assert full.grid.shape == (2, 3, N) and not np.isnan(full.grid).any()
    assert np.allclose(full.grid, ref.grid, atol=1e-4, rtol=0)
    assert full.clean == pytest.approx(ref.clean, abs=1e-4)
    assert full.corrupt == pytest.approx(ref.corrupt, abs=1e-4)
    assert full.tokens == ref.tokens and full.sites == SITES


def test_zoom_re_sweeps_exactly_the_sub_grid(study, full):
    layers, positions = [2, 0], [4, 5, 6]
    zoomed = study.zoom(full, layers=layers, positions=positions, sites=["hook_resid_pre"])
    assert zoomed.grid.shape == (1, 2, 3) and zoomed.sites == ["pre_attn"]
    want = full.grid[1][np.ix_(layers, positions)]
    assert np.allclose(zoomed.grid[0], want, atol=1e-4, rtol=0)
    # another alpha: alpha 0 leaves every cell at the corrupt baseline
    off = study.zoom(full, layers=[1], positions=[0, 10], alpha=0.0)
    assert off.spec.alpha == 0.0 and off.sites == SITES
    assert np.allclose(off.grid, full.corrupt, atol=1e-4, rtol=0)


def test_zoom_on_skipped_positions_says_why_instead_of_a_silent_nan_grid(study, unaligned):
    assert unaligned.skipped == [4]
    steps = study.engine.num_steps
    with pytest.raises(InvalidRequestError, match=r"zoom has nothing to patch") as e:
        study.zoom(unaligned, positions=[4])
    message = str(e.value)
    assert "positions [4] are skipped (unaligned)" in message
    assert "clean prompt has 10 tokens and the corrupt prompt 8" in message
    assert "prefix_len=4, suffix_len=3, offset=2" in message
    assert study.engine.num_steps == steps  # refused before anything ran
    # Some valid positions among them: the valid cells run, the skipped one warns and says why.
    with pytest.warns(UserWarning, match=r"positions \[4\] are skipped \(unaligned\)"):
        mixed = study.zoom(unaligned, positions=[3, 4])
    assert mixed.skipped == [4] and np.isnan(mixed.grid[..., 1]).all()
    assert np.allclose(mixed.grid[..., 0], unaligned.grid[..., 3], atol=1e-4, rtol=0)
    # A plain sweep of skipped positions only is the same clear error.
    with pytest.raises(InvalidRequestError, match="no position of this sweep can be patched"):
        study.sweep(SHORT_CORRUPT, ANSWER, FOIL, positions=[4], clean_prompt=LONG_CLEAN)


def test_top_lists_the_largest_finite_cells_in_order(study, full, unaligned):
    top = study.top(full, k=5)
    assert [c.value for c in top] == sorted(full.grid.ravel(), reverse=True)[:5]
    for c in top:
        s = full.sites.index(c.site)
        assert full.grid[s, full.layers.index(c.layer), c.position] == c.value
        assert c.token == full.tokens[c.position]
    assert top[0].value == full.argmax.value
    # NaN cells never count; k beyond the finite cells returns them all
    finite = unaligned.grid[np.isfinite(unaligned.grid)]
    every = study.top(unaligned, k=unaligned.grid.size)
    assert len(every) == finite.size < unaligned.grid.size
    assert [c.value for c in every] == sorted(finite, reverse=True)
    assert all(c.position != 4 for c in every)
    assert np.array_equal(study.to_numpy(full), full.grid, equal_nan=True)


def _read_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)  # [height, width, channels]
    assert pixels.ndim == 3 and pixels.shape[0] > 0 and pixels.shape[1] > 0
    return pixels


def test_heatmaps_are_readable_pngs_that_grow_with_the_grid(study, full, unaligned, tmp_path):
    assert unaligned.skipped == [4] and np.isnan(unaligned.grid).any()
    holes = study.heatmap(unaligned, tmp_path / "unaligned.png", title="unequal lengths")
    assert holes == tmp_path / "unaligned.png"
    _read_png(holes)
    both = _read_png(study.heatmap(full, tmp_path / "full.png"))
    one = _read_png(study.heatmap(full, str(tmp_path / "sub" / "one.png"), site="resid_pre"))
    narrow = study.zoom(full, layers=[1, 2], positions=[3, 4], sites=["post_block"])
    small = _read_png(study.heatmap(narrow, tmp_path / "small.png"))
    assert both.shape[0] > one.shape[0]  # a panel per site
    assert one.shape[1] > small.shape[1] and one.shape[0] > small.shape[0]


def test_a_captured_clean_run_sweeps_like_the_inline_clean_prompt(path, full):
    engine, store = _stored_engine(path)
    study = PatchStudy(engine)
    assert study.capture_clean(CLEAN, sites=["post_block"], run="clean-1") == "clean-1"
    (manifest,) = store.manifests(["clean-1"])
    assert manifest.keys == ((0, "post_block"), (1, "post_block"), (2, "post_block"))
    assert manifest.positions == tuple(range(N)) and manifest.token_ids == tuple(CLEAN)
    res = study.sweep(CORRUPT, ANSWER, FOIL)  # the last captured run
    assert res.source == "stored run 'clean-1'" and res.spec.source_run == "clean-1"
    assert np.allclose(res.grid[0], full.grid[0], atol=1e-4, rtol=0)
    assert res.clean == pytest.approx(full.clean, abs=1e-4)
    (manifest,) = store.manifests(["clean-1"])
    assert not [h for h in manifest.holders if h.startswith("patch-study")]  # lease released
    zoomed = study.zoom(res, layers=[1], positions=[3, 7])
    assert zoomed.source == res.source
    assert np.allclose(zoomed.grid[0, 0], full.grid[0, 1, [3, 7]], atol=1e-4, rtol=0)
    # sites the run lacks: the kept clean prompt is captured inline, same numbers
    other = study.sweep(CORRUPT, ANSWER, FOIL, sites=["pre_attn"], layers=[0, 2])
    assert "inline" in other.source and other.spec.source_run is None
    assert np.allclose(other.grid[0], full.grid[1, [0, 2]], atol=1e-4, rtol=0)
    with pytest.raises(RunExistsError, match="clean-1"):
        study.capture_clean(CLEAN, run="clean-1")
    assert not engine.has_unfinished_requests()


def test_a_stored_run_of_another_length_is_aligned_inline(path, study, unaligned):
    engine, store = _stored_engine(path)
    stored = PatchStudy(engine)
    run = stored.capture_clean(LONG_CLEAN)
    assert run.startswith("clean-") and store.manifests([run])
    res = stored.sweep(SHORT_CORRUPT, ANSWER, FOIL, layers=[0, 2])
    assert "aligned" in res.source and res.skipped == [4]
    assert np.allclose(res.grid, unaligned.grid, atol=1e-4, rtol=0, equal_nan=True)


def test_without_a_store_capture_clean_keeps_the_prompt(path, full):
    study = PatchStudy(_engine(path))
    run = study.capture_clean(CLEAN, run="kept")
    res = study.sweep(CORRUPT, ANSWER, FOIL, sites=["post_block"], layers=[0, 1])
    assert run == "kept" and "inline" in res.source and res.run == "kept"
    assert np.allclose(res.grid[0], full.grid[0, :2], atol=1e-4, rtol=0)
    assert study.engine.num_patch_passes > 0 and not study.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s, r: s.zoom(r, layers=[0, 3]), r"layers \[3\] are outside"),
        (lambda s, r: s.zoom(r, positions=[N]), "positions .* outside"),
        (lambda s, r: s.zoom(r, sites=["post_attn"]), "sites .* outside"),
        (lambda s, r: s.zoom(r, layers=[]), "non-empty"),
        (lambda s, r: s.heatmap(r, "x.png", site="post_attn"), "not in this result"),
        (lambda s, r: s.heatmap(r, "x.png", site="mlp_out"), "unknown site"),
        (lambda s, r: s.heatmap(r, "x.pdf"), "PNG"),
        (lambda s, r: s.top(r, k=0), "k must be"),
        (lambda s, r: s.top(r, k=2.5), "k must be"),
        (lambda s, r: s.sweep(CORRUPT, ANSWER, FOIL), "no clean run"),
        (lambda s, r: s.sweep(CORRUPT, ANSWER, FOIL, run="nope"), "unknown clean run"),
        (lambda s, r: s.sweep(CORRUPT, ANSWER, FOIL, clean_prompt=CLEAN, run="x"), "not both"),
        (lambda s, r: s.sweep(CORRUPT, ANSWER, metric="logit_diff", clean_prompt=CLEAN), "foil"),
        (lambda s, r: s.sweep(CORRUPT, ANSWER, FOIL, sites=[], clean_prompt=CLEAN), "non-empty"),
        (lambda s, r: s.capture_clean(CLEAN, sites="post_block"), "list of site names"),
    ],
)
def test_bad_requests_are_invalid_request_errors(path, full, call, message):
    study = PatchStudy(_engine(path))
    with pytest.raises(InvalidRequestError, match=message):
        call(study, full)
    assert study.engine.num_steps == 0


def test_zoom_needs_a_study_result(path, study):
    spec = SweepSpec(corrupt_prompt=CORRUPT, clean_prompt=CLEAN, answer_token=ANSWER, layers=[0])
    plain = Sweep(_engine(path), spec).run()
    with pytest.raises(InvalidRequestError, match=r"PatchStudy\.sweep"):
        study.zoom(plain, layers=[0])
    assert len(study.top(plain, k=1)) == 1  # the readers take any SweepResult
