"""Tokenizer from `tokenizer.json`; special tokens and chat template from its config file.

Encoding goes through the Rust tokenizer's batch call, which releases the GIL: a server
tokenizes a long prompt in a worker thread while the engine thread keeps stepping (the
single-text call holds the GIL for the whole encode, stalling every other thread).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from services.common.errors import CheckpointError, InvalidRequestError


def check_unicode(text: Any, what: str = "the prompt") -> None:
    """InvalidRequestError unless `text` is a string of Unicode scalar values. JSON lets a
    client send a lone surrogate (`"\\ud800"`), which no UTF-8 text or tokenizer can hold."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a string, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{what} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) "
            f"at character {e.start}"
        ) from None


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens as strings or AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encodes prompts and decodes generated ids exactly as the checkpoint's HF tokenizer does."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = root / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template: str | None = self.config.get("chat_template")
        if self.chat_template is None and (root / "chat_template.jinja").is_file():
            self.chat_template = (root / "chat_template.jinja").read_text()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; InvalidRequestError if it is not valid Unicode text."""
        return self._encode(text, add_special_tokens).ids

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in `text` ((0, 0): special)."""
        enc = self._encode(text, add_special_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        try:  # a batch of one: the batch call releases the GIL while it works
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        except TypeError:  # the binding refuses what is not a str it can pass to Rust
            check_unicode(text)
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt string the model was trained on."""
        if not self.chat_template:
            raise InvalidRequestError(
                "this checkpoint has no chat_template in tokenizer_config.json"
            )
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise InvalidRequestError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed to render: {e}") from None

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template already spells out special tokens; don't add BOS twice.
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)
