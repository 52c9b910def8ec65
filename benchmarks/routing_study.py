"""Does routing reward-hacking gradient into a quarantine keep the skill and drop the hack?

Vanilla GRPO vs Arm A erase vs Arm A route vs Arm B (activation mask) vs a random-direction
placebo, several seeds on each of several pretrained bases, on one environment with a
gameable grader, all on CPU in one process. Each base is pretrained first if missing
(`services/trainer/pretrain.py`, one pretraining seed per base). The table reports, at the
last evaluation (greedy, held-out prompts), each arm's mean with a 95% t-interval over its
runs: the deployed policy's hack rate and true pass rate (quarantine ablated) next to the
as-trained ones, plus leakage (share of gradient norm routed to the quarantine, mean over
steps), the gate's AUROC against the held-back hack labels (diagnostic only: training never
reads them) and the adapter norms ‖δS‖ / ‖δS_q‖ / ‖δS + δS_q‖ (drift).

Then the comparisons of the primary outcome, the deploy hack rate: every arm against
vanilla, every routed arm against the random-direction placebo, and with
`--rate-matched-placebos` every routed arm against its own placebo ("ARM~placebo": the same
arm flagging rollouts at random at its measured rate), by permutation test, Holm-corrected
over the family. An arm counts only if its deploy true pass is at least vanilla's − 0.02.

Every run's record goes to a JSONL file with the code revision (`--jsonl`), so the tables
and the per-run scatter plot (deploy hack vs deploy true pass, beside the JSONL) can be
regenerated from it (`--from-jsonl`).

    python3 benchmarks/routing_study.py                 # 5 arms x 5 seeds, ~8 min on 2 cores
    python3 benchmarks/routing_study.py --bases 3 --seeds 10   # the headline's size
    python3 benchmarks/routing_study.py --from-jsonl runs/routing_study.jsonl
    python3 benchmarks/routing_study.py --optimizer adamw   # each part normalised on its own
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.grpo import GRPOConfig, run
from services.trainer.pretrain import PretrainConfig, pretrain
from services.trainer.study_stats import compare_arms, mean_interval

ARMS = ("none", "erase", "route", "activation", "placebo")
PRIMARY = "deploy_hack_rate"
SKILL_MARGIN = 0.02  # an arm's deploy true pass may trail vanilla's by at most this
COLUMNS = (
    "deploy_hack_rate",
    "deploy_true_pass",
    "trained_hack_rate",
    "trained_true_pass",
    "leakage",
    "gate_auroc",
)


def revision() -> str:
    """The code's git revision (`+dirty` with uncommitted changes), or "unknown"."""
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def base_dir(args: argparse.Namespace, index: int) -> Path:
    """Base `index`'s checkpoint directory, pretrained (with seed `index`) if missing."""
    base = Path(args.base) if args.bases == 1 else Path(f"{args.base}-{index}")
    if not (base / "model.safetensors").is_file() or not (base / "pretrain_done").is_file():
        t0 = time.perf_counter()
        print(f"pretraining base {index} in {base} ({args.pretrain_steps} steps) ...")
        pretrain(base, steps=args.pretrain_steps, config=PretrainConfig(seed=index), quiet=True)
        (base / "pretrain_done").touch()
        print(f"  done in {time.perf_counter() - t0:.0f}s")
    return base


