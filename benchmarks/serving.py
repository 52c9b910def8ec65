"""HTTP serving latency under mixed steered and unsteered traffic: TTFT and TPOT at p50/p99.

One run against one server, in rounds of two timed phases with the same arrival process
and request shape:

1. **alone**: every request unsteered.
2. **mixed**: `--steered-fraction` of the requests carry their own steering (request i of the
   steered ones gets config i % `--configs`), and `--capture-fraction` more carry steering
   plus an activation capture and per-token read-outs; the rest are unsteered.

Every request is a streaming `POST /v1/completions` (greedy, `ignore_eos`, random prompt
token ids, fresh ones per phase so no phase reads another's prefix cache). TTFT is the time
from sending the request to the SSE chunk carrying its first token; TPOT is the time from
that chunk to the one carrying its last token, over the tokens after the first; ITL is the
gap between successive chunks carrying tokens. All come from `time.perf_counter()` stamps
of the chunks as the client reads them.

    python3 benchmarks/serving.py                    # tiny model served here (about a minute)
    python3 benchmarks/serving.py --rate 20          # Poisson arrivals at 20 req/s
    python3 benchmarks/serving.py --url http://gateway:8000 --api-key $KEY   # a cluster

Without `--url` the gateway app (`services.gateway.http_app.build_app`) serves an engine
(`EngineService.from_model`) on a generated checkpoint (or `--model DIR`) built in this
process. With `--frontend process` (the default) uvicorn runs in `--frontend-workers` child
processes over that engine (`services/gateway/process_backend.py`: deltas cross a Unix
socket once per step); `--frontend thread` runs it in a thread beside the engine, sharing
its GIL. The load generator runs in a child process of its own so that it competes with
neither. Prints numbers only; it is never a pass/fail test, but it warns when steering
changed nothing or a capture or read-out did not come back, because a no-op steering path
would look free here.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, Python puts benchmarks/ on sys.path but not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np
import torch
from generated_model import add_model_arguments, checkpoint_dir, resolve_device

from services.common.wire import pack_tensor

UNSTEERED, STEERED, CAPTURED = "unsteered", "steered", "steered+capture"
KINDS = (UNSTEERED, STEERED, CAPTURED)


@dataclass
class Model:
    """What the client needs to know of the served model (from `GET /v1/models`)."""

    id: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    device: str
    dtype: str


@dataclass
class Sample:
    """One streamed request: its timings and what came back beyond the tokens."""

    kind: str
    ttft: float  # seconds, request sent -> first token's chunk
    tpot: float | None  # seconds per token after the first (None with one token)
    tokens: int
    token_ids: list[int] = field(repr=False)
    itl: list[float] = field(default_factory=list, repr=False)  # gaps between token chunks
    logprobs: list[float | None] = field(default_factory=list, repr=False)  # if asked
    readouts: int = 0  # (token, probe) read-out values received
    captures: list[str] | None = None  # keys of the returned captures
    error: str | None = None


@dataclass
class Phase:
    name: str
    samples: list[Sample]
    seconds: float

    def of(self, kind: str) -> list[Sample]:
        return [s for s in self.samples if s.kind == kind and s.error is None]


# -- requests -------------------------------------------------------------------------------


def unit_vectors(k: int, hidden: int, seed: int) -> torch.Tensor:  # [k, H] float32
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(k, hidden, generator=g)
    return v / v.norm(dim=-1, keepdim=True)


@dataclass
class RequestMaker:
    """Builds the JSON bodies of the three kinds of request."""

    model: Model
    output_len: int
    layers: list[int]
    scale: float
    configs: int
    seed: int

    def __post_init__(self) -> None:
        H = self.model.hidden_size
        # Packed vectors: a real model's 4096 floats as JSON text would dwarf the prompt.
        self.vectors = [pack_tensor(v) for v in unit_vectors(self.configs, H, self.seed)]
        self.probe = pack_tensor(unit_vectors(1, H, self.seed + 1)[0])

    def body(self, kind: str, prompt: list[int], index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model.id,
            "prompt": prompt,
            "max_tokens": self.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        if kind in (STEERED, CAPTURED):
            body["steering"] = self.steering(index % self.configs)
        if kind == CAPTURED:
            body["capture"] = {"sites": {"post_block": self.layers}, "positions": "last_prompt"}
            body["readouts"] = [
                {"probe": self.probe, "layer": layer, "site": "post_block", "name": f"p{layer}"}
                for layer in self.layers
            ]
        return body

    def steering(self, config: int) -> dict[str, Any]:
        vec = self.vectors[config]
        return {
            "vectors": [
                {"site": "post_block", "layers": self.layers, "vector": vec, "scale": self.scale}
            ]
        }


async def stream_completion(client: httpx.AsyncClient, kind: str, body: dict) -> Sample:
    """Send one streaming completion; stamp each SSE chunk that carries tokens as it arrives.
    A failed request (an HTTP error status, an error event, a broken connection) comes
    back as a Sample with `error` set, so one failure never ends the run."""
    stamps: list[float] = []
    ids: list[int] = []
    logprobs: list[float | None] = []
    readouts = 0
    captures = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise _Failed(f"HTTP {resp.status_code}: {resp.text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, keep-alive comments
                now = time.perf_counter()
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _Failed(chunk["error"].get("message", str(chunk["error"])))
                for choice in chunk.get("choices", []):
                    extras = choice.get("coxswain") or {}
                    new = extras.get("token_ids") or []
                    if new:
                        stamps.append(now)
                        ids.extend(new)
                        lps = (choice.get("logprobs") or {}).get("token_logprobs")
                        logprobs.extend(lps or [])
                    for per_token in extras.get("readouts") or []:  # {name: h·probe}
                        readouts += sum(v is not None for v in per_token.values())
                for prompt in (chunk.get("coxswain") or {}).get("prompts", []):
                    captures = sorted(prompt.get("captures") or {})
        if not stamps:
            raise _Failed("the stream carried no tokens")
    except (_Failed, httpx.HTTPError) as exc:
        return Sample(kind, 0.0, None, len(ids), ids, error=str(exc) or type(exc).__name__)
    n = len(ids)
    tpot = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return Sample(kind, stamps[0] - t0, tpot, n, ids, itl, logprobs, readouts, captures)


class _Failed(Exception):
    """A request the server answered with an error."""


async def run_phase(
    client: httpx.AsyncClient,
    name: str,
    work: list[tuple[str, dict]],
    arrivals: list[float] | None,
    concurrency: int,
) -> Phase:
    """Send `work` with Poisson `arrivals` (offsets in seconds) or, without them, closed-loop
    with `concurrency` requests in flight."""
    start = time.perf_counter()
    if arrivals is not None:

        async def at(offset: float, kind: str, body: dict) -> Sample:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await stream_completion(client, kind, body)

        samples = await asyncio.gather(
            *(at(t, k, b) for t, (k, b) in zip(arrivals, work, strict=True))
        )
    else:
        queue = list(enumerate(work))
        results: list[Sample | None] = [None] * len(work)

        async def worker() -> None:
            while queue:
                i, (kind, body) = queue.pop(0)
                results[i] = await stream_completion(client, kind, body)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        samples = [s for s in results if s is not None]
    return Phase(name, list(samples), time.perf_counter() - start)


# -- the served model -----------------------------------------------------------------------


@contextmanager
def local_gateway(args: argparse.Namespace, key: str) -> Iterator[tuple[str, Any]]:
    """The gateway app over an engine on a generated checkpoint (or `--model`); yields its URL
    and the engine's AsyncLLM. `--frontend process` (the default) serves HTTP from a child
    process over the engine in this one (`services/gateway/process_backend.py`); `thread`
    runs uvicorn in a thread beside the engine, sharing its GIL."""
    from services.common.auth import ApiKey, ApiKeys
    from services.engine.service import EngineService
    from services.gateway.http_app import build_app
    from services.gateway.process_backend import BackendServer, http_frontend
    from tests.serving import serve_asgi

    resolve_device(args)
    keys = ApiKeys([ApiKey("bench", "read", key)])
    with tempfile.TemporaryDirectory(prefix="coxswain-bench-") as tmp:
        model_dir = checkpoint_dir(args, Path(tmp), max(1024, args.prompt_len + args.output_len))
        backend = EngineService.from_model(
            model_dir,
            model_id="bench",
            device=str(args.device),
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        server = BackendServer(backend) if args.frontend == "process" else None
        try:
            if server is not None:
                frontend = http_frontend(
                    server.start(), model_dir, keys, workers=args.frontend_workers
                )
                with frontend as url:
                    yield url, backend.llm
            else:
                with serve_asgi(build_app(backend, keys)) as url:
                    yield url, backend.llm
        finally:
            if server is not None:
                server.close()
            backend.llm.shutdown()


async def fetch_model(client: httpx.AsyncClient) -> Model:
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise SystemExit(f"GET {client.base_url.join('/v1/models')}: {exc!r}") from None
    if resp.status_code != 200:
        raise SystemExit(f"GET /v1/models: HTTP {resp.status_code}: {resp.text}")
    card = resp.json()["data"][0]["coxswain"]
    return Model(
        id=card["id"],
        num_layers=card["num_layers"],
        hidden_size=card["hidden_size"],
        vocab_size=card["vocab_size"],
        max_model_len=card["max_model_len"],
        device=card["device"],
        dtype=card["dtype"],
    )


# -- the report -----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


METRICS = ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99")


@dataclass
class Row:
    """One line of the table: the successful requests of one kind in one phase."""

    label: str
    samples: list[Sample]

    def stats(self) -> dict[str, float]:
        """Seconds, by the names in METRICS. TTFT and TPOT are per request; ITL (the gaps
        between chunks carrying tokens) is pooled over requests, so it shows stalls."""
        ttft = [s.ttft for s in self.samples]
        tpot = [s.tpot for s in self.samples if s.tpot is not None]
        itl = [g for s in self.samples for g in s.itl]
        values = (pct(ttft, 50), pct(ttft, 99), pct(tpot, 50), pct(tpot, 99), pct(itl, 99))
        return dict(zip(METRICS, values, strict=True))


def pooled(phases: list[Phase], name: str) -> Phase:
    """Every round's requests of phase `name` as one phase."""
    runs = [ph for ph in phases if ph.name == name]
    return Phase(name, [s for ph in runs for s in ph.samples], sum(ph.seconds for ph in runs))


