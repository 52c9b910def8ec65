"""Requests that arrive while others run: the continuous-batching path tests exercise."""

from __future__ import annotations

from services.engine import LLMEngine, OutputAccumulator, SamplingParams


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, gap: int
) -> list[list[int]]:
    """Add one prompt every `gap` steps; return each prompt's generated tokens, in order."""
    done: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    totals = OutputAccumulator()
    while pending or engine.has_unfinished_requests():
        if pending and step % gap == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in totals.finished(engine.step()):
            done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [done[str(i)] for i in range(len(prompts))]
