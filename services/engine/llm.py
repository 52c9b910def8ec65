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

        Prompts are admitted as the engine gets to them: before each step, those the step
        can take (a step's token budget waiting, `_admit_ahead`), so on a GPU their
        admission (steering specs resolved, vectors decoded) runs while the device
        computes the step launched before, in even shares rather than ahead of all steps.

        A bad prompt fails the whole call (naming its index) and leaves nothing queued or
        running.
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
        todo = list(enumerate(zip(prompts, params, strict=True)))[::-1]  # pop() takes the next
        rids: list[str] = []
        self._admit_ahead(todo, rids)  # one step's prompts: the first step starts soon
        totals = OutputAccumulator()
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        while todo or len(final) < len(rids):
            for out in totals.finished(self.engine.step()):
                final[out.request_id] = out
                if bar is not None:
                    bar.update(1)
            if todo:
                self._admit_ahead(todo, rids)
        if bar is not None:
            bar.close()
        return [final[r] for r in rids]

    def _admit_ahead(
        self, todo: list[tuple[int, tuple[Prompt, SamplingParams]]], rids: list[str]
    ) -> None:
        """Admit prompts from the end of `todo` (appending their ids to `rids`) until the
        engine has a step's worth of prompt tokens waiting, or a batch of sequences, or
        `todo` is empty: what the next step can take, so admission is spread evenly over
        the steps that prefill. A bad prompt aborts every request of the call and raises."""
        engine = self.engine
        sched = engine.scheduler
        waiting = sum(s.num_tokens - s.num_computed for s in sched.waiting)
        budget = sched.max_num_batched_tokens
        # One SamplingParams for many prompts: its steering resolves once a wave.
        with engine.interventions.resolver.shared_specs():
            while todo and waiting < budget and len(sched.waiting) < sched.max_num_seqs:
                i, (prompt, p) = todo.pop()
                rid = f"llm-{next(self._ids)}"
                try:
                    engine.add_request(rid, prompt, p)
                except InvalidRequestError as e:
                    for admitted in rids:  # all or nothing: drop what this call started
                        if admitted in engine.requests:  # (not those finished already)
                            engine.abort(admitted)
                    todo.clear()
                    raise type(e)(f"prompt {i}: {e}") from None
                rids.append(rid)
                seq = engine.requests[rid].seqs[0]
                waiting += seq.num_tokens

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)
