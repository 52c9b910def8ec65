"""The OpenAI-compatible API's requests: the request bodies and their conversions.

`sampling_params(body)` is the one place a request body becomes `SamplingParams`;
`prompts_of` and `chat_messages` give what the engine and the chat template take. The
response side (bodies and `Renderer`, where engine outputs become them) is
`openai_responses.py`; its names are importable from here too.

Coxswain's extras ride along in the same bodies: `steering`, `capture`, `patch`,
`readouts`, `logprob_token_ids` and `conversation_id` in a request (the schemas of
`services/engine/interventions/spec.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, WrapValidator, model_validator

from services.common.errors import InvalidRequestError
from services.engine.interventions.spec import CaptureSpec, PatchEntry, Readout, SteeringSpec
from services.engine.model.tokenizer import check_unicode
from services.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from services.gateway.openai_responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
    PackedTensor,
    Renderer,
)

# What the routes and converters import from here, the response side's names included.
__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "GenerationRequest",
    "ModelList",
    "PackedTensor",
    "Renderer",
    "StrictSteering",
    "chat_messages",
    "check_chat_role",
    "check_texts",
    "prompts_of",
    "sampling_params",
]

MAX_N = 128  # samples per prompt; more than a batch holds is never what a client meant
MAX_PROMPTS = 64  # prompts in one completions request
_INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=_INT64)]


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
