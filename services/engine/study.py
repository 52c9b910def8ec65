"""PatchStudy: the researcher-facing client over `Sweep` — capture a clean run once, sweep
corrupt prompts against it, zoom into a sub-grid, list the top cells, draw a heatmap.

A study drives one engine (an `LLMEngine`; later a client with the same methods). Clean runs
go to the engine's patch-source store when one is attached; without one the study keeps the
clean prompt and each sweep captures it inline. Either way the numbers are the same: a
stored run is only a cache of the clean activations.
"""

from __future__ import annotations

import logging
import math
import uuid
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    RunExistsError,
    RunNotFoundError,
)
from services.engine.interventions.sites import SITE_ALIASES, parse_site
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import OutputAccumulator
from services.engine.sampling_params import SamplingParams
from services.engine.sweep import Metric, Sweep, SweepResult, SweepSpec, skipped_reason

log = logging.getLogger(__name__)

Prompt = str | list[int]

# Heatmap geometry, in inches: room per grid column and row, and caps for huge grids.
_COL_IN, _ROW_IN, _MIN_WIDTH_IN, _MAX_WIDTH_IN, _MAX_PANEL_IN = 0.34, 0.3, 5.5, 60.0, 16.0
_MAX_ANNOTATED_CELLS = 240  # a panel up to this size prints each cell's value
_NAN_STYLE: dict[str, Any] = {"facecolor": "0.86", "edgecolor": "0.5", "hatch": "///"}


@dataclass
class StudyResult(SweepResult):
    """A `SweepResult` that remembers how it was made, so `zoom` can re-run part of it."""

    spec: SweepSpec | None = None  # the spec that ran
    run: str | None = None  # the study's clean run it used (None: an explicit clean_prompt)
    source: str = ""  # where the clean activations came from, in words


@dataclass(frozen=True)
class TopCell:
    """One cell of a result, with the corrupt-prompt token at its position."""

    layer: int
    site: str
    position: int
    token: str
    value: float


@dataclass
class _CleanRun:
    prompt: Prompt
    token_ids: list[int]
    sites: list[str]
    stored: bool  # written to the engine's patch-source store


