"""Mixed-workload throughput: Hugging Face `generate` against Coxswain `LLM.generate`.

Shaped like nano-vllm's bench.py: random prompt token ids, a random input and output
length per request, `ignore_eos`, greedy. Both systems run the same workload in this one
process on the same device: HF in static left-padded batches, Coxswain with all requests
submitted at once (continuous batching). On CUDA it also prints the batch-1 decode roofline
(weight bytes / measured copy bandwidth) and how close each system gets to it.

    PYTHONPATH=. python3 benchmarks/throughput.py                  # cpu preset on CPU
    PYTHONPATH=. python3 benchmarks/throughput.py --preset gpu     # ~1B model on CUDA

Prints numbers only; it is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.engine import LLM, SamplingParams
from services.engine.model.config import load_model_config
from services.engine.model.tiny import make_tiny_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Preset:
    """A generated checkpoint's shape plus workload and engine defaults sized for a machine."""

    checkpoint: dict[str, Any]  # make_tiny_checkpoint keyword arguments
    num_seqs: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    hf_batch_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float = 0.85  # the engine's default


PRESETS = {
    # ~4M parameters: the whole run takes about a minute on 2 CPU cores.
    "cpu": Preset(
        checkpoint=dict(
            layers=4,
            hidden=256,
            heads=8,
            kv_heads=4,
            vocab=2048,
            max_position_embeddings=1024,
            dtype="float32",
        ),
        num_seqs=32,
        input_range=(16, 128),
        output_range=(16, 128),
        hf_batch_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    ),
    # ~0.9B parameters (Llama shape, bf16): nano-vllm's bench.py scaled to one GPU.
    "gpu": Preset(
        checkpoint=dict(
            layers=16,
            hidden=2048,
            heads=16,
            kv_heads=8,
            intermediate=5632,
            vocab=32000,
            max_position_embeddings=4096,
            dtype="bfloat16",
        ),
        num_seqs=256,
        input_range=(100, 1024),
        output_range=(100, 1024),
        hf_batch_size=32,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        # The whole workload needs ~18 GiB of KV; leave the rest for activations and for
        # other processes sharing the GPU.
        gpu_memory_utilization=0.4,
    ),
}


@dataclass
class Workload:
    """The requests both systems run: prompt token ids and each request's output length."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class RunResult:
    """One system's timed pass over a workload."""

    system: str
    requests: int
    generated_tokens: int
    seconds: float
    outputs: list[list[int]] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def make_workload(
    rng: random.Random, n: int, vocab: int, inputs: tuple[int, int], outputs: tuple[int, int]
) -> Workload:
    """`n` requests of random token ids below `vocab`, lengths uniform in the given ranges."""
    prompts, output_lens = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(*inputs))])
        output_lens.append(rng.randint(*outputs))
    return Workload(prompts, output_lens)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- Hugging Face ------------------------------------------------------------------------


def load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The checkpoint as a transformers model whose generation defaults are plain greedy."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # generate() fills every setting we leave unset from the checkpoint's generation_config,
    # which may carry a repetition penalty or the like: keep only its padding id.
    candidates = (model.generation_config.pad_token_id, model.config.pad_token_id, 0)
    pad_id = next(t for t in candidates if t is not None)
    model.generation_config = GenerationConfig(pad_token_id=pad_id)
    return model


def hf_generate(
    model: Any, prompts: list[list[int]], max_new: int, device: torch.device
) -> torch.Tensor:  # [B, max_new] the new token ids
    """One left-padded greedy batch of exactly `max_new` new tokens per row, like ignore_eos.

    It passes no EOS ids: min_new_tokens alone also prevents early stops, but by masking the
    EOS logits, so HF would pick another token wherever EOS is the argmax. min_new_tokens stays
    as a guard in case a transformers version fills the empty EOS list from the model's.
    """
    from transformers import GenerationConfig

    pad_id = model.generation_config.pad_token_id  # any id would do: the mask hides it
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=[],
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
    return out[:, width:]


def run_hf(model: Any, work: Workload, batch_size: int, device: torch.device) -> RunResult:
    """Batches of `batch_size` requests in workload order, each generating its largest
    output length; only each request's own output length counts as generated."""
    outputs: list[list[int]] = []
    sync(device)
    start = time.perf_counter()
    for b in range(0, len(work.prompts), batch_size):
        lens = work.output_lens[b : b + batch_size]
        new = hf_generate(model, work.prompts[b : b + batch_size], max(lens), device).tolist()
        outputs.extend(row[:n] for row, n in zip(new, lens, strict=True))
    sync(device)
    seconds = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    return RunResult("hf-generate", len(work.prompts), generated, seconds, outputs)


