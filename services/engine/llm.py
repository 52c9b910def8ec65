"""`LLM`: the offline batch API — give it prompts, get one RequestOutput per prompt back."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine, Prompt
from services.engine.outputs import OutputAccumulator, RequestOutput
from services.engine.sampling_params import SamplingParams


class LLM:
    """Generate from a local Hugging Face checkpoint with continuous batching.

    `LLM("DIR", device="cpu", dtype="float32", block_size=16, max_num_seqs=64,
    enable_prefix_caching=True, ...)`: keyword arguments are `EngineConfig` fields.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        patch_store: Any = None,
        engine: LLMEngine | None = None,
        **engine_args: Any,
    ):
        """`engine=` serves a prebuilt engine instead (e.g. a parallel replica's driver)."""
        if (model is None) == (engine is None):
            raise ValueError("give LLM a model directory or an engine, not both")
        self.engine = engine or LLMEngine(
            model,  # type: ignore[arg-type]
            EngineConfig(**engine_args),
            patch_store=patch_store,
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Requests are prepared (tokenized, validated, their steering, captures and patches
        resolved) on a thread of their own while the engine steps, so that admission
        overlaps the device's work instead of preceding it; the first step waits for a
        step's worth of prompt tokens. A bad prompt fails the whole call, naming its index:
        the requests the call queued are aborted and nothing is left queued.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(prompts)} prompts but {len(params)} SamplingParams"
            )
        rids = [f"llm-{next(self._ids)}" for _ in prompts]
        admission = _Admission(self.engine, rids, prompts, params)
        totals = OutputAccumulator()
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req")
        try:
            # A first step's worth of prompt tokens (or every request) before stepping.
            admission.admit(until_tokens=self.engine.config.max_num_batched_tokens)
            while len(final) < len(rids):
                admission.admit(until_tokens=0 if self.engine.has_unfinished_requests() else 1)
                for out in totals.finished(self.engine.step()):
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            admission.abort()
            raise
        finally:
            admission.close()
            if bar is not None:
                bar.close()
        return [final[r] for r in rids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)


class _Admission:
    """`LLM.generate`'s requests, prepared in order on a thread of their own
    (`LLMEngine.prepare_request` changes no engine state) and queued on the engine's
    thread (`add_prepared`) as `admit` takes them."""

    def __init__(
        self,
        engine: LLMEngine,
        rids: list[str],
        prompts: list[Prompt],
        params: list[SamplingParams],
    ):
        self.engine, self.rids = engine, rids
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.num_added = 0
        self._stop = threading.Event()

        def prepare() -> None:
            for i, (rid, prompt, p) in enumerate(zip(rids, prompts, params, strict=True)):
                if self._stop.is_set():
                    return
                try:
                    self.ready.put((i, engine.prepare_request(rid, prompt, p)))
                except BaseException as exc:  # handed to the engine's thread, raised there
                    self.ready.put((i, exc))
                    return

        self._thread = threading.Thread(target=prepare, name="llm-admission", daemon=True)
        self._thread.start()

    def admit(self, until_tokens: int) -> None:
        """Queue every prepared request; wait for more while fewer than `until_tokens`
        prompt tokens were queued by this call (0: never wait)."""
        tokens = 0
        while self.num_added < len(self.rids):
            try:
                i, item = self.ready.get(block=tokens < until_tokens)
            except queue.Empty:
                return
            if isinstance(item, InvalidRequestError):
                raise type(item)(f"prompt {i}: {item}") from None
            if isinstance(item, BaseException):
                raise item
            try:
                self.engine.add_prepared(item)
            except InvalidRequestError as e:
                raise type(e)(f"prompt {i}: {e}") from None
            self.num_added += 1
            tokens += len(item.prompt_token_ids)

    def abort(self) -> None:
        """Drop every request this call queued (all or nothing)."""
        self._stop.set()
        for rid in self.rids[: self.num_added]:
            if rid in self.engine.requests:
                self.engine.abort(rid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
