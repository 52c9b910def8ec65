"""Does routing reward-hacking gradient into a quarantine keep the skill and drop the hack?

Vanilla GRPO vs Arm A erase vs Arm A route vs Arm B (activation mask) vs a random-direction
placebo, several seeds each, on one environment with a gameable grader, all on CPU in one
process. Each run starts from the same pretrained tiny base policy (built first if missing:
`services/trainer/pretrain.py`). The table reports, at the last evaluation (greedy, held-out
prompts), the deployed policy's hack rate and true pass rate (quarantine ablated) next to
the as-trained ones, plus leakage (share of gradient norm routed to the quarantine, mean over
steps) and the gate's AUROC against the held-back hack labels (diagnostic only: training
never reads them).

    python3 benchmarks/routing_study.py                 # 5 arms x 5 seeds, ~8 min on 2 cores
    python3 benchmarks/routing_study.py --seeds 5 --steps 200 --env reverse
    python3 benchmarks/routing_study.py --optimizer adamw   # each part normalised on its own
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.grpo import GRPOConfig, run
from services.trainer.pretrain import pretrain

ARMS = ("none", "erase", "route", "activation", "placebo")


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {std:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="runs/base", help="pretrained base (built if missing)")
    ap.add_argument("--pretrain-steps", type=int, default=1000)
    ap.add_argument("--env", default="addition")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=5)
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
    args = ap.parse_args()

    base = Path(args.base)
    if not (base / "model.safetensors").is_file() or not (base / "pretrain_done").is_file():
        t0 = time.perf_counter()
        print(f"pretraining the base policy in {base} ({args.pretrain_steps} steps) ...")
        pretrain(base, steps=args.pretrain_steps)
        (base / "pretrain_done").touch()
        print(f"  done in {time.perf_counter() - t0:.0f}s")

    rows = []
    t_all = time.perf_counter()
    for arm in args.arms.split(","):
        finals, leaks, aurocs, norms = [], [], [], []
        for seed in range(args.seeds):
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
                rank=args.rank,
                targets=args.targets.split(","),
                seed=seed,
                eval_every=args.steps,
                eval_prompts=args.eval_prompts,
                out_dir=tempfile.mkdtemp(prefix=f"routing-{arm}-{seed}-"),
            )
            records = run(cfg, resume=False)
            final = [r for r in records if r["kind"] == "eval"][-1]
            train = [r for r in records if r["kind"] == "train"]
            finals.append(final)
            leaks.append(statistics.fmean(r["leakage"] for r in train))
            norms.append(tuple(train[-1][k] for k in ("kept_norm", "quarantine_norm", "sum_norm")))
            scores = [r["gate_auroc"] for r in train if r.get("gate_auroc") is not None]
            if scores:
                aurocs.append(statistics.fmean(scores))
            print(
                f"  {arm:10s} seed {seed}: deploy hack {final['deploy_hack_rate']:.2f}, deploy "
                f"true pass {final['deploy_true_pass']:.2f}, trained hack "
                f"{final['trained_hack_rate']:.2f}; ‖δS‖ {norms[-1][0]:.2f}, ‖δS_q‖ "
                f"{norms[-1][1]:.2f}, ‖δS+δS_q‖ {norms[-1][2]:.2f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        rows.append(
            (
                arm,
                _mean_std([f["deploy_hack_rate"] for f in finals]),
                _mean_std([f["deploy_true_pass"] for f in finals]),
                _mean_std([f["trained_hack_rate"] for f in finals]),
                _mean_std([f["trained_true_pass"] for f in finals]),
                _mean_std(leaks) if arm != "none" else "—",
                _mean_std(aurocs) if aurocs else "—",
                " / ".join(_mean_std([n[j] for n in norms]) for j in range(3)),
            )
        )
    print()
    print(
        f"env {args.env}, {args.seeds} seeds x {args.steps} GRPO steps per arm, "
        f"{args.optimizer} lr {args.lr}, tau {args.tau}, {args.split} split, rank {args.rank} "
        f"on {args.targets}; "
        f"greedy eval on {args.eval_prompts} held-out prompts; "
        f"{time.perf_counter() - t_all:.0f}s"
    )
    header = (
        "| arm | deploy hack rate | deploy true pass | trained hack rate | trained true pass "
        "| leakage | gate AUROC (diagnostic) | ‖δS‖ / ‖δS_q‖ / ‖δS+δS_q‖ |"
    )
    print(header)
    print("|" + "---|" * 8)
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
