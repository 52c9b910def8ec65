"""`AsyncLLM`: the engine behind an asyncio API, for streaming servers.

The engine steps in one background thread (a model forward blocks); each request's
deltas are handed to whoever asked for them: an asyncio caller of `generate()` (one
`call_soon_threadsafe` per event loop per step, however many of its requests the step
advanced), or any thread through `submit()`'s callback. Listeners see every step's deltas
(the async controller's read-out publisher is one).

String prompts are tokenized before they reach the engine thread (in a worker thread for
`generate`, in the caller's thread for `submit`): tokenizing a long prompt takes a while,
and on the engine thread it would stall every other request's steps. For the same reason a
request `admit` takes is resolved (its steering, captures, read-outs and patch sources:
about a millisecond for a steered request, a store round trip for a patch) on an admission
thread, and the engine thread only queues the resolved request between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from services.common.errors import ServiceUnavailableError
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine, Prompt
from services.engine.outputs import RequestDelta
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import RequestGroup

log = logging.getLogger(__name__)

Deliver = Callable[[RequestDelta | BaseException], None]
Listener = Callable[[list[RequestDelta]], None]


class DeltaStream:
    """One request's deltas on their way to an asyncio reader: filled from other threads in
    batches (`deliver_all`: one wake-up of the reader's loop however many streams a step
    advanced), read with `read()`, which merges what a slow reader has not taken yet."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    @staticmethod
    def deliver_all(items: Iterable[tuple[DeltaStream, RequestDelta | BaseException]]) -> None:
        """Hand each item to its stream, from any thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in by_loop.items():
            if not loop.is_closed():  # a reader's loop may be gone (its streams with it)
                loop.call_soon_threadsafe(_put_all, batch)

    async def read(self) -> AsyncIterator[RequestDelta]:
        """The deltas until the finished one; a delivered exception is raised. Under load
        the reader falls behind the engine: one delta saying what all the waiting ones did
        replaces them."""
        queue = self.queue
        finished = False
        while not finished:
            item = await queue.get()
            if not isinstance(item, BaseException) and not queue.empty():
                item = item.detached()  # listeners saw the delivered delta: leave it as it was
            while not isinstance(item, BaseException) and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    item = later
                else:
                    item.merge(later)
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item


class AsyncLLM:
    """Continuous batching for many concurrent callers of one engine.

    `AsyncLLM("DIR", **engine_config)` builds its engine; `AsyncLLM(engine=e)` serves a
    prebuilt one (e.g. the driver rank of a tensor/pipeline-parallel replica).
    """

    def __init__(
        self, model: str | Path | None = None, *, engine: LLMEngine | None = None, **engine_args
    ):
        if (model is None) == (engine is None):
            raise ValueError("give AsyncLLM a model directory or an engine, not both")
        self.engine = engine or LLMEngine(model, EngineConfig(**engine_args))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()  # engine calls: add/abort from callers, step from the loop
        self._wake = threading.Event()
        self._deliver: dict[str, Deliver | DeltaStream] = {}
        # Requests to admit and aborts, handed to the engine thread (see `admit`).
        self._inbox_lock = threading.Lock()
        self._admissions: deque[tuple] = deque()
        # Resolves admitted requests off the engine thread; one worker keeps their order.
        self._admission_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="coxswain-admit"
        )
        self._aborts: deque[str] = deque()
        self._listeners: list[Listener] = []
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="coxswain-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None,
        deliver: Deliver,
    ) -> None:
        """Queue a request whose deltas (or the step's failure) go to `deliver`, called in the
        engine thread after each step that advanced it. Bad input raises here. Waits for the
        engine lock, so call it from a worker thread, never from an event loop (`generate`
        hands admission to the engine thread instead)."""
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")
        # Tokenized and resolved here, not under the engine lock a step holds.
        group = self.engine.prepare_request(request_id, prompt, params)
        self._queue(group, deliver)
        self._wake.set()

    def _queue(self, group: RequestGroup, deliver: Deliver | DeltaStream) -> None:
        """Queue a resolved request in the engine, under its lock, with where its deltas go."""
        with self._lock:
            self.engine.add_prepared(group)
            self._deliver[group.request_id] = deliver

    def admit(
        self,
        request_id: str,
        prompt: Prompt,
        text: str | None,
        params: SamplingParams | None,
        deliver: Deliver | DeltaStream,
    ) -> concurrent.futures.Future:
        """Resolve a request on the admission thread, then hand it to the engine thread,
        which queues it between steps; the future completes once it is queued (or fails
        with why not). Neither runs on a caller's thread, so an event loop never waits for
        the engine lock while a step holds it, nor does the engine thread spend a step's
        time resolving specs. `deliver` is a callback (called in the engine thread) or a
        `DeltaStream`."""
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._admission_thread.submit(
            self._resolve, request_id, prompt, text, params, deliver, admitted
        )
        return admitted

    def _resolve(
        self,
        request_id: str,
        prompt: Prompt,
        text: str | None,
        params: SamplingParams | None,
        deliver: Deliver | DeltaStream,
        admitted: concurrent.futures.Future,
    ) -> None:
        """Admission thread: resolve the request, then queue it for the engine thread."""
        if self._stopped:
            admitted.set_exception(RuntimeError("AsyncLLM is shut down"))
            return
        try:
            group = self.engine.prepare_request(request_id, prompt, params, text=text)
        except BaseException as exc:  # bad input: the caller gets why
            admitted.set_exception(exc)
            return
        with self._inbox_lock:
            if self._stopped:
                admitted.set_exception(RuntimeError("AsyncLLM is shut down"))
                return
            self._admissions.append((group, deliver, admitted))
        self._wake.set()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_text: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Yield what each step added to the request; the last delta has `finished=True`.
        (`OutputAccumulator` adds them up, for a caller that wants the whole output.)

        A string prompt is tokenized in a worker thread. `prompt_text`: the text a token-id
        `prompt` was encoded from (a caller that tokenized it already), for the outputs.
        Bad input raises here, before anything is yielded. Closing the generator early
        (`aclose()`, e.g. via `contextlib.aclosing`, when the client went away) aborts the
        request and frees its KV blocks.
        """
        rid = request_id or f"async-{next(self._ids)}"
        stream = DeltaStream(asyncio.get_running_loop())
        if isinstance(prompt, str):
            prompt_text, prompt = prompt, await asyncio.to_thread(self.tokenizer.encode, prompt)
        admitted = self.admit(rid, prompt, prompt_text, params, stream)
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:  # gone before admission: abort once it is admitted
            admitted.add_done_callback(lambda f: f.exception() or self.abort_soon(rid))
            raise
        finished = False
        try:
            async for delta in stream.read():
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort_soon(rid)

    def abort_soon(self, request_id: str) -> None:
        """Abort a request at the top of the engine thread's next iteration (never blocks)."""
        with self._inbox_lock:
            self._aborts.append(request_id)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request now; its stream (if anyone still reads it) ends with the aborted
        final delta, so a caller aborting another caller's request never leaves it waiting."""
        with self._lock:
            final = self.engine.abort(request_id) if request_id in self.engine.requests else None
            if final is not None:
                self._emit([final])

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(deltas)` in the engine thread after every step that produced
        deltas. It must be quick and must not raise (errors are logged and ignored)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener` (added by `add_listener`)."""
        self._listeners.remove(listener)

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` between steps (under the engine lock) and return its result."""
        with self._lock:
            return fn(self.engine)

    def stats(self) -> dict:
        return self.call(LLMEngine.stats)

    def _emit(self, items: list[RequestDelta], failure: BaseException | None = None) -> None:
        """Hand each delta (or, for each request of `items`, `failure`) to whoever waits for
        it: callbacks now, `generate` streams with one wake-up of each event loop."""
        streamed = []
        for delta in items:
            rid = delta.request_id
            last = failure is not None or delta.finished
            target = self._deliver.pop(rid, None) if last else self._deliver.get(rid)
            if target is None:
                continue
            item = failure or delta
            if isinstance(target, DeltaStream):
                streamed.append((target, item))
                continue
            try:
                target(item)
            except Exception:
                log.exception("delivering output of %s failed", rid)
        DeltaStream.deliver_all(streamed)

    def _drain_inbox(self) -> None:
        """Admit queued requests and apply queued aborts, between steps (engine thread)."""
        with self._inbox_lock:
            admissions, self._admissions = self._admissions, deque()
            aborts, self._aborts = self._aborts, deque()
        for group, deliver, admitted in admissions:
            try:
                self._queue(group, deliver)
            except BaseException as exc:
                admitted.set_exception(exc)
            else:
                admitted.set_result(None)
        for rid in aborts:
            self.abort(rid)

    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
            except Exception as e:  # a bug, not bad input: fail what was in flight, keep serving
                log.exception("engine step failed")
                with self._lock:  # those that finished and awaited their captures did not fail
                    done = self.engine.deliver_captured(wait=True)
                    failed = [self.engine.abort(rid) for rid in list(self.engine.requests)]
                self._emit(done)
                self._emit(failed, self._step_error(e))
                continue
            self._emit(outputs)
            for listener in self._listeners:
                try:
                    listener(outputs)
                except Exception:
                    log.exception("output listener failed")

    def _step_error(self, exc: Exception) -> Exception:
        """What a failed step's requests get: on a replica of several ranks, the replica's
        failure (a rank died or diverged, and its owner replaces it: retry); else the bug."""
        if self.engine.sync is not None:
            return ServiceUnavailableError(
                f"the engine replica failed during the call ({type(exc).__name__} in its "
                "ranks' lock-step): retry shortly"
            )
        return RuntimeError(f"engine step failed: {exc}")

    def shutdown(self) -> None:
        with self._inbox_lock:
            self._stopped = True
        self._wake.set()
        self._admission_thread.shutdown(wait=False)  # what it still holds fails: stopped
        self._thread.join(timeout=10)
        with self._inbox_lock:
            for *_, admitted in self._admissions:
                admitted.set_exception(RuntimeError("AsyncLLM is shut down"))
            self._admissions.clear()


def _put_all(batch: list[tuple[asyncio.Queue, RequestDelta | BaseException]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
