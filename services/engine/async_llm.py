"""`AsyncLLM`: the engine behind an asyncio API, for streaming servers.

The engine steps in one background thread (a model forward blocks); each request's
outputs are handed to the asyncio loop that asked for them. `generate()` yields the
request's cumulative output after every step that advanced it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine, Prompt
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class AsyncLLM:
    """Continuous batching for many concurrent asyncio callers of one engine."""

    def __init__(self, model: str | Path, **engine_args: Any):
        self.engine = LLMEngine(model, EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()  # engine calls: add/abort from callers, step from the loop
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="coxswain-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after each step; the last one has `finished=True`.

        Bad input raises here, before anything is queued. Closing the generator early
        (`aclose()`, e.g. via `contextlib.aclosing`, when the client went away) aborts the
        request and frees its KV blocks.
        """
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")
        rid = request_id or f"async-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(rid, prompt, params)
            self._streams[rid] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.engine.requests:
                self.engine.abort(request_id)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
            except Exception as e:  # a bug, not bad input: fail what was in flight, keep serving
                log.exception("engine step failed")
                with self._lock:
                    rids = list(self.engine.requests)
                    for rid in rids:
                        self.engine.abort(rid)
                for rid in rids:
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
