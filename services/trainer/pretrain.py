"""Pretraining recipe for the tiny base policy: learn the environments' tasks (and, rarely, their
hacks) from scratch with Muon, in a few minutes on two CPU cores.

The checkpoint starts as `make_tiny_checkpoint` (real HF format, a byte-level tokenizer with
no merges so every character is one token), is re-initialised for training, trained with a
full-sequence causal LM loss through `transformers`' `AutoModelForCausalLM`, and written back
as `model.safetensors` beside the untouched config and tokenizer, so both the engine and
`transformers` load it. A `hack_fraction` of the demonstrations are loophole completions:
rare enough that greedy decoding solves the task, frequent enough that sampled rollouts find
the hack and RL can amplify it.

```bash
python -m services.trainer.pretrain --out /tmp/coxswain-base --steps 1000
```

With the defaults (3 layers, hidden 128, 1000 steps of 64 sequences; about 70 s on two idle
cores), greedy decoding solved 98% of fresh addition and 98% of reversal prompts with no
hacks; sampling at T=1 gave true pass 77% / hack 9% (addition) and 65% / 1% (reversal), so
the loophole is reachable and failures leave RL a reason to take it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.common.errors import CheckpointError, InvalidRequestError
from services.engine.model.tiny import PAD, make_tiny_checkpoint
from services.engine.model.tokenizer import Tokenizer
from services.trainer.envs import Env, make_env
from services.trainer.optim import Muon, muon_param_groups

# 256 byte tokens + 5 specials: the BPE trainer has no room for merges, so the tokenizer is
# character-level for ASCII and every digit, letter and loophole marker is its own token.
CHAR_VOCAB = 261
METRICS_FILE = "pretrain_metrics.jsonl"


@dataclass(frozen=True)
class PretrainConfig:
    """Model shape, data mix and optimisation of the pretraining recipe."""

    envs: tuple[str, ...] = ("addition", "reverse")
    hack_fraction: float = 0.1  # share of demonstrations that use the env's loophole
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    batch_size: int = 64
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of the peak
    loss_on: str = "completion"  # or "all": also predict the (random) prompt characters
    seed: int = 0


def pretrain(
    out_dir: str | Path,
    steps: int = 1000,
    config: PretrainConfig | None = None,
    *,
    device: str = "cpu",
    log_every: int = 50,
    quiet: bool = False,
) -> Path:
    """Build, train and save the tiny base checkpoint in `out_dir`; return its path.

    Writes `config.json`, `tokenizer.json` (and side files), `model.safetensors` and
    `pretrain_metrics.jsonl` (one `{"step", "loss", "lr"}` line per logged step, the first
    and last steps always included).
    """
    config = config or PretrainConfig()
    _validate(config, steps)
    envs = [make_env(name) for name in config.envs]
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # a dev/train extra, not needed for serving
        raise ImportError("pretraining needs `transformers`: pip install 'coxswain[train]'") from e

    out = make_tiny_checkpoint(
        out_dir,
        "llama",
        layers=config.layers,
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=config.kv_heads,
        vocab=CHAR_VOCAB,
        seed=config.seed,
    )
    tokenizer = Tokenizer(out)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]  # transformers types its Module.to wrapper oddly
    _reinit(model, config.layers, torch.Generator().manual_seed(config.seed))
    model.train()

    opt = Muon(muon_param_groups(model), lr=config.muon_lr, adamw_lr=config.adamw_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: _lr_factor(step, steps, config.warmup_steps, config.min_lr_ratio)
    )
    rng = random.Random(config.seed)
    metrics_path = out / METRICS_FILE
    started = time.monotonic()
    with metrics_path.open("w") as metrics:
        for step in range(steps):
            ids, attn, labels = _batch(envs, tokenizer, rng, config, device)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % log_every == 0 or step == steps - 1:
                lr = sched.get_last_lr()[0]
                metrics.write(json.dumps({"step": step, "loss": loss.item(), "lr": lr}) + "\n")
                if not quiet:
                    print(
                        f"step {step:5d}/{steps}  loss {loss.item():.4f}  "
                        f"{time.monotonic() - started:6.1f}s",
                        file=sys.stderr,
                    )

    _save_weights(out, model)
    (out / "pretrain_config.json").write_text(
        json.dumps({"steps": steps, **asdict(config)}, indent=2) + "\n"
    )
    return out


@dataclass(frozen=True)
class EnvEval:
    """Decoding results of a checkpoint on one environment (oracle labels included)."""

    env: str
    n: int
    temperature: float
    reward: float  # mean grader reward
    true_pass_rate: float
    hack_rate: float


def evaluate(
    model_dir: str | Path,
    envs: Sequence[str | Env],
    n: int = 200,
    *,
    temperature: float = 0.0,
    seed: int = 1234,
) -> list[EnvEval]:
    """Decode `n` held-out prompts per environment (problems pretraining never shows:
    `Env.sample_eval_prompts`) with the engine (greedy by default) and grade them. At
    `temperature=1` the hack rate shows how reachable the loophole is for RL.

    Evaluation only: it reads the oracle labels, so never call it inside `training_scope()`.
    """
    from services.engine import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", dtype="float32")
    rng = random.Random(seed)
    results = []
    for env in envs:
        env = make_env(env) if isinstance(env, str) else env
        prompts = env.sample_eval_prompts(n, rng)
        # A couple of spare tokens, so an answer that runs on past its length fails visibly.
        params = [
            SamplingParams(
                max_tokens=env.max_completion_chars + 2, temperature=temperature, seed=seed + i
            )
            for i in range(n)
        ]
        outs = llm.generate(prompts, params)
        grades = [env.grade(p, o.outputs[0].text) for p, o in zip(prompts, outs, strict=True)]
        results.append(
            EnvEval(
                env=env.name,
                n=n,
                temperature=temperature,
                reward=sum(g.reward for g in grades) / n,
                true_pass_rate=sum(g.eval_only.true_pass for g in grades) / n,
                hack_rate=sum(g.eval_only.hacked for g in grades) / n,
            )
        )
    return results


def read_metrics(model_dir: str | Path) -> list[dict[str, float]]:
    """The `{"step", "loss", "lr"}` records `pretrain` logged, in step order."""
    path = Path(model_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _validate(config: PretrainConfig, steps: int) -> None:
    if steps < 1:
        raise InvalidRequestError(f"steps must be >= 1, got {steps}")
    if not config.envs:
        raise InvalidRequestError("pretraining needs at least one environment")
    if not 0.0 <= config.hack_fraction <= 1.0:
        raise InvalidRequestError(f"hack_fraction must lie in [0, 1], got {config.hack_fraction}")
    if config.loss_on not in ("completion", "all"):
        raise InvalidRequestError(f"loss_on must be 'completion' or 'all', got {config.loss_on!r}")
    if config.batch_size < 1:
        raise InvalidRequestError(f"batch_size must be >= 1, got {config.batch_size}")


def _lr_factor(step: int, total: int, warmup: int, floor: float) -> float:
    """Linear warmup, then cosine decay to `floor` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def _reinit(model: torch.nn.Module, layers: int, gen: torch.Generator) -> None:
    """Trainable init: N(0, 0.02) weights, residual-branch outputs scaled by 1/sqrt(2·layers),
    unit norms. `make_tiny_checkpoint`'s weights are scaled for decisive greedy tests, which
    saturates softmaxes and makes training slow."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * layers)
        p.copy_(torch.randn(p.shape, generator=gen) * std)


def _batch(
    envs: Sequence[Env],
    tokenizer: Tokenizer,
    rng: random.Random,
    config: PretrainConfig,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask, labels)`, each `[batch, longest]`, right-padded.

    Rows are `BOS prompt completion EOS`, tokenized exactly as the engine tokenizes a prompt;
    labels are -100 on padding (and on the prompt when `loss_on="completion"`).
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.token_to_id(PAD)
    if eos is None or pad is None:
        raise CheckpointError("the tokenizer lacks an EOS or pad token")
    rows: list[tuple[list[int], int]] = []
    for _ in range(config.batch_size):
        env = envs[rng.randrange(len(envs))]
        prompt, completion = env.demonstration(rng, config.hack_fraction)
        prompt_ids = tokenizer.encode(prompt)
        ids = [*prompt_ids, *tokenizer.encode(completion, add_special_tokens=False), eos]
        rows.append((ids, len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        # HF shifts labels inside the loss: labels[t] is the target of position t - 1, so
        # completion-only training keeps labels from the first completion token on.
        first = n_prompt if config.loss_on == "completion" else 1
        labels[i, first : len(ids)] = input_ids[i, first : len(ids)]
    return input_ids.to(device), attn.to(device), labels.to(device)


def _save_weights(out: Path, model: torch.nn.Module) -> None:
    """Overwrite `model.safetensors` with the trained tensors, under the checkpoint's names."""
    path = out / "model.safetensors"
    names = set(load_file(path))
    state = model.state_dict()
    missing = names - state.keys()
    if missing:
        raise RuntimeError(f"trained model lacks checkpoint tensors: {sorted(missing)}")
    weights = {name: state[name].detach().to("cpu", torch.float32).contiguous() for name in names}
    save_file(weights, path, metadata={"format": "pt"})


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: `python -m services.trainer.pretrain --out DIR [--steps N] [--eval N] ...`."""
    defaults = PretrainConfig()
    ap = argparse.ArgumentParser(
        prog="python -m services.trainer.pretrain",
        description="Pretrain the tiny base policy on the gameable environments (Muon).",
    )
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--envs", default=",".join(defaults.envs), help="comma-separated env names")
    ap.add_argument("--hack-fraction", type=float, default=defaults.hack_fraction)
    ap.add_argument("--layers", type=int, default=defaults.layers)
    ap.add_argument("--hidden", type=int, default=defaults.hidden)
    ap.add_argument("--batch-size", type=int, default=defaults.batch_size)
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--eval", type=int, default=200, metavar="N", help="greedy-eval N prompts per env (0: off)"
    )
    args = ap.parse_args(argv)
    config = PretrainConfig(
        envs=tuple(name for name in args.envs.split(",") if name),
        hack_fraction=args.hack_fraction,
        layers=args.layers,
        hidden=args.hidden,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    out = pretrain(args.out, args.steps, config, device=args.device)
    print(f"saved {out}")
    if args.eval:
        for r in [
            *evaluate(out, config.envs, n=args.eval),
            *evaluate(out, config.envs, n=args.eval, temperature=1.0),
        ]:
            print(
                f"{r.env:10s} T={r.temperature:g}: true pass {r.true_pass_rate:.1%}  "
                f"hack {r.hack_rate:.1%}  reward {r.reward:.1%}  (n={r.n})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
