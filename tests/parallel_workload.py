"""The workload the tensor/pipeline-parallel tests run on a replica's driver and, for the
reference, in one process: steering (request, global, by registry name), capture, patching
and read-outs in one continuous batch. Module-level so spawned ranks can import it."""

from __future__ import annotations

import faulthandler
import gc
import signal
import time

import torch

from services.common.errors import InvalidRequestError
from services.engine import LLM, SamplingParams
from tests.adapter_states import random_state

H = 64  # the tiny checkpoint's hidden size
LAYERS = 4
# An adapter in every kind of target Linear: column-parallel (merged `qkv_proj` and
# `gate_up_proj`) and row-parallel (`o_proj`, `down_proj`), with a LoRA quarantine.
ADAPTERS = dict(
    adapter_capacity=1,
    adapter_rank=8,
    adapter_targets=("*.qkv_proj", "*.o_proj", "*.gate_up_proj", "*.down_proj"),
    adapter_lora_rank=2,
)


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
    """Register a vector, set global steering, load an adapter with a LoRA quarantine (on an
    engine that serves adapters), then run every request in one batch."""
    engine.vectors.register("registered", _vec(6, 1.0))
    if engine.adapters is not None:
        engine.load_adapter("policy", random_state(engine.adapters, seed=11, lora=2))
    steer_all = {"layers": [1], "site": "pre_attn", "vector": _vec(7, 1.0)}
    engine.set_global_steering({"vectors": [steer_all]})
    llm = LLM(engine=engine)
    reqs = requests()
    if engine.adapters is not None:
        greedy = dict(temperature=0.0, max_tokens=6, logprobs=3)
        reqs += [
            ("the quick brown fox", SamplingParams(**greedy, adapter="policy")),
            (
                "a small model runs on",
                SamplingParams(**greedy, adapter="policy", adapter_variant="deploy"),
            ),
        ]
    prompts, params = zip(*reqs, strict=True)
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


def refused_adapters(engine) -> dict:
    """Load adapters that must be refused on the driver, whichever stage their fault is in;
    then a request, to show the replica still steps in lock-step."""
    bank = engine.adapters
    good = random_state(bank, seed=12, lora=2)
    last = max(bank.shapes)  # a module of the last layer: another stage's under PP
    missing = {k: v for k, v in good.items() if k != last}
    bad_lora = {k: dict(v) for k, v in good.items()}
    bad_lora[last]["lora_a"] = torch.zeros(2, bank.shapes[last][1] + 1)
    errors = {}
    for name, state in (("missing", missing), ("bad_lora", bad_lora)):
        try:
            engine.load_adapter(name, state)
        except InvalidRequestError as e:
            errors[name] = str(e)
    out = LLM(engine=engine).generate(["the quick brown fox"], SamplingParams(max_tokens=3))
    return {
        "errors": errors,
        "tokens": out[0].outputs[0].token_ids,
        "last": last,
        "local": sorted(bank.modules),
    }


def diverge(engine) -> str:
    """Change the driver's steering state behind its peers' backs (an applied-action count
    no rank replays), then step: the replica must refuse to go on."""
    from services.engine.distributed import ReplicaDivergedError

    engine.add_request("r", "the quick brown fox", SamplingParams(max_tokens=4))
    engine.step()
    engine.interventions.counters.applied["untracked"] += 1
    try:
        engine.step()
    except ReplicaDivergedError as e:
        return str(e)
    return "no error"


def sweep(engine) -> dict:
    """A causal-tracing sweep at three sites of every layer, through layered patch passes
    (on a TP replica every rank runs each pass's forward): the grid and the passes run."""
    from services.engine.study import PatchStudy

    study = PatchStudy(engine)
    study.capture_clean("the quick brown fox", sites=["pre_attn", "post_attn", "post_block"])
    res = study.sweep(
        "the slow brown fox",
        answer=5,
        foil=7,
        sites=["pre_attn", "post_attn", "post_block"],
    )
    return {"grid": res.grid, "corrupt": res.corrupt, "passes": engine.num_patch_passes}


# Intervened decode steps replay CUDA graphs at every site (a replica captures them per rank).
GRAPH_SITES = ("pre_attn", "post_attn", "post_block")


