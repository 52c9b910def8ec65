"""Causal-tracing sweeps: one patched request per (site, layer, position) cell, batched.

A sweep runs the clean prompt (capturing the residuals it needs, unless a stored run is
the source) and the corrupt prompt unpatched, then adds every cell plus an in-batch
corrupt control to the engine at once so they share one continuous batch (and the corrupt
prompt's prefix blocks before each cell's patched position). Cells are graded with the
exact logprobs of an answer token and an optional foil.

How the sweep's requests run is its driver's business. By default (`StepDriver`) the sweep
drives `engine.step()` itself, so the engine must have no other unfinished requests when it
starts (InvalidRequestError otherwise); outputs of requests someone adds while it runs are
kept in `Sweep.foreign_outputs`, never dropped. In a served engine, `AsyncLLMDriver` adds
them through `AsyncLLM.submit` as ordinary traffic, batched with everyone else's.

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
import queue
import uuid
from collections.abc import AsyncGenerator, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from services.common.errors import (
    CoxswainError,
    InvalidRequestError,
    PatchPassUnavailableError,
    RunNotFoundError,
)
from services.engine.interventions.sites import parse_site, site_key
from services.engine.llm_engine import LLMEngine
from services.engine.model.patch_pass import PassCell, PassJob, PassResult, plan_passes
from services.engine.outputs import OutputAccumulator, RequestDelta, RequestOutput
from services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

Metric = Literal["logprob", "logit_diff", "recovered"]
# How cells run: one layered forward per batch of cells (`model/patch_pass.py`), or one
# patched request per cell through the scheduler; "auto" takes the pass wherever it can run.
Executor = Literal["auto", "patch_pass", "requests"]
EXECUTORS = ("auto", "patch_pass", "requests")

# A sweep leases the run version it reads for this long (released when it ends).
SWEEP_LEASE_TTL_S = 600.0


@dataclass
class SweepSpec:
    """What to sweep: prompts (or a stored clean run), the grid, and how to grade a cell."""

    corrupt_prompt: str | list[int]
    answer_token: int | str
    clean_prompt: str | list[int] | None = None
    source_run: str | None = None
    layers: list[int] | Literal["all"] = "all"
    # of the corrupt prompt: ints, or text spans (a str item: the tokens covering its first
    # occurrence in a string corrupt prompt)
    positions: list[int | str] | Literal["all_prompt"] = "all_prompt"
    sites: list[str] = field(default_factory=lambda: ["post_block"])
    alpha: float = 1.0
    foil_token: int | str | None = None
    metric: Metric = "logprob"


@dataclass
class Cell:
    """One patched request's result; `void` holds the error when it has no value."""

    layer: int
    site: str
    position: int
    value: float | None = None
    logprob_answer: float | None = None
    logprob_foil: float | None = None
    void: str | None = None


@dataclass
class SweepResult:
    """The graded grid `[site, layer, position]` (NaN where skipped or void) and its context."""

    grid: np.ndarray  # [len(sites), len(layers), len(positions)]
    layers: list[int]
    positions: list[int]
    sites: list[str]
    metric: str
    clean: float | None  # the clean baseline's metric (None: a stored run without tokens)
    corrupt: float
    argmax: Cell | None
    skipped: list[int]
    alignment: dict[str, Any]
    noise_floor: float
    void: list[Cell]
    tokens: list[str]
    cells: list[Cell]
    run_ref: str | None = None  # the stored run version every cell read, "<run>@<version>"
    executor: str = "requests"  # how the cells ran: "patch_pass" or "requests"

    def to_numpy(self) -> np.ndarray:
        return self.grid.copy()


