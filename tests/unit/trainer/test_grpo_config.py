"""`GRPOConfig` validation of the routing designs' arms (issue 28: kept-ablated, route-dropout),
and the routing study's names for them mapping onto valid configs (no training here: the
arms' updates are `tests/integration/test_grpo.py`'s)."""

from __future__ import annotations

import importlib.util
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
        else:
            assert cfg.arm == run.arm and cfg.quarantine_dropout is None
    for bad in ("route-dropout", "route-dropout1.5", "route-dropoutx", "kept-ablated~twice"):
        with pytest.raises(SystemExit, match="unknown arm"):
            study.parse_arm(bad)
    assert study.parse_arm("route-dropout0.25~placebo") == ("route-dropout0.25", "placebo")
