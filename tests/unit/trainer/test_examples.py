"""Every example GRPO config validates; each routing arm has one named for it."""

from pathlib import Path

import yaml

from services.trainer.grpo import GRPOConfig

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "grpo"


def test_every_example_validates_and_each_arm_has_one():
    configs = {
        path.stem: GRPOConfig.model_validate(yaml.safe_load(path.read_text()))
        for path in sorted(EXAMPLES.glob("*.yaml"))
    }
    arms = ("none", "erase", "route", "activation", "placebo", "kept-ablated", "route-dropout")
    for arm in (*arms, "route2", "expand-route-ablate"):
        assert configs[arm].arm == arm
    assert configs["route2"].quarantine == "lora"
    era = configs["expand-route-ablate"]
    assert (era.quarantine_rank, era.coherence_steps) == (era.rank + 8, 4)
    assert configs["route-dropout"].quarantine_dropout == 0.25
    assert configs["lora-activation"].quarantine == "lora"
    assert configs["async-route"].rollout_mode == "async"
    probe = configs["checksum-probe"]
    assert (probe.env, probe.activation_space, probe.hack_pairs_from) == (
        "checksum", "residual", "persona"
    )  # fmt: skip