def print_report(phases: list[Phase]) -> tuple[Row, list[Row]]:
    """Throughput per phase, the latency table and the mixed/alone ratios."""
    for name in ("alone", "mixed"):
        ph = pooled(phases, name)
        ok = [s for s in ph.samples if s.error is None]
        rounds = [Row("", r.of(UNSTEERED)).stats()["TPOT p50"] for r in phases if r.name == name]
        print(
            f"{name}: {len(ok)}/{len(ph.samples)} requests in {ph.seconds:.2f}s, "
            f"{len(ok) / ph.seconds:.2f} req/s, "
            f"{sum(s.tokens for s in ok) / ph.seconds:.1f} generated tokens/s; "
            f"unsteered TPOT p50 by round (ms): " + " ".join(f"{1000 * t:.2f}" for t in rounds)
        )
    base = Row("alone: unsteered", pooled(phases, "alone").of(UNSTEERED))
    mixed = pooled(phases, "mixed")
    rows = [Row(f"mixed: {kind}", mixed.of(kind)) for kind in KINDS]

    print()
    print(f"{'requests':<24}{'n':>5}" + "".join(f"{m:>10}" for m in METRICS))
    for r in [base, *rows]:
        cells = "".join(f"{1000 * v:>10.{1 if 'TTFT' in m else 2}f}" for m, v in r.stats().items())
        print(f"{r.label:<24}{len(r.samples):>5}{cells}")
    print(
        "milliseconds; TPOT: per output token after the first; ITL: gap between token chunks; "
        "a p99 over n < 100 is near the max"
    )

    print()
    b = base.stats()
    for r in rows:
        if r.samples:
            ratios = ", ".join(f"{m} {v / b[m]:.2f}x" for m, v in r.stats().items())
            print(f"{r.label} / alone: {ratios}")
    return base, rows


