"""Steady-state decode speed: Coxswain against the ceiling a hand-written loop reaches.

In one process, on one checkpoint (generated with random weights in a real model's shape,
or `--model DIR`), at each batch size with every request `--context` tokens deep:

- roofline: the measured copy bandwidth, and the tok/s at which one decode step would only
  read the weights and the batch's KV cache once;
- ceiling: a plain PyTorch decoder of the same weights with a static, contiguous KV cache,
  one whole decode step (embedding → greedy token fed back) captured in one CUDA graph
  (gpt-fast's recipe) and replayed;
- hf: transformers `generate` (greedy, static batches), decode rate = the extra time of
  `--steps` more new tokens;
- coxswain: `LLMEngine.step()` after every request has prefilled;
- coxswain-OPTS: the same engine with options, `+`-joined (`coxswain-fa+skinny`), and its
  rate over coxswain's:
  - skinny: `EngineConfig.skinny_gemm` (CUDA: the decoder Linears of steps of at most 16
    tokens on `kernels/skinny_gemm.py`);
  - lt: PyTorch's GEMMs on cuBLASLt (`torch.backends.cuda.preferred_blas_library
    ("cublaslt")` while it is built, its graphs captured and run): whether cuBLASLt's
    choice for a one-row GEMM (no split-K reduce kernel?) beats cuBLAS's at small batch;
  - fa: `EngineConfig.fused_decode_attention` (a decode layer's norms, RoPE, cache write,
    attention and merge in one kernel);
  - gemv: `EngineConfig.gemv=True` (CUDA: every one-row Linear on `kernels/gemv.py`; the
    default runs it only at the weight shapes it measures faster than cuBLAS at load);
  - cublas: `EngineConfig.gemv=False` (every Linear on cuBLAS: the default's baseline);
  - gact: `EngineConfig.gemv_activation=True` (the gate-up GEMV and the MLP's activation in
    one launch; the default runs it where it can);
  - fold: `EngineConfig.gemv_fold_norms=True` (a batch-1 layer's norms and residual adds
    inside its GEMV launches; the default runs it where it can);
  - unfused: both of those False (the GEMV kernel's launches do only the Linear);
- with `--tp N` / `--pp M`: also Coxswain on a replica of N × M local processes (one GPU
  each, NCCL; gloo on CPU), driven from its first rank, in the same run as the one-process
  engine, and its rate over the one-process one.

    PYTHONPATH=. python3 benchmarks/decode.py --shape qwen3-0.6b
    PYTHONPATH=. python3 benchmarks/decode.py --shape llama3-8b --systems ceiling,coxswain
    PYTHONPATH=. python3 benchmarks/decode.py --shape llama3-8b --systems coxswain --tp 2
    PYTHONPATH=. python3 benchmarks/decode.py --shape llama3-70b --systems none --tp 4
    PYTHONPATH=. python3 benchmarks/decode.py --shape tiny --device cpu --batch-sizes 1,4

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from throughput import copy_bandwidth, load_hf, sync

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.local_replica import launch_local
from services.engine.model.config import load_model_config
from services.engine.model.layers import RotaryEmbedding
from services.engine.model.tiny import make_tiny_checkpoint

SHAPES = {  # make_tiny_checkpoint arguments of real models' shapes
    "qwen3-0.6b": dict(
        arch="qwen3", layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128,
        intermediate=3072, vocab=151936,
    ),
    "llama3-8b": dict(
        arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
        intermediate=14336, vocab=128256,
    ),
    "llama3-70b": dict(
        arch="llama", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
        intermediate=28672, vocab=128256,
    ),
    "tiny": dict(arch="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512),
}  # fmt: skip
# Shapes written straight into shards of two layers by parallel processes (140 GB in bf16:
# one process drawing it all in memory would need twice that in float32).
STREAMED = {"llama3-70b"}


# -- the ceiling: a static-KV decoder in one CUDA graph ------------------------------------


class StaticDecoder:
    """The checkpoint's decoder written plainly over a contiguous `[L, B, Hkv, S, D]` cache.

    `step()` runs one decode step for the whole batch from `self.tokens` at `self.pos` and
    writes the greedy next tokens back into `self.tokens`, so replays chain like decoding.
    """

    def __init__(
        self, model_dir: Path, batch: int, max_len: int, device, dtype, kv_cache: bool = True
    ):
        """`kv_cache=False`: no cache (a subclass that attends its input's own K/V)."""
        cfg = load_model_config(model_dir)
        self.cfg = cfg
        files = sorted(Path(model_dir).glob("*.safetensors"))
        w = {}
        for f in files:
            w.update({k: v.to(device, dtype) for k, v in load_file(f).items()})
        self.w = w
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        rope = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope).to(device)
        self.cos, self.sin = rope.cos.to(dtype), rope.sin.to(dtype)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype) if kv_cache else None
        self.v = torch.zeros(shape, device=device, dtype=dtype) if kv_cache else None
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.arange = torch.arange(max_len, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _norm(self, x, name):
        return F.rms_norm(x, (x.shape[-1],), self.w[name], self.cfg.rms_norm_eps)

    def _rope(self, x):  # [B, H, 1, D]
        at = self.pos.view(1)  # a 1-element index: indexing by a 0-dim tensor would sync
        c, s = self.cos.index_select(0, at), self.sin.index_select(0, at)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * c + rot * s

    def step(self) -> None:
        cfg, w = self.cfg, self.w
        b = self.tokens.shape[0]
        h = F.embedding(self.tokens, self.embed)  # [B, H]
        mask = (self.arange <= self.pos)[None, None, None, :]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = self._norm(h, p + "input_layernorm.weight")
            q = F.linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = F.linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = F.linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q = q.view(b, cfg.num_heads, 1, cfg.head_dim)
            k = k.view(b, cfg.num_kv_heads, 1, cfg.head_dim)
            v = v.view(b, cfg.num_kv_heads, 1, cfg.head_dim)
            if cfg.qk_norm:
                q = self._norm(q, p + "self_attn.q_norm.weight")
                k = self._norm(k, p + "self_attn.k_norm.weight")
            q, k = self._rope(q), self._rope(k)
            self.k[i].index_copy_(2, self.pos.view(1), k)
            self.v[i].index_copy_(2, self.pos.view(1), v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], mask, enable_gqa=True)
            h = h + F.linear(o.reshape(b, -1), w[p + "self_attn.o_proj.weight"])
            x = self._norm(h, p + "post_attention_layernorm.weight")
            gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
            up = F.linear(x, w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        logits = F.linear(self._norm(h, "model.norm.weight"), self.lm_head)
        self.tokens.copy_(logits.argmax(-1))
        self.pos.add_(1)

    def capture(self) -> None:
        """Warm up on a side stream, then capture one step (cuda only)."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()


@torch.inference_mode()
def bench_ceiling(model_dir, batch, context, steps, device, dtype) -> float:
    dec = StaticDecoder(model_dir, batch, context + steps + 8, device, dtype)
    dec.k.normal_(std=0.5)  # positions [0, context) hold "prefilled" keys and values
    dec.v.normal_(std=0.5)
    dec.pos.fill_(context)
    if device.type == "cuda":
        dec.capture()
    dec.pos.fill_(context)
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        dec.run()
    sync(device)
    seconds = time.perf_counter() - t
    del dec
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return batch * steps / seconds


# -- transformers and Coxswain -------------------------------------------------------------


@torch.inference_mode()
def bench_hf(model, prompts, steps, device) -> float:
    ids = torch.tensor(prompts, device=device)

    def timed(new: int) -> float:
        sync(device)
        t = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=[],
        )
        sync(device)
        return time.perf_counter() - t

    timed(2)  # warm-up
    return len(prompts) * steps / max(1e-9, timed(steps + 1) - timed(1))


def intervened(hidden: int, layers: int, index: int) -> dict:
    """What `--interventions` adds to request `index`: its own random unit vector (scale
    4) after every layer, prompt and generation alike, and the block output of every layer
    captured at each generated token (float32, the default)."""
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(index))
    vector = (4.0 * v / v.norm()).tolist()
    site = {"site": "post_block", "layers": list(range(layers)), "vector": vector}
    return {
        "steering": {"vectors": [{**site, "phase": "both"}]},
        "capture": {"sites": {"post_block": "all"}, "positions": "all_generated"},
    }


# The one-process engine's options (`coxswain-OPTS`, `+`-joined): `EngineConfig.skinny_gemm`,
# cuBLASLt, `EngineConfig.fused_decode_attention`, `EngineConfig.gemv` True or False,
# `EngineConfig.gemv_activation` and `EngineConfig.gemv_fold_norms` True, or both False.
ENGINE_OPTIONS = ("skinny", "lt", "fa", "gemv", "cublas", "gact", "fold", "unfused")


def on_off(option: str, options: set[str]) -> bool | None:
    """An `EngineConfig` field that defaults to None (on where it can run): True for a row
    that names `option`, False for an `unfused` row, else the default."""
    return True if option in options else False if "unfused" in options else None


def engine_options(system: str) -> set[str] | None:
    """The options of a one-process engine row (`coxswain`: none), or None for any other
    system; an option we do not know is an error, not a plain engine under a new name."""
    if system == "coxswain":
        return set()
    if not system.startswith("coxswain-"):
        return None
    options = set(system.removeprefix("coxswain-").split("+"))
    if unknown := options - set(ENGINE_OPTIONS):
        raise SystemExit(f"{system}: unknown options {sorted(unknown)} (known: {ENGINE_OPTIONS})")
    return options


@contextlib.contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """PyTorch's preferred BLAS library (`torch.backends.cuda.preferred_blas_library`) set to
    `name` inside the block, and back after; None leaves it alone (and off CUDA, always)."""
    if name is None or not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def bench_coxswain(
    engine: LLMEngine,
    prompts,
    steps,
    profile: Path | None = None,
    interventions: bool = False,
) -> float:
    """Decode tok/s of `prompts` after every prefill; with `profile`, also a torch.profiler
    table of 8 more steps (device kernels by total time, and the host's calls) written
    there, e.g. a TP driver's all-reduce kernels waiting for the other rank, and beside it
    their Chrome trace (`*.trace.json`: gaps between graph replays are host time). With
    `interventions`, every request steers and captures (`intervened`)."""
    cfg = engine.model_config
    rids = [f"b{len(prompts)}-{i}{'-iv' if interventions else ''}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        extra = intervened(cfg.hidden_size, cfg.num_layers, i) if interventions else {}
        params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True, **extra)
        engine.add_request(rid, p, params)
    groups = [engine.requests[r] for r in rids]
    while any(g.seqs[0].num_generated == 0 for g in groups):  # every prefill done
        engine.step()
    for _ in range(4):  # graph buckets and the overlap pipeline settle
        engine.step()
    sync(engine.device)
    t = time.perf_counter()
    # Tokens accepted, not calls times batch: with pipeline microbatches a call advances a
    # part of the batch (an overlapped call accepts the step the call before launched).
    before = engine.num_generated_tokens
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    seconds = time.perf_counter() - t
    tokens = engine.num_generated_tokens - before
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU]
        if engine.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profiler(activities=activities) as prof:
            for _ in range(8):
                engine.step()
            sync(engine.device)
        sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
        profile.parent.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        profile.write_text(f"8 decode steps at batch {len(prompts)}\n{table}")
        prof.export_chrome_trace(str(profile.with_suffix(".trace.json")))
    for rid in rids:
        engine.abort(rid)
    engine.step()  # drain the step still in flight
    return tokens / seconds


def bench_replica(
    prompts: dict[int, list[list[int]]],
    steps: int,
    profile: Path | None,
    interventions: bool,
    engine: LLMEngine,
) -> dict:
    """`bench_coxswain` at each batch size, on the driver rank of a parallel replica: plain,
    and with `interventions` intervened too (keys `(batch, True)`)."""
    out: dict = {}
    for b, p in prompts.items():
        out[b] = bench_coxswain(engine, p, steps, profile and profile / f"driver-batch{b}.txt")
        if interventions:
            out[b, True] = bench_coxswain(
                engine, p, steps, profile and profile / f"driver-batch{b}-iv.txt", True
            )
    return out


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model", type=Path, help="a local HF checkpoint dir instead of --shape")
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--systems", default="ceiling,hf,coxswain")
    p.add_argument("--hf-batch-max", type=int, default=32, help="skip HF above this batch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--enforce-eager", action="store_true", help="Coxswain without CUDA graphs")
    p.add_argument("--tp", type=int, default=1, help="also run a replica of this TP size")
    p.add_argument("--pp", type=int, default=1, help="... and this PP size")
    p.add_argument(
        "--parallel",
        help="instead of --tp/--pp: several replicas in turn, as TPxPP (e.g. 2x1,1x2); a "
        "trailing f (2x1f) turns EngineConfig.fused_all_reduce_norm on for that one and a "
        "trailing u (2x1u) off (neither: its default, on at TP=2), a trailing m (1x2m) "
        "EngineConfig.pipeline_microbatches=2, a trailing s (2x1s) EngineConfig.skinny_gemm, "
        "a trailing g (2x1g) EngineConfig.gemv=True and a trailing c (2x1c) False (neither: "
        "its default, where it measures faster)",
    )
    p.add_argument(
        "--interventions",
        action="store_true",
        help="also time Coxswain (and each replica) with every request steering every layer "
        "and capturing every layer's block output at each generated token (rows +iv)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--profile",
        type=Path,
        help="also write a torch.profiler table of 8 steps per batch size and system here "
        "(a replica's: its driver rank's)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batch_sizes.split(",")]
    systems = [s for s in args.systems.split(",") if s not in ("", "none")]
    for s in systems:  # before a checkpoint is written: a typo costs nothing
        if s not in ("ceiling", "hf") and engine_options(s) is None:
            raise SystemExit(f"unknown system {s!r}: ceiling, hf, coxswain or coxswain-OPTS")
    max_len = args.context + args.steps + 64
    tmp = tempfile.TemporaryDirectory()
    label = str(args.model or args.shape)
    if args.model is None:
        t = time.perf_counter()
        streamed = {}
        if args.shape in STREAMED:
            streamed = dict(layers_per_shard=2, workers=min(16, os.cpu_count() or 1))
        args.model = make_tiny_checkpoint(
            Path(tmp.name) / args.shape,
            **SHAPES[args.shape],
            max_position_embeddings=max(2048, max_len),
            dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
            **streamed,
        )
        print(f"generated a random {args.shape} checkpoint in {time.perf_counter() - t:.0f} s")
    cfg = load_model_config(args.model)
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(10, cfg.vocab_size) for _ in range(args.context)]
                   for _ in range(b)] for b in batches}  # fmt: skip
    results: dict[str, dict[int, float]] = {s: {} for s in systems}

    weights = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    bw = copy_bandwidth(device, 2**28) if device.type == "cuda" else float("nan")
    roof = {b: b / ((weights + b * args.context * kv_per_token) / bw) for b in batches}
    print(f"{label}: {weights / 1e9:.2f} GB of "
          f"weights, {kv_per_token * args.context / 1e6:.1f} MB of KV per request at context "
          f"{args.context}; copy bandwidth {bw / 1e12:.2f} TB/s on {device}")  # fmt: skip

    if "ceiling" in systems:
        for b in batches:
            results["ceiling"][b] = bench_ceiling(
                args.model, b, args.context, args.steps, device, dtype
            )
    if "hf" in systems:
        model = load_hf(args.model, device, dtype)
        for b in batches:
            if b <= args.hf_batch_max:
                results["hf"][b] = bench_hf(model, prompts[b], args.steps, device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    engine_config = EngineConfig(
        device=device.type,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        max_num_seqs=max(batches),
        max_num_batched_tokens=8192,
        max_model_len=max_len,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=0.6,
    )
    for system in list(systems):
        options = engine_options(system)
        if options is None:
            continue
        if "fa" in options and device.type != "cuda":
            print(f"{system}: fused_decode_attention needs the Triton kernels (CUDA): skipped")
            continue
        t = time.perf_counter()
        config = dataclasses.replace(
            engine_config,
            skinny_gemm="skinny" in options,
            fused_decode_attention="fa" in options,
            gemv=True if "gemv" in options else False if "cublas" in options else None,
            gemv_activation=on_off("gact", options),
            gemv_fold_norms=on_off("fold", options),
        )
        with blas_library("cublaslt" if "lt" in options else None):
            engine = LLMEngine(args.model, config)
            print(f"{system} engine ready in {time.perf_counter() - t:.1f} s (graphs captured)")
            for b in batches:
                profile = args.profile and args.profile / system / f"batch{b}.txt"
                results[system][b] = bench_coxswain(engine, prompts[b], args.steps, profile)
                if args.interventions:
                    results.setdefault(system + "+iv", {})[b] = bench_coxswain(
                        engine, prompts[b], args.steps, interventions=True
                    )
            stats = engine.stats()  # a fast path that fell back to eager steps shows here
            print(
                f"{system}: {stats['num_graph_steps']} graph steps, "
                f"{stats['num_eager_steps']} eager (prefills included), of {stats['num_steps']}; "
                f"{stats['num_gemv_linears']} Linears on gemv"
            )
            del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    shapes = [(args.tp, args.pp, "")]
    if args.parallel:  # 2x1; 2x1f/2x1u: fused_all_reduce_norm on/off; 1x2m: microbatches;
        shapes = []  # 2x1s: skinny_gemm; 2x1g/2x1c: gemv on/off
        for spec in args.parallel.split(","):
            dims = spec.rstrip("fumsgc")
            shapes.append((*(int(n) for n in dims.split("x")), spec[len(dims) :]))
    replicas = []
    for tp, pp, flags in shapes:
        if tp * pp == 1:
            continue
        name = f"tp{tp}pp{pp}{flags}"  # ranks are processes of their own
        systems.append(name)
        replicas.append(name)
        t = time.perf_counter()
        results[name] = launch_local(
            str(args.model),
            tp,
            pp,
            functools.partial(
                bench_replica,
                {b: prompts[b] for b in batches},
                args.steps,
                args.profile and args.profile / name,
                args.interventions,
            ),
            engine_config=dataclasses.replace(
                engine_config,
                fused_all_reduce_norm=True if "f" in flags else False if "u" in flags else None,
                pipeline_microbatches=2 if "m" in flags else 1,
                skinny_gemm="s" in flags,
                gemv=True if "g" in flags else False if "c" in flags else None,
            ),
            device_type=device.type,
        )
        if args.interventions:  # the intervened runs as a row of their own
            results[name + "+iv"] = {b: results[name].pop((b, True)) for b in batches}
        print(f"{name} replica measured in {time.perf_counter() - t:.1f} s")
        # each GPU reads its 1/tp share of a stage's weights and KV (stages run in turn)
        share = {b: tp * roof[b] for b in batches}
        print(f"{name} roofline: " + ", ".join(f"batch {b} {share[b]:,.0f} tok/s" for b in batches))

    ceiling = results.get("ceiling", {})
    print(f"\ndecode at context {args.context}, {args.steps} steps; ratio = tok/s ÷ ceiling")
    width = max(10, *(len(n) + 1 for n in results))
    print(f"{'system':<{width}}" + "".join(f"{'batch ' + str(b):>26}" for b in batches))
    names = [n for s in systems for n in (s, s + "+iv") if n in results]
    rows = [("roofline", roof)] + [(n, results[n]) for n in names]
    for name, row in rows:
        cells = []
        for b in batches:
            if b not in row or row[b] != row[b]:
                cells.append(f"{'—':>26}")
                continue
            ms = 1e3 * b / row[b]
            ratio = f" ({row[b] / ceiling[b]:.2f}×)" if b in ceiling else ""
            cells.append(f"{row[b]:>9,.0f} tok/s {ms:6.2f} ms{ratio:>8}")
        print(f"{name:<{width}}" + "".join(cells))
    one = results.get("coxswain", {})
    for name in replicas:
        many = results[name]
        if one and many:
            ratios = ", ".join(f"batch {b} {many[b] / one[b]:.2f}×" for b in batches)
            print(f"{name} ÷ one process: {ratios}")
    for name in [s for s in systems if engine_options(s)]:
        other = results.get(name, {})
        if one and other:
            ratios = ", ".join(f"batch {b} {other[b] / one[b]:.2f}×" for b in batches)
            print(f"{name} ÷ coxswain: {ratios}")
    for name in [n for n in names if n.endswith("+iv")]:
        plain = results[name.removesuffix("+iv")]
        ratios = ", ".join(f"batch {b} {results[name][b] / plain[b]:.0%}" for b in batches)
        print(f"{name} ÷ {name.removesuffix('+iv')}: {ratios}")
    if args.json:
        args.json.write_text(json.dumps({"roofline": roof, **results}, indent=1))


if __name__ == "__main__":
    main()
