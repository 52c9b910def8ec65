"""What a controller keeps in Redis so that a restart (a new process, or Ray restarting its
actor) resumes where it stopped: its policy configs and each latch policy's latched
conversations.

Keys, per consumer group (the controllers of one cluster share them):
- `coxswain:controller:<group>:policies`: the policy configs, a JSON list in the order they
  were added. Written before an admin change returns, so a change the caller saw succeed is
  never lost; absent until the first write (then the controller's own seed policies apply).
- `coxswain:controller:<group>:latched:<policy>`: a sorted set of conversation ids scored by
  when they last latched (the LRU order `max_conversations` evicts in). Written before the
  read-outs that latched them are acknowledged.

Other policy state (a scale policy's gains, a monitor's firing window) is rebuilt from the
read-outs that follow.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import redis

_PREFIX = "coxswain:controller:"


def policies_key(group: str) -> str:
    return f"{_PREFIX}{group}:policies"


def latched_key(group: str, policy: str) -> str:
    return f"{_PREFIX}{group}:latched:{policy}"


def load_policies(client: redis.Redis, group: str) -> list[dict[str, Any]] | None:
    """The stored policy configs (dicts), or None when none were ever stored."""
    raw: Any = client.get(policies_key(group))
    return None if raw is None else json.loads(raw)


def save_policies(
    client: redis.Redis, group: str, configs: Iterable[Any], dropped: Iterable[str] = ()
) -> None:
    """Store the policy configs (pydantic models) and forget the latches of `dropped`
    policies (removed, or replaced by a changed config), in one transaction."""
    payload = json.dumps([c.model_dump(mode="json") for c in configs])
    pipe = client.pipeline(transaction=True)
    pipe.set(policies_key(group), payload)
    for name in dropped:
        pipe.delete(latched_key(group, name))
    pipe.execute()


def load_latched(client: redis.Redis, group: str, policy: str, limit: int) -> list[str]:
    """A latch policy's latched conversations, least recently latched first (at most the
    `limit` most recent)."""
    ids: Any = client.zrange(latched_key(group, policy), -limit, -1)
    return list(ids)


def save_latches(
    client: redis.Redis,
    group: str,
    latched: Mapping[str, Mapping[str, float]],
    evicted: Mapping[str, Iterable[str]],
) -> None:
    """Record conversations that latched (policy -> {conversation: when}) and drop the ones
    a policy evicted. Idempotent, so a batch retried after an outage writes it again."""
    pipe = client.pipeline(transaction=False)
    for policy, conversations in latched.items():
        if conversations:
            pipe.zadd(latched_key(group, policy), dict(conversations))
    for policy, gone in evicted.items():
        if names := list(gone):
            pipe.zrem(latched_key(group, policy), *names)
    pipe.execute()
