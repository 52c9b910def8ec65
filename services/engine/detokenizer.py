"""Incremental detokenization: the text each new token adds, from a short window of recent
tokens, on the engine's thread or in a front end's process.

By default the engine decodes every token it accepts (stop strings are matched in text).
At batch 128 that is about a third of the engine thread's per-step work outside the model,
so a front end in another process (`ProcessBackend`: `coxswain serve`'s HTTP processes and
a cluster gateway's) takes it over, as vLLM v1's front end does: it sends a request without
stop strings with `detokenize=False` and fills in each delta's text from its token ids with
`DeltaDetokenizer`, by the same windows, so the text and its split into deltas are the
engine's.
"""

from __future__ import annotations

import copy
from typing import Any

from services.engine.outputs import RequestDelta
from services.engine.sampling_params import SamplingParams

# A sample's first window starts this many prompt tokens back, so that tokenizers which
# drop a leading space at the start of a decode treat the first generated token as they
# would in the middle of the text.
PROMPT_WINDOW = 5


def decode_window(
    tokenizer: Any, ids: list[int], prefix: int, read: int, end: int, skip_special: bool
) -> tuple[str, int, int]:
    """The text `ids[read:end]` adds after `ids[:read]`, and the next window's offsets.

    Decodes `ids[prefix:read]` and `ids[prefix:end]` and returns what the second adds to the
    first: both start at the same token, so a leading space dropped at a decode's start
    affects them alike. A byte-level token can end mid-character: then nothing is emitted
    (and the offsets stay) until the character completes.
    """
    before = tokenizer.decode(ids[prefix:read], skip_special)
    after = tokenizer.decode(ids[prefix:end], skip_special)
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return "", prefix, read
    return after[len(before) :], read, end


class SampleDetokenizer:
    """One sample's text, a token at a time, from the tail of its prompt on."""

    __slots__ = ("ids", "prefix", "read")

    def __init__(self, prompt_token_ids: list[int]):
        self.ids = list(prompt_token_ids[-PROMPT_WINDOW:])
        self.prefix, self.read = 0, len(self.ids)

    def add(self, tokenizer: Any, token_ids: list[int], skip_special: bool) -> str:
        """The text `token_ids` (the sample's next tokens) add, decoded a token at a time as
        the engine would."""
        ids, parts = self.ids, []
        for token in token_ids:
            ids.append(token)
            text, self.prefix, self.read = decode_window(
                tokenizer, ids, self.prefix, self.read, len(ids), skip_special
            )
            if text:
                parts.append(text)
        if self.prefix > 64:  # keep the window's tokens only
            del ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        return "".join(parts)


class DeltaDetokenizer:
    """Fills in the text of one request's deltas, which the engine sent without it
    (`detokenize=False`): give it every delta of the request, in order (merged ones too)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.prompt: list[int] = []
        self.samples: dict[int, SampleDetokenizer] = {}

    def fill(self, delta: RequestDelta) -> RequestDelta:
        if delta.prompt_token_ids is not None:  # the request's first delta
            self.prompt = delta.prompt_token_ids
        for s in delta.samples:
            sample = self.samples.get(s.index)
            if sample is None:
                sample = self.samples[s.index] = SampleDetokenizer(self.prompt)
            s.text += sample.add(self.tokenizer, s.token_ids, self.skip_special)
        return delta


def detokenize_here(
    params: SamplingParams, tokenizer: Any
) -> tuple[SamplingParams, DeltaDetokenizer | None]:
    """For a front end with `tokenizer` (None: it has none): the params to send the engine,
    and the `DeltaDetokenizer` that fills in the text of their deltas here, or None where the
    engine keeps that work (stop strings are matched in its text; the caller asked for no
    text)."""
    if tokenizer is None or not params.detokenize or params.stop:
        return params, None
    sent = copy.copy(params)  # validated already: no second __post_init__
    sent.detokenize = False
    return sent, DeltaDetokenizer(tokenizer, params.skip_special_tokens)
