"""What a causal-tracing sweep is asked for and what it answers: `SweepSpec` (the prompts or
stored run, the grid and the metric), `Cell` (one patched request's result) and `SweepResult`
(the graded grid). Plain records: the HTTP and gRPC fronts, the client and studies convert
these without needing an engine (`services/engine/sweep.py` runs them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Metric = Literal["logprob", "logit_diff", "recovered"]
# How cells run: one layered forward per batch of cells (`model/patch_pass.py`), or one
# patched request per cell through the scheduler; "auto" takes the pass wherever it can run.
Executor = Literal["auto", "patch_pass", "requests"]
EXECUTORS = ("auto", "patch_pass", "requests")


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
