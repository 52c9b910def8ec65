"""`EngineService`: one engine replica as an asyncio service, the seam every front end calls.

The HTTP gateway and the gRPC servers turn their bodies into these calls and the results
back into their wire formats; nothing here knows about either. The engine steps in
`AsyncLLM`'s thread, so everything that reads or changes engine state goes through
`llm.call` / `llm.submit` (between steps, under the engine lock), and the async methods
take that lock in a worker thread so the event loop never waits on a model forward.

Limits hold before work is done: a prompt's UTF-8 size is checked before it is tokenized
(`max_prompt_bytes`), tokenizing happens in a worker thread, never the engine's, and a
request whose prompt plus `max_tokens` cannot fit the context is refused, as vLLM's
OpenAI server does, rather than silently cut short.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from services.common.errors import (
    InvalidRequestError,
    NotFoundError,
    PromptTooLongError,
    TooLargeError,
)
from services.common.wire import pack_tensor
from services.engine.async_llm import AsyncLLM
from services.engine.config import EngineConfig
from services.engine.interventions.sites import SITES
from services.engine.interventions.spec import parse_steering
from services.engine.llm_engine import LLMEngine, Prompt
from services.engine.model.tokenizer import check_unicode
from services.engine.outputs import RequestDelta
from services.engine.sampling_params import SamplingParams
from services.engine.sweep import AsyncLLMDriver, Cell, Sweep, SweepResult, SweepSpec

RATE_WINDOW_S = 10.0  # throughput in `stats()` is averaged over this many seconds
# The default prompt size limit: generous bytes per token of context (English averages ~4;
# long whitespace or repeated-character tokens run longer), between a floor that small
# contexts never feel and a cap that bounds how long one tokenization can take.
PROMPT_BYTES_PER_TOKEN = 16
MIN_PROMPT_BYTES = 64 * 2**10
MAX_PROMPT_BYTES = 8 * 2**20


def default_max_prompt_bytes(max_model_len: int) -> int:
    """The largest prompt (UTF-8 bytes) an engine of this context tokenizes by default."""
    return min(MAX_PROMPT_BYTES, max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_model_len))


def check_prompt_text(text: str, max_bytes: int, what: str = "the prompt") -> None:
    """Refuse, before tokenizing, a text prompt no tokenizer should see: empty
    (InvalidRequestError), over `max_bytes` UTF-8 bytes (TooLargeError, 413) or not valid
    Unicode (a lone surrogate: InvalidRequestError)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a string or a list of token ids")
    if not text:
        raise InvalidRequestError(f"{what} is empty")
    # Every character is at least one byte: a text this long is refused without encoding it.
    if len(text) > max_bytes:
        raise _too_large(f"{what} is at least {len(text)} bytes", max_bytes)
    check_unicode(text, what)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise _too_large(f"{what} is {size} bytes", max_bytes)


def _too_large(what: str, max_bytes: int) -> TooLargeError:
    return TooLargeError(
        f"{what}, more than this engine's limit of {max_bytes} bytes (max_prompt_bytes)"
    )


