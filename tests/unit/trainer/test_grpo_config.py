"""`GRPOConfig` validation of the routing designs' arms (issue 28: route2, kept-ablated,
route-dropout, expand-route-ablate), and the routing study's names for them mapping onto
valid configs (no training here: the arms' updates are `tests/integration/test_grpo*.py`'s)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pydantic
import pytest

from services.common.errors import InvalidRequestError
from services.trainer.grpo import GRPOConfig, validate_config

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("routing_study", ROOT / "benchmarks/routing_study.py")
study = importlib.util.module_from_spec(spec)
sys.modules["routing_study"] = study  # its dataclasses look their module up
spec.loader.exec_module(study)


def _config(**kw) -> GRPOConfig:
    return GRPOConfig(model="unused", **kw)


@pytest.mark.parametrize("p", [-0.1, 1.5, math.nan])
def test_a_dropout_probability_outside_0_1_is_refused_naming_the_field(p):
    with pytest.raises(InvalidRequestError, match=r"(?s)in cfg\.yaml.*quarantine_dropout"):
        validate_config(
            {"model": "unused", "arm": "route-dropout", "quarantine_dropout": p}, "in cfg.yaml"
        )


@pytest.mark.parametrize(
    "kw",
    [
        {"arm": "route-dropout"},  # the arm without its probability
        {"arm": "route", "quarantine_dropout": 0.25},  # a probability no arm reads
        {"arm": "kept-ablated", "quarantine_dropout": 0.25},
    ],
)
def test_quarantine_dropout_goes_with_arm_route_dropout_and_only_with_it(kw):
    with pytest.raises(
        pydantic.ValidationError, match=r"quarantine_dropout .* goes with arm 'route-dropout'"
    ):
        _config(**kw)


def test_the_designs_take_their_placebo_and_oracle_variants_and_their_quarantines():
    for arm, extra in (("kept-ablated", {}), ("route-dropout", {"quarantine_dropout": 0.5})):
        for variant in ({}, {"random_flags": 0.3}, {"oracle_flags": True}):
            assert _config(arm=arm, **extra, **variant).arm == arm
    # kept-ablated moves no gradient between bases: a LoRA quarantine is its own
    assert _config(arm="kept-ablated", quarantine="lora").quarantine == "lora"
    with pytest.raises(pydantic.ValidationError, match="needs quarantine 'svd'"):
        _config(arm="route-dropout", quarantine_dropout=0.5, quarantine="lora")
    with pytest.raises(pydantic.ValidationError, match=r"kept-ablated.*route_split"):
        _config(arm="kept-ablated", route_split="share")


def test_study_arms_of_the_designs_map_onto_their_configs(tmp_path):
    args = study.parse_args(["--arms", "none," + study.DESIGN_ARMS, "--seeds", "1"])
    runs = study.plan(args)
    names = {r.name for r in runs}
    assert {"kept-ablated~placebo", "route-dropout0.25", "route-dropout0.5~oracle"} <= names
    for run in runs:
        rate = 0.2 if run.variant == "placebo" else None
        cfg = study.run_config(args, run, tmp_path, rate)
        assert cfg.oracle_flags == (run.variant == "oracle") and cfg.random_flags == rate
        if run.arm.startswith("route-dropout"):
            assert cfg.arm == "route-dropout"
            assert cfg.quarantine_dropout == float(run.arm.removeprefix("route-dropout"))
        elif run.arm.startswith("expand-route-ablate"):
            assert cfg.arm == "expand-route-ablate" and cfg.quarantine_dropout is None
        else:
            assert cfg.arm == run.arm.removesuffix("-token") and cfg.quarantine_dropout is None
    for bad in ("route-dropout", "route-dropout1.5", "route-dropoutx", "kept-ablated~twice"):
        with pytest.raises(SystemExit, match="unknown arm"):
            study.parse_arm(bad)
    assert study.parse_arm("route-dropout0.25~placebo") == ("route-dropout0.25", "placebo")


def test_route2_needs_a_lora_quarantine_and_takes_its_variants_per_rollout_and_per_token():
    """route2 (design a) routes into a quarantine of its own basis: the same-basis δS_q, or
    a step split that route2 does not use, is refused with the setting to change. Per
    rollout it takes random and oracle flags; per token random flags (per token) but not
    the oracle's, which label rollouts (their bound is the per-rollout run)."""
    for bad in ({}, {"quarantine": "svd"}, {"quarantine": "lora", "route_split": "recentre"}):
        with pytest.raises(pydantic.ValidationError, match=r"route2.*quarantine 'lora'"):
            _config(arm="route2", **bad)
    with pytest.raises(InvalidRequestError, match=r"(?s)in cfg\.yaml.*set quarantine 'lora'"):
        validate_config({"model": "unused", "arm": "route2"}, "in cfg.yaml")
    lora = {"arm": "route2", "quarantine": "lora"}
    for variant in ({}, {"random_flags": 0.3}, {"oracle_flags": True}):
        assert _config(**lora, **variant).arm == "route2"
    token = {**lora, "activation_granularity": "token"}
    assert _config(**token, random_flags=0.3).random_flags == 0.3
    with pytest.raises(pydantic.ValidationError, match="activation_granularity"):
        _config(**token, oracle_flags=True)
    with pytest.raises(pydantic.ValidationError, match="activation_granularity"):
        _config(arm="activation", activation_granularity="token", random_flags=0.3)
    with pytest.raises(pydantic.ValidationError, match="use arm 'route2'"):
        _config(arm="route", quarantine="lora")