def hf_output_positions(work: Workload, batch_size: int) -> int:
    """Output positions HF computes: every row of a batch runs to the batch's longest output."""
    return sum(
        len(work.output_lens[b : b + batch_size]) * max(work.output_lens[b : b + batch_size])
        for b in range(0, len(work.output_lens), batch_size)
    )


def hf_decode_tokens_per_s(
    model: Any, prompt: list[int], n: int, device: torch.device, repeats: int = 3
) -> float:
    """Batch-1 decode speed: (n - 1) tokens over the time of an n-token generate minus a
    1-token (prefill-only) generate, best of `repeats` each."""

    def best(max_new: int) -> float:
        times = []
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            hf_generate(model, [prompt], max_new, device)
            sync(device)
            times.append(time.perf_counter() - t)
        return min(times)

    return (n - 1) / (best(n) - best(1))


# -- Coxswain ----------------------------------------------------------------------------


def run_coxswain(llm: LLM, work: Workload, device: torch.device) -> RunResult:
    """Every request submitted at once; the engine batches continuously."""
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens
    ]
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(o) for o in outputs)
    return RunResult("coxswain", len(work.prompts), generated, seconds, outputs)


def coxswain_decode_tokens_per_s(
    llm: LLM, prompt: list[int], n: int, device: torch.device
) -> float:
    """Batch-1 decode speed from engine steps after the first (which prefills the prompt)."""
    engine = llm.engine
    request_id = f"bench-b1-{time.monotonic_ns()}"
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    engine.step()  # prefill + first token
    sync(device)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync(device)
    return steps / (time.perf_counter() - start)


