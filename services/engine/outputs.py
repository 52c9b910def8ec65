"""What a caller gets back: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One sample of a request. `logprobs[i]` maps token id -> logprob at generated step i."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "probe"
    stop_reason: int | str | None = None  # the stop token id or string, or the probe's name
    # readouts[i]: {read-out name: h·probe} at the position that produced token i
    readouts: list[dict[str, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request (all its samples) so far; `finished` once every sample ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
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