def test_study_arms_of_route2_train_a_lora_quarantine_and_record_it(tmp_path):
    """The study's route2 arms train with a LoRA quarantine and the partition split whatever
    `--quarantine` and `--split` say, and their records say so (and `--resume` keeps
    them); route2-token flags tokens, its placebo at its measured token rate, and has no
    oracle of its own (the labels flag rollouts: its bound is route2~oracle)."""
    argv = ["--arms", "none," + study.DESIGN_ARMS, "--seeds", "1", "--split", "recentre"]
    args = study.parse_args(argv)
    runs = {r.name: r for r in study.plan(args)}
    assert {"route2", "route2~placebo", "route2~oracle", "route2-token"} <= set(runs)
    assert "route2-token~placebo" in runs and "route2-token~oracle" not in runs
    for name, token in (("route2", False), ("route2~oracle", False), ("route2-token", True)):
        cfg = study.run_config(args, runs[name], tmp_path, None)
        assert (cfg.arm, cfg.quarantine, cfg.route_split) == ("route2", "lora", "partition")
        assert (cfg.activation_granularity == "token") == token
        assert cfg.oracle_flags == name.endswith("oracle")
    placebo = study.run_config(args, runs["route2-token~placebo"], tmp_path, 0.2)
    assert placebo.random_flags == 0.2 and placebo.activation_granularity == "token"
    assert study.run_config(args, runs["kept-ablated"], tmp_path, None).quarantine == "svd"
    with pytest.raises(SystemExit, match="route2~oracle"):
        study.parse_arm("route2-token~oracle")
    common = {
        "revision": "r",
        "env": args.env,
        **{k: getattr(args, k) for k in study.CONFIG_KEYS[1:]},
    }
    history = [
        {"kind": "eval", "deploy_hack_rate": 0.0},
        {"kind": "train", "leakage": 0.1, "flagged": 0.5, "token_flag_rate": 0.25,
         "kept_norm": 1.0, "quarantine_norm": 0.0, "sum_norm": 1.0},
    ]  # fmt: skip
    (record,) = study.run_records(runs["route2-token"], history, 1.0, common, None, False)
    assert (record["quarantine"], record["split"], record["token_flag_rate"]) == (
        "lora", "partition", 0.25
    )  # fmt: skip
    path = tmp_path / "study.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert study.earlier_records(path, common) == [record]


ERA = {"arm": "expand-route-ablate", "quarantine": "lora", "quarantine_extra_rank": 4}


def test_expand_route_ablate_widens_its_lora_quarantine_and_alone_takes_coherence_steps():
    """Design d: route2's quarantine with rank + quarantine_extra_rank, its variants as
    route2's; the extra rank and the coherence steps go with this arm only, and the LoRA's
    rank is not set twice."""
    cfg = _config(**ERA, rank=8, coherence_steps=3)
    assert (cfg.quarantine_rank, cfg.coherence_steps) == (12, 3)
    assert _config(**ERA).coherence_steps == 0  # K = 0: no coherence phase
    for variant in (
        {"random_flags": 0.3},
        {"oracle_flags": True},
        {"gate_calibration": "midpoint"},
    ):
        assert _config(**ERA, **variant).arm == "expand-route-ablate"
    with pytest.raises(pydantic.ValidationError, match=r"expand-route-ablate.*quarantine 'lora'"):
        _config(arm="expand-route-ablate", quarantine_extra_rank=4)
    with pytest.raises(pydantic.ValidationError, match="quarantine_extra_rank"):
        _config(arm="expand-route-ablate", quarantine="lora")
    with pytest.raises(pydantic.ValidationError, match="quarantine_extra_rank"):
        _config(arm="route2", quarantine="lora", quarantine_extra_rank=4)
    with pytest.raises(pydantic.ValidationError, match="leave lora_rank unset"):
        _config(**ERA, lora_rank=4)
    with pytest.raises(pydantic.ValidationError, match="coherence_steps"):
        _config(arm="route2", quarantine="lora", coherence_steps=2)
    with pytest.raises(pydantic.ValidationError, match="coherence_steps"):
        _config(**ERA, coherence_steps=-1)
    assert _config(arm="route2", quarantine="lora", lora_rank=3).quarantine_rank == 3


def test_study_arms_of_expand_route_ablate_name_their_coherence_steps(tmp_path):
    """`expand-route-ablate-KN` trains route2's routing with a quarantine of twice the kept
    rank and N coherence steps, with a LoRA quarantine whatever `--quarantine` says; the
    headline's defaults report K = 0 and 4, each with its placebo and oracle."""
    args = study.parse_args(["--arms", "none," + study.DESIGN_ARMS, "--seeds", "1"])
    runs = {r.name: r for r in study.plan(args)}
    for k in study.ERA_KS:
        for variant in ("", "~placebo", "~oracle"):
            run = runs[f"expand-route-ablate-K{k}{variant}"]
            cfg = study.run_config(args, run, tmp_path, 0.2 if variant == "~placebo" else None)
            assert (cfg.arm, cfg.quarantine, cfg.route_split) == (
                "expand-route-ablate", "lora", "partition"
            )  # fmt: skip
            assert (cfg.coherence_steps, cfg.quarantine_rank) == (k, 2 * args.rank)
            assert cfg.oracle_flags == (variant == "~oracle")
    assert study.parse_arm("expand-route-ablate-K12~oracle") == (
        "expand-route-ablate-K12",
        "oracle",
    )
    for bad in ("expand-route-ablate", "expand-route-ablate-K", "expand-route-ablate-Kx"):
        with pytest.raises(SystemExit, match="unknown arm"):
            study.parse_arm(bad)
    study_settings = {"quarantine": "svd", "split": "share"}
    trained = study.as_run("expand-route-ablate-K4~placebo", study_settings)
    assert trained == {"quarantine": "lora", "split": "partition"}
