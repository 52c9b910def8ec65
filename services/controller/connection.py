"""Redis clients that fail fast, and the backoff between reconnection attempts.

redis-py retries a failed command itself (ten times, with backoff) by default; the engine
link and the controller instead see the failure at once, count it, and retry on their own
schedule, so a Redis outage never stalls a thread for longer than one backoff step and every
loss is counted where it happens.
"""

from __future__ import annotations

import random
import threading

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# The failures that mean "Redis is unreachable or restarting": reconnect and retry later.
# Anything else (a ResponseError such as WRONGTYPE) is a problem with what we sent.
REDIS_DOWN: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (restarting from disk)
    redis.exceptions.TimeoutError,
)
# Either of those, or Redis refusing a command (WRONGTYPE, OOM, NOGROUP, ...).
REDIS_ERRORS: tuple[type[Exception], ...] = (*REDIS_DOWN, redis.exceptions.ResponseError)


def connect(url: str, *, block_s: float = 0.0, timeout_s: float = 2.0) -> redis.Redis:
    """A client for `url` that raises on the first failure. `block_s` is the longest blocking
    read this client will issue (its socket timeout must outlast it)."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=block_s + timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


class Backoff:
    """Exponential backoff with jitter: `wait()` sleeps the next delay (or until `stop` is
    set, returning True then); `reset()` after a success."""

    def __init__(
        self,
        stop: threading.Event,
        *,
        initial_s: float = 0.05,
        max_s: float = 2.0,
        factor: float = 2.0,
    ) -> None:
        self.stop, self.initial_s, self.max_s, self.factor = stop, initial_s, max_s, factor
        self.delay_s = initial_s
        self.failures = 0  # consecutive

    def wait(self) -> bool:
        self.failures += 1
        # jitter in [delay/2, delay]: replicas that lost Redis together do not come back in
        # lockstep
        delay = self.delay_s * random.uniform(0.5, 1.0)
        self.delay_s = min(self.max_s, self.delay_s * self.factor)
        return self.stop.wait(delay)

    def reset(self) -> None:
        self.delay_s = self.initial_s
        self.failures = 0
