"""Per-request generation settings, validated when built so bad values never reach a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request. `temperature == 0` is greedy.

    `logprobs=k` returns, per generated token, the top-k logprobs plus the sampled token's;
    `logprob_token_ids` adds the exact logprob of each listed id at every generated step;
    `prompt_logprobs=k` returns, per prompt position, the top-k plus the actual token's.
    Logprobs are of the model's raw distribution (before temperature and truncation).

    Interventions (schema in `services/engine/interventions/spec.py`): `steering` adds
    vectors, gates and `abort_when` probes; `capture` returns pristine residuals;
    `readouts` reports probe scores with every generated token; `patch` replaces prompt
    activations (activation patching). Their structure is checked
    here; layers, sizes and vector names when the engine accepts the request.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    logprob_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: the engine decodes no text (deltas and outputs carry token ids, and empty text);
    # for callers that need ids only, and front ends that decode in their own process
    # (`services/engine/detokenizer.py`). Stop strings need the text.
    detokenize: bool = True
    steering: Any = None  # SteeringSpec or its dict form
    capture: Any = None  # CaptureSpec or its dict form
    readouts: Any = None  # list of Readout or their dict forms
    patch: Any = None  # list of PatchEntry or their dict forms
    # Ties the requests of one conversation together for the async controller (its latch
    # policy keeps steering a conversation once a probe fired in it); opaque to the engine.
    conversation_id: str | None = None
    # A loaded adapter (`LLMEngine.load_adapter`) to run under, as trained (kept + quarantine)
    # or as deployed (quarantine ablated).
    adapter: str | None = None
    adapter_variant: str = "trained"

    def __post_init__(self) -> None:
        from services.engine.interventions.spec import (
            parse_capture,
            parse_patch,
            parse_readouts,
            parse_steering,
        )

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logprob_token_ids = list(self.logprob_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.steering = parse_steering(self.steering)
        self.capture = parse_capture(self.capture)
        self.readouts = parse_readouts(self.readouts)
        self.patch = parse_patch(self.patch)

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling params: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise bad("stop strings are matched in the generated text: they need detokenize")
        if self.adapter_variant not in ("trained", "deploy"):
            raise bad(f"adapter_variant must be trained or deploy, not {self.adapter_variant!r}")
        for name in ("stop_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if any(not isinstance(i, int) or i < 0 for i in ids):
                raise bad(f"{name} must be a list of non-negative token ids, got {ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
