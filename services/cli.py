"""The `coxswain` command line: make tiny checkpoints, generate, serve one engine over HTTP
(`serve`), run the demo, serve the patch store, run the local cluster (`up`, `status`,
`down`), train."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

from services.common.errors import CoxswainError
from services.common.paths import check_model_dir, coxswain_home, resolve_model


def _add_engine_args(p: argparse.ArgumentParser) -> None:
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


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {
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
    llm = LLM(args.model, **_engine_kwargs(args))
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
    from services.engine.service import EngineService
    from services.gateway.process_backend import BackendServer, http_frontend

    keys = ApiKeys.from_env(args.api_keys_file)
    made = {}
    if not keys.enabled:  # every port authenticates: make keys rather than serve openly
        made = {scope: f"cx-{scope}-{secrets.token_urlsafe(24)}" for scope in ("admin", "read")}
        keys = ApiKeys([ApiKey(scope, scope, key) for scope, key in made.items()])  # type: ignore[arg-type]
    model_dir = resolve_model("tiny" if args.tiny or not args.model else args.model)
    check_model_dir(model_dir)
    service = EngineService.from_model(model_dir, model_id=model_dir.name, **_engine_kwargs(args))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = BackendServer(service)
    try:
        frontend = http_frontend(
            server.start(), model_dir, keys, host=args.host, port=args.port, workers=args.workers
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
    llm = LLM(model_dir, **_engine_kwargs(args))
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


def cmd_patch_store_serve(args: argparse.Namespace) -> int:
    """Serve a patch store over gRPC until SIGINT or SIGTERM, then stop gracefully."""
    import signal
    import threading

    from services.patch_store.server import serve
    from services.patch_store.store import PatchStore

    store = PatchStore(int(args.budget_gb * 2**30))
    server = serve(store, args.host, args.port, int(args.max_message_mb * 2**20))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"patch store serving on {server.address} (budget {args.budget_gb:g} GiB, "
        f"messages up to {args.max_message_mb:g} MiB)",
        flush=True,
    )
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        http, _ = start_http_server(args.metrics_port, args.host, registry=store.registry)
        print(f"metrics on http://{args.host}:{http.server_port}/metrics", flush=True)
    while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
        pass
    print("patch store stopping", flush=True)
    server.stop(grace_s=5.0)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Start the local cluster and print where everything is."""
    import signal

    from services.cluster.local import UpOptions, up

    # Killed halfway, `up` still stops what it started (SystemExit unwinds like Ctrl-C).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    model = "tiny" if args.tiny or not args.model else args.model
    info = up(
        UpOptions(
            model=model,
            tp=args.tp,
            pp=args.pp,
            replicas=args.replicas,
            device=args.device,
            dtype=args.dtype,
            host=args.host,
            http_port=args.port,
            grpc_port=args.grpc_port,
            controller_grpc_port=args.controller_grpc_port,
            redis_url=args.redis_url,
            api_keys_file=args.api_keys_file,
            num_cpus=args.num_cpus,
            new_keys=args.new_keys,
        )
    )
    print(f"coxswain is up: model {info['model']}")
    print(f"  {'listening':10s} {_bind_text(info.get('bind', '127.0.0.1'))}")
    for name in ("http", "openapi", "dashboard", "metrics", "grpc", "redis"):
        print(f"  {name:10s} {info[name]}")
    print(f"  {'controller':10s} {info['controller']}")
    if info["api_keys"]:
        print(f"  API keys (also in {info['api_keys_file']}):")
        for scope, key in info["api_keys"].items():
            print(f"    {scope:6s} {key}")
    print("stop it with: coxswain down")
    return 0