class EngineService:
    """One engine replica behind an async API: generation, steering control, the vector
    registry, sweeps and observability. Errors are `CoxswainError`s with their status."""

    def __init__(
        self,
        llm: AsyncLLM,
        *,
        model_id: str,
        patch_store: Any = None,
        max_prompt_bytes: int | None = None,
    ):
        """Serve `llm` as `model_id`. `patch_store`, when given, is attached to the engine
        (run patch sources, capture runs, sweeps over stored runs, `drop_patch_source`).
        `max_prompt_bytes`: the largest text prompt (UTF-8 bytes) tokenized; default
        `default_max_prompt_bytes` of the engine's context."""
        self.llm = llm
        self.model_id = model_id
        if max_prompt_bytes is not None and max_prompt_bytes < 1:
            raise InvalidRequestError(f"max_prompt_bytes must be >= 1, got {max_prompt_bytes}")
        self.max_prompt_bytes = max_prompt_bytes or default_max_prompt_bytes(
            llm.engine.max_model_len
        )
        if patch_store is not None:
            llm.call(lambda e: setattr(e.interventions, "patch_sources", patch_store))
        self._global_spec: dict | None = None
        # Queueing global steering and recording its spec happen together, so concurrent
        # sets leave `global_spec` naming the one queued last.
        self._global_lock = threading.Lock()
        self._sweeps: set[AsyncLLMDriver] = set()  # running sweeps, interrupted on shutdown
        self._throughput = _Throughput(llm.engine)
        llm.add_listener(self._throughput.on_step)

    @classmethod
    def from_model(
        cls,
        model: str | Path,
        *,
        model_id: str | None = None,
        patch_store: Any = None,
        max_prompt_bytes: int | None = None,
        **engine_config: Any,
    ) -> EngineService:
        """Build the engine for checkpoint directory `model` (`EngineConfig` fields as keyword
        arguments); `model_id` defaults to the directory's name."""
        engine = LLMEngine(model, EngineConfig(**engine_config), patch_store=patch_store)
        return cls(
            AsyncLLM(engine=engine),
            model_id=model_id or Path(model).name,
            max_prompt_bytes=max_prompt_bytes,
        )

    @property
    def engine(self) -> LLMEngine:
        """The engine itself: read its configuration freely, change its state via `llm`."""
        return self.llm.engine

    # -- model ----------------------------------------------------------------------------

    def model_card(self) -> dict:
        """What a client needs to build requests: sizes, context, hook sites, dtype, device."""
        e = self.engine
        mc = e.model_config
        return {
            "id": self.model_id,
            "max_model_len": e.max_model_len,
            "num_layers": mc.num_layers,
            "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size,
            "sites": list(SITES),
            "dtype": str(e.dtype).removeprefix("torch."),
            "device": str(e.device),
            "max_prompt_bytes": self.max_prompt_bytes,
        }

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The prompt token ids of a conversation under the checkpoint's chat template (its
        texts are held to `max_prompt_bytes` together before the template renders)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content}")
        size = 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] needs a string `role`")
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}].content must be a string")
            for key, value in m.items():
                check_unicode(value, f"messages[{i}].{key}")
                size += len(value.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise _too_large(f"the messages' texts are {size} bytes", self.max_prompt_bytes)
        return self.engine.tokenizer.encode_chat(messages)

    # -- generation -----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestDelta, None]:
        """Yield what each step that advanced the request added to it; the last delta has
        `finished=True`. Bad input raises a CoxswainError before anything is yielded.
        Closing the iterator early (client gone) aborts the request."""
        text, ids = await self.prepare(prompt, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        outputs = self.llm.generate(ids, params, rid, prompt_text=text)
        async with aclosing(outputs):  # type: ignore[type-var]  # an async generator
            async for out in outputs:
                yield out

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, Prompt]:
        """(text, token ids) of a request this service would admit: the checks made before
        the engine sees it (CoxswainError naming the problem), the prompt tokenized in a
        worker thread. `generate` starts with it; so does a front end in another process
        (`services/gateway/process_backend.py`)."""
        max_seqs = self.engine.config.max_num_seqs
        if params.n > max_seqs:  # its samples could never all run at once
            raise InvalidRequestError(f"n={params.n} exceeds this engine's max_num_seqs={max_seqs}")
        text, ids = await self._prompt_ids(prompt)
        self._check_fits(ids, params)
        return text, ids

    async def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, Prompt]:
        """(text, token ids) of a prompt: a text prompt is size-checked, then tokenized in a
        worker thread (token ids and anything else pass through)."""
        if isinstance(prompt, str):
            check_prompt_text(prompt, self.max_prompt_bytes)
            return prompt, await asyncio.to_thread(self.engine.tokenizer.encode, prompt)
        return None, prompt

    def _check_fits(self, ids: Prompt, params: SamplingParams) -> None:
        """PromptTooLongError unless the prompt and its `max_tokens` fit the context (vLLM's
        OpenAI server refuses what it would otherwise cut short). Checked before the request
        reaches the engine thread; anything but a token list, the engine names the problem."""
        if not isinstance(ids, list | tuple):
            return
        limit, n, max_tokens = self.engine.max_model_len, len(ids), params.max_tokens
        if n >= limit:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but the model's context is {limit} (the prompt "
                "plus at least one generated token must fit)"
            )
        if n and max_tokens is not None and n + max_tokens > limit:
            raise PromptTooLongError(
                f"max_tokens is too large: {max_tokens}. This model's maximum context length "
                f"is {limit} tokens and your request has {n} input tokens "
                f"({max_tokens} > {limit} - {n})"
            )

    async def abort(self, request_id: str) -> None:
        """Stop a request now (a no-op if it already finished)."""
        await asyncio.to_thread(self.llm.abort, request_id)

    # -- steering -------------------------------------------------------------------------

    async def set_global_steering(self, spec: Any) -> dict:
        """Steer every request with `spec` (vectors only) from the next step on, replacing any
        global steering. Checked now (InvalidRequestError); returns `steering_state()`."""
        parsed = parse_steering(spec)
        shown = None if parsed is None else _jsonable(parsed.model_dump())

        def apply() -> dict:
            with self._global_lock:
                self.llm.call(lambda e: e.set_global_steering(parsed))
                self._global_spec = shown
            return self.steering_state()

        return await asyncio.to_thread(apply)

    async def clear_global_steering(self) -> dict:
        """Remove engine-wide steering from the next step on; returns `steering_state()`."""
        return await self.set_global_steering(None)

    def steering_state(self) -> dict:
        """The engine's steering snapshot (queue, pools, tiers, monitors, consumers) plus
        `global_spec`, the last global spec accepted (None when cleared)."""
        snap = self.llm.call(LLMEngine.steering_snapshot)
        return {**snap, "global_spec": self._global_spec}

    def dynamic_state(self) -> dict:
        """The closed loop's view: the dynamic tier, monitors, override pool, the action
        queue, probe aborts, gate firing counts per (layer, site), and latched sequences."""

        def read(e: LLMEngine) -> dict:
            snap = e.steering_snapshot()
            latched = sum(1 for g in e.requests.values() for s in g.seqs if s.latched)
            return {
                "dynamic": snap["dynamic"],
                "monitors": snap["monitors"],
                "override_pool": snap["pools"]["dynamic"],
                "queue": snap["queue"],
                "probe_aborts": snap["probe_aborts"],
                # per gated (layer, site): decode tokens its gates saw, and fired on
                "gate_firing": snap.get("gate_firing", {}),
                "latched_sequences": latched,
                "steps": e.num_steps,
            }

        return self.llm.call(read)

    def submit_action(self, action: Any, source: str = "api") -> bool:
        """Queue a controller action for the top of the next step (False: the queue was full
        and dropped it, counted). A non-action raises InvalidRequestError."""
        return self.engine.submit_action(action, source)  # the queue is thread-safe

    # -- the vector registry --------------------------------------------------------------
    # The registry has its own lock (and a parallel replica mirrors changes to its ranks
    # under its own lock), so these do not take the engine lock: requests resolve names
    # when they are added, never mid-step.

    def register_vector(self, name: str, value: Any, *, overwrite: bool = False) -> dict:
        """Register `value` (`[H]`, `[num_layers, H]`, `{layer: [H]}`, packed) as `name`."""
        return self.engine.vectors.register(name, value, overwrite=overwrite).describe()

    def import_vector(self, name: str, path: str, *, overwrite: bool = False) -> dict:
        """Register `name` from a `.gguf` control vector or `.safetensors` file on this host."""
        return self.engine.vectors.import_file(name, path, overwrite=overwrite).describe()

    def list_vectors(self) -> list[dict]:
        """Metadata of every registered vector, sorted by name."""
        return self.engine.vectors.list()

    def get_vector(self, name: str) -> dict:
        """A vector's metadata plus `value`, packed: `[H]`, or `[len(layers), H]` with row `i`
        for `layers[i]`. NotFoundError if `name` is not registered."""
        registry = self.engine.vectors
        if name not in registry:
            raise NotFoundError(f"no vector named '{name}' is registered")
        entry = registry.get(name)
        if entry.vector is not None:
            value = entry.vector
        else:
            assert entry.per_layer is not None
            value = torch.stack(list(entry.per_layer.values()))
        return {**entry.describe(), "value": pack_tensor(value)}

    def unregister_vector(self, name: str) -> dict:
        """Remove `name`; returns its metadata. NotFoundError if it is not registered."""
        return self.engine.vectors.unregister(name).describe()

    # -- patching -------------------------------------------------------------------------

    async def patch_sweep(self, spec: SweepSpec) -> AsyncGenerator[dict, None]:
        """Run a causal-tracing sweep as ordinary traffic (other requests keep running).

        Yields `{"event": "cell", ...}` per cell as it finishes, then one
        `{"event": "summary", ...}` with the `SweepResult` fields (NaN as None). A bad spec
        raises a CoxswainError before anything is yielded; closing early aborts the sweep.
        """
        for what in ("corrupt_prompt", "clean_prompt"):
            text = getattr(spec, what, None)
            if isinstance(text, str):
                check_prompt_text(text, self.max_prompt_bytes, what)
        driver = AsyncLLMDriver(self.llm)
        # Validation may read a remote patch store: keep it off the event loop.
        sweep = await asyncio.to_thread(Sweep, self.engine, spec, driver)
        self._sweeps.add(driver)
        try:
            async with aclosing(sweep.cells()) as cells:
                async for cell in cells:
                    yield {"event": "cell", **cell_dict(cell)}
        finally:
            self._sweeps.discard(driver)
        yield {"event": "summary", **sweep_summary(sweep.result())}

    def drop_patch_source(self, run: str) -> dict:
        """Drop a stored run now, leased or not. RunNotFoundError if the store lacks it;
        InvalidRequestError if no patch-source store is attached."""
        store = self.engine.interventions.patch_sources
        if store is None:
            raise InvalidRequestError("no patch-source store is attached to this engine")
        return {"run": run, "dropped": True, "bytes_freed": store.drop_run(run)}

    # -- observability --------------------------------------------------------------------

    def stats(self) -> dict:
        """Engine counters plus throughput over the last `RATE_WINDOW_S` seconds, the prefix
        cache hit rate and the number of requests running and waiting."""
        s = self.llm.stats()
        queries = s["prefix_cache_queries"]
        return {
            **s,
            "model": self.model_id,
            "requests_running": s["num_running"],
            "requests_waiting": s["num_waiting"],
            "prefix_cache_hit_rate": s["prefix_cache_hits"] / queries if queries else 0.0,
            **self._throughput.rates(),
        }

    def health(self) -> dict:
        """Liveness: the model served and how many steps the engine has taken."""
        return {"status": "ok", "model": self.model_id, "steps": self.engine.num_steps}

    async def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests stop receiving outputs; running sweeps
        end with an error)."""
        for driver in list(self._sweeps):
            driver.interrupt()
        await asyncio.to_thread(self.llm.shutdown)


class _Throughput:
    """Generated and prompt tokens per second over a sliding window, sampled after each
    step (in the engine thread) from the engine's cumulative counters."""

    def __init__(
        self,
        engine: LLMEngine,
        window_s: float = RATE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine, self.window_s, self.clock = engine, window_s, clock
        self._start = clock()
        # (time, generated tokens, prompt tokens), oldest first; starts at the counters' origin
        self._samples: deque[tuple[float, int, int]] = deque(
            [(self._start, engine.num_generated_tokens, engine.num_prompt_tokens_computed)]
        )
        self._lock = threading.Lock()

    def on_step(self, _outputs: list[RequestDelta]) -> None:
        e = self.engine
        now = self.clock()
        with self._lock:
            self._samples.append((now, e.num_generated_tokens, e.num_prompt_tokens_computed))
            self._trim(now)

    def _trim(self, now: float) -> None:
        # Keep one sample at or before the window's start: it holds the counts there.
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        now = self.clock()
        with self._lock:
            self._trim(now)
            _, gen0, prompt0 = self._samples[0]
            _, gen1, prompt1 = self._samples[-1]
        span = max(min(self.window_s, now - self._start), 1e-9)
        return {
            "generation_tokens_per_s": (gen1 - gen0) / span,
            "prompt_tokens_per_s": (prompt1 - prompt0) / span,
            "rate_window_s": self.window_s,
        }


# -- sweep results on the wire -------------------------------------------------------------


def cell_dict(cell: Cell) -> dict:
    """A sweep cell as JSON-able data (non-finite numbers as None)."""
    return _jsonable(asdict(cell))


def sweep_summary(res: SweepResult) -> dict:
    """A `SweepResult`'s fields as JSON-able data: the grid as nested lists, NaN as None."""
    return {
        "grid": _jsonable(res.grid.tolist()),
        "layers": res.layers,
        "positions": res.positions,
        "sites": res.sites,
        "metric": res.metric,
        "clean": _finite_or_none(res.clean),
        "corrupt": _finite_or_none(res.corrupt),
        "argmax": None if res.argmax is None else cell_dict(res.argmax),
        "skipped": res.skipped,
        "alignment": _jsonable(res.alignment),
        "noise_floor": _finite_or_none(res.noise_floor),
        "void": [cell_dict(c) for c in res.void],
        "tokens": res.tokens,
        "cells": [cell_dict(c) for c in res.cells],
    }


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _jsonable(value: Any) -> Any:
    """Plain JSON data from dicts/lists/pydantic models/tensors; non-finite floats as None."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return _finite_or_none(value)
    return value