def align(clean: list[int], corrupt: list[int]) -> dict[str, Any]:
    """Map corrupt positions to clean ones: identity for equal lengths; otherwise the common
    prefix by identity, the common suffix shifted by `offset`, the middle skipped."""
    n_clean, n_corrupt = len(clean), len(corrupt)
    shortest = min(n_clean, n_corrupt)
    prefix = 0
    while prefix < shortest and clean[prefix] == corrupt[prefix]:
        prefix += 1
    suffix = 0
    while (
        suffix < shortest - prefix
        and clean[n_clean - 1 - suffix] == corrupt[n_corrupt - 1 - suffix]
    ):
        suffix += 1
    offset = n_clean - n_corrupt
    if offset == 0:
        return {"prefix_len": prefix, "suffix_len": suffix, "skipped": [], "offset": 0}
    skipped = list(range(prefix, n_corrupt - suffix))
    return {"prefix_len": prefix, "suffix_len": suffix, "skipped": skipped, "offset": offset}


def clean_position(alignment: dict[str, Any], p: int) -> int | None:
    """The clean position a corrupt position `p` takes its activation from (None: skipped)."""
    if alignment["offset"] == 0:
        return p
    if p < alignment["prefix_len"]:
        return p
    if p in alignment["skipped"]:
        return None
    return p + alignment["offset"]


def skipped_reason(alignment: dict[str, Any], skipped: list[int], num_corrupt: int) -> str:
    """Why corrupt positions `skipped` have no clean position to patch from, in words."""
    prefix, suffix, offset = alignment["prefix_len"], alignment["suffix_len"], alignment["offset"]
    num_clean = num_corrupt + offset
    spans = []
    if prefix:
        spans.append(f"the common prefix (positions 0-{prefix - 1}, patched from themselves)")
    if suffix:
        spans.append(
            f"the common suffix (positions {num_corrupt - suffix}-{num_corrupt - 1}, patched "
            f"from clean position + {offset})".replace("+ -", "- ")
        )
    aligned = " and ".join(spans) or "no common prefix or suffix"
    return (
        f"positions {skipped} are skipped (unaligned): the clean prompt has {num_clean} tokens "
        f"and the corrupt prompt {num_corrupt}, so only {aligned} align; the positions between "
        f"have no clean counterpart (alignment: prefix_len={prefix}, suffix_len={suffix}, "
        f"offset={offset}). Pick positions outside {alignment['skipped']}, or prompts of "
        "equal length"
    )


Final = tuple[str, RequestOutput | str]  # (request id, final output or why there is none)


class SweepDriver(Protocol):
    """How a sweep's requests reach an engine and their final outputs come back."""

    def start(self) -> None:
        """Check the engine can take the sweep now (raises InvalidRequestError if not)."""

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue one request; bad input raises a CoxswainError and queues nothing."""

    def finals(self, pending: set[str]) -> Iterator[Final]:
        """Block until each of `pending` (emptied as they come) finishes; yield each once."""

    def abort(self, request_id: str) -> None:
        """Stop a request the sweep no longer wants (a no-op if it already finished)."""

    def run_pass(self, job: PassJob) -> PassResult:
        """Run one patching pass on the engine, between its steps."""

    def interrupt(self) -> None:
        """Make a blocked `finals()` stop soon, raising CoxswainError (from another thread)."""


class StepDriver:
    """Steps a bare `LLMEngine` itself: the engine must be otherwise idle."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._totals = OutputAccumulator()
        self.foreign_outputs: list[RequestOutput] = []

    def start(self) -> None:
        if self.engine.has_unfinished_requests():
            raise InvalidRequestError(
                f"the engine has {len(self.engine.requests)} unfinished requests: a sweep steps "
                "the engine itself and needs it to itself"
            )

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt_ids, params)

    def finals(self, pending: set[str]) -> Iterator[Final]:
        engine = self.engine
        while pending:
            for rid in [r for r in pending if r not in engine.requests]:
                pending.discard(rid)  # aborted by someone else: no output will come
                yield rid, "the request was aborted before it finished"
            if not pending:
                return
            for out in self._totals.finished(engine.step()):
                if out.request_id in pending:
                    pending.discard(out.request_id)
                    yield out.request_id, out
                else:
                    self.foreign_outputs.append(out)

    def abort(self, request_id: str) -> None:
        if request_id in self.engine.requests:
            self.engine.abort(request_id)

    def run_pass(self, job: PassJob) -> PassResult:
        return self.engine.run_patch_pass(job)

    def interrupt(self) -> None:
        pass  # finals() returns after the step in progress: it never waits on anyone else


