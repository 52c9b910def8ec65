"""How a sweep's requests reach an engine and their final outputs come back.

`StepDriver` steps a bare `LLMEngine` itself, so the engine must have no other unfinished
requests when the sweep starts (InvalidRequestError otherwise); outputs of requests someone
adds while it runs are kept in `foreign_outputs`, never dropped. `AsyncLLMDriver` adds them
through a served engine's `AsyncLLM.submit` as ordinary traffic, batched with everyone else's.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from services.common.errors import CoxswainError, InvalidRequestError
from services.engine.llm_engine import LLMEngine
from services.engine.model.patch_pass import PassJob, PassResult
from services.engine.outputs import OutputAccumulator, RequestDelta, RequestOutput
from services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.async_llm import AsyncLLM

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
