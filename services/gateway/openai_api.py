"""The OpenAI-compatible API: request and response bodies, and the two conversions.

`sampling_params(body)` is the one place a request body becomes `SamplingParams`;
`Renderer` is the one place engine outputs become response bodies (whole responses and
stream chunks render the same way: a stream chunk is one engine delta).

Coxswain's extras ride along in the same bodies: `steering`, `capture`, `patch`,
`readouts`, `logprob_token_ids` and `conversation_id` in a request (the schemas of
`services/engine/interventions/spec.py`), and a `coxswain` object per choice (what the
sample produced: token ids, read-outs, exact logprobs of the requested ids, why it
stopped) and per response (what each prompt's request produced: captures, cache hits).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, WrapValidator, model_validator

from services.common.errors import InvalidRequestError
from services.common.wire import pack_tensor
from services.engine.interventions.spec import CaptureSpec, PatchEntry, Readout, SteeringSpec
from services.engine.model.tokenizer import Tokenizer, check_unicode
from services.engine.outputs import CompletionDelta, CompletionOutput, RequestDelta, RequestOutput
from services.engine.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # samples per prompt; more than a batch holds is never what a client meant
MAX_PROMPTS = 64  # prompts in one completions request
_INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=_INT64)]
Api = Literal["completions", "chat"]


class _Body(BaseModel):
    """Request bodies: unknown fields are an error (never silently ignored), no NaN/Inf, and
    types are strict (`"max_tokens": "8"` or `"stream": "true"` is a 400 naming the field,
    never coerced; an integer is still a valid float)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def strict_json(model: type[BaseModel]) -> Any:
    """`model` as part of a JSON body, validated as strictly as the body's own fields
    (`"scale": "2"` inside steering is a 400 naming the field). A body's `strict` does not
    reach nested models, and making the spec models strict themselves would refuse what the
    engine's Python API rightly takes (tuples, numpy scalars)."""

    def validate(value: Any, handler: Any) -> Any:
        if isinstance(value, dict):
            return model.model_validate(value, strict=True)
        return handler(value)

    return Annotated[model, WrapValidator(validate)]


StrictSteering = strict_json(SteeringSpec)
StrictCapture = strict_json(CaptureSpec)
StrictPatchEntry = strict_json(PatchEntry)
StrictReadout = strict_json(Readout)


def check_texts(value: Any, where: str = "") -> Any:
    """`value` (a decoded JSON body), if every string in it, keys included, is valid
    Unicode; else InvalidRequestError naming the first that is not. JSON can carry a lone
    surrogate (`"\\ud800"`), which no UTF-8 response, tokenizer or protobuf can hold, so a
    body is refused whole rather than failing wherever the string lands."""
    if isinstance(value, str):
        check_unicode(value, where or "the body")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, f"a key of {where or 'the body'}")
            check_texts(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | dict | list):  # numbers (vectors) need no look
                check_texts(item, f"{where}[{i}]")
    return value


class StreamOptions(_Body):
    include_usage: bool = Field(
        False, description="Send a last chunk with token usage (and empty `choices`)."
    )


class _GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_texts(data)

    model: str | None = Field(None, description="The served model's id (default: that model).")
    temperature: float = Field(1.0, ge=0.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1, description="0 or -1: off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N, description="Samples per prompt.")
    stop: str | list[str] | None = Field(None, description="Stop strings (not in the output).")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=_INT64)
    presence_penalty: float = Field(0.0, description="Not supported: only 0 is accepted.")
    frequency_penalty: float = Field(0.0, description="Not supported: only 0 is accepted.")
    user: str | None = Field(
        None, max_length=256, description="An end-user id: accepted for compatibility, unused."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Coxswain extras
    steering: StrictSteering | None = Field(
        None, description="Per-request steering: vectors, probe-gated edits, abort_when probes."
    )
    capture: StrictCapture | None = Field(
        None,
        description="Return pristine residuals (base64-packed, per prompt in `coxswain`), "
        "or write them to the patch store as a run.",
    )
    patch: list[StrictPatchEntry] | None = Field(
        None, description="Activation patches at prompt positions (stored run, vector, zeros)."
    )
    readouts: list[StrictReadout] | None = Field(
        None, description="Probe scores h·probe reported with every generated token."
    )
    logprob_token_ids: list[TokenId] | None = Field(
        None, description="Token ids whose exact logprob is reported at every generated token."
    )
    conversation_id: str | None = Field(
        None, max_length=256, description="Ties the requests of one conversation together."
    )
    adapter: str | None = Field(
        None, max_length=256, description="A loaded adapter to run under (null: the base model)."
    )
    adapter_variant: Literal["trained", "deploy"] = Field(
        "trained", description="The adapter as trained, or as deployed (quarantine ablated)."
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    include_stop_str_in_output: bool = Field(
        False, description="Keep the stop string that ended a sample in its text."
    )


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(16, ge=1, description="Null: up to the model's context.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Top logprobs per generated token."
    )
    echo: bool = Field(False, description="Prepend the prompt to the returned text.")


class TextPart(_Body):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


def check_chat_role(role: object, where: str) -> str:
    """`role` if a chat message may have it (`ChatRole`, OpenAI's roles), else
    InvalidRequestError naming `where`. gRPC chats are checked with it, HTTP ones by the
    same `ChatRole` in `ChatMessage`: both fronts take exactly the same roles."""
    if role not in get_args(ChatRole):
        raise InvalidRequestError(
            f"{where} is {str(role)[:40]!r}; a chat role is one of {', '.join(get_args(ChatRole))}"
        )
    return role  # type: ignore[return-value]


class ChatMessage(_Body):
    role: ChatRole
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of the next.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


GenerationRequest = CompletionRequest | ChatCompletionRequest


def sampling_params(body: GenerationRequest) -> SamplingParams:
    """The engine's `SamplingParams` for a request body (InvalidRequestError if it asks for
    something Coxswain cannot do, rather than ignoring it)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise InvalidRequestError(f"{name} is not supported (only 0)")
    if isinstance(body, ChatCompletionRequest):
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        max_tokens = body.max_tokens
        logprobs = body.logprobs
        if body.echo and logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options needs stream: true")
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        logprob_token_ids=list(body.logprob_token_ids or []),
        skip_special_tokens=body.skip_special_tokens,
        steering=body.steering,
        capture=body.capture,
        readouts=body.readouts,
        patch=body.patch,
        conversation_id=body.conversation_id,
        adapter=body.adapter,
        adapter_variant=body.adapter_variant,
    )


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions body: one per string or token-id list."""
    p = body.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str):
        prompts = [p]
    elif not p:
        raise InvalidRequestError("prompt is an empty list")
    elif isinstance(p[0], int):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request")
    return prompts


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template takes them (text parts joined)."""
    out = []
    for m in body.messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        msg = {"role": m.role, "content": text}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


# -- response bodies -------------------------------------------------------------------------


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