class PatchStudy:
    """Causal-tracing sweeps for a researcher: one clean run, many corrupt prompts."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._runs: dict[str, _CleanRun] = {}
        self._last_run: str | None = None
        self._holder = f"patch-study-{uuid.uuid4().hex[:12]}"

    @property
    def store(self) -> Any:
        """The engine's patch-source store (None when none is attached)."""
        return self.engine.interventions.patch_sources

    def _stored(self, run: str) -> bool:
        """Whether the engine's patch-source store holds `run` now."""
        if self.store is None:
            return False
        try:
            return bool(self.store.manifests([run]))
        except RunNotFoundError:
            return False

    # -- clean runs ----------------------------------------------------------------------

    def capture_clean(
        self,
        clean_prompt: Prompt,
        sites: list[str] | None = None,
        run: str | None = None,
        *,
        overwrite: bool = False,
    ) -> str:
        """Capture the clean prompt at every layer of `sites` (default post_block) and all its
        positions; returns the run id. With a patch-source store the rows are written there as
        that run; without one the prompt is kept and each sweep captures it inline."""
        sites = self._sites(["post_block"] if sites is None else sites)
        run = run if run is not None else f"clean-{uuid.uuid4().hex[:8]}"
        if not isinstance(run, str) or not run:
            raise InvalidRequestError(f"run must be a non-empty string, got {run!r}")
        _, ids = self.engine.encode(clean_prompt)
        self.engine.validate(ids, SamplingParams(max_tokens=1))
        stored = self.store is not None
        if stored:
            if self._stored(run):
                if not overwrite:
                    raise RunExistsError(
                        f"run {run!r} is already stored; pass overwrite=True to replace it"
                    )
                self.store.drop_run(run)
            capture = {
                "sites": {s: "all" for s in sites},
                "positions": "all_prompt",
                "sink": "patch_store",
                "run": run,
            }
            out = self._finish(ids, SamplingParams(max_tokens=1, capture=capture))
            if out.capture_run != run:
                raise CoxswainError(
                    f"capturing clean run {run!r} failed: {out.capture_error or 'no run written'}"
                )
        elif run in self._runs and not overwrite:
            raise RunExistsError(f"run {run!r} is already kept; pass overwrite=True to replace it")
        self._runs[run] = _CleanRun(clean_prompt, ids, sites, stored)
        self._last_run = run
        return run

    def _finish(self, ids: list[int], params: SamplingParams) -> Any:
        """Run one request to the end on an otherwise idle engine; its final output."""
        engine = self.engine
        if engine.has_unfinished_requests():
            raise InvalidRequestError(
                f"the engine has {len(engine.requests)} unfinished requests: a study steps the "
                "engine itself and needs it to itself"
            )
        rid = f"{self._holder}-{uuid.uuid4().hex[:8]}"
        engine.add_request(rid, ids, params)
        try:
            totals = OutputAccumulator()
            while rid in engine.requests:
                for out in totals.finished(engine.step()):
                    if out.request_id == rid:
                        return out
            raise CoxswainError(f"request {rid!r} was aborted before it finished")
        finally:
            if rid in engine.requests:
                engine.abort(rid)

    # -- sweeps --------------------------------------------------------------------------

    def sweep(
        self,
        corrupt_prompt: Prompt,
        answer: int | str,
        foil: int | str | None = None,
        layers: list[int] | Literal["all"] = "all",
        positions: list[int] | Literal["all_prompt"] = "all_prompt",
        sites: list[str] | None = None,
        metric: Metric = "logit_diff",
        alpha: float = 1.0,
        clean_prompt: Prompt | None = None,
        run: str | None = None,
    ) -> StudyResult:
        """Patch clean activations into the corrupt prompt, one cell per (site, layer,
        position); the clean side is `clean_prompt` if given, else `run` (default: the last
        captured clean run)."""
        sites = self._sites(["post_block"] if sites is None else sites)
        spec = SweepSpec(
            corrupt_prompt=corrupt_prompt,
            answer_token=answer,
            foil_token=foil,
            layers=layers,
            positions=positions,
            sites=sites,
            metric=metric,
            alpha=alpha,
        )
        if clean_prompt is not None:
            if run is not None:
                raise InvalidRequestError("give clean_prompt or run, not both")
            return self._run(replace(spec, clean_prompt=clean_prompt), None, "clean prompt")
        run = run if run is not None else self._last_run
        if run is None:
            raise InvalidRequestError(
                "no clean run: call capture_clean(...) first or pass clean_prompt"
            )
        spec, source = self._clean_source(spec, run)
        return self._run(spec, run, source)

    def _clean_source(self, spec: SweepSpec, run: str) -> tuple[SweepSpec, str]:
        """The spec reading `run` from the store when it covers the sweep, else capturing the
        kept clean prompt inline (same numbers; unequal lengths need it to align)."""
        kept = self._runs.get(run)
        if kept is None:  # not ours: a run someone else stored; Sweep checks it covers the grid
            if not self._stored(run):
                raise InvalidRequestError(
                    f"unknown clean run {run!r}: capture it with capture_clean first"
                )
            return replace(spec, source_run=run), f"stored run {run!r}"
        inline = replace(spec, clean_prompt=kept.prompt)
        if not kept.stored:
            return inline, f"clean prompt of run {run!r} (no patch store: captured inline)"
        _, corrupt_ids = self.engine.encode(spec.corrupt_prompt)
        if len(corrupt_ids) != len(kept.token_ids):
            why = f"{len(kept.token_ids)} clean vs {len(corrupt_ids)} corrupt tokens: aligned"
        elif not set(spec.sites) <= set(kept.sites):
            why = f"run holds sites {kept.sites} only"
        elif not self._stored(run):
            why = "run no longer in the patch store"
        else:
            return replace(spec, source_run=run), f"stored run {run!r}"
        log.info("sweep against run %r captures the clean prompt inline: %s", run, why)
        return inline, f"clean prompt of run {run!r}, captured inline ({why})"

    def _run(self, spec: SweepSpec, run: str | None, source: str) -> StudyResult:
        # A sweep of a stored run leases and reads the version it found (see sweep.py).
        res = Sweep(self.engine, spec).run()
        values = {f.name: getattr(res, f.name) for f in fields(SweepResult)}
        return StudyResult(**values, spec=spec, run=run, source=source)

    def zoom(
        self,
        res: SweepResult,
        layers: list[int] | None = None,
        positions: list[int] | None = None,
        sites: list[str] | None = None,
        alpha: float | None = None,
    ) -> StudyResult:
        """Re-sweep a sub-grid of `res` (each axis defaults to all of `res`'s), optionally with
        another alpha; the same prompts, answer, foil, metric and clean source.

        Positions `res` skipped (unaligned: no clean counterpart) cannot be patched: asking
        only for those is an InvalidRequestError saying why; asking for some among valid ones
        warns (UserWarning) and leaves their cells NaN, listed in the result's `skipped`."""
        if not isinstance(res, StudyResult) or res.spec is None:
            raise InvalidRequestError("zoom needs a result of PatchStudy.sweep or zoom")
        layers = _subset(layers, res.layers, "layers")
        asked = positions is not None
        positions = _subset(positions, res.positions, "positions")
        skipped = [p for p in positions if p in res.skipped]
        if asked and skipped:
            why = skipped_reason(res.alignment, skipped, len(res.tokens))
            if len(skipped) == len(positions):
                raise InvalidRequestError(f"zoom has nothing to patch: {why}")
            warnings.warn(f"zoom: {why}; their cells stay NaN", UserWarning, stacklevel=2)
        sites = _subset(None if sites is None else self._sites(sites), res.sites, "sites")
        spec = res.spec
        return self.sweep(
            spec.corrupt_prompt,
            answer=spec.answer_token,
            foil=spec.foil_token,
            layers=layers,
            positions=positions,
            sites=sites,
            metric=spec.metric,
            alpha=spec.alpha if alpha is None else alpha,
            clean_prompt=spec.clean_prompt if res.run is None else None,
            run=res.run,
        )

    # -- reading results -----------------------------------------------------------------

    def top(self, res: SweepResult, k: int = 5) -> list[TopCell]:
        """The k cells with the largest values, largest first (NaN cells never count; ties
        keep grid order)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidRequestError(f"k must be an int >= 1, got {k!r}")
        flat = res.grid.ravel()  # [S * L * P]
        finite = np.flatnonzero(np.isfinite(flat))
        order = finite[np.argsort(-flat[finite], kind="stable")][:k]
        out = []
        for i in order:
            s, li, pi = np.unravel_index(i, res.grid.shape)
            p = res.positions[pi]
            out.append(TopCell(res.layers[li], res.sites[s], p, _token_at(res, p), float(flat[i])))
        return out

    def to_numpy(self, res: SweepResult) -> np.ndarray:
        """A copy of the grid `[site, layer, position]` (NaN where skipped or void)."""
        return res.to_numpy()

    def heatmap(
        self,
        res: SweepResult,
        path: str | Path,
        site: str | None = None,
        title: str | None = None,
    ) -> Path:
        """Write a PNG of the grid: one panel per site (or just `site`), corrupt-prompt tokens
        across, layers up, colour centred on the corrupt baseline; returns the path."""
        path = Path(path)
        if path.suffix.lower() != ".png":
            raise InvalidRequestError(f"heatmap writes a PNG: give a .png path, not {str(path)!r}")
        if site is None:
            shown = list(range(len(res.sites)))
        else:
            name = parse_site(site)
            if name not in res.sites:
                raise InvalidRequestError(f"site {site!r} is not in this result: {res.sites}")
            shown = [res.sites.index(name)]
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = _heatmap_figure(res, shown, title)
        with warnings.catch_warnings():  # odd tokens can lack a glyph; the label still draws
            warnings.filterwarnings("ignore", message=".*Glyph.*missing", category=UserWarning)
            fig.savefig(path, format="png")
        return path

    def _sites(self, sites: list[str]) -> list[str]:
        if isinstance(sites, str) or not isinstance(sites, list | tuple) or not sites:
            raise InvalidRequestError(
                f"sites must be a non-empty list of site names, got {sites!r}"
            )
        return [parse_site(s) for s in sites]


def _subset(wanted: list | None, have: list, name: str) -> list:
    """`wanted` if every item is on the result's axis `have` (None: all of it)."""
    if wanted is None:
        return list(have)
    if not isinstance(wanted, list | tuple) or not wanted:
        raise InvalidRequestError(f"zoom {name} must be a non-empty list, got {wanted!r}")
    outside = [v for v in wanted if v not in have]
    if outside:
        raise InvalidRequestError(f"zoom {name} {outside[:5]} are outside the result's {have}")
    return list(wanted)


