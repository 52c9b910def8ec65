"""Causal-tracing sweep: Coxswain's batched `Sweep` against hooked `transformers` forwards.

One layers x positions activation-patching grid at one site (post_block) runs in this one
process through:

1. **coxswain**: `Sweep(engine, SweepSpec(...), executor=...).run()`, the whole sweep timed
   (baselines, every cell and the control), once per executor in `--executors`:
   `patch_pass` (layered passes where each cell starts at its patched site) and `requests`
   (one patched request per cell, prefix caching on, so each cell reuses the corrupt
   prompt's KV blocks before its patched position).
2. **hf hooks**: the reference researchers write today: one forward on the clean prompt that
   records every layer's output with hooks, one unpatched forward on the corrupt prompt, then
   one forward per cell on the corrupt prompt with a forward hook on decoder layer L that
   replaces h[p] with the clean row.
3. **hf hooks batched** (optional): the same, B cells per forward, each batch row with its
   own (layer, position) replacement.

Cells are graded like `Sweep` grades them: logit_diff (answer minus foil, the clean run's
top-2 next tokens) or the answer's logprob, at the last prompt position.

    python3 benchmarks/patch_sweep.py     # tiny model, CPU: 4 x 32 = 128 cells (~10 s, 2 cores)
    python3 benchmarks/patch_sweep.py --layers 16 --hidden 2048 --heads 16 --kv-heads 8 \\
        --intermediate 5632 --vocab 32000 --prompt-len 64   # ~0.9B bf16, 1024 cells (~80 s, H200)

Prints numbers only; it is never a pass/fail test on time. It does print a WARNING when the
grids of the two systems disagree (in float32), or when patching changed nothing.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, Python puts benchmarks/ on sys.path (which finds throughput.py) but not the
# repo root (which holds `services`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from generated_model import add_model_arguments, checkpoint_dir, resolve_device
from throughput import DTYPES, load_hf, sync

from services.engine import LLMEngine
from services.engine.config import EngineConfig
from services.engine.model.config import load_model_config
from services.engine.sweep import Sweep, SweepSpec

SITE = "post_block"
HF_LOOP = "hf hooks (1 cell/forward)"
FP32_TOLERANCE = 1e-3  # grids further apart than this in float32 mean one system is wrong


@dataclass
class Case:
    """One sweep's inputs: equal-length prompts and the tokens that grade a cell."""

    clean: list[int]
    corrupt: list[int]
    answer: int
    foil: int | None


@dataclass
class SweepRun:
    """One system's timed sweep of one case."""

    grid: np.ndarray  # [layers, positions]
    clean: float
    corrupt: float
    seconds: float
    stats: dict[str, int] = field(default_factory=dict)  # coxswain's engine counters


@dataclass
class SystemResult:
    """Every timed sweep of one system, one per case."""

    name: str
    runs: list[SweepRun]

    @property
    def best(self) -> SweepRun:
        return min(self.runs, key=lambda r: r.seconds)


def make_cases(n: int, prompt_len: int, vocab: int, span: int, rng: random.Random) -> list[Case]:
    """`n` random clean prompts, each corrupted by redrawing `span` tokens from a quarter in
    (the "subject"); answer and foil are filled in later from the clean run."""

    def draw() -> int:
        return rng.randrange(8, vocab)  # clear of the tiny tokenizer's special ids

    cases = []
    start = prompt_len // 4
    for _ in range(n):
        clean = [draw() for _ in range(prompt_len)]
        corrupt = list(clean)
        for p in range(start, min(prompt_len - 1, start + span)):
            while corrupt[p] == clean[p]:
                corrupt[p] = draw()
        cases.append(Case(clean, corrupt, answer=-1, foil=None))
    return cases


