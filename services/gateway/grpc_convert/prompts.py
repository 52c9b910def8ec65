"""Prompts on the wire: a text, token ids, or a chat that the server renders with the
model's template (`EncodeChat`) into the token ids the engine takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.common.errors import InvalidRequestError
from services.gateway.grpc_convert.fields import checked
from services.gateway.openai_api import check_chat_role
from services.proto.coxswain.v1 import engine_pb2 as pb

EnginePrompt = str | list[int]  # what EngineService.generate takes
EncodeChat = Callable[[list[dict]], list[int]]


def prompt_to_proto(prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> pb.Prompt:
    """A text, a token-id list, or a chat (a list of `{role, content}` dicts)."""
    if isinstance(prompt, str):
        return pb.Prompt(text=prompt)
    items: list[Any] | None = list(prompt) if isinstance(prompt, Sequence) else None
    if items and all(isinstance(m, Mapping) for m in items):
        messages = []
        for i, m in enumerate(items):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role or not isinstance(content, str):
                raise InvalidRequestError(
                    f"chat message {i} needs a non-empty string `role` and a string `content`"
                )
            messages.append(pb.ChatMessage(role=role, content=content))
        return pb.Prompt(chat=pb.Chat(messages=messages))
    if items is not None and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return checked(lambda: pb.Prompt(token_ids=pb.TokenIds(ids=items)), "prompt")
    raise InvalidRequestError(
        "a prompt is a string, a list of token ids, or a list of {role, content} messages; "
        f"got {type(prompt).__name__}"
    )


def prompt_from_proto(
    msg: pb.Prompt, encode_chat: EncodeChat, what: str = "prompt"
) -> EnginePrompt:
    """The engine's prompt: text, or token ids (a chat rendered with `encode_chat`)."""
    kind = msg.WhichOneof("kind")
    if kind == "text":
        return msg.text
    if kind == "token_ids":
        return list(msg.token_ids.ids)
    if kind == "chat":
        messages = msg.chat.messages
        for i, m in enumerate(messages):
            check_chat_role(m.role, f"{what}.chat.messages[{i}].role")
        return encode_chat([{"role": m.role, "content": m.content} for m in messages])
    raise InvalidRequestError(f"{what} is missing: give text, token_ids or chat")
