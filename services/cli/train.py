"""`coxswain train grpo` (here, or in a Ray actor with `--ray`) and `train pretrain` (which
reads its own flags).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from services.common.errors import CoxswainError


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
