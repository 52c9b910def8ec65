"""Running the engine requests behind one HTTP request, and streaming their events as SSE.

A completions request with several prompts is one engine request per prompt. They are all
submitted before anything is answered, so a bad prompt is a 4xx and the others are aborted;
after that, outputs are merged as they come. When the client goes away mid-stream the SSE
response cancels the generator, and cleanup (shielded from that cancellation) aborts every
engine request still running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent

from services.common.errors import CoxswainError
from services.engine.outputs import OutputAccumulator, RequestDelta, RequestOutput
from services.gateway.http_errors import error_body

PING_S = 15  # keep-alive comments on long streams (proxies drop idle connections)


def sse(events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    return EventSourceResponse(events, ping=PING_S)


def _json(body: Any) -> str:
    return json.dumps(body, separators=(",", ":"), allow_nan=False)


def error_event(exc: BaseException, event: str | None = None) -> ServerSentEvent:
    """An error after the stream began (its status line is already sent)."""
    if isinstance(exc, CoxswainError):  # ours say what happened, 503s included
        body = error_body(exc.http_status, str(exc), type(exc).__name__)
    else:
        body = error_body(500, "internal server error")
    return ServerSentEvent(_json(body), event=event)


class EngineRequests:
    """The engine requests of one API request: `open()` submits them all (raising the first
    error after aborting the rest), `finals()` / `merged()` read their delta streams,
    `close()` aborts whatever is unfinished."""

    def __init__(self, streams: list[AsyncGenerator[RequestDelta, None]]):
        self.streams = streams
        self.firsts: list[RequestDelta] = []

    async def open(self) -> None:
        """Submit every request and wait for its first delta (the first step it ran in)."""
        results = await asyncio.gather(*(anext(s) for s in self.streams), return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                await self.close()
                if isinstance(r, CoxswainError) and len(results) > 1:
                    raise type(r)(f"prompt {i}: {r}") from None
                raise r
        self.firsts = list(results)  # type: ignore[arg-type]

    async def finals(self) -> list[RequestOutput]:
        """Every request's whole output, in prompt order. (Reading them one after another
        costs nothing: the engine runs them all at once and their deltas queue up.)"""
        finals = []
        try:
            for first, stream in zip(self.firsts, self.streams, strict=True):
                total = RequestOutput.start(first)
                while not total.finished:
                    total.add(await anext(stream))
                finals.append(total)
        finally:
            await self.close()
        return finals

    async def merged(self) -> AsyncGenerator[tuple[int, RequestDelta], None]:
        """(prompt index, delta) as deltas arrive, the first ones included."""
        queue: asyncio.Queue[tuple[int, RequestDelta | BaseException]] = asyncio.Queue()

        async def pump(i: int) -> None:
            delta = self.firsts[i]
            await queue.put((i, delta))
            try:
                while not delta.finished:
                    delta = await anext(self.streams[i])
                    await queue.put((i, delta))
            except Exception as exc:  # the engine failed the request: tell the reader
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield i, item
        finally:
            with anyio.CancelScope(shield=True):  # the client may be gone: clean up anyway
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Abort every unfinished request (closing a stream aborts its request)."""
        with anyio.CancelScope(shield=True):
            for s in self.streams:
                await s.aclose()


async def completion_events(
    requests: EngineRequests,
    render_chunk: Callable[[int, RequestDelta], dict | None],
    opening: dict | None,
    closing: Callable[[list[RequestOutput]], dict | None],
) -> AsyncIterator[ServerSentEvent]:
    """OpenAI stream events: `opening`, a chunk per delta with news, `closing` (given every
    request's whole output), `[DONE]`."""
    try:
        if opening is not None:
            yield ServerSentEvent(_json(opening))
        totals = OutputAccumulator()
        finals: list[RequestOutput | None] = [None] * len(requests.streams)
        try:
            async with aclosing(requests.merged()) as deltas:
                async for i, delta in deltas:
                    chunk = render_chunk(i, delta)
                    if chunk is not None:
                        yield ServerSentEvent(_json(chunk))
                    total = totals.add(delta)
                    if total.finished:
                        finals[i] = total
        except Exception as exc:
            yield error_event(exc)
        else:
            last = closing(finals)  # type: ignore[arg-type]
            if last is not None:
                yield ServerSentEvent(_json(last))
        yield ServerSentEvent("[DONE]")
    finally:
        await requests.close()


async def sweep_events(
    first: dict, events: AsyncGenerator[dict, None]
) -> AsyncIterator[ServerSentEvent]:
    """A sweep's stream: `event: cell` per cell, then `event: summary` (or `event: error`)."""
    try:
        item: dict | None = first
        while item is not None:
            name = item.pop("event")
            yield ServerSentEvent(_json(item), event=name)
            item = await anext(events, None)
    except Exception as exc:
        yield error_event(exc, event="error")
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