def check_outputs(phases: list[Phase], output_len: int, layers: list[int]) -> None:
    """Make no-ops and failures visible: errors, short outputs, missing captures/read-outs."""
    for ph in phases:
        errors = [s for s in ph.samples if s.error is not None]
        for s in errors[:3]:
            print(f"WARNING {ph.name}: a {s.kind} request failed: {s.error}")
        if len(errors) > 3:
            print(f"WARNING {ph.name}: {len(errors)} requests failed in all")
        short = [s for s in ph.samples if s.error is None and s.tokens != output_len]
        if short:
            print(f"WARNING {ph.name}: {len(short)} requests stopped before {output_len} tokens")
        captured = ph.of(CAPTURED)
        if not captured:
            continue
        want = sorted(f"{layer}.post_block" for layer in layers)
        got = sum(s.captures == want for s in captured)
        full = sum(s.readouts == s.tokens * len(layers) for s in captured)
        print(
            f"{ph.name}: {got}/{len(captured)} captures came back with {want}; "
            f"{full}/{len(captured)} got {len(layers)} read-outs per token"
        )
        if got < len(captured) or full < len(captured):
            print(f"WARNING {ph.name}: captures or read-outs missing")


async def steering_effect(
    client: httpx.AsyncClient, maker: RequestMaker, prompts: list[list[int]]
) -> tuple[int, int]:
    """Of `prompts`, how many steering changes the output of at all (a token, or a sampled
    token's logprob), and how many it changes the greedy tokens of. Run untimed, before the
    phases: a steering path that did nothing would look free in the table."""
    changed = tokens_changed = 0
    for i, p in enumerate(prompts):
        plain, steered = [
            await stream_completion(client, kind, maker.body(kind, p, i) | {"logprobs": 0})
            for kind in (UNSTEERED, STEERED)
        ]
        for s in (plain, steered):
            if s.error is not None:
                raise SystemExit(f"warm-up {s.kind} request failed: {s.error}")
        moved = any(
            a is None or b is None or abs(a - b) > 1e-4
            for a, b in zip(plain.logprobs, steered.logprobs, strict=True)
        )
        tokens_changed += plain.token_ids != steered.token_ids
        changed += moved or plain.token_ids != steered.token_ids
    return changed, tokens_changed


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    t = p.add_argument_group("target (default: serve the model in this process)")
    t.add_argument("--url", help="a running gateway, e.g. http://coxswain-serve-svc:8000")
    t.add_argument("--api-key", help="bearer key for --url (default: $COXSWAIN_API_KEY)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64, help="per phase and round")
    w.add_argument("--rounds", type=int, default=4, help="alone+mixed rounds, order alternating")
    w.add_argument("--prompt-len", type=int, default=64, help="random prompt token ids")
    w.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    arrival = w.add_mutually_exclusive_group()
    arrival.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s")
    arrival.add_argument(
        "--concurrency", type=int, default=8, help="closed loop: requests in flight (default)"
    )
    w.add_argument("--steered-fraction", type=float, default=0.5, help="of the mixed phase")
    w.add_argument(
        "--capture-fraction",
        type=float,
        default=0.1,
        help="of the mixed phase: steered plus a capture and per-token read-outs",
    )
    w.add_argument("--configs", type=int, default=8, help="distinct steering configs")
    w.add_argument("--steer-layers", help="comma-separated (default: layers L/3 and 2L/3)")
    w.add_argument("--scale", type=float, default=4.0, help="scale of the unit vectors")
    w.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    w.add_argument(
        "--throughput",
        action="store_true",
        help="instead: generated tok/s of --num-requests unsteered streams over HTTP "
        "(--concurrency in flight) against the same workload sent to the engine in process",
    )
    w.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="with --throughput: load-generator processes sharing the HTTP workload",
    )
    w.add_argument(
        "--tolerate-errors",
        action="store_true",
        help="with --throughput: count failed requests instead of stopping (a replica killed "
        "mid-run)",
    )
    e = p.add_argument_group("local engine (without --url)")
    e.add_argument(
        "--frontend",
        choices=("process", "thread"),
        default="process",
        help="HTTP from child processes over the engine here (default), or uvicorn in a "
        "thread of the engine's process (sharing its GIL)",
    )
    e.add_argument(
        "--frontend-workers",
        type=int,
        default=2,
        help="with --frontend process: HTTP worker processes (default 2)",
    )
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.device == "auto":  # `resolve_device` picks CUDA (bf16) when present
        args.device = None
    if not 0 <= args.steered_fraction + args.capture_fraction <= 1:
        p.error("--steered-fraction + --capture-fraction must be within [0, 1]")
    if min(args.rounds, args.num_requests, args.concurrency, args.configs) < 1:
        p.error("--rounds, --num-requests, --concurrency and --configs must be >= 1")
    if not 1 <= args.client_processes <= args.concurrency or args.frontend_workers < 1:
        p.error("need 1 <= --client-processes <= --concurrency and --frontend-workers >= 1")
    if args.rate is not None and args.rate <= 0:
        p.error("--rate must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.url:
        key = args.api_key or os.environ.get("COXSWAIN_API_KEY", "")
        if args.throughput:  # the cluster's side of the comparison (benchmarks/cluster_serving.py)
            tokens, seconds, errors = _http_throughput(args, args.url, key)
            print(
                f"{args.num_requests} streams of {args.prompt_len} prompt -> {args.output_len} "
                f"generated tokens, {args.concurrency} in flight, over HTTP at {args.url}: "
                f"{tokens / seconds:,.0f} generated tok/s ({tokens} in {seconds:.2f} s, "
                f"{errors} requests failed)"
            )
            return
        run_client(args, args.url, key, "")
        return
    key = secrets.token_urlsafe(24)
    if args.throughput:
        compare_throughput(args, key)
        return
    with local_gateway(args, key) as (url, _):
        where = f" ({_frontend(args)}, {torch.get_num_threads()} threads)"
        # The load generator gets its own interpreter. Here it would compete with the engine
        # thread and uvicorn for the GIL, read chunks late and in bursts, and so report
        # inflated TTFT and near-zero TPOT.
        client = multiprocessing.get_context("spawn").Process(
            target=run_client, args=(args, url, key, where), name="serving-client"
        )
        client.start()
        client.join()
    if client.exitcode:
        raise SystemExit(f"the client process failed (exit code {client.exitcode})")


def _frontend(args: argparse.Namespace) -> str:
    if args.frontend == "process":
        return f"uvicorn in {args.frontend_workers} child processes over the engine in this one"
    return "uvicorn in a thread of the engine's process"


# -- --throughput: HTTP against the engine in process ----------------------------------------


def _throughput_prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]