class AsyncLLMDriver:
    """Runs a sweep as ordinary traffic of a served engine: requests go in through
    `AsyncLLM.submit`, finals come back through its delivery callbacks (engine thread) into a
    queue that `finals()` reads in the sweep's thread. Other requests keep running alongside.
    A request someone else aborts still delivers its (aborted) final, so none is waited on
    forever; `interrupt()` ends the wait from outside (a cancelled client, a shutdown)."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self._totals = OutputAccumulator()  # touched in the engine thread only
        self._finals: queue.Queue[Final | None] = queue.Queue()
        self._interrupted = False

    def start(self) -> None:
        pass

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        def deliver(item: RequestDelta | BaseException) -> None:
            if isinstance(item, BaseException):
                self._totals.totals.pop(request_id, None)
                self._finals.put((request_id, f"{type(item).__name__}: {item}"))
                return
            total = self._totals.add(item)
            if total.finished:
                self._finals.put((request_id, total))

        self.llm.submit(request_id, prompt_ids, params, deliver)

    def finals(self, pending: set[str]) -> Iterator[Final]:
        while pending:
            item = self._finals.get()
            if item is None:
                raise CoxswainError("the sweep was interrupted")
            rid, out = item
            if rid in pending:
                pending.discard(rid)
                yield rid, out

    def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    def run_pass(self, job: PassJob) -> PassResult:
        if self._interrupted:
            raise CoxswainError("the sweep was interrupted")
        return self.llm.call(lambda engine: engine.run_patch_pass(job))

    def interrupt(self) -> None:
        self._interrupted = True
        self._finals.put(None)


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
        self.run_ref: str | None = None  # set by _check_run for a stored source run
        self._validate()
        self._executor_asked = executor
        self.executor = self._choose_executor(executor)

    # -- validation (before anything runs) ----------------------------------------------

    def _validate(self) -> None:
        spec, engine = self.spec, self.engine
        num_layers = engine.model_config.num_layers
        if (spec.clean_prompt is None) == (spec.source_run is None):
            raise InvalidRequestError("a sweep needs exactly one of clean_prompt or source_run")
        if spec.metric not in ("logprob", "logit_diff", "recovered"):
            raise InvalidRequestError(f"unknown metric {spec.metric!r}")
        if not isinstance(spec.alpha, int | float) or not math.isfinite(spec.alpha):
            raise InvalidRequestError(f"alpha must be a finite number, got {spec.alpha!r}")
        self.layers = self._index_list(spec.layers, "all", num_layers, "layers")
        if not spec.sites:
            raise InvalidRequestError("sites is empty")
        self.sites = [parse_site(s) for s in spec.sites]
        if len(set(self.sites)) != len(self.sites):
            raise InvalidRequestError(f"a site is listed twice: {spec.sites}")
        _, self.corrupt_ids = engine.encode(spec.corrupt_prompt)
        probe = SamplingParams(max_tokens=1)
        engine.validate(self.corrupt_ids, probe)
        self.positions = self._index_list(
            self._text_spans(spec.positions), "all_prompt", len(self.corrupt_ids), "positions"
        )
        self.answer = self._token(spec.answer_token, "answer_token")
        self.foil = None if spec.foil_token is None else self._token(spec.foil_token, "foil_token")
        if spec.metric == "logit_diff" and self.foil is None:
            raise InvalidRequestError("metric 'logit_diff' needs a foil_token")
        if self.foil is not None and self.foil == self.answer:
            raise InvalidRequestError("foil_token is the answer token")
        self.clean_ids: list[int] | None
        if spec.clean_prompt is not None:
            _, self.clean_ids = engine.encode(spec.clean_prompt)
            engine.validate(self.clean_ids, probe)
            self.alignment = align(self.clean_ids, self.corrupt_ids)
        else:
            self.clean_ids = self._check_run(spec.source_run)
            self.alignment = align(self.clean_ids or self.corrupt_ids, self.corrupt_ids)
        if spec.metric == "recovered" and self.clean_ids is None:
            raise InvalidRequestError(
                f"metric 'recovered' needs the clean baseline, but run {spec.source_run!r} "
                "holds no token ids"
            )
        self.skipped = [p for p in self.positions if clean_position(self.alignment, p) is None]
        if self.skipped and len(self.skipped) == len(self.positions):  # a grid of NaN only
            raise InvalidRequestError(
                "no position of this sweep can be patched: "
                + skipped_reason(self.alignment, self.skipped, len(self.corrupt_ids))
            )

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
        n, n_clean = len(self.corrupt_ids), len(self.clean_ids or [])
        if 3 * n + n_clean > budget:  # corrupt, control, clean and one whole cell
            return (
                "a pass holds the corrupt prompt twice, the clean one and a cell "
                f"({3 * n + n_clean} rows), more than max_num_batched_tokens={budget}"
            )
        return None

    def _text_spans(self, positions: Any) -> Any:
        """Positions with each text span replaced by the token positions that cover it."""
        if not isinstance(positions, list | tuple) or not any(
            isinstance(p, str) for p in positions
        ):
            return positions
        prompt = self.spec.corrupt_prompt
        if not isinstance(prompt, str):
            raise InvalidRequestError("text-span positions need corrupt_prompt as a string")
        ids, offsets = self.engine.tokenizer.encode_with_offsets(prompt)
        if ids != self.corrupt_ids:
            raise InvalidRequestError("the corrupt prompt's token offsets do not match its ids")
        out: list[Any] = []
        for p in positions:
            if not isinstance(p, str):
                out.append(p)
                continue
            start = prompt.find(p) if p else -1
            if start < 0:
                raise InvalidRequestError(f"text span {p!r} is not in the corrupt prompt")
            end = start + len(p)
            covering = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
            out += [i for i in covering if i not in out]
        return out

    def _index_list(self, value: Any, every: str, bound: int, name: str) -> list[int]:
        if value == every:
            return list(range(bound))
        if not isinstance(value, list | tuple) or not value:
            raise InvalidRequestError(f"{name} must be {every!r} or a non-empty list of ints")
        bad = [
            v for v in value if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < bound
        ]
        if bad:
            raise InvalidRequestError(f"{name} out of range [0, {bound}): {bad[:5]}")
        if len(set(value)) != len(value):
            raise InvalidRequestError(f"{name} lists a value twice: {list(value)}")
        return list(value)

    def _token(self, value: int | str, name: str) -> int:
        vocab = self.engine.model_config.vocab_size
        if isinstance(value, str):
            ids = self.engine.tokenizer.encode(value, add_special_tokens=False)
            if len(ids) != 1:
                raise InvalidRequestError(
                    f"{name} {value!r} is multi-token ({len(ids)} tokens: {ids}); "
                    "give one token (or its id)"
                )
            value = ids[0]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise InvalidRequestError(f"{name} must be a token id in [0, {vocab}), got {value!r}")
        return value

    def _check_run(self, run: str | None) -> list[int] | None:
        """The stored run's token ids (None if it has none), after checking it holds every row
        the grid needs; a length mismatch with the corrupt prompt is an error."""
        store = self.engine.interventions.patch_sources
        if store is None:
            raise InvalidRequestError(
                "source_run needs a patch-source store attached to the engine"
            )
        manifests = store.manifests([run])
        if not manifests:
            raise RunNotFoundError(f"no run {run!r} in the patch-source store")
        manifest = manifests[0]
        self.run_ref = manifest.ref  # this version, whatever is stored under `run` later
        n_clean = len(manifest.token_ids) or (max(manifest.positions) + 1)
        if n_clean != len(self.corrupt_ids):
            raise InvalidRequestError(
                f"run {run!r} covers {n_clean} positions but the corrupt prompt has "
                f"{len(self.corrupt_ids)} tokens: a length mismatch needs clean_prompt to align"
            )
        missing_keys = [
            site_key(L, s) for s in self.sites for L in self.layers if (L, s) not in manifest.keys
        ]
        missing_pos = sorted(set(self.positions) - set(manifest.positions))
        if missing_keys or missing_pos:
            raise InvalidRequestError(
                f"run {run!r} lacks rows the sweep needs: sites {missing_keys[:5]}, "
                f"positions {missing_pos[:5]}"
            )
        return list(manifest.token_ids) or None

    # -- driving the engine ----------------------------------------------------------------

    def _params(self, **kw: Any) -> SamplingParams:
        ids = [self.answer] if self.foil is None else [self.answer, self.foil]
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
        if self.answer not in lps or (self.foil is not None and self.foil not in lps):
            return "the answer/foil logprobs are missing from the output"
        return lps[self.answer], (lps[self.foil] if self.foil is not None else None)

    def _raw(self, answer: float, foil: float | None) -> float:
        return answer - foil if foil is not None else answer

    def _baselines(self) -> None:
        """Run the clean prompt (capturing rows when it is the source) and the corrupt prompt
        alone; sets the baseline metrics and the clean rows."""
        spec = self.spec
        adds: dict[str, tuple[list[int], SamplingParams]] = {
            f"{self._tag}-corrupt": (self.corrupt_ids, self._params())
        }
        if self.clean_ids is not None:
            capture = None
            if spec.source_run is None:
                capture = {"sites": {s: self.layers for s in self.sites}, "positions": "all_prompt"}
            adds[f"{self._tag}-clean"] = (self.clean_ids, self._params(capture=capture))
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
        if self.clean_ids is not None:
            clean_raw = self._raw(*results[f"{self._tag}-clean"])
            clean_out = done[f"{self._tag}-clean"]
            if spec.source_run is None:
                assert isinstance(clean_out, RequestOutput) and clean_out.captures is not None
                if clean_out.capture_positions != list(range(len(self.clean_ids))):
                    raise CoxswainError("the clean capture did not cover every prompt position")
                for s in self.sites:
                    for L in self.layers:
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
        assert self._raw_clean is not None  # checked in _validate
        return (raw - self._raw_corrupt) / (self._raw_clean - self._raw_corrupt)

    def _patch_entry(self, layer: int, site: str, p: int, q: int) -> dict:
        if self.run_ref is not None:
            source: dict = {"run": self.run_ref, "position": q}
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
        for s in self.sites:
            for L in self.layers:
                for p in self.positions:
                    q = clean_position(self.alignment, p)
                    if q is not None:
                        yield Cell(L, s, p), q

    def _request_cells(self) -> Generator[Cell, None, None]:
        """The baselines, then one patched request per cell, all in one continuous batch."""
        ours: set[str] = set()
        try:
            self._baselines()
            control = f"{self._tag}-control"
            self.driver.add(control, self.corrupt_ids, self._params())
            ours.add(control)
            by_id: dict[str, Cell] = {}
            for cell, q in self._grid_cells():
                rid = f"{self._tag}-{cell.layer}.{cell.site}.{cell.position}"
                try:
                    params = self._params(
                        patch=[self._patch_entry(cell.layer, cell.site, cell.position, q)]
                    )
                    self.driver.add(rid, self.corrupt_ids, params)
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
        if self.run_ref is None and cell.position < self.alignment["prefix_len"]:
            return True
        last_layer = self.engine.model_config.num_layers - 1
        return (
            cell.site == "post_block"
            and cell.layer == last_layer
            and cell.position != len(self.corrupt_ids) - 1
        )

    def _pass_cells(self) -> Generator[Cell, None, None]:
        """Every cell in layered patching passes (`model/patch_pass.py`): the first pass
        also gives the baselines and an in-pass control; each later pass re-runs the corrupt
        prompt, whose distance from the first one's counts towards the noise floor."""
        runs: list[tuple[Cell, PassCell]] = []
        same: list[Cell] = []
        for cell, q in self._grid_cells():
            if self._cannot_change(cell):
                same.append(cell)
            else:
                runs.append((cell, PassCell(cell.layer, cell.site, cell.position, q)))
        token_ids = [self.answer] if self.foil is None else [self.answer, self.foil]
        n_clean = len(self.clean_ids) if self.clean_ids is not None else 0
        budget = self.engine.config.max_num_batched_tokens
        passes = plan_passes([pc for _, pc in runs], len(self.corrupt_ids), n_clean, budget)
        corrupt_raw = 0.0
        for i, chunk in enumerate(passes or [[]]):
            cells = [runs[k][0] for k in chunk]
            pass_cells, rows = [runs[k][1] for k in chunk], None
            if self.run_ref is not None and pass_cells:
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
                self.corrupt_ids,
                pass_cells,
                token_ids,
                alpha=self.spec.alpha,
                clean_ids=self.clean_ids,
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
        return values[0], (values[1] if self.foil is not None else None)

    def _stored_rows(self, cells: list[PassCell]) -> Any:
        """`[len(cells), H]` patch rows from the run version the sweep leased."""
        store = self.engine.interventions.patch_sources
        return store.get_rows(self.run_ref, [(c.layer, c.site, c.source) for c in cells])

    def _lease_run(self) -> bool:
        """Lease the run version the cells read; False when there is none to lease. A version
        already gone is no error here: each cell that cannot read it is void, saying why."""
        if self.run_ref is None:
            return False
        store = self.engine.interventions.patch_sources
        try:
            store.lease(self.run_ref, SWEEP_LEASE_TTL_S, self._tag)
        except RunNotFoundError as exc:
            log.warning("sweep %s: its run is gone, its cells will be void: %s", self._tag, exc)
            return False
        return True

    def _release_run(self) -> None:
        """Give the lease back; a store that cannot be reached lets it run out instead."""
        try:
            self.engine.interventions.patch_sources.release(self.run_ref, self._tag)
        except CoxswainError as exc:
            log.warning("sweep %s: releasing %s failed: %s", self._tag, self.run_ref, exc)

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
        grid = np.full((len(self.sites), len(self.layers), len(self.positions)), np.nan)
        si = {s: i for i, s in enumerate(self.sites)}
        li = {L: i for i, L in enumerate(self.layers)}
        pi = {p: i for i, p in enumerate(self.positions)}
        for c in self.cells_done:
            if c.void is None:
                grid[si[c.site], li[c.layer], pi[c.position]] = c.value
        valid = [c for c in self.cells_done if c.void is None]
        tok = self.engine.tokenizer
        return SweepResult(
            grid=grid,
            layers=self.layers,
            positions=self.positions,
            sites=self.sites,
            metric=self.spec.metric,
            clean=self.clean,
            corrupt=self.corrupt,
            argmax=max(valid, key=lambda c: -math.inf if c.value is None else c.value)
            if valid
            else None,
            skipped=self.skipped,
            alignment=self.alignment,
            noise_floor=self.noise_floor,
            void=[c for c in self.cells_done if c.void is not None],
            tokens=[tok.decode([t], skip_special_tokens=False) for t in self.corrupt_ids],
            cells=list(self.cells_done),
            run_ref=self.run_ref,
            executor=self.executor,
        )
