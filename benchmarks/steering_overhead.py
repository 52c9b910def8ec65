"""Per-request steering overhead: Coxswain steered against unsteered, and `transformers` hooks.

One fixed workload (random prompt ids of one length, one output length, greedy,
`ignore_eos`) runs in this one process through Coxswain unsteered, Coxswain with K distinct
per-request steering configs (request i gets config i % K; each config adds its own random
vector at post_block of a couple of layers, phase both), Coxswain with an all-layer
last-prompt-token capture on every request, and `transformers` `generate` unsteered and with
forward hooks that add each batch row's own vector (the way researchers steer today).

    python3 benchmarks/steering_overhead.py           # tiny model, CPU (about 45 s on 2 cores)
    python3 benchmarks/steering_overhead.py --layers 16 --hidden 2048 --heads 16 \\
        --kv-heads 8 --intermediate 5632 --vocab 32000 --num-seqs 128 --prompt-len 256 \\
        --output-len 128 --max-num-batched-tokens 8192   # ~0.9B bf16 model, one GPU

Prints numbers only; it is never a pass/fail test. It does warn when steering changed no
output, because a no-op steering path would look free here.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Run as a script, Python puts benchmarks/ on sys.path (which finds throughput.py) but not the
# repo root (which holds `services`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from generated_model import add_model_arguments, checkpoint_dir, resolve_device
from throughput import DTYPES, hf_generate, load_hf, sync

import services.engine.kernels.capture as capture_kernels
from services.engine import LLM, SamplingParams
from services.engine.heap import freeze_startup_heap
from services.engine.host_memory import transparent_huge_pages
from services.engine.interventions.actions import SteeringMonitorUpdate
from services.engine.model.config import load_model_config
from services.engine.step_batch import PendingStep

# Every layer at every site: the prompt's last token (in the prefill step), or each generated
# token (every decode step).
ALL_SITES = {site: "all" for site in ("pre_attn", "post_attn", "post_block")}
CAPTURE = {"sites": ALL_SITES, "positions": "last_prompt"}
CAPTURE_DECODE = {"sites": ALL_SITES, "positions": "all_generated"}
# What probe-training jobs ask for: the block output of every layer at every generated token.
CAPTURE_POST_BLOCK = {"sites": {"post_block": "all"}, "positions": "all_generated"}


@dataclass
class RunResult:
    """One configuration's timed pass over the workload."""

    config: str
    generated_tokens: int
    seconds: float
    outputs: list[list[int]] = field(repr=False)
    captures: list[dict[str, torch.Tensor] | None] | None = field(default=None, repr=False)
    all_seconds: list[float] = field(default_factory=list)  # every timed pass, this one's too
    # Coxswain's phases (`run_coxswain`): seconds in `add_request`, and from the start until
    # every request had its first token (admission and prefill)
    admit_s: float | None = None
    first_tokens_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


Run = Callable[[list[list[int]], str], RunResult]  # (prompts, config name) -> result


def profile_runs(
    configs: dict[str, list[SamplingParams]],
    llm: LLM,
    work: list[list[int]],
    device: torch.device,
    out: Path,
) -> None:
    """One more run of each config under cProfile: its 30 costliest functions by own time
    (where the host's time goes: admission, planning, page-locking, a wait on the device),
    then its 40 costliest by cumulative time (which caller it goes through), in
    `out/<config>.txt`."""
    out.mkdir(parents=True, exist_ok=True)
    for name, params in configs.items():
        profiler = cProfile.Profile()
        profiler.enable()
        run_coxswain(llm, name, work, params, device)
        profiler.disable()
        (out / f"{file_name(name)}.txt").write_text(profile_text(profiler))
    print(f"profiles of one run per config: {out}")


def file_name(config: str) -> str:
    """A config's name as a file name (`coxswain K=1` -> `coxswain-K1`)."""
    return config.replace(" ", "-").replace("=", "")


