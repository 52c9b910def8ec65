"""How `coxswain` reads its arguments: one parser per command, each with the help formatter
that shows defaults, and each naming itself so that a stray flag is reported with the usage
of the command it was given to. The commands themselves are in the modules beside this one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path
from typing import Any

from services.cli.cluster import cmd_down, cmd_status, cmd_up
from services.cli.engine import (
    add_engine_args,
    cmd_demo,
    cmd_generate,
    cmd_make_tiny,
    cmd_serve,
)
from services.cli.patch_store import cmd_patch_store_serve
from services.cli.train import cmd_train_grpo, cmd_train_pretrain
from services.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES

# The top-level help, line for line (the formatter keeps a description's line breaks).
DESCRIPTION = (
    "The `coxswain` command line: make tiny checkpoints, generate, serve one engine over HTTP\n"
    "(`serve`), run the demo, serve the patch store, run the local cluster (`up`, `status`,\n"
    "`down`), train."
)


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

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def _positive(kind: type) -> Any:
    """An argparse type: a number of `kind` greater than zero."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="coxswain", description=DESCRIPTION)
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
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve one engine over HTTP (no Ray: see `up`)")
    which = srv.add_mutually_exclusive_group()
    which.add_argument("--model", help="a local Hugging Face checkpoint directory")
    which.add_argument("--tiny", action="store_true", help="the embedded tiny model (default)")
    srv.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines")
    srv.add_argument("--port", type=int, default=8000, help="HTTP port")
    srv.add_argument("--workers", type=int, default=2, help="HTTP worker processes")
    srv.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest request body accepted (413 beyond)",
    )
    srv.add_argument(
        "--body-timeout-s",
        type=_positive(float),
        default=DEFAULT_BODY_TIMEOUT_S,
        help="how long a request's body may take to arrive after its headers (408 beyond)",
    )
    srv.add_argument(
        "--api-keys-file",
        default=None,
        help="name:scope:secret lines (default: $COXSWAIN_API_KEYS, else new keys, printed)",
    )
    add_engine_args(srv)
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
    add_engine_args(demo)
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
    upp.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an EngineConfig field for every engine replica (repeatable; the value is read as "
        "YAML), e.g. --engine max_num_seqs=256 --engine graph_steering_sites=[post_block]",
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
