"""The routing study's plan: which runs it trains, in what order a pool may start them, and
which earlier records `--resume` keeps (no training here; the runs themselves are
`tests/integration/test_grpo.py`'s)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("routing_study", ROOT / "benchmarks/routing_study.py")
study = importlib.util.module_from_spec(spec)
sys.modules["routing_study"] = study  # its dataclasses look their module up
spec.loader.exec_module(study)

ARMS = "base,none,activation,activation~placebo"


def test_plan_is_base_by_base_arm_by_arm_seed_by_seed_and_trains_no_base_arm():
    runs = study.plan(study.parse_args(["--arms", ARMS, "--bases", "2", "--seeds", "2"]))
    assert [(r.base, r.name, r.seed) for r in runs] == [
        (b, arm, s)
        for b in range(2)
        for arm in ("none", "activation", "activation~placebo")
        for s in range(2)
    ]


@pytest.mark.parametrize(
    ("arms", "message"),
    [("base,activation", "add arm 'none'"), ("none,probe~placebo", "add arm 'probe'")],
)
def test_plan_refuses_an_arm_whose_reference_is_missing(arms, message):
    with pytest.raises(SystemExit, match=message):
        study.plan(study.parse_args(["--arms", arms]))


def test_a_placebo_waits_for_every_run_of_its_arm_on_its_base_only():
    placebo = study.Run(0, "activation", "placebo", 3)
    arm_b0, arm_b1 = study.Run(0, "activation", None, 9), study.Run(1, "activation", None, 0)
    other = study.Run(0, "probe", None, 0)
    assert not study.ready(placebo, [arm_b0, other])
    assert study.ready(placebo, [arm_b1, other, placebo])
    assert study.ready(arm_b0, [arm_b0, arm_b1])


def test_resume_keeps_records_of_the_same_configuration_and_refuses_others(tmp_path):
    parsed = study.parse_args(["--arms", ARMS])
    common = {"revision": "r", "env": parsed.env}
    common.update({k: getattr(parsed, k) for k in study.CONFIG_KEYS[1:]})
    run = {**common, "arm": "none", "base": 0, "seed": 0}
    legacy = {k: v for k, v in run.items() if k != "quarantine"}  # before --quarantine
    zero = {**run, "arm": "base", "steps": 0}  # a base record's steps are 0
    path = tmp_path / "study.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (zero, run, legacy)))
    assert study.earlier_records(path, common) == [zero, run, legacy]
    path.write_text(json.dumps({**run, "lr": 0.5}) + "\n")
    with pytest.raises(SystemExit, match=r"another configuration.*'lr': \(0.5, 0.05\)"):
        study.earlier_records(path, common)
    assert study.earlier_records(tmp_path / "absent.jsonl", common) == []