def profile_text(profiler: cProfile.Profile) -> str:
    """The 30 costliest functions by own time, then the 40 costliest by cumulative time."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()


def timed(
    runs: dict[str, Run], work: list[list[int]], warm: list[list[int]], repeats: int
) -> dict[str, RunResult]:
    """Each config's fastest of `repeats` passes over `work`. Untimed first: the first config
    over `work` (the allocator and the kernels meet the real shapes), every other one over
    `warm` (its own first-use costs). Passes go round-robin over the configs, so a slow spell
    of the machine does not land on one config alone."""
    for i, (name, run) in enumerate(runs.items()):
        run(work if i == 0 else warm, name)
    passes: dict[str, list[RunResult]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            passes[name].append(run(work, name))
    best = {name: max(rs, key=lambda r: r.tokens_per_s) for name, rs in passes.items()}
    for name, r in best.items():
        r.all_seconds = [p.seconds for p in passes[name]]
    return best


def steering_vectors(k: int, hidden: int, seed: int) -> torch.Tensor:  # [k, H] float32
    """`k` random unit vectors; row j is the same for every k > j, so the K=8 configs of
    Coxswain and of the HF hooks are the same eight vectors."""
    rows = [
        torch.randn(hidden, generator=torch.Generator().manual_seed(seed * 100_003 + j))
        for j in range(k)
    ]
    v = torch.stack(rows)
    return v / v.norm(dim=-1, keepdim=True)


def greedy(n: int, **interventions: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **interventions)


def steered_params(
    vectors: torch.Tensor, layers: list[int], scale: float, n: int
) -> list[SamplingParams]:
    """One SamplingParams per config: add `scale · vectors[j]` after each of `layers`."""
    return [
        greedy(
            n,
            steering={
                "vectors": [
                    {
                        "site": "post_block",
                        "layers": layers,
                        "vector": v.tolist(),
                        "scale": scale,
                        "phase": "both",
                    }
                ]
            },
        )
        for v in vectors
    ]


# -- Coxswain ----------------------------------------------------------------------------


def run_coxswain(
    llm: LLM,
    name: str,
    prompts: list[list[int]],
    configs: list[SamplingParams],
    device: torch.device,
) -> RunResult:
    """All requests submitted at once, request i with `configs[i % len(configs)]`; also
    times the run's phases (the engine's `add_request` and `step` wrapped for the call)."""
    params = [configs[i % len(configs)] for i in range(len(prompts))]
    engine = llm.engine
    admit = [0.0]
    first: list[float] = []

    def add_request(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return type(engine).add_request(engine, *a, **kw)
        finally:
            admit[0] += time.perf_counter() - t

    def step() -> Any:
        out = type(engine).step(engine)
        if not first and all(g.seqs[0].num_generated for g in engine.requests.values()):
            first.append(time.perf_counter())
        return out

    engine.add_request, engine.step = add_request, step
    try:
        sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        del engine.add_request, engine.step
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    captures = [o.captures for o in outs]
    r = RunResult(name, sum(map(len, outputs)), seconds, outputs, captures)
    r.admit_s = admit[0]
    r.first_tokens_s = first[0] - start if first else seconds
    return r


def read_back_configs(
    vectors: torch.Tensor, layers: list[int], num_layers: int, scale: float, n: int, adapters: int
) -> dict[str, tuple[list[SamplingParams], list[Any], list[Any]]]:
    """The decode configs beyond steering, as (per-request params, engine actions before,
    actions after):
    - "monitor+gate": each request steered (8 configs, at `layers`) with its rows gated by
      a monitor at each of those sites, plus a `rest_of_request` gate of its own;
    - "readouts x4": each request reads 4 probes, spread over the layers, on every token;
    - "capture x3 sites": each request captures every generated token at all 3 sites of
      every layer;
    - "capture post_block" / "... bf16": every generated token's post_block residual of
      every layer, returned in float32 (the default) / bfloat16;
    - "adapters xN": request i runs under δ-adapter i % N (`load_adapters`; none for 0)."""
    H = vectors.shape[1]
    probes = steering_vectors(5, H, 777)  # unit vectors
    gated = []
    for i, v in enumerate(vectors[:8]):
        vector = {"site": "post_block", "layers": layers, "vector": v.tolist(), "scale": scale}
        gate = {
            "when": {"probe": probes[4].tolist(), "layer": layers[len(layers) // 2],
                     "threshold": 0.0, "sharpness": 4.0},
            "scope": "rest_of_request",
            "apply": {"add": {"vector": (scale * vectors[(i + 1) % len(vectors)]).tolist()}},
        }  # fmt: skip
        gated.append(greedy(n, steering={"vectors": [vector], "gates": [gate]}))
    monitors = [
        SteeringMonitorUpdate("post_block", layer, probes[3].tolist(), 0.0, 1.0, gate_rows=True)
        for layer in layers
    ]
    cleared = [SteeringMonitorUpdate("post_block", layer, None) for layer in layers]
    at = sorted({num_layers // 4, num_layers // 2, 3 * num_layers // 4, num_layers - 1})
    reads = [
        {"probe": probes[j].tolist(), "layer": layer, "name": f"probe{j}"}
        for j, layer in enumerate(at)
    ]
    configs = {
        "monitor+gate": (gated, monitors, cleared),
        f"readouts x{len(reads)}": ([greedy(n, readouts=reads)], [], []),
        "capture x3 sites": ([greedy(n, capture=CAPTURE_DECODE)], [], []),
        "capture post_block": ([greedy(n, capture=CAPTURE_POST_BLOCK)], [], []),
        "capture post_block bf16": (
            [greedy(n, capture={**CAPTURE_POST_BLOCK, "dtype": "bfloat16"})],
            [],
            [],
        ),
    }
    if adapters:
        by_adapter = [greedy(n, adapter=f"adapter{j}") for j in range(adapters)]
        configs[f"adapters x{adapters}"] = (by_adapter, [], [])
    return configs


def load_adapters(llm: LLM, count: int, scale: float, seed: int) -> None:
    """`count` δ-adapters (random δ of norm `scale` per target module, no quarantine)."""
    bank = llm.engine.adapters
    g = torch.Generator().manual_seed(seed)
    for j in range(count):
        state = {}
        for name in bank.modules:
            delta = torch.randn(bank.rank, generator=g)
            state[name] = {"kept": scale * delta / delta.norm()}
        llm.engine.load_adapter(f"adapter{j}", state)


# Tokens a `decode_rates` request may generate beyond its timed steps, the warm steps and
# the steps that prefill the others (a request prefilled early decodes while the rest
# prefill), so that none ends inside them.
DECODE_SLACK = 16


# Engine stats taken per config over its timed decode steps: how the steps ran (graphs by
# kind, eager) and capture's way to the host.
STEP_STATS = (
    "capture_drain_blocks", "capture_drain_copy_wait_s", "capture_drain_move_s",
    "capture_drain_lag_s", "num_capture_host_waits", "capture_host_wait_s",
    "num_capture_host_misses", "num_graph_steps", "num_steered_graph_steps",
    "num_capture_graph_steps", "num_eager_steps",
)  # fmt: skip


def decode_rates(
    llm: LLM, prompts: list[list[int]], configs: dict[str, list[SamplingParams]], steps: int,
    repeats: int, device: torch.device,
    actions: dict[str, tuple[list[Any], list[Any]]] | None = None, profile: Path | None = None,
) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float],
           dict[str, dict[str, float]]]:  # fmt: skip
    """Steady-state decode tok/s of each config: every request prefilled and a few steps
    warm, then `steps` timed engine steps of the whole batch (no request ends in them),
    `repeats` times, round-robin over the configs. Two rates: the batch over the median
    step time of all those steps (a host hiccup moves a median little), and the best
    pass's (which a hiccup in every pass drags down). Also, on CUDA, the GPU
    milliseconds of one replay of the graph the config's steps ran (plain or steered),
    timed back to back by CUDA events on that config's last step batch: the device's cost
    alone, free of the host's jitter. And the host's own milliseconds per step: the step's
    wall time less the time it waited for the device (`PendingStep.result`), median over
    all steps. With overlapped steps a step takes the larger of the two. `actions`:
    engine actions submitted before a config runs and after it (monitors). `profile`: one
    more, untimed pass per config with its steps under cProfile (`profile_text`), in
    `profile/decode-<config>.txt`. Last, per config, the step and capture counters of its timed
    steps (`STEP_STATS`, summed over its passes)."""
    waited = [0.0]
    result = PendingStep.result

    def timed_result(self: PendingStep) -> Any:
        t0 = time.perf_counter()
        try:
            return result(self)
        finally:
            waited[0] += time.perf_counter() - t0

    engine = llm.engine
    # Steps until the last prompt has its first token: each step's budget less the decode
    # tokens of the requests already prefilled, at most one step more for the remainders.
    budget = max(engine.config.max_num_batched_tokens - len(prompts), 1)
    max_tokens = -(-sum(map(len, prompts)) // budget) + 1 + 4 + steps + DECODE_SLACK
    best = dict.fromkeys(configs, 0.0)
    step_s: dict[str, list[float]] = {name: [] for name in configs}
    host_s: dict[str, list[float]] = {name: [] for name in configs}
    gpu_ms: dict[str, float] = {}
    per_config = {name: dict.fromkeys(STEP_STATS, 0.0) for name in configs}
    PendingStep.result = timed_result
    actions = actions or {}
    for rep in range(repeats + (profile is not None)):
        profiled = rep == repeats  # the extra pass: under cProfile, not timed
        for name, params in configs.items():
            before, after = actions.get(name, ([], []))
            for action in before:
                engine.submit_action(action)
            for i, p in enumerate(prompts):
                cfg = params[i % len(params)]
                engine.add_request(f"decode-{i}", p, replace(cfg, max_tokens=max_tokens))
            while any(g.seqs[0].num_generated == 0 for g in engine.requests.values()):
                engine.step()
            for _ in range(4):
                engine.step()
            sync(device)
            counts = graph_counts(engine.runner)
            if profiled:
                assert profile is not None
                profile.mkdir(parents=True, exist_ok=True)
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(steps):
                    engine.step()
                profiler.disable()
                sync(device)
                (profile / f"decode-{file_name(name)}.txt").write_text(profile_text(profiler))
            else:
                before_stats = engine.stats()
                start = last = time.perf_counter()
                for _ in range(steps):
                    waited[0] = 0.0
                    engine.step()
                    now = time.perf_counter()
                    step_s[name].append(now - last)
                    host_s[name].append(now - last - waited[0])
                    last = now
                sync(device)
                rate = len(prompts) * steps / (time.perf_counter() - start)
                best[name] = max(best[name], rate)
                after_stats = engine.stats()
                for key in STEP_STATS:
                    per_config[name][key] += after_stats[key] - before_stats[key]
                ms = replay_ms(engine.runner, len(prompts), graph_kind(engine.runner, counts))
                if ms is not None:
                    gpu_ms[name] = min(gpu_ms.get(name, ms), ms)
            ended = sum(g.is_finished for g in engine.requests.values())
            if ended or len(engine.requests) < len(prompts):  # the rate assumes the whole batch
                raise RuntimeError(f"{name}: requests ended inside the timed decode steps")
            for rid in list(engine.requests):
                engine.abort(rid)
            while engine.step():  # the step still in flight
                pass
            for action in after:
                engine.submit_action(action)
    PendingStep.result = result
    median = {name: len(prompts) / statistics.median(ts) for name, ts in step_s.items()}
    host_ms = {name: 1e3 * statistics.median(ts) for name, ts in host_s.items()}
    return median, best, gpu_ms, host_ms, per_config


def graph_counts(runner: Any) -> dict[str, int]:
    """How many steps so far replayed each kind of decode graph."""
    return {
        "steered": runner.num_steered_graph_steps,
        "capture": runner.num_capture_graph_steps,
        "adapted": runner.num_adapted_graph_steps,
    }


def graph_kind(runner: Any, before: dict[str, int]) -> tuple[str, bool]:
    """The kind of graph the steps since `before` (`graph_counts`) replayed, and whether
    it was an adapted one."""
    now = graph_counts(runner)
    kind = next((k for k in ("capture", "steered") if now[k] > before[k]), "plain")
    return kind, now["adapted"] > before["adapted"]


def replay_ms(runner: Any, batch: int, key: tuple[str, bool], n: int = 50) -> float | None:
    """GPU ms per replay of the decode graph of `key` (`graph_kind`) for `batch` rows (None
    without graphs)."""
    graphs = runner.graph_sets.get(key)
    if not graphs or batch > runner.graph_sizes[-1]:
        return None
    graph = graphs[min(b for b in runner.graph_sizes if b >= batch)].graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


# -- Hugging Face ------------------------------------------------------------------------


class RowSteeringHooks:
    """Forward hooks on decoder layers that add batch row b's own vector to every position
    of row b (prompt and generated: phase both). `tests/oracle.py`'s post_block hook, but
    with one vector per batch row; set `rows` ([B, H], already scaled) before each batch."""

    def __init__(self, model: Any, layers: list[int]):
        self.rows = torch.empty(0)
        self.handles = [model.model.layers[L].register_forward_hook(self._add) for L in layers]

    def _add(self, module: Any, args: Any, out: Any) -> Any:
        h = out[0] if isinstance(out, tuple) else out  # [B, T, H]
        h = h + self.rows[:, None, :]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def run_hf(
    model: Any,
    name: str,
    prompts: list[list[int]],
    output_len: int,
    batch_size: int,
    device: torch.device,
    steering: tuple[list[int], torch.Tensor] | None = None,
) -> RunResult:
    """Static batches of `batch_size` through `generate` (`throughput.hf_generate`: left
    padding, a KV cache, one prefill per batch), in request order. `steering` is (layers,
    [K, H] scaled vectors): request i gets vector i % K by the hooks."""
    hooks = RowSteeringHooks(model, steering[0]) if steering else None
    outputs: list[list[int]] = []
    try:
        sync(device)
        start = time.perf_counter()
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            if hooks is not None:
                vectors = steering[1]
                hooks.rows = vectors[torch.arange(b, b + len(batch), device=device) % len(vectors)]
            outputs.extend(hf_generate(model, batch, output_len, device).tolist())
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        if hooks is not None:
            hooks.remove()
    return RunResult(name, sum(map(len, outputs)), seconds, outputs)


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument("--num-seqs", type=int, default=64)
    w.add_argument("--prompt-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--ks", default="1,8,32,128", help="distinct steering configs per run")
    w.add_argument("--hf-k", type=int, default=8, help="distinct configs of the HF hooks run")
    w.add_argument("--steer-layers", help="comma-separated (default: layers L/3 and 2L/3)")
    w.add_argument("--scale", type=float, default=4.0, help="scale of the unit vectors")
    w.add_argument(
        "--adapters",
        type=int,
        default=8,
        help="distinct δ-adapters of the decode row (0: no row)",
    )
    w.add_argument(
        "--adapter-scale", type=float, default=1.0, help="norm of each adapter's δ per module"
    )
    e = p.add_argument_group("engines")
    e.add_argument("--hf-batch-size", type=int, help="default: num-seqs")
    e.add_argument("--skip-hf", action="store_true", help="run Coxswain only")
    e.add_argument("--max-num-seqs", type=int, help="Coxswain's (default: num-seqs)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    e.add_argument(
        "--scatter-programs",
        type=int,
        help="programs of the capture scatter kernel (kernels/capture.py SCATTER_PROGRAMS)",
    )
    e.add_argument(
        "--capture-arena-bytes",
        type=int,
        help="EngineConfig.capture_arena_bytes (default: the engine's; 0: drain and assembler)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per config; best counts")
    p.add_argument(
        "--profile",
        type=Path,
        help="also profile one more run per config, and one more pass of steady-state decode"
        " per config (cProfile; a text file per config here)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=0,
        help="also time this many steady-state decode steps of the whole batch per config "
        "(each as a fraction of plain decode in the same run)",
    )
    args = p.parse_args(argv)
    resolve_device(args)
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.hf_batch_size = args.hf_batch_size or args.num_seqs
    args.max_num_seqs = args.max_num_seqs or args.num_seqs
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="coxswain-bench-") as tmp:
        bench(args, checkpoint_dir(args, Path(tmp), max(1024, args.prompt_len + args.output_len)))


def bench(args: argparse.Namespace, model_dir: Path) -> None:
    """Time every configuration and print the table and the sanity checks."""
    device, dtype = args.device, DTYPES[args.dtype]
    if args.scatter_programs:
        capture_kernels.SCATTER_PROGRAMS = args.scatter_programs
    cfg = load_model_config(model_dir)
    if args.prompt_len + args.output_len > cfg.max_position_embeddings:
        raise SystemExit(
            f"prompt-len + output-len exceeds max_position_embeddings {cfg.max_position_embeddings}"
        )
    L, H = cfg.num_layers, cfg.hidden_size
    layers = (
        [int(x) for x in args.steer_layers.split(",")]
        if args.steer_layers
        else sorted({L // 3, 2 * L // 3})
    )
    rng = random.Random(args.seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(cfg.vocab_size) for _ in range(length)] for _ in range(n)]

    work = prompts(args.num_seqs, args.prompt_len)
    warm = prompts(min(8, args.num_seqs), 32)
    n_out = args.output_len
    vectors = steering_vectors(max([*args.ks, args.hf_k]), H, args.seed)  # [K, H]

    where = f"{device}" + (
        f" ({torch.cuda.get_device_name(device)})"
        if device.type == "cuda"
        else f", {torch.get_num_threads()} CPU threads"
    )
    print(
        f"model {model_dir} ({cfg.architecture}, {L} layers, hidden {H}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, intermediate {cfg.intermediate_size}, "
        f"vocab {cfg.vocab_size}) on {where}, {args.dtype}"
    )
    print(
        f"workload: {args.num_seqs} requests x {args.prompt_len} prompt tokens -> {n_out} "
        f"generated, greedy, ignore_eos, seed {args.seed}; steering: unit vectors x "
        f"{args.scale} at post_block of layers {layers}, phase both; capture: {CAPTURE}"
    )

    # HF first, freed before Coxswain sizes its KV cache from the free CUDA memory.
    hf: dict[str, RunResult] = {}
    hf_name = f"hf hooks K={args.hf_k}"
    if not args.skip_hf:
        model = load_hf(model_dir, device, dtype)
        rows = (args.scale * vectors[: args.hf_k]).to(device, dtype)  # [K, H]
        hf = timed(
            {
                "hf unsteered": lambda ps, name: run_hf(
                    model, name, ps, n_out, args.hf_batch_size, device
                ),
                hf_name: lambda ps, name: run_hf(
                    model, name, ps, n_out, args.hf_batch_size, device, (layers, rows)
                ),
            },
            work,
            warm,
            args.repeats,
        )
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    llm = LLM(
        model_dir,
        device=str(device),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        # Every config runs the same prompts: with the prefix cache on, every run after the
        # first would skip most of its prefill (and steered prefills would not).
        enable_prefix_caching=False,
        steering_request_rows=max(256, *args.ks),  # the default pool, or more if K needs it
        adapter_capacity=args.adapters if args.decode_steps else 0,
        capture_arena_bytes=args.capture_arena_bytes,
        seed=args.seed,
    )
    # As a serving process does (`coxswain serve`, a cluster's replicas): the collector
    # leaves what exists now alone, and a full collection no longer stalls a pass.
    print(f"startup heap frozen: {freeze_startup_heap()} objects")
    k_names = {
        k: f"coxswain K={k}" + (f" ({args.num_seqs} used)" if args.num_seqs < k else "")
        for k in args.ks
    }
    configs = {"coxswain unsteered": [greedy(n_out)]}
    for k, name in k_names.items():
        configs[name] = steered_params(vectors[:k], layers, args.scale, n_out)
    configs["coxswain capture"] = [greedy(n_out, capture=CAPTURE)]
    cox = timed(
        {
            name: lambda ps, name, c=c: run_coxswain(llm, name, ps, c, device)
            for name, c in configs.items()
        },
        work,
        warm,
        args.repeats,
    )
    if args.profile:
        profile_runs(configs, llm, work, device, args.profile)
    waits = llm.engine.steering_snapshot()["pools"]["admissions_waiting_for_rows"]
    plain, cap = cox["coxswain unsteered"], cox["coxswain capture"]
    by_k = {k: cox[name] for k, name in k_names.items()}

    base = plain.tokens_per_s
    print()
    print(
        f"{'config':<26} {'gen tokens':>10} {'seconds':>8} {'tok/s':>9} {'overhead':>9}"
        f" {'median':>8}  all runs (s)"
    )
    plain_median = statistics.median(plain.all_seconds)
    for r in [*cox.values(), *hf.values()]:
        over = "-" if r is plain else f"{base / r.tokens_per_s - 1:+.1%}"
        median = statistics.median(r.all_seconds)
        ours = r.config in cox  # HF's rows: against HF's own unsteered run, below
        over_median = f"{median / plain_median - 1:+.1%}" if ours and r is not plain else "-"
        line = (
            f"{r.config:<26} {r.generated_tokens:>10} {r.seconds:>8.2f} "
            f"{r.tokens_per_s:>9.1f} {over:>9} {over_median:>8}  "
            + " ".join(f"{s:.2f}" for s in r.all_seconds)
        )
        if r.config == hf_name:  # HF's own hook overhead too
            own = hf["hf unsteered"].tokens_per_s / r.tokens_per_s - 1
            line += f"  ({own:+.1%} vs hf unsteered)"
        print(line)
    print(
        "overhead: extra wall time per generated token against coxswain unsteered (its "
        f"tok/s / this tok/s - 1); each row is the fastest of {args.repeats} timed runs; "
        "median: the same from each config's median run (the passes go round-robin, so a "
        "slow spell of a shared host moves every config's median alike)"
    )
    if waits:
        print(f"coxswain: {waits} admissions waited for a free steering row")
    print(
        f"\n{'where the run went':<26} {'add_request':>11} {'to all 1st tokens':>17} "
        f"{'after':>8} {'vs unsteered':>24}"
    )
    for r in cox.values():
        after, base_after = r.seconds - r.first_tokens_s, plain.seconds - plain.first_tokens_s
        vs = (
            "-"
            if r is plain
            else f"{r.first_tokens_s - plain.first_tokens_s:+.3f} s, {after - base_after:+.3f} s"
        )
        print(
            f"{r.config:<26} {1e3 * r.admit_s:>8.1f} ms {r.first_tokens_s:>15.3f} s "
            f"{after:>6.3f} s {vs:>24}"
        )
    print(
        "add_request: the engine's admission of every request (inside the first column); "
        "to all 1st tokens: from submitting until every request has its first token "
        "(admission and prefill); after: the decode that follows"
    )

    # Cheap checks that steering and capture really did their work: a no-op would look free.
    print()
    n = args.num_seqs

    def changed(a: RunResult, b: RunResult) -> int:
        return sum(x != y for x, y in zip(a.outputs, b.outputs, strict=True))

    checks = [(r, plain) for r in by_k.values()]
    if hf:
        checks.append((hf[hf_name], hf["hf unsteered"]))
    for steered, ref in checks:
        count = changed(steered, ref)
        print(f"{steered.config}: steering changed the greedy output of {count}/{n} requests")
        if count == 0:
            print(f"WARNING: {steered.config} changed no output: was the steering applied?")
    if hf and args.hf_k in by_k:
        # Near-tied logits flip under a different kernel order (often in bf16), so compare
        # the steered agreement with the unsteered one.
        for a, b in ((plain, hf["hf unsteered"]), (by_k[args.hf_k], hf[hf_name])):
            same = n - changed(a, b)
            print(f"{a.config} and {b.config}: outputs identical in {same}/{n} requests")
    want = {f"{layer}.{site}" for layer in range(L) for site in ALL_SITES}
    complete = sum(
        c is not None and set(c) == want and all(t.shape == (1, H) for t in c.values())
        for c in cap.captures
    )
    print(
        f"coxswain capture: all {L} layers' last-prompt residual at 3 sites in {complete}/{n} "
        "requests"
    )
    if complete < n:
        print("WARNING: some captures are missing or misshapen")

    if args.decode_steps:
        if args.adapters:
            load_adapters(llm, args.adapters, args.adapter_scale, args.seed)
        decode_configs = dict(configs)  # "coxswain capture" decodes after a prompt capture
        extra = read_back_configs(vectors, layers, L, args.scale, n_out, args.adapters)
        decode_configs |= {name: params for name, (params, _, _) in extra.items()}
        actions = {name: (before, after) for name, (_, before, after) in extra.items()}
        rates, best, gpu_ms, host_ms, per_config = decode_rates(
            llm, work, decode_configs, args.decode_steps, args.repeats, device, actions,
            profile=args.profile,
        )  # fmt: skip
        plain_rate, plain_best = rates["coxswain unsteered"], best["coxswain unsteered"]
        print(
            f"\nsteady-state decode of all {args.num_seqs} requests, {args.decode_steps} steps "
            f"after prefill, {args.repeats} passes per config (tok/s: batch / median step time;"
            " best pass: its tok/s):"
        )
        gpu_head = "  GPU ms/replay  of plain" if gpu_ms else ""
        print(f"{'config':<26}{'tok/s':>10}  of plain  best pass  of plain  host ms/step{gpu_head}")
        for name, rate in rates.items():
            line = (
                f"{name:<26}{rate:>10.1f}  {rate / plain_rate:6.1%}  {best[name]:9.1f}  "
                f"{best[name] / plain_best:6.1%}  {host_ms[name]:12.3f}"
            )
            if name in gpu_ms:  # a time: plain's over this one is the fraction of plain's rate
                ms, plain_ms = gpu_ms[name], gpu_ms["coxswain unsteered"]
                line += f"  {ms:13.3f}  {plain_ms / ms:8.1%}"
            print(line)
        stats = llm.engine.stats()
        print(
            f"graph steps: {stats['num_graph_steps']} (steered {stats['num_steered_graph_steps']},"
            f" adapted {stats['num_adapted_graph_steps']}),"
            f" eager steps: {stats['num_eager_steps']}, capture blocks outside the pinned"
            f" reserve: {stats['num_capture_host_misses']}, steps that waited for its rows:"
            f" {stats['num_capture_host_waits']} ({stats['capture_host_wait_s']:.2f} s)"
        )
        # How each config's timed steps ran: an eager step costs the host a whole forward
        # pass of launches, so a config that fell off its graphs reads as host-bound.
        for name, d in per_config.items():
            print(
                f"{name}: timed steps on graphs {d['num_graph_steps']:.0f} (steered"
                f" {d['num_steered_graph_steps']:.0f}, capturing"
                f" {d['num_capture_graph_steps']:.0f}), eager {d['num_eager_steps']:.0f}"
            )
        for name, d in per_config.items():  # where each capturing config's rows went
            if blocks := d["capture_drain_blocks"]:
                per = {
                    k: 1e3 * d[f"capture_drain_{k}_s"] / blocks
                    for k in ("copy_wait", "move", "lag")
                }
                print(
                    f"{name}: {blocks:.0f} blocks drained in its timed steps; a block took"
                    f" {per['move']:.2f} ms to move to pageable memory, waited"
                    f" {per['copy_wait']:.2f} ms for its copy, {per['lag']:.2f} ms from"
                    f" submission to its rows' return; the steps waited for rows"
                    f" {d['num_capture_host_waits']:.0f} times, {d['capture_host_wait_s']:.2f} s;"
                    f" blocks outside the pinned reserve: {d['num_capture_host_misses']:.0f}"
                )
        if any(d["capture_drain_blocks"] for d in per_config.values()):
            print(f"transparent huge pages: {transparent_huge_pages()}")
        if args.adapters:  # they must change outputs, or a no-op adapter path looks free
            name = f"adapters x{args.adapters}"
            count = changed(run_coxswain(llm, name, work, extra[name][0], device), plain)
            print(f"{name}: changed the greedy output of {count}/{n} requests")
            if count == 0:
                print("WARNING: the adapters changed no output: were they applied?")

    print()
    if hf and args.hf_k in by_k:
        ratio = by_k[args.hf_k].tokens_per_s / hf[hf_name].tokens_per_s
        print(f"throughput ratio coxswain K={args.hf_k} / {hf_name} = {ratio:.2f}x")
    else:
        print(f"throughput coxswain unsteered = {base:.1f} tokens/s (hf skipped)")


if __name__ == "__main__":
    main()