def compare_throughput(args: argparse.Namespace, key: str) -> None:
    """Generated tok/s over HTTP (client in its own process) and in process (the same
    AsyncLLM, no HTTP), on the same model and the same workload shape; fresh prompts for
    each run so neither reads the other's prefix cache."""
    with local_gateway(args, key) as (url, llm):
        http_tokens, http_s, _ = _http_throughput(args, url, key)
        vocab = llm.engine.model_config.vocab_size
        local_tokens, local_s = asyncio.run(_in_process_throughput(args, llm, vocab))
    http, local = http_tokens / http_s, local_tokens / local_s
    print(
        f"{args.num_requests} streams of {args.prompt_len} prompt -> {args.output_len} "
        f"generated tokens, {args.concurrency} in flight, greedy, ignore_eos, "
        f"HTTP front end: {_frontend(args)}; {args.client_processes} client processes\n"
        f"  over HTTP:  {http:10,.0f} generated tok/s ({http_tokens} in {http_s:.2f} s)\n"
        f"  in process: {local:10,.0f} generated tok/s ({local_tokens} in {local_s:.2f} s)\n"
        f"  HTTP / in process = {http / local:.2f}"
    )


def _http_throughput(args: argparse.Namespace, url: str, key: str) -> tuple[int, float, int]:
    """Generated tokens over HTTP, the seconds they took and the requests that failed (any
    is fatal unless `--tolerate-errors`), from `--client-processes` load generators that
    split the requests and the concurrency and start together: one Python client reading
    SSE saturates its core near 10k chunks/s, below what the server sends."""
    ctx = multiprocessing.get_context("spawn")
    k = args.client_processes
    results, start = ctx.Queue(), ctx.Barrier(k)
    clients = [
        ctx.Process(
            target=_http_throughput_client,
            args=(args, url, key, j, start, results),
            name=f"http-client-{j}",
        )
        for j in range(k)
    ]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    failed = [c.exitcode for c in clients if c.exitcode]
    if failed or results.qsize() != k:
        raise SystemExit(f"an HTTP client failed (exit codes {failed})")
    parts = [results.get() for _ in range(k)]
    tokens = sum(n for n, _, _, _ in parts)
    seconds = max(t1 for _, _, t1, _ in parts) - min(t0 for _, t0, _, _ in parts)
    return tokens, seconds, sum(e for _, _, _, e in parts)


