"""A GRPO environment for tests: rewards a random tiny model's rollouts unevenly."""

from __future__ import annotations

from services.trainer.envs import Grade
from services.trainer.envs.arithmetic import AdditionEnv


class ParityEnv(AdditionEnv):
    """Addition prompts; reward when the completion has an even number of characters, so a
    random model's rollouts differ in reward (nonzero advantages) from the first step."""

    name = "parity-test"

    def grade(self, prompt: str, completion: str) -> Grade:
        passed = len(completion) % 2 == 0
        return Grade.of(passed=passed, true_pass=passed and completion.startswith("1"))