# -- roofline ----------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Device memory bandwidth in bytes/s: best of `repeats` timed device-to-device copies of
    an `nbytes` tensor, each counted as `nbytes` read plus `nbytes` written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    per_timing = 10
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        for _ in range(per_timing):
            dst.copy_(src)
        sync(device)
        best = min(best, (time.perf_counter() - t) / per_timing)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every (deduplicated) parameter: what one decode step must read at least once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a local HF checkpoint dir (default: generate one)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu on CUDA, else cpu")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, else fp32")
    p.add_argument("--num-seqs", type=int)
    p.add_argument("--min-input", type=int)
    p.add_argument("--max-input", type=int)
    p.add_argument("--min-output", type=int)
    p.add_argument("--max-output", type=int)
    p.add_argument("--hf-batch-size", type=int)
    p.add_argument("--skip-hf", action="store_true", help="run Coxswain only")
    p.add_argument("--max-num-seqs", type=int, help="Coxswain's max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, help="Coxswain's token budget per step")
    p.add_argument(
        "--gpu-memory-utilization", type=float, help="share of free CUDA memory for Coxswain's KV"
    )
    p.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        help="batch-1 decode vs the bandwidth roofline (default: on for CUDA only)",
    )
    p.add_argument("--decode-tokens", type=int, default=256, help="output tokens of batch-1 runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; use 1 on a busy machine)"
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.preset = args.preset or ("gpu" if args.device.type == "cuda" else "cpu")
    preset = PRESETS[args.preset]
    defaults = {
        "num_seqs": preset.num_seqs,
        "min_input": preset.input_range[0],
        "max_input": preset.input_range[1],
        "min_output": preset.output_range[0],
        "max_output": preset.output_range[1],
        "hf_batch_size": preset.hf_batch_size,
        "max_num_seqs": preset.max_num_seqs,
        "max_num_batched_tokens": preset.max_num_batched_tokens,
        "gpu_memory_utilization": preset.gpu_memory_utilization,
        "dtype": "bfloat16" if args.device.type == "cuda" else "float32",
        "roofline": args.device.type == "cuda",
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # Shrinking only the max of a range must not leave min > max.
    args.min_input = min(args.min_input, args.max_input)
    args.min_output = min(args.min_output, args.max_output)
    return args


def print_table(results: list[RunResult]) -> None:
    print(f"{'system':<12} {'requests':>8} {'gen tokens':>11} {'seconds':>9} {'tokens/s':>10}")
    for r in results:
        print(
            f"{r.system:<12} {r.requests:>8} {r.generated_tokens:>11} "
            f"{r.seconds:>9.2f} {r.tokens_per_s:>10.1f}"
        )


def agreement(a: RunResult, b: RunResult) -> int:
    """How many requests got identical greedy tokens from both systems."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs, strict=True))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, dtype = args.device, DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="coxswain-bench-") as tmp:
        if args.model is None:
            spec = PRESETS[args.preset].checkpoint
            t = time.perf_counter()
            model_dir = make_tiny_checkpoint(Path(tmp) / "model", seed=args.seed, **spec)
            print(f"built random {args.preset}-preset checkpoint in {time.perf_counter() - t:.1f}s")
        else:
            model_dir = args.model
        bench(args, model_dir, device, dtype)


def bench(
    args: argparse.Namespace, model_dir: Path, device: torch.device, dtype: torch.dtype
) -> None:
    """Run the workload through HF (unless skipped), then Coxswain, and print the results."""
    cfg = load_model_config(model_dir)
    if args.max_input + args.max_output > cfg.max_position_embeddings:
        raise SystemExit(
            f"max-input + max-output = {args.max_input + args.max_output} exceeds the model's "
            f"max_position_embeddings = {cfg.max_position_embeddings}"
        )
    rng = random.Random(args.seed)
    work = make_workload(
        rng,
        args.num_seqs,
        cfg.vocab_size,
        (args.min_input, args.max_input),
        (args.min_output, args.max_output),
    )
    warmup = make_workload(rng, min(4, args.num_seqs), cfg.vocab_size, (8, 32), (8, 16))
    b1_prompt = make_workload(rng, 1, cfg.vocab_size, (16, 16), (1, 1)).prompts[0]
    print(
        f"model {model_dir} ({cfg.architecture}, {cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}) on {device}, {args.dtype}"
        + (f", {torch.get_num_threads()} CPU threads" if device.type == "cpu" else "")
    )
    print(
        f"workload: {args.num_seqs} requests, input {args.min_input}-{args.max_input} "
        f"({sum(map(len, work.prompts))} prompt tokens), output {args.min_output}-"
        f"{args.max_output} ({work.num_output_tokens} tokens), greedy, ignore_eos, seed {args.seed}"
    )

    bandwidth = copy_bandwidth(device) if args.roofline else None
    results: list[RunResult] = []
    hf_b1 = None
    if not args.skip_hf:
        # HF first, and freed before Coxswain sizes its KV cache from the free memory.
        model = load_hf(model_dir, device, dtype)
        run_hf(model, warmup, args.hf_batch_size, device)
        hf = run_hf(model, work, args.hf_batch_size, device)
        results.append(hf)
        if args.roofline:
            hf_b1 = hf_decode_tokens_per_s(model, b1_prompt, args.decode_tokens, device)
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
        seed=args.seed,
    )
    run_coxswain(llm, warmup, device)
    steps_before = llm.engine.stats()["num_steps"]
    cox = run_coxswain(llm, work, device)
    stats = llm.engine.stats()
    results.append(cox)
    cox_b1 = None
    if args.roofline:
        coxswain_decode_tokens_per_s(llm, b1_prompt, 16, device)  # warm the batch-1 path
        cox_b1 = coxswain_decode_tokens_per_s(llm, b1_prompt, args.decode_tokens, device)

    print()
    print_table(results)
    print(
        f"coxswain: {stats['num_steps'] - steps_before} engine steps, "
        f"{stats['num_preemptions']} preemptions, {stats['num_kv_blocks']} KV blocks of "
        f"{stats['config']['block_size']}, max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}"
        + (
            f", gpu_memory_utilization {args.gpu_memory_utilization}"
            if device.type == "cuda"
            else ""
        )
    )
    if not args.skip_hf:
        hf = results[0]
        print(
            f"hf-generate: batches of {args.hf_batch_size}, left-padded; each batch decodes its "
            f"longest output, so it computed {hf_output_positions(work, args.hf_batch_size)} "
            f"output positions but is credited only each request's own {hf.generated_tokens} tokens"
        )
        print(f"greedy outputs identical in {agreement(hf, cox)}/{len(work.prompts)} requests")

    if args.roofline:
        wbytes = weight_bytes(llm.engine.runner.model)
        step_s = wbytes / bandwidth
        roof = 1 / step_s
        print()
        print(
            f"decode roofline (batch 1): {wbytes / 1e9:.3f} GB of weights / "
            f"{bandwidth / 1e9:.0f} GB/s copy bandwidth = {step_s * 1e3:.3f} ms per step "
            f"= {roof:.1f} tokens/s"
        )
        print(
            f"coxswain batch-1 decode: {cox_b1:.1f} tokens/s "
            f"({cox_b1 / roof:.1%} of roofline, {args.decode_tokens} output tokens)"
        )
        if hf_b1 is not None:
            print(
                f"hf-generate batch-1 decode: {hf_b1:.1f} tokens/s ({hf_b1 / roof:.1%} of roofline)"
            )

    print()
    if args.skip_hf:
        print(f"throughput coxswain = {cox.tokens_per_s:.1f} tokens/s (hf skipped)")
    else:
        print(f"throughput ratio coxswain/hf = {cox.tokens_per_s / results[0].tokens_per_s:.2f}x")


if __name__ == "__main__":
    main()