def graph_requests() -> list[tuple[str, SamplingParams]]:
    """Requests whose decode steps the intervened graphs serve: steering at three sites, a
    per-token capture into the capture buffer, read-outs, an adapter; a patch at a prompt
    position (its prefill runs eagerly, its decode in the graph). Lengths differ, so decode
    steps replay each kind of graph: the capture graph while the capturing request runs, the
    steered one after it, the plain one at the end; the adapted twins while the adapter's
    request runs."""
    greedy = dict(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    steering = {
        "vectors": [
            {"layers": [0], "site": "post_block", "vector": _vec(1)},
            {"layers": [3], "site": "pre_attn", "vector": _vec(2), "phase": "decode"},
            {"layers": [2], "site": "post_attn", "vector": "registered", "scale": 2.0},
        ]
    }
    capture = {"sites": {"post_block": "all"}, "positions": "all_generated"}
    patch = [{"layer": 2, "site": "post_block", "position": 3, "source": {"vector": _vec(3)}}]
    readouts = [
        {"name": "early", "layer": 1, "site": "post_block", "probe": _vec(4, 1.0)},
        {"name": "late", "layer": 3, "site": "post_attn", "probe": _vec(5, 1.0)},
    ]
    return [
        ("the quick brown fox", SamplingParams(**{**greedy, "max_tokens": 20})),
        ("the quick brown fox", SamplingParams(**greedy, steering=steering)),
        ("a small model runs on", SamplingParams(**{**greedy, "max_tokens": 5}, capture=capture)),
        ("a small model runs on", SamplingParams(**greedy, patch=patch)),
        ("once upon a time there", SamplingParams(**greedy, readouts=readouts)),
        ("once upon a time", SamplingParams(**{**greedy, "max_tokens": 8}, adapter="policy")),
    ]


def graph_decode(engine) -> dict:
    """Every `graph_requests()` request in one continuous batch; returns each one's tokens,
    logprobs, read-outs and captures, and how many steps replayed which graph."""
    engine.vectors.register("registered", _vec(6, 1.0))
    engine.load_adapter("policy", random_state(engine.adapters, seed=11, lora=2))
    prompts, params = zip(*graph_requests(), strict=True)
    outs = LLM(engine=engine).generate(list(prompts), list(params))
    stats = engine.stats()
    return {
        "outputs": [
            {
                "token_ids": o.outputs[0].token_ids,
                "logprobs": o.outputs[0].logprobs,
                "readouts": o.outputs[0].readouts,
                "captures": o.captures,
            }
            for o in outs
        ],
        "graph_steps": {
            k: stats[k]
            for k in (
                "num_graph_steps",
                "num_steered_graph_steps",
                "num_capture_graph_steps",
                "num_adapted_graph_steps",
            )
        },
    }


def overlapped(engine) -> dict:
    """Plain requests (greedy and seeded sampling, no logprobs): every step overlaps the
    next, whose placeholders the first stage fills from tokens the last stage sent it."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True),
    ]
    for i, p in enumerate(params * 2):
        engine.add_request(f"r{i}", ["the quick brown fox", "once upon a time"][i % 2], p)
    overlapping, tokens = [], {}
    while engine.has_unfinished_requests():
        overlapping.append(engine._can_overlap())
        for delta in engine.step():
            for sample in delta.samples:
                tokens.setdefault(delta.request_id, []).extend(sample.token_ids)
    return {"tokens": tokens, "overlapped": all(overlapping), "steps": engine.num_steps}


def microbatched(engine) -> dict:
    """Five plain requests (greedy and seeded sampling, top-3 logprobs) in one batch: their
    tokens and logprobs, the requests of each overlapped step once every prefill is done
    (with `pipeline_microbatches`, disjoint parts of the batch in turn), and the most steps
    ever in flight between calls."""
    prompts = ["the quick brown fox", "once upon a time", "1 2 3 4", "a b c", "we went"]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10, logprobs=3, ignore_eos=True
        )
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[dict]] = {}
    steps: list[list[str]] = []
    depth = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for sample in delta.samples:
                tokens.setdefault(delta.request_id, []).extend(sample.token_ids)
                logprobs.setdefault(delta.request_id, []).extend(sample.logprobs or [])
        in_flight = engine._in_flight
        depth = max(depth, len(in_flight))
        if in_flight and all(len(t) for t in tokens.values()) and len(tokens) == 5:
            steps.append(sorted(s.seq.group.request_id for s in in_flight[-1][0].scheduled))
    return {"tokens": tokens, "logprobs": logprobs, "steps": steps, "depth": depth}


def plain_decode(engine) -> dict:
    """Requests that intervene nowhere, in one batch (every step on the plain path, whose
    TP all-reduces `EngineConfig.fused_all_reduce_norm` fuses): their tokens and logprobs,
    the graph steps, and whether the fused kernel is on."""
    prompts = ["the quick brown fox", "a small model runs on", "once upon a time", "1 2 3 4"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    outs = LLM(engine=engine).generate(prompts, params)
    return {
        "outputs": [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
        "graph_steps": engine.stats()["num_graph_steps"],
        "fused": engine.runner.ctx.fused_norm is not None,
    }


def linger(seconds: float, ready) -> None:
    """A rank that will not exit after the driver's result (a stuck teardown); it prints
    its stacks on SIGUSR1, as `local_replica`'s ranks do, from when it sets `ready`."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ready.set()
    time.sleep(seconds)


def stalled(engine) -> str:
    """A driver that stops stepping for 20 s (its peers wait for its next broadcast): past
    the caller's timeout (12 s), whose stack dump comes 5 s before it."""
    time.sleep(20)
    return "late"


def frozen_heap(engine) -> int:
    """How many objects this rank's process froze at start (`heap.freeze_startup_heap`)."""
    return gc.get_freeze_count()
