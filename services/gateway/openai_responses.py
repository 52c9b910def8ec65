"""The OpenAI-compatible API's responses: the response bodies (for the OpenAPI schema) and
`Renderer`, the one place engine outputs become response bodies. Whole responses and stream
chunks render the same way: a stream chunk is one engine delta.

Coxswain's extras ride along: a `coxswain` object per choice (what the sample produced:
token ids, read-outs, exact logprobs of the requested ids, why it stopped) and per response
(what each prompt's request produced: captures, cache hits). The request side is
`openai_api.py`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from services.common.wire import pack_tensor
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import CompletionDelta, CompletionOutput, RequestDelta, RequestOutput
from services.engine.sampling_params import SamplingParams

Api = Literal["completions", "chat"]


class PackedTensor(BaseModel):
    """A tensor on the wire: base64 of its little-endian, row-major bytes."""

    dtype: str
    shape: list[int]
    data: str


class ChoiceExtras(BaseModel):
    """What one sample produced beyond its text (in a stream chunk: since the last chunk)."""

    prompt_index: int
    token_ids: list[int]
    readouts: list[dict[str, float | None]] | None = Field(
        None, description="Per generated token: {read-out name: h·probe}."
    )
    requested_logprobs: list[dict[str, float | None]] | None = Field(
        None, description="Per generated token: {token id: logprob} of `logprob_token_ids`."
    )
    stop_reason: int | str | None = Field(
        None, description="The stop token id or string, or the name of the probe that fired."
    )


class PromptExtras(BaseModel):
    """What one prompt's request produced: cache use and captured activations."""

    index: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    captures: dict[str, PackedTensor] | None = Field(
        None, description="'<layer>.<site>' -> [len(capture_positions), H] float32."
    )
    capture_positions: list[int] | None = None
    capture_run: str | None = None
    capture_error: str | None = None


