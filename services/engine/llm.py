"""`LLM`: the offline batch API — give it prompts, get one RequestOutput per prompt back."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine, Prompt
from services.engine.outputs import OutputAccumulator, RequestOutput
from services.engine.sampling_params import SamplingParams


class LLM:
    """Generate from a local Hugging Face checkpoint with continuous batching.

    `LLM("DIR", device="cpu", dtype="float32", block_size=16, max_num_seqs=64,
    enable_prefix_caching=True, ...)`: keyword arguments are `EngineConfig` fields.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        patch_store: Any = None,
        engine: LLMEngine | None = None,
        **engine_args: Any,
    ):
        """`engine=` serves a prebuilt engine instead (e.g. a parallel replica's driver)."""
        if (model is None) == (engine is None):
            raise ValueError("give LLM a model directory or an engine, not both")
        self.engine = engine or LLMEngine(
            model,  # type: ignore[arg-type]
            EngineConfig(**engine_args),
            patch_store=patch_store,
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A bad prompt fails the whole call (naming its index) and leaves nothing queued.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(prompts)} prompts but {len(params)} SamplingParams"
            )
        rids: list[str] = []
        # One SamplingParams for every prompt: its steering resolves once, not per prompt.
        with self.engine.interventions.resolver.shared_specs():
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = f"llm-{next(self._ids)}"
                try:
                    self.engine.add_request(rid, prompt, p)
                except InvalidRequestError as e:
                    for queued in rids:  # all or nothing: drop what this call already queued
                        self.engine.abort(queued)
                    raise type(e)(f"prompt {i}: {e}") from None
                rids.append(rid)
        totals = OutputAccumulator()
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req")
        while len(final) < len(rids):
            for out in totals.finished(self.engine.step()):
                final[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in rids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)