def _token_label(position: int, token: str) -> str:
    """`"<position>: <token>"` with control characters escaped and edge spaces visible."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in token)
    if len(text) > 14:
        text = text[:13] + "…"
    if not text or text != text.strip():
        text = f"'{text}'"
    return f"{position}: {text}"


def _site_label(site: str) -> str:
    tl = [a for a, s in SITE_ALIASES.items() if s == site and a.startswith("hook_")]
    return f"{site} (blocks.L.{tl[0]})" if tl else site


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _heatmap_figure(res: SweepResult, shown: list[int], title: str | None) -> Any:
    # Imported here: plotting is optional to a server that imports the study module.
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import CenteredNorm
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    n_layers, n_pos = len(res.layers), len(res.positions)
    grids = res.grid[shown]  # [S', L, P]
    finite = grids[np.isfinite(grids)]
    centre = res.corrupt
    reach = [abs(float(v) - centre) for v in (finite.min(), finite.max())] if finite.size else []
    if res.clean is not None:
        reach.append(abs(res.clean - centre))  # keep the clean baseline on the scale
    norm = CenteredNorm(vcenter=centre, halfrange=max([*reach, 1e-6]))

    width = min(_MAX_WIDTH_IN, max(_MIN_WIDTH_IN, 3.0 + _COL_IN * n_pos))
    panel = min(_MAX_PANEL_IN, 1.0 + _ROW_IN * n_layers)
    fig = Figure(figsize=(width, 3.4 + panel * len(shown)), dpi=110, layout="constrained")
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    x_step = max(1, math.ceil(n_pos / 160))
    y_step = max(1, math.ceil(n_layers / 50))
    annotate = n_layers * n_pos <= _MAX_ANNOTATED_CELLS
    for ax, s in zip(axes, shown, strict=True):
        grid = res.grid[s]  # [L, P]
        image = ax.imshow(grid, cmap="RdBu_r", norm=norm, aspect="auto", origin="lower")
        holes = np.argwhere(~np.isfinite(grid))
        if len(holes):
            boxes = [Rectangle((p - 0.5, li - 0.5), 1, 1) for li, p in holes]
            ax.add_collection(PatchCollection(boxes, linewidth=0, **_NAN_STYLE))
        if annotate:
            for li in range(n_layers):
                for pi in range(n_pos):
                    v = grid[li, pi]
                    if np.isfinite(v):
                        dark = abs(norm(v) - 0.5) > 0.3
                        ax.text(
                            pi,
                            li,
                            f"{v:.2f}".replace("-0.00", "0.00"),
                            ha="center",
                            va="center",
                            fontsize=6.5,
                            color="white" if dark else "black",
                        )
        best = res.argmax
        if best is not None and best.site == res.sites[s]:
            at = (res.positions.index(best.position) - 0.5, res.layers.index(best.layer) - 0.5)
            ax.add_patch(Rectangle(at, 1, 1, fill=False, edgecolor="black", linewidth=2))
        ax.set_title(_site_label(res.sites[s]), fontsize=10, loc="left")
        ax.set_ylabel("layer")
        ys = list(range(0, n_layers, y_step))
        ax.set_yticks(ys, [str(res.layers[i]) for i in ys])
    xs = list(range(0, n_pos, x_step))
    labels = [_token_label(res.positions[i], _token_at(res, res.positions[i])) for i in xs]
    axes[-1].set_xticks(xs, labels, rotation=90, fontsize=8, parse_math=False)
    axes[-1].set_xlabel("corrupt prompt position: token")

    bar = fig.colorbar(image, ax=list(axes), shrink=0.9, pad=0.02)
    bar.set_label(f"{res.metric} (centre: corrupt baseline)")
    if res.clean is not None:
        bar.ax.axhline(res.clean, color="black", linewidth=2)

    handles: list[Any] = [
        Patch(color=image.cmap(0.5), label=f"corrupt baseline = {_fmt(res.corrupt)}")
    ]
    if res.clean is not None:
        label = f"clean baseline = {_fmt(res.clean)} (line on the colour bar)"
        handles.append(Line2D([], [], color="black", linewidth=2, label=label))
    if res.argmax is not None and res.argmax.site in {res.sites[s] for s in shown}:
        best = res.argmax
        label = f"argmax: layer {best.layer}, position {best.position} = {_fmt(best.value)}"
        handles.append(Patch(fill=False, edgecolor="black", linewidth=2, label=label))
    if np.isnan(grids).any():
        n_void = sum(1 for c in res.void if c.site in {res.sites[s] for s in shown})
        why = [f"positions {res.skipped} skipped (unaligned)"] if res.skipped else []
        why += [f"{n_void} void cells"] if n_void else []
        label = f"NaN: {', '.join(why) or 'not run'}"
        handles.append(Patch(**_NAN_STYLE, label=label))
    ncol = 2 if width >= 10 else 1  # a narrow figure stacks the legend
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)

    alpha = getattr(getattr(res, "spec", None), "alpha", None)
    lines = [
        title or "Activation patching sweep",
        f"metric: {res.metric}   alpha: {_fmt(alpha)}",
        f"clean: {_fmt(res.clean)}   corrupt: {_fmt(res.corrupt)}   "
        f"noise floor: {res.noise_floor:.2g}",
    ]
    if not finite.size:
        lines.append("no cell has a value")
    fig.suptitle("\n".join(lines), fontsize=10)
    return fig


def _token_at(res: SweepResult, position: int) -> str:
    return res.tokens[position] if position < len(res.tokens) else "?"