def _bind_text(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return f"{host or '0.0.0.0'} (HTTP and gRPC on every interface: other machines can connect)"
    return f"{host} (HTTP and gRPC; --host 0.0.0.0 to serve other machines)"


def cmd_down(args: argparse.Namespace) -> int:
    from services.cluster.local import down

    stopped, left = down()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    for e in left:  # the cluster is down all the same; the next `up` names the file again
        print(f"coxswain: warning: could not remove {e.filename}: {e.strerror}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """What `coxswain up` started and whether it answers; exit status 1 when it is not up
    (not running, or degraded: a part of it does not answer)."""
    from services.cluster.status import status

    report = status()
    if args.json:
        print(json.dumps(report))
        return 0 if report["state"] == "up" else 1
    print(
        f"coxswain is {report['state']}"
        + (f": {', '.join(report['degraded'])} not answering" if report["degraded"] else "")
    )
    if "reason" in report:
        print(f"  {report['reason']}")
    for name in ("model", "bind", "http", "grpc", "controller", "redis", "api_keys_file"):
        if name in report:
            print(f"  {name:14s} {report[name]}")
    if "ray_head_processes" in report:
        print(f"  {'ray head':14s} {report['ray_head_processes']} processes")
    health = report.get("health")
    if isinstance(health, dict):
        print(f"  {'health':14s} {json.dumps(health)}")
    return 0 if report["state"] == "up" else 1


def cmd_train_grpo(args: argparse.Namespace) -> int:
    """GRPO with gradient routing from a YAML config (see examples/grpo/): here, or with --ray
    as a Ray actor on the attached (or a new local) Ray cluster."""
    import yaml

    from services.trainer.grpo import run, validate_config

    raw = yaml.safe_load(Path(args.config).read_text()) or {}
    if args.out_dir:
        raw["out_dir"] = args.out_dir
    if args.steps is not None:
        raw["steps"] = args.steps
    config = validate_config(raw, source=args.config)
    if args.ray:
        records = _train_grpo_on_ray(config, args)
    else:
        on_record = None
        if args.metrics_port is not None:
            from services.trainer.metrics import TrainingMetrics

            metrics = TrainingMetrics.for_config(config)
            port = metrics.serve(args.metrics_port, args.metrics_host)
            print(f"metrics on http://{args.metrics_host}:{port}/metrics", flush=True)
            on_record = metrics.observe
        records = run(config, resume=not args.fresh, progress=True, on_record=on_record)
    last = [r for r in records if r["kind"] == "eval"][-1:]
    if last:
        print(json.dumps(last[0]))
    print(f"metrics: {config.out_dir}/metrics.jsonl; plot: {config.out_dir}/rates.png")
    return 0


def _train_grpo_on_ray(config, args: argparse.Namespace) -> list[dict]:
    """Run `config` in a `TrainerActor`, following it by polling until it ends; its records.
    The actor belongs to this process: Ctrl-C (or the end) stops it."""
    from services.cluster.processes import ray_client_env

    os.environ.update(ray_client_env())  # before Ray is imported (a `coxswain up` cluster)
    import ray
    from tqdm import tqdm

    from services.trainer.actor import start_trainer

    ray.init(logging_level="WARNING")  # RAY_ADDRESS, or the `ray start` cluster, or a new one
    num_gpus = 1 if config.device.startswith("cuda") else 0
    _check_ray_room(num_cpus=1, num_gpus=num_gpus)
    actor = start_trainer(
        config,
        resume=not args.fresh,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        num_cpus=1,
        num_gpus=num_gpus,
    )
    try:
        ready, _ = ray.wait([first := actor.metrics_url.remote()], timeout=args.placement_timeout)
        if not ready:
            raise CoxswainError(
                f"the trainer actor did not start within {args.placement_timeout:g} s: "
                f"{_ray_room_text()} (raise --placement-timeout if the cluster is scaling up)"
            )
        url = ray.get(first)
        if url is not None:
            print(f"metrics on {url}", flush=True)
        records: list[dict] = []
        bar = tqdm(total=config.steps, desc=f"grpo {config.arm} (ray)")
        while True:
            status = ray.get(actor.wait.remote(1.0))
            new = ray.get(actor.records.remote(len(records)))  # after wait: none is missed
            records += new
            for r in new:
                if r["kind"] == "train":
                    bar.update(r["step"] - bar.n)
                    bar.set_postfix(
                        reward=f"{r['reward']:.3f}", hack=f"{r['rollout_hack_rate']:.3f}"
                    )
            if status["state"] in ("done", "failed"):
                break
        bar.close()
        if status["state"] == "failed":
            raise CoxswainError(f"the GRPO run failed: {status['error']}")
        return records
    finally:
        ray.kill(actor)


def _ray_room_text() -> str:
    import ray

    free, total = ray.available_resources(), ray.cluster_resources()
    return ", ".join(f"{free.get(r, 0):g} of {total.get(r, 0):g} {r}s free" for r in ("CPU", "GPU"))


def _check_ray_room(*, num_cpus: float, num_gpus: float) -> None:
    """Fail at once when the connected Ray cluster has no room for the trainer actor: Ray
    would otherwise wait forever to place it (a `coxswain up` cluster's replicas may hold
    every CPU)."""
    import ray

    free = ray.available_resources()
    if free.get("CPU", 0) < num_cpus or free.get("GPU", 0) < num_gpus:
        want = f"{num_cpus:g} CPU" + (f" and {num_gpus:g} GPU" if num_gpus else "")
        raise CoxswainError(
            f"the Ray cluster has no room for the trainer actor ({want}): {_ray_room_text()}. "
            "Free some (e.g. `coxswain up --num-cpus N` leaves the rest), or run without --ray"
        )


def cmd_train_pretrain(args: argparse.Namespace) -> int:
    from services.trainer.pretrain import main as pretrain_main

    return pretrain_main(args.rest)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The one formatter of every `coxswain` parser: descriptions as written (they are
    docstrings), and each option's default after its help, unless it has none worth telling
    (None, a flag's False) or its help already says what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        if "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """A parser whose subcommands get its formatter, and which names itself in the parsed
    arguments (`command_parser`: the deepest one wins), so that a stray flag is reported
    with the usage of the command it was given to, not the top-level one."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.set_defaults(command_parser=self)


def _version() -> str:
    """The installed package's version; from the source tree's pyproject.toml where the
    tree runs uninstalled (on `PYTHONPATH`, as the offline bundle's hosts run it)."""
    try:
        return importlib.metadata.version("coxswain")
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="coxswain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="checkpoint tools").add_subparsers(
        dest="model_command", required=True
    )
    tiny = model.add_parser("make-tiny", help="write a tiny random HF checkpoint directory")
    tiny.add_argument(
        "--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"], help="family"
    )
    tiny.add_argument("--out", required=True, help="the directory to write")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads")
    tiny.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    tiny.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the stored weights",
    )
    tiny.add_argument("--shards", type=int, default=1, help="safetensors files to split into")
    tiny.set_defaults(func=cmd_make_tiny)

    gen = sub.add_parser("generate", help="generate from a local HF checkpoint")
    gen.add_argument("--model", required=True, help="a local Hugging Face checkpoint directory")
    gen.add_argument("prompts", nargs="+", help="one completion per prompt")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest; 0: all")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below p × the top")
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token")
    gen.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve one engine over HTTP (no Ray: see `up`)")
    which = srv.add_mutually_exclusive_group()
    which.add_argument("--model", help="a local Hugging Face checkpoint directory")
    which.add_argument("--tiny", action="store_true", help="the embedded tiny model (default)")
    srv.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines")
    srv.add_argument("--port", type=int, default=8000, help="HTTP port")
    srv.add_argument("--workers", type=int, default=2, help="HTTP worker processes")
    srv.add_argument(
        "--api-keys-file",
        default=None,
        help="name:scope:secret lines (default: $COXSWAIN_API_KEYS, else new keys, printed)",
    )
    _add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo",
        help="build the embedded tiny model and serve a batch; --cluster: tour the running "
        "local cluster",
        description=cmd_demo.__doc__,
    )
    demo.add_argument(
        "--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"], help="family"
    )
    demo.add_argument(
        "--model-dir", default=None, help="where the tiny model is (default: $COXSWAIN_HOME)"
    )
    demo.add_argument(
        "--cluster", action="store_true", help="tour the running local cluster (`coxswain up`)"
    )
    _add_engine_args(demo)
    demo.set_defaults(func=cmd_demo)

    store = sub.add_parser("patch-store", help="the patch-source store").add_subparsers(
        dest="patch_store_command", required=True
    )
    ps = store.add_parser("serve", help="serve a patch store over gRPC until Ctrl-C")
    ps.add_argument("--port", type=int, default=50061, help="0: any free port (printed)")
    ps.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    ps.add_argument("--budget-gb", type=float, default=4.0, help="byte budget in GiB")
    ps.add_argument("--max-message-mb", type=float, default=64.0, help="gRPC message limit, MiB")
    ps.add_argument("--metrics-port", type=int, default=None, help="serve prometheus metrics")
    ps.set_defaults(func=cmd_patch_store_serve)

    upp = sub.add_parser("up", help="start the whole cluster locally (Redis, Ray, Serve)")
    which = upp.add_mutually_exclusive_group()
    which.add_argument("--model", help="a local Hugging Face checkpoint directory")
    which.add_argument("--tiny", action="store_true", help="the embedded tiny model (default)")
    upp.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks per replica (on one node)"
    )
    upp.add_argument("--pp", type=int, default=1, help="pipeline stages per replica")
    upp.add_argument("--replicas", type=int, default=1, help="engine replicas")
    upp.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, or auto (cuda when a GPU is visible). On cuda each engine rank gets "
        "a GPU of its own: --replicas × --tp × --pp GPUs, counted before anything starts "
        "(CUDA_VISIBLE_DEVICES limits which)",
    )
    upp.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16, or auto (the device's)"
    )
    upp.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface for HTTP and both gRPC servers; 0.0.0.0 serves other machines",
    )
    upp.add_argument("--port", type=int, default=8000, help="HTTP port")
    upp.add_argument("--grpc-port", type=int, default=50051, help="engine gRPC front")
    upp.add_argument(
        "--controller-grpc-port", type=int, default=50071, help="the controller's gRPC"
    )
    upp.add_argument(
        "--redis-url",
        default=None,
        help="your Redis (redis://:PASSWORD@HOST:PORT/0); default: start one with a password",
    )
    upp.add_argument("--api-keys-file", default=None, help="default: the cluster's own keys")
    upp.add_argument(
        "--new-keys", action="store_true", help="replace the cluster's API keys (when it is down)"
    )
    upp.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs Ray may schedule (default: all)"
    )
    upp.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop what `coxswain up` started").set_defaults(func=cmd_down)
    st = sub.add_parser("status", help="what `coxswain up` started, and whether it answers")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.set_defaults(func=cmd_status)

    train = sub.add_parser("train", help="training").add_subparsers(
        dest="train_command", required=True
    )
    grpo = train.add_parser("grpo", help="GRPO with gradient routing (YAML config)")
    grpo.add_argument("--config", required=True, help="a YAML file of GRPOConfig fields")
    grpo.add_argument(
        "--out", "--out-dir", dest="out_dir", default=None, help="override the config's out_dir"
    )
    grpo.add_argument("--steps", type=int, default=None, help="override the config's steps")
    grpo.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    grpo.add_argument(
        "--metrics-port", type=int, default=None, help="serve prometheus metrics (0: any port)"
    )
    grpo.add_argument("--metrics-host", default="127.0.0.1", help="0.0.0.0: every interface")
    grpo.add_argument(
        "--ray", action="store_true", help="train in a Ray actor (RAY_ADDRESS or a local Ray)"
    )
    grpo.add_argument(
        "--placement-timeout",
        type=float,
        default=120.0,
        help="--ray: seconds to wait for the actor to start",
    )
    grpo.set_defaults(func=cmd_train_grpo)
    # Its own parser reads the flags (--out DIR --steps N ...; --help lists them).
    pre = train.add_parser("pretrain", help="pretrain the tiny base policy (Muon)", add_help=False)
    pre.set_defaults(func=cmd_train_pretrain, passes_flags_on=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse.REMAINDER cannot take flags that come first (`pretrain --out DIR`), so a
    # command with its own parser gets what this one does not know.
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passes_flags_on", False):
        args.rest = rest
    elif rest:
        args.command_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except CoxswainError as e:
        print(f"coxswain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("coxswain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
