"""Serving steps that are not plain decode: prompts arriving beside long-context decodes, a
burst of long prompts, and prefill speed against dense SDPA prefill.

In one process, on one checkpoint (random weights in a real model's shape, or `--model`),
one engine (prefix caching off, so no prompt is served from the cache):

- **mixed**: for each N in `--decodes`, N requests decode at context `--context` while one
  prompt of `--prompt` tokens arrives and prefills in chunks of about `--chunk` tokens. The
  steps that carry its chunks (mixed steps) are timed against what their parts cost alone
  in the same run: that prompt's prefill with nothing else running, plus as many plain
  decode steps of the N requests. Ratio 1.0 means a mixed step costs its parts.
- **burst**: `--burst` prompts of `--prompt` tokens submitted at once, the time until every
  one has its first token, against `--burst` × one prompt's prefill alone.
- **prefill**: one prompt of each of `--prefill-lengths` tokens through the engine (its
  chunking), against a plain PyTorch forward of the same weights over the whole prompt with
  `F.scaled_dot_product_attention(is_causal=True)` (flash attention on CUDA); tok/s and model
  FLOP utilisation (matmul FLOPs, causal attention counted half) against `--peak-tflops`.

Every step is timed to the device's completion (a synchronize after each), so the numbers
are device time plus the host's share of each step.

    PYTHONPATH=. python3 benchmarks/mixed.py --shape qwen3-0.6b
    PYTHONPATH=. python3 benchmarks/mixed.py --shape llama3-8b --decodes 4,32
    PYTHONPATH=. python3 benchmarks/mixed.py --shape tiny --device cpu --context 256 \\
        --prompt 256 --chunk 64 --decodes 2 --burst 2 --prefill-lengths 128

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from decode import SHAPES, StaticDecoder
from throughput import sync

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.model.config import load_model_config
from services.engine.model.tiny import make_tiny_checkpoint

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM


class Bench:
    """The engine, fresh random prompts (none repeats, so none hits a cache) and step timing."""

    def __init__(self, engine: LLMEngine, vocab: int):
        self.engine = engine
        self.rng = random.Random(0)
        self.vocab = vocab
        self.n = 0

    def add(self, length: int, max_tokens: int) -> str:
        self.n += 1
        rid = f"r{self.n}"
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(length)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def step(self) -> float:
        """One engine step, timed to the device's completion."""
        sync(self.engine.device)
        t = time.perf_counter()
        self.engine.step()
        sync(self.engine.device)
        return time.perf_counter() - t

    def prefilled(self, rids: list[str]) -> bool:
        groups = [self.engine.requests.get(r) for r in rids]
        return all(g is None or g.seqs[0].num_generated > 0 for g in groups)

    def until_prefilled(self, rids: list[str]) -> list[float]:
        """Step until every one of `rids` has its first token; each step's seconds."""
        times = []
        while not self.prefilled(rids):
            times.append(self.step())
        return times

    def drain(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        sync(self.engine.device)


def bench_mixed(b: Bench, decodes: int, context: int, prompt: int, steps: int) -> dict:
    alone = b.until_prefilled([b.add(prompt, 1)])
    b.drain()
    running = [b.add(context, 10**6) for _ in range(decodes)]
    b.until_prefilled(running)
    for _ in range(4):  # graphs and the overlap pipeline settle
        b.step()
    decode = sorted(b.step() for _ in range(steps))[steps // 2]  # the median step
    mixed = b.until_prefilled([b.add(prompt, 1)])
    b.drain()
    parts = sum(alone) + len(mixed) * decode
    return {
        "decodes": decodes, "context": context, "prompt": prompt,
        "prefill_alone_ms": [1e3 * t for t in alone], "decode_step_ms": 1e3 * decode,
        "mixed_ms": [1e3 * t for t in mixed], "ratio": sum(mixed) / parts,
    }  # fmt: skip


def bench_burst(b: Bench, burst: int, prompt: int) -> dict:
    one = sum(b.until_prefilled([b.add(prompt, 1)]))
    b.drain()
    times = b.until_prefilled([b.add(prompt, 1) for _ in range(burst)])
    b.drain()
    return {
        "burst": burst, "prompt": prompt, "one_s": one, "burst_s": sum(times),
        "step_ms": [1e3 * t for t in times], "ratio": sum(times) / (burst * one),
    }  # fmt: skip


class DensePrefill(StaticDecoder):
    """The checkpoint's forward over one whole prompt, plainly: no cache, no paging, SDPA
    with `is_causal` (flash attention on CUDA), the greedy next token at the end."""

    def __init__(self, model_dir: Path, max_len: int, device, dtype):
        super().__init__(model_dir, 1, max_len, device, dtype, kv_cache=False)

    def _rope_at(self, x, n):  # [1, H, n, D]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos[:n] + rot * self.sin[:n]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        n = ids.shape[0]
        h = F.embedding(ids, self.embed)  # [n, H]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = self._norm(h, p + "input_layernorm.weight")
            heads = []
            for name, count in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", None)):
                y = F.linear(x, w[p + f"self_attn.{name}_proj.weight"],
                             w.get(p + f"self_attn.{name}_proj.bias"))  # fmt: skip
                y = y.view(n, count or cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)[None]
                if name != "v" and cfg.qk_norm:
                    y = self._norm(y, p + f"self_attn.{name}_norm.weight")
                heads.append(self._rope_at(y, n) if name != "v" else y)
            q, k, v = heads
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + F.linear(o[0].transpose(0, 1).reshape(n, -1), w[p + "self_attn.o_proj.weight"])
            x = self._norm(h, p + "post_attention_layernorm.weight")
            gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
            up = F.linear(x, w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        last = self._norm(h[-1:], "model.norm.weight")
        return F.linear(last, self.lm_head).argmax(-1)


def prefill_flops(cfg, n: int) -> float:
    """Matmul FLOPs of prefilling n tokens: 2 per weight per token in the layers (the
    embedding is a lookup; the head runs for the last token only), plus causal attention's
    two [n, n] products per head, counted half."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    proj = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o; k, v
    mlp = 3 * h * cfg.intermediate_size
    attention = 2 * cfg.num_heads * d * n * n  # QK^T and PV, 2 FLOPs a MAC, half of [n, n]
    return layers * (2 * n * (proj + mlp) + attention) + 2 * h * cfg.vocab_size


def _mfu(flops: float, seconds: float, peak_tflops: float | None) -> str:
    return f"{flops / seconds / (peak_tflops * 1e12):.0%}" if peak_tflops else "—"


def bench_dense(
    model: Path, lengths: list[int], device, dtype, repeats: int = 3
) -> dict[int, float]:
    """Best-of-`repeats` seconds of `DensePrefill` over a prompt of each length. Run before
    the engine starts: the engine takes most of the device's memory for its KV cache."""
    if not lengths:
        return {}
    dense = DensePrefill(model, max(lengths), device, dtype)
    seconds = {}
    for n in lengths:
        ids = torch.randint(10, dense.cfg.vocab_size, (n,), device=dense.embed.device)
        dense.forward(ids)  # warm-up
        times = []
        for _ in range(repeats):
            sync(ids.device)
            t = time.perf_counter()
            dense.forward(ids)
            sync(ids.device)
            times.append(time.perf_counter() - t)
        seconds[n] = min(times)
    del dense
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def bench_prefill(b: Bench, length: int, repeats: int = 3) -> float:
    """Best-of-`repeats` seconds of the engine prefilling one prompt of `length`."""
    engine_s = []
    for _ in range(repeats):
        engine_s.append(sum(b.until_prefilled([b.add(length, 1)])))
        b.drain()
    return min(engine_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model", type=Path, help="a local HF checkpoint dir instead of --shape")
    p.add_argument("--decodes", default="4,32", help="N: requests decoding beside the prompt")
    p.add_argument("--context", type=int, default=16384, help="C: their context")
    p.add_argument("--prompt", type=int, default=16384, help="P: the arriving prompt's length")
    p.add_argument("--chunk", type=int, default=4096, help="prefill tokens a step")
    p.add_argument("--burst", type=int, default=8, help="prompts of P submitted at once")
    p.add_argument("--prefill-lengths", default="2048,8192,32768")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed alone")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (MFU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    decodes = [int(n) for n in args.decodes.split(",") if n]
    lengths = [int(n) for n in args.prefill_lengths.split(",") if n]
    max_len = max(args.context + 64, args.prompt + 8, *lengths) + 8
    tmp = tempfile.TemporaryDirectory()
    if args.model is None:
        t = time.perf_counter()
        args.model = make_tiny_checkpoint(
            Path(tmp.name) / args.shape, **SHAPES[args.shape],
            max_position_embeddings=max(2048, max_len),
            dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        )  # fmt: skip
        print(f"generated a random {args.shape} checkpoint in {time.perf_counter() - t:.0f} s")
    cfg = load_model_config(args.model)
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    dense_s = bench_dense(args.model, lengths, device, dtype)
    config = EngineConfig(
        device=device.type,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        max_num_seqs=max(max(decodes, default=1), args.burst) + 2,
        max_num_batched_tokens=args.chunk + max(decodes, default=0),
        max_model_len=max_len,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    t = time.perf_counter()
    engine = LLMEngine(args.model, config)
    print(f"engine ready in {time.perf_counter() - t:.1f} s; {args.chunk} + N tokens a step")
    b = Bench(engine, cfg.vocab_size)
    b.until_prefilled([b.add(2 * args.chunk, 4)])  # warm-up: the prefill path, then decode
    b.drain()
    results: dict = {"mixed": [], "burst": None, "prefill": []}

    print(f"\nmixed steps: N decodes at context {args.context} + a {args.prompt}-token prompt")
    print(f"{'N':>4} {'decode step':>12} {'prefill alone':>14} {'mixed steps':>12} {'ratio':>6}")
    for n in decodes:
        r = bench_mixed(b, n, args.context, args.prompt, args.steps)
        results["mixed"].append(r)
        each = ", ".join(f"{ms:.1f}" for ms in r["mixed_ms"])
        print(f"{n:>4} {r['decode_step_ms']:>9.2f} ms {sum(r['prefill_alone_ms']):>11.1f} ms "
              f"{sum(r['mixed_ms']):>9.1f} ms {r['ratio']:>5.2f}×   (each: {each} ms)")  # fmt: skip

    if args.burst:
        r = bench_burst(b, args.burst, args.prompt)
        results["burst"] = r
        print(f"\nburst: {args.burst} × {args.prompt}-token prompts at once: {r['burst_s']:.2f} s "
              f"against {args.burst} × {r['one_s']:.3f} s alone = {r['ratio']:.2f}×; steps "
              f"{r['step_ms'][0]:.0f} → {r['step_ms'][-1]:.0f} ms")  # fmt: skip

    if lengths:
        print("\nprefill of one prompt: the engine (its chunking) against dense SDPA prefill")
        print(f"{'tokens':>7} {'engine tok/s':>13} {'MFU':>6} {'dense tok/s':>12} {'MFU':>6} "
              f"{'÷ dense':>8}")  # fmt: skip
        for n in lengths:
            r = {"length": n, "engine_s": bench_prefill(b, n), "dense_s": dense_s[n]}
            results["prefill"].append(r)
            flops = prefill_flops(cfg, n)
            print(f"{n:>7} {n / r['engine_s']:>13,.0f} {_mfu(flops, r['engine_s'], peak):>6}"
                  f" {n / r['dense_s']:>12,.0f} {_mfu(flops, r['dense_s'], peak):>6} "
                  f"{r['dense_s'] / r['engine_s']:>7.2f}×")  # fmt: skip
        if peak:
            print(f"(MFU against {peak:.0f} dense bf16 TFLOPS)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
