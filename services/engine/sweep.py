"""Causal-tracing sweeps: one patched request per (site, layer, position) cell, batched.

A sweep runs the clean prompt (capturing the residuals it needs, unless a stored run is
the source) and the corrupt prompt unpatched, then adds every cell plus an in-batch
corrupt control to the engine at once so they share one continuous batch (and the corrupt
prompt's prefix blocks before each cell's patched position). Cells are graded with the
exact logprobs of an answer token and an optional foil.

This module drives a sweep and grades its cells. What it is asked and answers is in
`sweep_spec.py`, the checks that resolve a spec against the engine in `sweep_plan.py`, and
how its requests reach the engine in `sweep_drivers.py` (`StepDriver` steps an otherwise
idle engine itself; `AsyncLLMDriver` runs a served engine's sweep as ordinary traffic).

A sweep over a stored run reads one version of it: the version current when the sweep was
built, named `"<run>@<version>"` in every cell's patch and leased for the sweep's run. A
re-capture of the run id meanwhile makes a new version and leaves the leased one readable
(`services/patch_store/store.py`), so every cell reads the rows the sweep started with; a
version that is gone anyway (dropped, invalidated, lost in a store restart) voids the cells
that could not read it, with the store's reason — never a number from other rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncGenerator, Generator, Iterator
from typing import Any

import numpy as np

from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    PatchPassUnavailableError,
    RunNotFoundError,
)
from services.engine.interventions.sites import site_key
from services.engine.llm_engine import LLMEngine
from services.engine.model.patch_pass import PassCell, PassJob, plan_passes
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sweep_drivers import AsyncLLMDriver, StepDriver, SweepDriver
from services.engine.sweep_plan import SweepPlan, clean_position, skipped_reason
from services.engine.sweep_spec import EXECUTORS, Cell, Executor, Metric, SweepResult, SweepSpec

# The sweep's names as its callers import them (`from services.engine.sweep import ...`).
__all__ = [
    "AsyncLLMDriver",
    "Cell",
    "Metric",
    "StepDriver",
    "Sweep",
    "SweepDriver",
    "SweepResult",
    "SweepSpec",
    "skipped_reason",
]

log = logging.getLogger(__name__)

# A sweep leases the run version it reads for this long (released when it ends).
SWEEP_LEASE_TTL_S = 600.0


class Sweep:
    """A causal-tracing sweep over one engine; `run()` for the whole grid, `iter_cells()` /
    `cells()` to stream cells as they finish. A Sweep runs once.

    `driver` decides how its work reaches the engine: `StepDriver(engine)` (the default)
    runs on an otherwise idle engine; `AsyncLLMDriver(llm)` goes through a served engine's
    `AsyncLLM` (pass `llm.engine` as `engine`: it is read for validation only).

    `executor` decides how cells run. "patch_pass" runs them in layered forwards where each
    cell starts at its patched site (`model/patch_pass.py`), between the engine's steps;
    "requests" adds one patched request per cell to the continuous batch. "auto" (the
    default) takes the pass unless the engine cannot run one (a multi-process replica,
    global prefill steering) or the prompts outgrow `max_num_batched_tokens`, and says why
    in the log; `executor="patch_pass"` makes that an error instead.
    """

    def __init__(
        self,
        engine: LLMEngine,
        spec: SweepSpec,
        driver: SweepDriver | None = None,
        executor: Executor = "auto",
    ):
        self.engine, self.spec = engine, spec
        self.driver: SweepDriver = driver or StepDriver(engine)
        self._tag = f"sweep-{uuid.uuid4().hex[:8]}"
        self._started = False
        self.plan = SweepPlan(engine, spec)
        self._executor_asked = executor
        self.executor = self._choose_executor(executor)

    def _choose_executor(self, wanted: str) -> str:
        if wanted not in EXECUTORS:
            raise InvalidRequestError(f"executor must be one of {EXECUTORS}, got {wanted!r}")
        if wanted == "requests":
            return wanted
        why = self._pass_unavailable()
        if why is None:
            return "patch_pass"
        if wanted == "patch_pass":
            raise PatchPassUnavailableError(f"executor 'patch_pass' cannot run this sweep: {why}")
        log.info("sweep %s runs its cells as patched requests: %s", self._tag, why)
        return "requests"

    def _pass_unavailable(self) -> str | None:
        why = self.engine.patch_pass_unavailable()
        if why is not None:
            return why
        budget = self.engine.config.max_num_batched_tokens
        n, n_clean = len(self.plan.corrupt_ids), len(self.plan.clean_ids or [])
        if 3 * n + n_clean > budget:  # corrupt, control, clean and one whole cell
            return (
                "a pass holds the corrupt prompt twice, the clean one and a cell "
                f"({3 * n + n_clean} rows), more than max_num_batched_tokens={budget}"
            )
        return None

    def _params(self, **kw: Any) -> SamplingParams:
        ids = self.plan.graded_ids
        return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=ids, **kw)

    @property
    def foreign_outputs(self) -> list[RequestOutput]:
        """Final outputs of other requests that finished while this sweep stepped the engine."""
        return getattr(self.driver, "foreign_outputs", [])

    def _grade(self, out: RequestOutput | str) -> tuple[float, float | None] | str:
        """(logprob of answer, of foil) from a finished request, or why there are none."""
        if isinstance(out, str):
            return out
        comp = out.outputs[0]
        if comp.finish_reason not in ("length", "stop") or not comp.logprobs:
            return f"the request ended with {comp.finish_reason!r} before a token"
        lps = comp.logprobs[0]
        answer, foil = self.plan.answer, self.plan.foil
        if answer not in lps or (foil is not None and foil not in lps):
            return "the answer/foil logprobs are missing from the output"
        return lps[answer], (lps[foil] if foil is not None else None)

    def _raw(self, answer: float, foil: float | None) -> float:
        return answer - foil if foil is not None else answer

    def _baselines(self) -> None:
        """Run the clean prompt (capturing rows when it is the source) and the corrupt prompt
        alone; sets the baseline metrics and the clean rows."""
        spec, plan = self.spec, self.plan
        adds: dict[str, tuple[list[int], SamplingParams]] = {
            f"{self._tag}-corrupt": (plan.corrupt_ids, self._params())
        }
        if plan.clean_ids is not None:
            capture = None
            if spec.source_run is None:
                capture = {
                    "sites": {s: plan.layers for s in plan.sites},
                    "positions": "all_prompt",
                }
            adds[f"{self._tag}-clean"] = (plan.clean_ids, self._params(capture=capture))
        for rid, (ids, params) in adds.items():
            self.driver.add(rid, ids, params)
        done = dict(self.driver.finals(set(adds)))
        results = {}
        for rid, out in done.items():
            graded = self._grade(out)
            if isinstance(graded, str):
                raise CoxswainError(f"sweep baseline {rid!r} failed: {graded}")
            results[rid] = graded
        clean_raw = None
        self._rows: dict[tuple[int, str], Any] = {}
        if plan.clean_ids is not None:
            clean_raw = self._raw(*results[f"{self._tag}-clean"])
            clean_out = done[f"{self._tag}-clean"]
            if spec.source_run is None:
                assert isinstance(clean_out, RequestOutput) and clean_out.captures is not None
                if clean_out.capture_positions != list(range(len(plan.clean_ids))):
                    raise CoxswainError("the clean capture did not cover every prompt position")
                for s in plan.sites:
                    for L in plan.layers:
                        self._rows[(L, s)] = clean_out.captures[site_key(L, s)]  # [P, H]
        self._set_baselines(self._raw(*results[f"{self._tag}-corrupt"]), clean_raw)

    def _set_baselines(self, raw_corrupt: float, raw_clean: float | None) -> None:
        self._raw_corrupt, self._raw_clean = raw_corrupt, raw_clean
        if self.spec.metric == "recovered" and self._raw_clean == self._raw_corrupt:
            raise InvalidRequestError(
                "metric 'recovered' is undefined: the clean and corrupt baselines are equal"
            )
        self.clean = None if self._raw_clean is None else self._value_of_raw(self._raw_clean)
        self.corrupt = self._value_of_raw(self._raw_corrupt)

    def _value_of_raw(self, raw: float) -> float:
        if self.spec.metric != "recovered":
            return raw
        assert self._raw_clean is not None  # checked by SweepPlan
        return (raw - self._raw_corrupt) / (self._raw_clean - self._raw_corrupt)

    def _patch_entry(self, layer: int, site: str, p: int, q: int) -> dict:
        if self.plan.run_ref is not None:
            source: dict = {"run": self.plan.run_ref, "position": q}
        else:
            source = {"vector": self._rows[(layer, site)][q]}
        return {
            "layer": layer,
            "site": site,
            "position": p,
            "alpha": self.spec.alpha,
            "source": source,
        }

    def iter_cells(self) -> Generator[Cell, None, None]:
        """Run the baselines, then every cell; yield each cell as it finishes (void cells
        included, skipped ones not). Closing the generator early stops the sweep (aborting
        its unfinished requests)."""
        if self._started:
            raise InvalidRequestError("this sweep has already run")
        self._started = True
        self.driver.start()
        self.cells_done: list[Cell] = []
        leased = self._lease_run()
        run = self._pass_cells() if self.executor == "patch_pass" else self._request_cells()
        try:
            with contextlib.closing(run):
                for cell in run:
                    self.cells_done.append(cell)
                    yield cell
        finally:
            if leased:
                self._release_run()

    def _grid_cells(self) -> Iterator[tuple[Cell, int]]:
        """Every cell of the grid with the clean position it patches from (skipped ones not)."""
        for s in self.plan.sites:
            for L in self.plan.layers:
                for p in self.plan.positions:
                    q = clean_position(self.plan.alignment, p)
                    if q is not None:
                        yield Cell(L, s, p), q

    def _request_cells(self) -> Generator[Cell, None, None]:
        """The baselines, then one patched request per cell, all in one continuous batch."""
        ours: set[str] = set()
        try:
            self._baselines()
            control = f"{self._tag}-control"
            self.driver.add(control, self.plan.corrupt_ids, self._params())
            ours.add(control)
            by_id: dict[str, Cell] = {}
            for cell, q in self._grid_cells():
                rid = f"{self._tag}-{cell.layer}.{cell.site}.{cell.position}"
                try:
                    params = self._params(
                        patch=[self._patch_entry(cell.layer, cell.site, cell.position, q)]
                    )
                    self.driver.add(rid, self.plan.corrupt_ids, params)
                except CoxswainError as exc:
                    cell.void = f"{type(exc).__name__}: {exc}"
                    yield cell
                    continue
                by_id[rid] = cell
                ours.add(rid)
            for rid, out in self.driver.finals(set(ours)):
                ours.discard(rid)
                graded = self._grade(out)
                if rid == control:
                    if isinstance(graded, str):
                        raise CoxswainError(f"the in-batch corrupt control failed: {graded}")
                    self.noise_floor = abs(self._value_of_raw(self._raw(*graded)) - self.corrupt)
                    continue
                cell = by_id[rid]
                if isinstance(graded, str):
                    cell.void = graded
                else:
                    self._set_value(cell, *graded)
                yield cell
        finally:
            for rid in ours:
                self.driver.abort(rid)

    def _set_value(self, cell: Cell, answer: float, foil: float | None) -> None:
        cell.logprob_answer, cell.logprob_foil = answer, foil
        cell.value = self._value_of_raw(self._raw(answer, foil))

    def _cannot_change(self, cell: Cell) -> bool:
        """Whether the cell's patch cannot move the answer, so its value is the corrupt
        baseline exactly: a position of the prompts' common prefix, whose residual at every
        site is the same in both runs (the clean prompt's, run beside it, is the source),
        or a row of the last layer's output other than the last."""
        if self.plan.run_ref is None and cell.position < self.plan.alignment["prefix_len"]:
            return True
        last_layer = self.engine.model_config.num_layers - 1
        return (
            cell.site == "post_block"
            and cell.layer == last_layer
            and cell.position != len(self.plan.corrupt_ids) - 1
        )

    def _pass_cells(self) -> Generator[Cell, None, None]:
        """Every cell in layered patching passes (`model/patch_pass.py`): the first pass
        also gives the baselines and an in-pass control; each later pass re-runs the corrupt
        prompt, whose distance from the first one's counts towards the noise floor."""
        plan = self.plan
        runs: list[tuple[Cell, PassCell]] = []
        same: list[Cell] = []
        for cell, q in self._grid_cells():
            if self._cannot_change(cell):
                same.append(cell)
            else:
                runs.append((cell, PassCell(cell.layer, cell.site, cell.position, q)))
        token_ids = plan.graded_ids
        n_clean = len(plan.clean_ids) if plan.clean_ids is not None else 0
        budget = self.engine.config.max_num_batched_tokens
        passes = plan_passes([pc for _, pc in runs], len(plan.corrupt_ids), n_clean, budget)
        corrupt_raw = 0.0
        for i, chunk in enumerate(passes or [[]]):
            cells = [runs[k][0] for k in chunk]
            pass_cells, rows = [runs[k][1] for k in chunk], None
            if plan.run_ref is not None and pass_cells:
                try:  # each cell's row is row k of this pass's stored rows
                    rows = self._stored_rows(pass_cells)
                    pass_cells = [
                        PassCell(c.layer, c.site, c.position, k) for k, c in enumerate(pass_cells)
                    ]
                except CoxswainError as exc:  # the version is gone: no number from other rows
                    for cell in cells:
                        cell.void = f"{type(exc).__name__}: {exc}"
                    cells, pass_cells = [], []
            if i > 0 and not pass_cells:
                yield from (runs[k][0] for k in chunk)
                continue
            job = PassJob(
                plan.corrupt_ids,
                pass_cells,
                token_ids,
                alpha=self.spec.alpha,
                clean_ids=plan.clean_ids,
                source_rows=rows,
                with_control=i == 0,
            )
            try:
                res = self.driver.run_pass(job)
            except PatchPassUnavailableError as exc:
                # The engine changed since the sweep chose (global steering applied
                # meanwhile): before any cell is out, "auto" can still switch.
                if i > 0 or self._executor_asked != "auto":
                    raise
                log.info("sweep %s runs its cells as patched requests: %s", self._tag, exc)
                self.executor = "requests"
                yield from self._request_cells()
                return
            raw = self._raw(*self._logprobs(res.corrupt))
            if i == 0:
                corrupt_raw = raw
                clean_raw = None if res.clean is None else self._raw(*self._logprobs(res.clean))
                self._set_baselines(raw, clean_raw)
                assert res.control is not None
                control = self._value_of_raw(self._raw(*self._logprobs(res.control)))
                self.noise_floor = abs(control - self.corrupt)
                for cell in same:
                    self._set_value(cell, *self._logprobs(res.corrupt))
                    yield cell
            else:
                drift = abs(self._value_of_raw(raw) - self._value_of_raw(corrupt_raw))
                self.noise_floor = max(self.noise_floor, drift)
            for k, cell in enumerate(cells):
                self._set_value(cell, *self._logprobs(res.cells[k]))
            yield from (runs[k][0] for k in chunk)

    def _logprobs(self, lp: Any) -> tuple[float, float | None]:
        """(answer, foil) of a pass member's logprobs of [answer(, foil)]."""
        values = lp.tolist()
        return values[0], (values[1] if self.plan.foil is not None else None)

    def _stored_rows(self, cells: list[PassCell]) -> Any:
        """`[len(cells), H]` patch rows from the run version the sweep leased."""
        store = self.engine.interventions.patch_sources
        return store.get_rows(self.plan.run_ref, [(c.layer, c.site, c.source) for c in cells])

    def _lease_run(self) -> bool:
        """Lease the run version the cells read; False when there is none to lease. A version
        already gone is no error here: each cell that cannot read it is void, saying why."""
        if self.plan.run_ref is None:
            return False
        store = self.engine.interventions.patch_sources
        try:
            store.lease(self.plan.run_ref, SWEEP_LEASE_TTL_S, self._tag)
        except RunNotFoundError as exc:
            log.warning("sweep %s: its run is gone, its cells will be void: %s", self._tag, exc)
            return False
        return True

    def _release_run(self) -> None:
        """Give the lease back; a store that cannot be reached lets it run out instead."""
        try:
            self.engine.interventions.patch_sources.release(self.plan.run_ref, self._tag)
        except CoxswainError as exc:
            log.warning("sweep %s: releasing %s failed: %s", self._tag, self.plan.run_ref, exc)

    async def cells(self) -> AsyncGenerator[Cell, None]:
        """`iter_cells()` run in a worker thread (with the default driver, don't use the
        engine from elsewhere while it runs). Cancelling the consumer aborts the sweep."""
        it = self.iter_cells()
        done = object()
        running: asyncio.Future | None = None
        try:
            while True:
                running = asyncio.ensure_future(asyncio.to_thread(next, it, done))
                cell = await asyncio.shield(running)  # a cancel must not orphan the thread
                running = None
                if cell is done:
                    return
                yield cell  # type: ignore[misc]
        finally:
            if running is not None:  # cancelled mid-wait: stop the thread before closing
                self.driver.interrupt()
                with contextlib.suppress(Exception):
                    await running
            it.close()

    def run(self) -> SweepResult:
        """Run the whole sweep and return the graded grid."""
        for _ in self.iter_cells():
            pass
        return self.result()

    def result(self) -> SweepResult:
        """The grid of a finished sweep (after `run()` or a fully consumed `iter_cells()`)."""
        plan = self.plan
        grid = np.full((len(plan.sites), len(plan.layers), len(plan.positions)), np.nan)
        si = {s: i for i, s in enumerate(plan.sites)}
        li = {L: i for i, L in enumerate(plan.layers)}
        pi = {p: i for i, p in enumerate(plan.positions)}
        for c in self.cells_done:
            if c.void is None:
                grid[si[c.site], li[c.layer], pi[c.position]] = c.value
        valid = [c for c in self.cells_done if c.void is None]
        tok = self.engine.tokenizer
        return SweepResult(
            grid=grid,
            layers=plan.layers,
            positions=plan.positions,
            sites=plan.sites,
            metric=self.spec.metric,
            clean=self.clean,
            corrupt=self.corrupt,
            argmax=max(valid, key=lambda c: -math.inf if c.value is None else c.value)
            if valid
            else None,
            skipped=plan.skipped,
            alignment=plan.alignment,
            noise_floor=self.noise_floor,
            void=[c for c in self.cells_done if c.void is not None],
            tokens=[tok.decode([t], skip_special_tokens=False) for t in plan.corrupt_ids],
            cells=list(self.cells_done),
            run_ref=plan.run_ref,
            executor=self.executor,
        )