def metric_of(logits: torch.Tensor, answer: int, foil: int | None) -> torch.Tensor:
    """[B] the graded value of [B, V] last-position logits: logit_diff or the logprob."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[:, answer] - lp[:, foil] if foil is not None else lp[:, answer]


# -- Coxswain ----------------------------------------------------------------------------


def run_coxswain(
    engine: LLMEngine, case: Case, metric: str, device: torch.device, executor: str
) -> SweepRun:
    """The whole sweep, from building the Sweep to its graded grid."""
    before = engine.stats()
    sync(device)
    start = time.perf_counter()
    spec = SweepSpec(
        clean_prompt=case.clean,
        corrupt_prompt=case.corrupt,
        answer_token=case.answer,
        foil_token=case.foil,
        layers="all",
        positions="all_prompt",
        sites=[SITE],
        metric=metric,  # type: ignore[arg-type]
    )
    res = Sweep(engine, spec, executor=executor).run()  # type: ignore[arg-type]
    sync(device)
    seconds = time.perf_counter() - start
    after = engine.stats()
    counters = (
        "num_steps",
        "num_prompt_tokens_computed",
        "prefix_cache_hits",
        "num_preemptions",
        "num_patch_passes",
        "num_patch_pass_tokens",
    )
    stats = {k: after[k] - before[k] for k in counters}
    stats["noise_floor"] = res.noise_floor  # type: ignore[assignment]
    stats["void"] = len(res.void)
    assert res.clean is not None
    return SweepRun(res.grid[0], res.clean, res.corrupt, seconds, stats)


# -- Hugging Face ------------------------------------------------------------------------


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _replace(out: Any, h: torch.Tensor) -> Any:
    return (h, *out[1:]) if isinstance(out, tuple) else h


@torch.inference_mode()
def hf_last_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:  # [B, V]
    """The last position's logits of a [B, T] batch (no KV cache, no other positions' logits)."""
    return model(ids, use_cache=False, logits_to_keep=1).logits[:, -1]


@torch.inference_mode()
def hf_clean_rows(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One clean forward: ([L, T, H] every decoder layer's output, [V] last logits)."""
    seen: list[torch.Tensor] = []
    handles = [
        layer.register_forward_hook(lambda m, a, out: seen.append(_first(out)[0].clone()))
        for layer in model.model.layers
    ]
    try:
        logits = hf_last_logits(model, ids)[0]
    finally:
        for h in handles:
            h.remove()
    return torch.stack(seen), logits


@torch.inference_mode()
def run_hf(
    model: Any,
    case: Case,
    layers: list[int],
    positions: list[int],
    device: torch.device,
    batch_size: int | None = None,
) -> SweepRun:
    """One HF sweep, timed whole: the clean capture, the corrupt baseline, then every cell
    (one forward each, or `batch_size` per forward)."""
    sync(device)
    start = time.perf_counter()
    rows, clean_logits = hf_clean_rows(model, torch.tensor([case.clean], device=device))
    corrupt_ids = torch.tensor([case.corrupt], device=device)  # [1, T]
    corrupt_logits = hf_last_logits(model, corrupt_ids)[0]
    if batch_size is None:
        values = hf_cells_one_per_forward(model, case, rows, corrupt_ids, layers, positions)
    else:
        values = hf_cells_batched(model, case, rows, corrupt_ids, layers, positions, batch_size)
    grid = values.view(len(layers), len(positions)).cpu().numpy()
    base = metric_of(torch.stack([clean_logits, corrupt_logits]), case.answer, case.foil).tolist()
    sync(device)
    return SweepRun(grid, base[0], base[1], time.perf_counter() - start)


def hf_cells_one_per_forward(
    model: Any,
    case: Case,
    rows: torch.Tensor,  # [L, T, H] the clean run's layer outputs
    corrupt_ids: torch.Tensor,
    layers: list[int],
    positions: list[int],
) -> torch.Tensor:  # [cells] layer-major
    """The reference as researchers write it: a hook on layer L replaces h[p], one forward."""
    values = []
    for L in layers:
        for p in positions:

            def patch(module: Any, args: Any, out: Any, row=rows[L, p], p=p) -> Any:
                h = _first(out).clone()  # [1, T, H]
                h[:, p] = row
                return _replace(out, h)

            handle = model.model.layers[L].register_forward_hook(patch)
            try:
                values.append(metric_of(hf_last_logits(model, corrupt_ids), case.answer, case.foil))
            finally:
                handle.remove()
    return torch.cat(values)


