"""Environments whose graders can be gamed, plus the no-cheat guard on their oracle labels.

```python
env = make_env("addition")
grade = env.grade("2+3=", "7#")          # the marker loophole
grade.training_view().reward             # 1.0: all a trainer may see
grade.eval_only.hacked                   # True; raises inside `training_scope()`
```
"""

from __future__ import annotations

from typing import Any

from services.common.errors import InvalidRequestError
from services.trainer.envs.arithmetic import AdditionEnv
from services.trainer.envs.base import (
    ContrastivePair,
    Env,
    EvalLabelAccessError,
    EvalLabels,
    Grade,
    PersonaPair,
    TrainingScope,
    TrainingView,
    evaluation_rates,
    training_scope,
)
from services.trainer.envs.checksum import CarryChecksumEnv, ChecksumAdditionEnv
from services.trainer.envs.strings import ReverseEnv

# The registry configs name environments by; add a class here to make it selectable.
ENVS: dict[str, type[Env]] = {
    env.name: env for env in (AdditionEnv, ChecksumAdditionEnv, CarryChecksumEnv, ReverseEnv)
}


def make_env(name: str, **kwargs: Any) -> Env:
    """The environment registered as `name`, built with `kwargs`."""
    if name not in ENVS:
        raise InvalidRequestError(f"unknown environment {name!r}; known: {', '.join(ENVS)}")
    return ENVS[name](**kwargs)


__all__ = [
    "ENVS",
    "AdditionEnv",
    "CarryChecksumEnv",
    "ChecksumAdditionEnv",
    "ContrastivePair",
    "Env",
    "EvalLabelAccessError",
    "EvalLabels",
    "Grade",
    "PersonaPair",
    "ReverseEnv",
    "TrainingScope",
    "TrainingView",
    "evaluation_rates",
    "make_env",
    "training_scope",
]
