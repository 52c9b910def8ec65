"""The workload the tensor/pipeline-parallel tests run on a replica's driver and, for the
reference, in one process: steering (request, global, by registry name), capture, patching
and read-outs in one continuous batch. Module-level so spawned ranks can import it."""

from __future__ import annotations

import torch

from services.engine import LLM, SamplingParams

H = 64  # the tiny checkpoint's hidden size
LAYERS = 4


def _vec(seed: int, scale: float = 4.0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(H, generator=g)).tolist()


def requests() -> list[tuple[str, SamplingParams]]:
    greedy = dict(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    steering = {
        "vectors": [
            {"layers": [0], "site": "post_block", "vector": _vec(1)},
            {"layers": [3], "site": "pre_attn", "vector": _vec(2), "phase": "decode"},
            {"layers": [2], "site": "post_attn", "vector": "registered", "scale": 2.0},
        ]
    }
    capture = {"sites": {"pre_attn": "all", "post_block": [1, 3]}, "positions": "all"}
    patch = [
        {"layer": 2, "site": "post_block", "position": 3, "source": {"vector": _vec(3)}},
        {"layer": 0, "site": "pre_attn", "position": 1, "alpha": 0.5, "source": {"zeros": True}},
    ]
    readouts = [
        {"name": "early", "layer": 1, "site": "post_block", "probe": _vec(4, 1.0)},
        {"name": "late", "layer": 3, "site": "post_attn", "probe": _vec(5, 1.0)},
    ]
    return [
        ("the quick brown fox", SamplingParams(**greedy)),
        ("the quick brown fox", SamplingParams(**greedy, steering=steering)),
        ("a small model runs on", SamplingParams(**greedy, capture=capture)),
        ("a small model runs on", SamplingParams(**greedy, patch=patch)),
        ("once upon a time there", SamplingParams(**greedy, readouts=readouts)),
        ("once upon a time", SamplingParams(temperature=0.8, seed=7, max_tokens=5, n=2)),
    ]


def run(engine) -> list[dict]:
    """Register a vector, set global steering, then run every request in one batch."""
    engine.vectors.register("registered", _vec(6, 1.0))
    steer_all = {"layers": [1], "site": "pre_attn", "vector": _vec(7, 1.0)}
    engine.set_global_steering({"vectors": [steer_all]})
    llm = LLM(engine=engine)
    prompts, params = zip(*requests(), strict=True)
    outs = llm.generate(list(prompts), list(params))
    return [
        {
            "prompt_logprobs": o.prompt_logprobs,
            "samples": [(c.token_ids, c.logprobs, c.readouts, c.finish_reason) for c in o.outputs],
            "captures": o.captures,
            "capture_positions": o.capture_positions,
            "num_cached_tokens": o.num_cached_tokens,
        }
        for o in outs
    ]
