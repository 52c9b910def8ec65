"""A sweep's plan: its `SweepSpec` resolved against one engine before anything runs.

`SweepPlan` checks every field and turns it into what the cells need: the corrupt and clean
token ids, the grid's layers, sites and positions (text spans resolved to the tokens covering
them), the answer and foil token ids, and the alignment of corrupt positions to clean ones
(`align`). A sweep over a stored run reads one version of it: the plan names the version
current when it was built (`run_ref`, `"<run>@<version>"`) after checking it holds every row
the grid needs.
"""

from __future__ import annotations

import math
from typing import Any

from services.common.errors import InvalidRequestError, RunNotFoundError
from services.engine.interventions.sites import parse_site, site_key
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.engine.sweep_spec import SweepSpec


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


class SweepPlan:
    """A `SweepSpec` checked and resolved against `engine`; raises InvalidRequestError (or
    RunNotFoundError for a missing source run) on the first field that cannot run."""

    def __init__(self, engine: LLMEngine, spec: SweepSpec):
        self.engine, self.spec = engine, spec
        self.run_ref: str | None = None  # set by _check_run for a stored source run
        self._validate()

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

    @property
    def graded_ids(self) -> list[int]:
        """The token ids a cell's logprobs are read for: `[answer]` or `[answer, foil]`."""
        return [self.answer] if self.foil is None else [self.answer, self.foil]

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