def _http_throughput_client(args, url: str, key: str, j: int, start, results) -> None:
    """Client `j` of `--client-processes`: every k-th request, its share of the concurrency."""
    k = args.client_processes
    concurrency = args.concurrency // k + (j < args.concurrency % k)

    async def run() -> tuple[int, float, float, int]:
        headers = {"Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=args.timeout, limits=limits
        ) as client:
            model = await fetch_model(client)
            maker = RequestMaker(model, args.output_len, [0], 1.0, 1, args.seed)
            warm = [(UNSTEERED, maker.body(UNSTEERED, [1] * args.prompt_len, 0))] * 8
            await run_phase(client, "warm-up", warm, None, concurrency)
            prompts = _throughput_prompts(args, model.vocab_size, args.seed)[j::k]
            work = [(UNSTEERED, maker.body(UNSTEERED, p, i)) for i, p in enumerate(prompts)]
            await asyncio.to_thread(start.wait)  # every client warmed up: go together
            t0 = time.time()
            phase = await run_phase(client, "http", work, None, concurrency)
            t1 = time.time()
        errors = [s.error for s in phase.samples if s.error]
        if errors and not args.tolerate_errors:
            raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
        return sum(s.tokens for s in phase.samples), t0, t1, len(errors)

    results.put(asyncio.run(run()))


