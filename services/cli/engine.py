"""The commands that run an engine in this process: `model make-tiny`, `generate`, `serve`
(the HTTP API over one engine, no Ray) and `demo`; and the engine flags they share, beside
the keyword arguments those flags become.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from services.common.errors import CoxswainError, InvalidRequestError
from services.common.paths import check_model_dir, coxswain_home, resolve_model


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="sequences a step batches (default: 256 on CUDA, 64 on CPU)",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="never reuse the KV of a shared prefix"
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other EngineConfig field (repeatable; the value is read as YAML), e.g. "
        "--engine max_model_len=4096 --engine graph_steering_sites=[post_block,pre_attn]",
    )


# EngineConfig fields the engine flags above set (`--engine` may not set them again).
FLAGGED = {
    "device": "--device",
    "dtype": "--dtype",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "enable_prefix_caching": "--no-prefix-caching",
}


def engine_settings(pairs: list[str]) -> dict[str, Any]:
    """`--engine FIELD=VALUE` flags as a dict, each value read as YAML (`256`, `true`,
    `[post_block, pre_attn]`); checked against EngineConfig by `check_settings`."""
    import yaml

    settings: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise InvalidRequestError(f"--engine {pair!r}: expected FIELD=VALUE")
        try:
            settings[name.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise InvalidRequestError(f"--engine {pair!r}: the value is not YAML ({e})") from None
    return settings


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags as EngineConfig keyword arguments; a bad `--engine` fails here,
    before any model loads."""
    from services.engine.config import check_settings

    settings = engine_settings(args.engine)
    check_settings(settings, "--engine", FLAGGED)
    return {
        **settings,
        "device": args.device,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": not args.no_prefix_caching,
    }


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from services.engine.model.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(
        args.out,
        args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        seed=args.seed,
        dtype=args.dtype,
        shards=args.shards,
    )
    print(f"wrote a tiny {args.arch} checkpoint to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine import LLM, SamplingParams

    check_model_dir(args.model)
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop or [],
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompts
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "prompt_token_ids": out.prompt_token_ids,
                        "outputs": [
                            {
                                "text": c.text,
                                "token_ids": c.token_ids,
                                "finish_reason": c.finish_reason,
                                "logprobs": c.logprobs,
                            }
                            for c in out.outputs
                        ],
                    }
                )
            )
        else:
            for c in out.outputs:
                print(f"{prompt!r} -> {c.text!r}  [{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """One engine in this process, the OpenAI-compatible HTTP API (plus Coxswain's routes)
    from `--workers` processes over it, until Ctrl-C. No Ray, Redis or gRPC: `up` runs the
    cluster."""
    import secrets
    import signal
    import threading

    from services.common.auth import ApiKey, ApiKeys
    from services.engine.heap import freeze_startup_heap
    from services.engine.service import EngineService
    from services.gateway.process_backend import BackendServer, http_frontend

    keys = ApiKeys.from_env(args.api_keys_file)
    made = {}
    if not keys.enabled:  # every port authenticates: make keys rather than serve openly
        made = {scope: f"cx-{scope}-{secrets.token_urlsafe(24)}" for scope in ("admin", "read")}
        keys = ApiKeys([ApiKey(scope, scope, key) for scope, key in made.items()])  # type: ignore[arg-type]
    model_dir = resolve_model("tiny" if args.tiny or not args.model else args.model)
    check_model_dir(model_dir)
    service = EngineService.from_model(model_dir, model_id=model_dir.name, **engine_kwargs(args))
    freeze_startup_heap()  # this process serves one engine for its life
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = BackendServer(service)
    try:
        frontend = http_frontend(
            server.start(),
            model_dir,
            keys,
            host=args.host,
            port=args.port,
            workers=args.workers,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout_s,
        )
        with frontend as url:
            print(f"serving {model_dir} at {url} ({args.workers} HTTP worker processes)")
            for scope, key in made.items():
                print(f"  {scope:6s} API key: {key}")
            print("stop with Ctrl-C", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                stop.wait()
    finally:
        server.close()
        service.llm.shutdown()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Build the embedded tiny model if needed and serve a mixed batch through the engine;
    with --cluster, tour the running local cluster (`coxswain up`) over HTTP and gRPC."""
    if args.cluster:
        from services.cluster.demo import run_demo
        from services.cluster.status import running_cluster

        info = running_cluster()
        if info is None:
            raise CoxswainError("no local cluster is running: start one with `coxswain up`")
        run_demo(info)
        return 0
    from services.engine import LLM, SamplingParams
    from services.engine.model.tiny import make_tiny_checkpoint

    model_dir = Path(args.model_dir or coxswain_home() / f"tiny-{args.arch}")
    if not (model_dir / "config.json").is_file():
        print(f"building a tiny {args.arch} checkpoint in {model_dir} ...")
        make_tiny_checkpoint(model_dir, args.arch)
    llm = LLM(model_dir, **engine_kwargs(args))
    shared = "The harbour master kept a log of every boat that came in, and on the first day "
    prompts = [shared + tail for tail in ("of spring", "of the storm", "after the race")] + [
        "Once upon a time",
        "def add(a, b):",
    ]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=11),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.7, n=2, seed=3),
    ]
    t0 = time.perf_counter()
    # The first request fills the prefix cache; the batch after it reuses the shared prefix.
    outs = llm.generate(prompts[:1], params[:1]) + llm.generate(prompts[1:], params[1:])
    dt = time.perf_counter() - t0
    print(f"model: {model_dir} ({llm.engine.model_config.architecture}, random weights)")
    for out in outs:
        for c in out.outputs:
            print(
                f"- {out.prompt[:48]!r:52} cached={out.num_cached_tokens:3d} "
                f"-> {c.text[:40]!r} [{c.finish_reason}]"
            )
    s = llm.engine.stats()
    n_tok = s["num_generated_tokens"]
    print(
        f"{len(prompts)} requests, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.0f} tok/s), "
        f"{s['num_steps']} steps; prefix cache hits {s['prefix_cache_hits']}/"
        f"{s['prefix_cache_queries']} tokens"
    )
    return 0
