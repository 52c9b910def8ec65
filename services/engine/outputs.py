"""What a caller gets back.

The engine emits one `RequestDelta` per request per step that advanced it: what that step
added (new tokens, the text they completed, their logprobs and read-outs), O(1) per token.
Every front end reads these deltas: streams forward them, `RequestDelta.merge` coalesces the
ones a slow reader has not taken yet, and `OutputAccumulator` (over `RequestOutput.add`) is the
one place deltas become totals, for callers that want the whole request (`LLM.generate`,
non-streaming HTTP, sweeps, rollouts, the gRPC client's `complete`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

Logprobs = dict[int, float]  # token id -> logprob at one position
Readouts = dict[str, float]  # read-out name -> h·probe at one position


@dataclass
class CompletionDelta:
    """What one step added to one sample. `token_offset`: how many generated tokens the sample
    had before these (so `token_ids[i]` is its generated token `token_offset + i`)."""

    index: int
    token_offset: int
    token_ids: list[int]
    text: str  # appended to the sample's text; never cut later (see LLMEngine._delta)
    logprobs: list[Logprobs] | None = None
    readouts: list[Readouts] | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "probe"
    stop_reason: int | str | None = None  # the stop token id or string, or the probe's name

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionDelta) -> None:
        """Append `later` (the same sample's next delta) to this one, in place."""
        _extend(self, later)

    def detached(self) -> CompletionDelta:
        """A copy whose lists a merge may extend without changing this one's."""
        return replace(
            self,
            token_ids=list(self.token_ids),
            logprobs=_copy(self.logprobs),
            readouts=_copy(self.readouts),
        )


@dataclass
class RequestDelta:
    """What one step added to one request: a delta for each sample it advanced.

    `prompt` and `prompt_token_ids` come on a request's first delta only (None after);
    `prompt_logprobs` holds the entries new since the last delta; `captures` and the
    capture fields come on the final one (`finished=True`).
    """

    request_id: str
    samples: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    captures: dict[str, Any] | None = None
    capture_positions: list[int] | None = None
    capture_run: str | None = None
    capture_error: str | None = None
    conversation_id: str | None = None

    def merge(self, later: RequestDelta) -> None:
        """Fold `later` (the same request's next delta) into this one, in place: one delta
        that says what both did. How a stream coalesces what a slow reader has not taken.
        Nothing of `later` is changed, then or by later merges."""
        mine = {s.index: s for s in self.samples}
        for s in later.samples:
            if s.index in mine:
                mine[s.index].merge(s)
            else:
                self.samples.append(s.detached())
        _follow(self, later)

    def detached(self) -> RequestDelta:
        """A copy that merges may extend without changing this delta, which others (output
        listeners) may hold."""
        return replace(
            self,
            samples=[s.detached() for s in self.samples],
            prompt_logprobs=_copy(self.prompt_logprobs),
        )


@dataclass
class CompletionOutput:
    """One sample of a request. `logprobs[i]` maps token id -> logprob at generated step i."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "probe"
    stop_reason: int | str | None = None  # the stop token id or string, or the probe's name
    # readouts[i]: {read-out name: h·probe} at the position that produced token i
    readouts: list[Readouts] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The whole of one request (all its samples) so far; `finished` once every sample ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
    # Pristine residuals `{"<layer>.<site>": [num_positions, H]}` (float32, CPU) at
    # `capture_positions`, on the final output of a request that asked for `capture`.
    captures: dict[str, Any] | None = None
    capture_positions: list[int] | None = None
    # With capture sink "patch_store": the run the captures were written to, or why not.
    capture_run: str | None = None
    capture_error: str | None = None
    # `SamplingParams.conversation_id`, echoed so output listeners (the async controller's
    # read-out publisher) can tie a request to its conversation after it has finished.
    conversation_id: str | None = None

    @classmethod
    def start(cls, delta: RequestDelta) -> RequestOutput:
        """The total of a stream whose first delta is `delta`."""
        out = cls(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=list(delta.prompt_token_ids or ()),
            outputs=[],
            finished=False,
        )
        out.add(delta)
        return out

    def add(self, delta: RequestDelta) -> None:
        """Add the stream's next delta, in place (O(size of the delta))."""
        samples = {c.index: c for c in self.outputs}
        for d in delta.samples:
            comp = samples.get(d.index)
            if comp is None:
                comp = samples[d.index] = CompletionOutput(d.index, "", [])
                self.outputs.append(comp)
                self.outputs.sort(key=lambda c: c.index)
            _extend(comp, d)
        _follow(self, delta)


@dataclass
class OutputAccumulator:
    """Totals of many requests' delta streams, by request id."""

    totals: dict[str, RequestOutput] = field(default_factory=dict)

    def add(self, delta: RequestDelta) -> RequestOutput:
        """The request's total with `delta` added; a finished request is forgotten after."""
        total = self.totals.get(delta.request_id)
        if total is None:
            total = RequestOutput.start(delta)
        else:
            total.add(delta)
        if total.finished:
            self.totals.pop(delta.request_id, None)
        else:
            self.totals[delta.request_id] = total
        return total

    def finished(self, deltas: Iterable[RequestDelta]) -> list[RequestOutput]:
        """Add every delta; the totals of the requests they finished, in their order."""
        return [out for out in map(self.add, deltas) if out.finished]


def _extend(sample: CompletionOutput | CompletionDelta, d: CompletionDelta) -> None:
    """Append what `d` added to a sample (a whole one, or an earlier delta of it)."""
    sample.token_ids += d.token_ids
    sample.text += d.text
    sample.logprobs = _concat(sample.logprobs, d.logprobs)
    sample.readouts = _concat(sample.readouts, d.readouts)
    if d.finish_reason is not None:
        sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason


def _follow(request: RequestOutput | RequestDelta, d: RequestDelta) -> None:
    """Bring the request-level fields of `request` (a total, or an earlier delta) up to its
    later delta `d`: new prompt logprobs appended, the latest state taken, the final's
    captures kept."""
    request.prompt_logprobs = _concat(request.prompt_logprobs, d.prompt_logprobs)
    request.finished = d.finished
    request.num_cached_tokens = d.num_cached_tokens
    request.conversation_id = d.conversation_id or request.conversation_id
    for name in ("captures", "capture_positions", "capture_run", "capture_error"):
        if getattr(d, name) is not None:
            setattr(request, name, getattr(d, name))


def _copy(a: list | None) -> list | None:
    return None if a is None else list(a)


def _concat(a: list | None, b: list | None) -> list | None:
    if b is None:
        return a
    if a is None:
        return list(b)
    a += b
    return a