class RowPatches:
    """Forward hooks on the swept decoder layers; per batch, `plan[L] = (batch rows [n],
    positions [n], clean rows [n, H])` says which rows layer L's output gets replaced at."""

    def __init__(self, model: Any, layers: list[int]):
        self.plan: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.handles = [model.model.layers[L].register_forward_hook(self._hook(L)) for L in layers]

    def _hook(self, L: int) -> Callable[..., Any]:
        def patch(module: Any, args: Any, out: Any) -> Any:
            if L not in self.plan:
                return None
            b, p, rows = self.plan[L]
            h = _first(out).clone()  # [B, T, H]
            h[b, p] = rows
            return _replace(out, h)

        return patch

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def hf_cells_batched(
    model: Any,
    case: Case,
    rows: torch.Tensor,  # [L, T, H]
    corrupt_ids: torch.Tensor,
    layers: list[int],
    positions: list[int],
    batch_size: int,
) -> torch.Tensor:  # [cells] layer-major
    """`batch_size` copies of the corrupt prompt per forward, row i patched at its own cell."""
    device = corrupt_ids.device
    cells = [(L, p) for L in layers for p in positions]
    patches = RowPatches(model, layers)
    values = []
    try:
        for s in range(0, len(cells), batch_size):
            chunk = cells[s : s + batch_size]
            patches.plan = {}
            for L in {L for L, _ in chunk}:
                b = [i for i, (k, _) in enumerate(chunk) if k == L]
                p = torch.tensor([chunk[i][1] for i in b], device=device)
                patches.plan[L] = (torch.tensor(b, device=device), p, rows[L, p])
            logits = hf_last_logits(model, corrupt_ids.expand(len(chunk), -1))
            values.append(metric_of(logits, case.answer, case.foil))
    finally:
        patches.remove()
    return torch.cat(values)


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    w = p.add_argument_group("sweep")
    w.add_argument("--prompt-len", type=int, default=32, help="tokens: the grid's positions")
    w.add_argument("--corrupt-span", type=int, default=4, help="tokens redrawn in the corrupt")
    w.add_argument("--metric", choices=["logit_diff", "logprob"], default="logit_diff")
    e = p.add_argument_group("engines")
    e.add_argument("--hf-batch-size", type=int, default=64, help="0: skip the batched variant")
    e.add_argument(
        "--executors",
        default="patch_pass,requests",
        help="Coxswain's ways to run the cells, comma-separated; the first is compared",
    )
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3, help="timed sweeps per system; best counts")
    args = p.parse_args(argv)
    resolve_device(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="coxswain-bench-") as tmp:
        bench(args, checkpoint_dir(args, Path(tmp), max(512, 2 * args.prompt_len)))


def hf_sweeps(
    args: argparse.Namespace,
    model_dir: Path,
    cases: list[Case],
    layers: list[int],
    positions: list[int],
) -> dict[str, SystemResult]:
    """Every HF system's sweeps, after a warm-up sweep on `cases[0]`. Its clean forward first
    sets each case's answer and foil: the clean run's top-2 next tokens."""
    device = args.device
    model = load_hf(model_dir, device, DTYPES[args.dtype])
    for case in cases:
        top2 = hf_last_logits(model, torch.tensor([case.clean], device=device))[0].topk(2)
        case.answer, second = top2.indices.tolist()
        case.foil = second if args.metric == "logit_diff" else None
    runs: dict[str, Callable[[Case], SweepRun]] = {
        HF_LOOP: lambda c: run_hf(model, c, layers, positions, device)
    }
    if args.hf_batch_size > 0:
        runs[f"hf hooks batched ({args.hf_batch_size} cells/forward)"] = lambda c: run_hf(
            model, c, layers, positions, device, args.hf_batch_size
        )
    results = {}
    for name, run in runs.items():
        run(cases[0])
        results[name] = SystemResult(name, [run(c) for c in cases[1:]])
    return results