class ResponseExtras(BaseModel):
    prompts: list[PromptExtras]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(
        None, description="stop, length, probe (an abort_when probe fired) or abort."
    )
    coxswain: ChoiceExtras


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    coxswain: ResponseExtras | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    coxswain: ChoiceExtras


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    coxswain: ResponseExtras | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "coxswain"
    coxswain: dict[str, Any] = Field(description="Layers, hidden size, sites, dtype, device.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: a non-finite number (a steered-to-overflow model) is null."""
    return x if x is not None and math.isfinite(x) else None


@dataclass
class _Cursor:
    """Where one choice of a stream stands."""

    token_chars: int = 0  # of the tokens' own text, for `text_offset`
    started: bool = False
    done: bool = False


@dataclass
class Renderer:
    """Turns the outputs of one API request (one engine request per prompt) into response
    bodies and stream chunks. `n` samples per prompt: choice `i * n + j` is sample `j` of
    prompt `i`, as in the OpenAI API."""

    api: Api
    model: str
    tokenizer: Tokenizer
    params: SamplingParams
    n: int
    echo_prompts: list[str] | None = None  # completions with echo: the prompt texts
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _cursors: dict[int, _Cursor] = field(default_factory=dict, init=False, repr=False)

    @property
    def object_name(self) -> str:
        if self.api == "chat":
            return "chat.completion"
        return "text_completion"

    # -- whole responses ------------------------------------------------------------------

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streaming response body for every prompt's final output."""
        choices = []
        for i, out in enumerate(finals):
            for comp in out.outputs:
                choice, _ = self._choice(i, comp, _Cursor(), final=True, stream=False)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(finals),
            "coxswain": self.extras(finals),
        }

    def usage(self, outputs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def extras(self, outputs: list[RequestOutput]) -> dict:
        """The per-prompt `coxswain` object of a response."""
        prompts = []
        for i, out in enumerate(outputs):
            captures = None
            if out.captures is not None:
                captures = {k: pack_tensor(v) for k, v in out.captures.items()}
            prompts.append(
                {
                    "index": i,
                    "request_id": out.request_id,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "cached_tokens": out.num_cached_tokens,
                    "captures": captures,
                    "capture_positions": out.capture_positions,
                    "capture_run": out.capture_run,
                    "capture_error": out.capture_error,
                }
            )
        return {"prompts": prompts}

    # -- streams --------------------------------------------------------------------------

    def chunk(self, prompt_index: int, delta: RequestDelta) -> dict | None:
        """A stream chunk with what `delta` added to its choices (None when it added
        nothing to send)."""
        choices = []
        for comp in delta.samples:
            index = prompt_index * self.n + comp.index
            cursor = self._cursors.setdefault(index, _Cursor())
            if cursor.done:
                continue
            choice, moved = self._choice(
                prompt_index, comp, cursor, final=comp.finished, stream=True
            )
            if moved:
                choices.append(choice)
        if not choices:
            return None
        return self._chunk_body(choices)

    def first_chunk(self, num_prompts: int) -> dict | None:
        """Chat streams open each choice with an assistant-role delta, as OpenAI's do."""
        if self.api != "chat":
            return None
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            for i in range(num_prompts * self.n)
        ]
        return self._chunk_body(choices)

    def last_chunk(self, finals: list[RequestOutput], include_usage: bool) -> dict | None:
        """The closing chunk (empty `choices`): usage if asked, captures if any were asked."""
        body: dict[str, Any] = {}
        if include_usage:
            body["usage"] = self.usage(finals)
        if self.params.capture is not None:
            body["coxswain"] = self.extras(finals)
        return self._chunk_body([]) | body if body else None

    def _chunk_body(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.api == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # -- one choice -------------------------------------------------------------------------

    def _choice(
        self,
        prompt_index: int,
        comp: CompletionOutput | CompletionDelta,
        cursor: _Cursor,
        *,
        final: bool,
        stream: bool,
    ) -> tuple[dict, bool]:
        """The choice body for a whole sample or a stream's delta of one (`cursor` advanced);
        whether anything moved."""
        index = prompt_index * self.n + comp.index
        text, ids, lps = comp.text, comp.token_ids, comp.logprobs
        if self.echo_prompts is not None and not cursor.started:  # echo opens the choice
            text = self.echo_prompts[prompt_index] + text
        moved = bool(text or ids or final)
        cursor.done, cursor.started = final, True
        extras = {
            "prompt_index": prompt_index,
            "token_ids": ids,
            "readouts": None
            if comp.readouts is None
            else [{k: _finite(v) for k, v in r.items()} for r in comp.readouts],
            "requested_logprobs": None
            if not self.params.logprob_token_ids or lps is None
            else [{str(t): _finite(d.get(t)) for t in self.params.logprob_token_ids} for d in lps],
            "stop_reason": comp.stop_reason if final else None,
        }
        finish = comp.finish_reason if final else None
        body: dict[str, Any] = {"index": index}
        if self.api == "chat":
            logprobs = self._chat_logprobs(ids, lps)
            if stream:
                body["delta"] = {"content": text} if text else {}
            else:
                body["message"] = {"role": "assistant", "content": text}
        else:
            logprobs = self._completion_logprobs(ids, lps, cursor)
            body["text"] = text
        body.update(logprobs=logprobs, finish_reason=finish, coxswain=extras)
        return body, moved

    def _top(self, d: dict[int, float]) -> list[tuple[int, float]]:
        k = self.params.logprobs or 0
        return sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []

    def _completion_logprobs(
        self, ids: list[int], lps: list[dict[int, float]] | None, cursor: _Cursor
    ) -> dict | None:
        if self.params.logprobs is None or lps is None:
            return None
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(cursor.token_chars)
            cursor.token_chars += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(d.get(t)) for t, d in zip(ids, lps, strict=True)],
            "top_logprobs": [
                {
                    self.tokenizer.decode([tid], skip_special_tokens=False): _finite(lp)
                    for tid, lp in self._top(d)
                }
                for d in lps
            ],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, ids: list[int], lps: list[dict[int, float]] | None) -> dict | None:
        if self.params.logprobs is None or lps is None:
            return None

        def entry(tid: int, lp: float | None) -> dict:
            tok = self.tokenizer.decode([tid], skip_special_tokens=False)
            return {"token": tok, "logprob": _finite(lp), "bytes": list(tok.encode())}

        return {
            "content": [
                entry(t, d.get(t)) | {"top_logprobs": [entry(i, lp) for i, lp in self._top(d)]}
                for t, d in zip(ids, lps, strict=True)
            ]
        }
