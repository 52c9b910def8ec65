"""Every example GRPO config validates, one per routing arm, named for its arm."""

from pathlib import Path

import yaml

from services.trainer.grpo import GRPOConfig

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "grpo"


def test_one_valid_example_per_arm():
    arms = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        config = GRPOConfig.model_validate(yaml.safe_load(path.read_text()))
        arms[config.arm] = path.stem
    assert arms == {a: a for a in ("none", "erase", "route", "activation", "placebo")}