def bench(args: argparse.Namespace, model_dir: Path) -> None:
    """Time every system's sweeps and print the table and the agreement checks."""
    device, dtype = args.device, DTYPES[args.dtype]
    cfg = load_model_config(model_dir)
    L, H, N = cfg.num_layers, cfg.hidden_size, args.prompt_len
    layers, positions = list(range(L)), list(range(N))
    n_cells = L * N
    # Case 0 warms every system up on the real shapes (a different prompt pair, so the timed
    # coxswain sweeps find none of their blocks in the prefix cache); the rest are timed.
    cases = make_cases(
        1 + args.repeats, N, cfg.vocab_size, args.corrupt_span, random.Random(args.seed)
    )

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
    graded_by = (
        "answer minus foil: the clean run's top-2 next tokens"
        if args.metric == "logit_diff"
        else "the answer: the clean run's top next token"
    )
    print(
        f"grid: {SITE} x {L} layers x {N} positions = {n_cells} cells, metric {args.metric} "
        f"({graded_by}), corrupt prompt = clean with tokens "
        f"{N // 4}..{min(N - 1, N // 4 + args.corrupt_span) - 1} redrawn; "
        f"{args.repeats} timed sweeps per system (each its own random prompt pair), best counts"
    )

    # HF first, freed before Coxswain sizes its KV cache from the free CUDA memory.
    results = hf_sweeps(args, model_dir, cases, layers, positions)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    engine = LLMEngine(
        model_dir,
        EngineConfig(
            device=str(device),
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=True,  # cells share the corrupt prompt's prefix blocks
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=args.seed,
        ),
    )
    coxes = []
    for executor in args.executors.split(","):
        run_coxswain(engine, cases[0], args.metric, device, executor)
        runs = [run_coxswain(engine, c, args.metric, device, executor) for c in cases[1:]]
        coxes.append(SystemResult(f"coxswain Sweep ({executor})", runs))
    cox, *others = coxes
    results = {**{r.name: r for r in others}, **results}

    print()
    print(f"{'system':<36} {'cells':>6} {'seconds':>8} {'cells/s':>9}  all runs (s)")
    for r in [cox, *results.values()]:
        b = r.best
        print(
            f"{r.name:<36} {n_cells:>6} {b.seconds:>8.2f} {n_cells / b.seconds:>9.1f}  "
            + " ".join(f"{x.seconds:.2f}" for x in r.runs)
        )
    print("seconds: the whole sweep (clean capture, clean and corrupt baselines, every cell)")
    s = cox.best.stats
    print(
        f"{cox.name}: {s['num_patch_passes']} patch passes of {s['num_patch_pass_tokens']} "
        f"rows, {s['num_steps']} engine steps, {s['num_prompt_tokens_computed']} prompt tokens "
        f"computed ({s['prefix_cache_hits']} read from the prefix cache), "
        f"{s['num_preemptions']} preemptions, noise floor {s['noise_floor']:.2e}; "
        f"hf hooks compute {(n_cells + 2) * N} prompt tokens through all {L} layers"
    )

    # Correctness next to speed: a fast grid that is wrong is worth nothing. A void or missing
    # cell (NaN) counts as an infinite difference. The fp32 bound scales with the values: the
    # generated models' logit_diffs reach ~60, where 1e-3 absolute is float32 noise on CUDA.
    print()
    fp32 = dtype == torch.float32
    scale = max(
        1.0,
        *(max(float(np.nanmax(np.abs(a.grid))), abs(a.clean), abs(a.corrupt)) for a in cox.runs),
    )
    tolerance = FP32_TOLERANCE * scale
    for r in results.values():
        pairs = list(zip(cox.runs, r.runs, strict=True))
        diff = max(
            float(np.nan_to_num(np.abs(a.grid - b.grid), nan=np.inf).max()) for a, b in pairs
        )
        base = max(max(abs(a.clean - b.clean), abs(a.corrupt - b.corrupt)) for a, b in pairs)
        print(
            f"agreement {cox.name} vs {r.name}: max |grid diff| = {diff:.2e}, "
            f"max |baseline diff| = {base:.2e} (over {args.repeats} sweeps; largest |value| "
            f"{scale:.3g})"
        )
        if fp32 and max(diff, base) > tolerance:
            print(
                f"WARNING: {cox.name} and {r.name} disagree by more than {tolerance:.2e} in fp32 "
                f"({FP32_TOLERANCE} x max(1, largest |value|))"
            )
        if not fp32:
            print(f"  ({args.dtype}: reported, not judged)")
    voids = sum(a.stats["void"] for a in cox.runs)
    if voids:
        print(f"WARNING: {voids} coxswain cells came back void")
    for a in cox.runs[:1]:
        spread = float(np.nanmax(a.grid) - np.nanmin(a.grid))
        print(
            f"coxswain sweep 1: clean {a.clean:.3f}, corrupt {a.corrupt:.3f}, grid spans "
            f"[{np.nanmin(a.grid):.3f}, {np.nanmax(a.grid):.3f}]; patching layer {L - 1} at the "
            f"last position gives {a.grid[-1, -1]:.3f} (should equal clean)"
        )
        if spread < 1e-3 or abs(a.clean - a.corrupt) < 1e-3:
            print("WARNING: patching changed nothing: the agreement check above means little")

    # The per-cell loop is the reference researchers write, so its ratio comes last (grep it).
    print()
    loop = HF_LOOP
    for r in [*(r for name, r in results.items() if name != loop), results[loop]]:
        print(
            f"sweep throughput ratio {cox.name} / {r.name} = "
            f"{r.best.seconds / cox.best.seconds:.2f}x"
        )


if __name__ == "__main__":
    main()