async def _in_process_throughput(args, llm, vocab: int) -> tuple[int, float]:
    from services.engine import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    queue = list(_throughput_prompts(args, vocab, args.seed + 1))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            async for delta in llm.generate(queue.pop(), params):
                tokens += sum(len(s.token_ids) for s in delta.samples)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return tokens, time.perf_counter() - start


def run_client(args: argparse.Namespace, url: str, key: str, where: str) -> None:
    asyncio.run(bench(args, url, key, where))


async def bench(args: argparse.Namespace, url: str, key: str, where: str) -> None:
    """Warm up, run the rounds of both phases against `url`, print the report."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        model = await fetch_model(client)
        if args.prompt_len + args.output_len > model.max_model_len:
            raise SystemExit(f"prompt-len + output-len exceeds max_model_len {model.max_model_len}")
        L = model.num_layers
        layers = (
            [int(x) for x in args.steer_layers.split(",")]
            if args.steer_layers
            else sorted({L // 3, 2 * L // 3})
        )
        maker = RequestMaker(model, args.output_len, layers, args.scale, args.configs, args.seed)
        rng = random.Random(args.seed)

        def prompts(n: int) -> list[list[int]]:
            return [
                [rng.randrange(model.vocab_size) for _ in range(args.prompt_len)] for _ in range(n)
            ]

        def work(kinds: list[str]) -> list[tuple[str, dict]]:
            return [
                (k, maker.body(k, p, i))
                for i, (k, p) in enumerate(zip(kinds, prompts(len(kinds)), strict=True))
            ]

        n = args.num_requests
        n_capture = round(args.capture_fraction * n)
        n_steered = round(args.steered_fraction * n)
        mix = [STEERED] * n_steered + [CAPTURED] * n_capture
        mix += [UNSTEERED] * (n - len(mix))
        arrivals = None
        if args.rate is not None:  # one schedule, replayed by every phase
            gaps = np.random.default_rng(args.seed).exponential(1 / args.rate, n)
            arrivals = [float(t) for t in np.cumsum(gaps)]

        arrival = (
            f"Poisson arrivals at {args.rate:g} req/s"
            if arrivals is not None
            else f"closed loop with {args.concurrency} in flight"
        )
        print(
            f"model {model.id} ({L} layers, hidden {model.hidden_size}, vocab {model.vocab_size}) "
            f"on {model.device}, {model.dtype}, served at {url}{where}"
        )
        print(
            f"workload: {args.rounds} rounds of an alone and a mixed phase (order alternating), "
            f"each {n} streaming completions of {args.prompt_len} random prompt tokens -> "
            f"{args.output_len} generated, greedy, ignore_eos, {arrival}, seed {args.seed}"
        )
        print(
            f"mixed phase: {n_steered} steered ({args.configs} configs: unit vectors x "
            f"{args.scale} at post_block of layers {layers}, phase both), {n_capture} steered "
            f"+ capture + read-outs at those layers, {n - n_steered - n_capture} unsteered"
        )

        # Untimed: the check that steering changes outputs at all, then a few requests of
        # each kind, which pay for allocator growth and first-use costs.
        warm = prompts(4)
        changed, tokens_changed = await steering_effect(client, maker, warm)
        await run_phase(client, "warm-up", work(list(KINDS) * 4), None, args.concurrency)

        # Rounds alternate the order (alone, mixed, mixed, alone, ...), so neither a slow spell
        # of a shared machine nor lingering warm-up lands on one phase only. Every phase gets
        # fresh prompts, so none reads another's prefix cache.
        phases: list[Phase] = []
        for r in range(args.rounds):
            for name in ("alone", "mixed") if r % 2 == 0 else ("mixed", "alone"):
                # The mixed phase's kinds interleaved: the same order every run of a seed.
                kinds = [UNSTEERED] * n if name == "alone" else rng.sample(mix, n)
                phases.append(
                    await run_phase(client, name, work(kinds), arrivals, args.concurrency)
                )

    print()
    base, rows = print_report(phases)
    print()
    print(
        f"steering changed the output of {changed}/{len(warm)} warm-up prompts (their greedy "
        f"tokens: {tokens_changed}/{len(warm)})"
    )
    if changed < len(warm):
        print("WARNING: steering left an output unchanged; the steered rows may measure a no-op")
    check_outputs([pooled(phases, "alone"), pooled(phases, "mixed")], args.output_len, layers)
    steered, alone = rows[1].stats(), base.stats()
    print()
    print(
        "latency ratio mixed steered / alone unsteered: "
        f"TPOT p50 = {steered['TPOT p50'] / alone['TPOT p50']:.2f}x, "
        f"TTFT p50 = {steered['TTFT p50'] / alone['TTFT p50']:.2f}x"
    )


if __name__ == "__main__":
    main()
