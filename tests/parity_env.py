"""A GRPO environment for tests: rewards a random tiny model's rollouts unevenly; the
fixture that registers it and the small config the GRPO tests start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.trainer.envs import ENVS, Grade
from services.trainer.envs.arithmetic import AdditionEnv
from services.trainer.grpo import GRPOConfig


class ParityEnv(AdditionEnv):
    """Addition prompts; reward when the completion has an even number of characters, so a
    random model's rollouts differ in reward (nonzero advantages) from the first step."""

    name = "parity-test"

    def grade(self, prompt: str, completion: str) -> Grade:
        passed = len(completion) % 2 == 0
        return Grade.of(passed=passed, true_pass=passed and completion.startswith("1"))


@pytest.fixture
def parity_env(monkeypatch):
    """Register `ParityEnv` for the test (use with `pytest.mark.usefixtures`)."""
    monkeypatch.setitem(ENVS, ParityEnv.name, ParityEnv)


def parity_config(path: Path, tmp_path: Path, **kw: Any) -> GRPOConfig:
    """One GRPO step on `ParityEnv`, small enough for CPU tests; `kw` overrides."""
    base = dict(
        model=str(path), env="parity-test", steps=1, prompts_per_step=2, group_size=6,
        eval_prompts=4, hack_pairs=4, lr=0.1, out_dir=str(tmp_path),
    )  # fmt: skip
    return GRPOConfig(**{**base, **kw})