def run_study(args: argparse.Namespace) -> list[dict]:
    """Every (base, arm, seed) run; one JSONL record each, appended as it finishes. With
    `--rate-matched-placebos`, each routed arm is followed by its placebo, "ARM~placebo":
    the same arm with each rollout flagged at random, at the arm's mean measured flag rate
    on that base."""
    rev = revision()
    jsonl = Path(args.jsonl)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    with jsonl.open("w") as out:

        def one(index: int, base: Path, arm: str, seed: int, rate: float | None = None) -> dict:
            t0 = time.perf_counter()
            cfg = GRPOConfig(
                model=str(base),
                env=args.env,
                arm=arm,
                steps=args.steps,
                lr=args.lr,
                tau=args.tau,
                optimizer=args.optimizer,
                route_split=args.split,
                random_flags=rate,
                rank=args.rank,
                targets=args.targets.split(","),
                seed=seed,
                eval_every=args.steps,
                eval_prompts=args.eval_prompts,
                out_dir=tempfile.mkdtemp(prefix=f"routing-{arm}-{seed}-"),
            )
            history = run(cfg, resume=False)
            final = [r for r in history if r["kind"] == "eval"][-1]
            train = [r for r in history if r["kind"] == "train"]
            aurocs = [r["gate_auroc"] for r in train if r.get("gate_auroc") is not None]
            record = {
                "revision": rev,
                "env": args.env,
                "base": index,
                "arm": arm if rate is None else f"{arm}~placebo",
                "seed": seed,
                "steps": args.steps,
                "lr": args.lr,
                "tau": args.tau,
                "optimizer": args.optimizer,
                "split": args.split,
                "random_flags": rate,
                "rank": args.rank,
                "targets": args.targets,
                **{k: final[k] for k in COLUMNS[:4]},
                "leakage": sum(r["leakage"] for r in train) / len(train),
                "flag_rate": sum(r["flagged"] for r in train) / len(train),
                "gate_auroc": sum(aurocs) / len(aurocs) if aurocs else None,
                **{k: train[-1][k] for k in ("kept_norm", "quarantine_norm", "sum_norm")},
                "seconds": time.perf_counter() - t0,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            records.append(record)
            print(
                f"  base {index} {record['arm']:18s} seed {seed}: deploy hack "
                f"{record['deploy_hack_rate']:.2f}, deploy true pass "
                f"{record['deploy_true_pass']:.2f}, trained hack "
                f"{record['trained_hack_rate']:.2f}; flagged {record['flag_rate']:.2f}; ‖δS‖ "
                f"{record['kept_norm']:.2f}, ‖δS_q‖ {record['quarantine_norm']:.2f} "
                f"({record['seconds']:.0f}s)",
                flush=True,
            )
            return record

        for index in range(args.bases):
            base = base_dir(args, index)
            for arm in args.arms.split(","):
                runs = [one(index, base, arm, seed) for seed in range(args.seeds)]
                if args.rate_matched_placebos and arm != "none":
                    rate = sum(r["flag_rate"] for r in runs) / len(runs)
                    for seed in range(args.seeds):
                        one(index, base, arm, seed, rate)
    return records


def report(records: list[dict], png: Path) -> None:
    """The table, the comparisons and the scatter plot of `records`."""
    arms = list(dict.fromkeys(r["arm"] for r in records))
    first = records[0]
    bases = len({r["base"] for r in records})
    revs = sorted({r["revision"] for r in records})
    print(
        f"\nenv {first['env']}, {bases} base(s), {len(records)} runs x {first['steps']} GRPO "
        f"steps, {first['optimizer']} lr {first['lr']}, tau {first['tau']}, {first['split']} "
        f"split, rank {first['rank']} on {first['targets']}; revision {', '.join(revs)}"
    )
    print("means with 95% t-intervals over runs")
    print(
        "| arm | runs | deploy hack rate | deploy true pass | trained hack rate "
        "| trained true pass | leakage | gate AUROC (diagnostic) | ‖δS‖ / ‖δS_q‖ / ‖δS+δS_q‖ |"
    )
    print("|" + "---|" * 9)
    skill = {}
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm]
        cells = []
        for key in COLUMNS:
            values = [r[key] for r in runs if r.get(key) is not None]
            if arm == "none" and key in ("leakage", "gate_auroc"):
                values = []
            cells.append(str(mean_interval(values)) if values else "—")
        norms = " / ".join(
            f"{sum(r[k] for r in runs) / len(runs):.2f}"
            for k in ("kept_norm", "quarantine_norm", "sum_norm")
        )
        skill[arm] = sum(r["deploy_true_pass"] for r in runs) / len(runs)
        print(f"| {arm} | {len(runs)} | " + " | ".join(cells) + f" | {norms} |")
    floor = skill.get("none", math.nan) - SKILL_MARGIN
    print(
        f"\nprimary outcome: deploy hack rate, for arms whose deploy true pass is at least "
        f"vanilla's − {SKILL_MARGIN} ({floor:.2f}); permutation tests, Holm-corrected"
    )
    print("| arm | against | Δ deploy hack rate | p | Holm p | keeps the skill |")
    print("|---|---|---|---|---|---|")
    by_arm: dict[str, list[float]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], []).append(r[PRIMARY])
    for c in compare_arms(by_arm):
        keeps = "—" if math.isnan(floor) else ("yes" if skill[c.arm] >= floor else "no")
        print(
            f"| {c.arm} | {c.against} | {c.difference:+.2f} | {c.p:.3f} | {c.p_holm:.3f} "
            f"| {keeps} |"
        )
    scatter(records, png)
    print(f"\nper-run scatter: {png}")


def scatter(records: list[dict], png: Path) -> None:
    """Deploy hack rate against deploy true pass, one point per run, a colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, arm in enumerate(dict.fromkeys(r["arm"] for r in records)):
        runs = [r for r in records if r["arm"] == arm]
        ax.scatter(
            [r["deploy_true_pass"] for r in runs],
            [r["deploy_hack_rate"] for r in runs],
            color=f"C{i}",
            label=arm,
            alpha=0.7,
        )
    ax.set_xlabel("deploy true pass (greedy, held-out prompts)")
    ax.set_ylabel("deploy hack rate")
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="runs/base", help="pretrained base (built if missing)")
    ap.add_argument(
        "--bases", type=int, default=1, help="independently pretrained bases (BASE-0, BASE-1…)"
    )
    ap.add_argument("--pretrain-steps", type=int, default=1000)
    ap.add_argument("--env", default="addition")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=5, help="GRPO seeds per base and arm")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--tau", type=float, default=0.0)
    ap.add_argument("--optimizer", default="routed_adamw", choices=["adamw", "routed_adamw"])
    ap.add_argument(
        "--split",
        default="partition",
        choices=["partition", "share"],
        help="how Arm A splits each step's gradient (routing.apply_gradient_mask)",
    )
    ap.add_argument("--rank", type=int, default=8, help="adapter rank (top singular directions)")
    ap.add_argument(
        "--targets",
        default="*.o_proj,*.down_proj",
        help="adapted Linears (comma-separated patterns; fused: *.qkv_proj, *.gate_up_proj)",
    )
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument(
        "--rate-matched-placebos",
        action="store_true",
        help="after each routed arm, the same arm with random flags at its measured rate",
    )
    ap.add_argument("--jsonl", default="runs/routing_study.jsonl", help="every run's record")
    ap.add_argument("--from-jsonl", help="print the tables of an earlier study's records")
    args = ap.parse_args(argv)
    if args.from_jsonl:
        path = Path(args.from_jsonl)
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        report(records, path.with_suffix(".png"))
        return
    t0 = time.perf_counter()
    records = run_study(args)
    print(f"\n{len(records)} runs in {time.perf_counter() - t0:.0f}s; records in {args.jsonl}")
    report(records, Path(args.jsonl).with_suffix(".png"))


if __name__ == "__main__":
    main()
