"""The engine's end of the async controller: read-outs out to Redis, actions back in.

`EngineLink` attaches to an `AsyncLLM`. After every engine step its listener turns the
step's deltas (the new tokens and their read-outs) into small entries in a bounded in-memory
buffer (nothing else: the step never waits on Redis). A flusher thread XADDs them to the
read-out stream; a drainer thread pops this replica's action queue and hands each action to
`engine.submit_action`, so it applies at the top of the next step. When Redis is down both
threads back off and retry; the buffer keeps the newest entries and counts the ones it had
to drop as lost.

Which requests are published: every token of a request that asked for `readouts`; for a
request with a `conversation_id` but no read-outs, its first token and its finish, so the
latch policy sees the conversation's later requests start.

Inside a Ray worker (an engine replica of the Serve app) the counters are also Ray metrics,
which Ray exports to Prometheus from every node (`ray_coxswain_engine_link_readouts_total`
by replica and outcome: produced, published, lost; `..._actions_total`: received,
submitted, malformed, dropped; `..._redis_errors_total`), so lost read-outs show on a
dashboard, not only in `counters()`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import redis

from services.common.errors import InvalidRequestError
from services.controller.connection import REDIS_DOWN, REDIS_ERRORS, Backoff, connect
from services.controller.messages import (
    ACTION_SOURCE_PREFIX,
    READOUT_STREAM,
    ReadoutEntry,
    action_queue_key,
    decode_action,
    encode_entry,
)
from services.engine.async_llm import AsyncLLM
from services.engine.outputs import CompletionDelta, RequestDelta

log = logging.getLogger(__name__)


class EngineLink:
    """Publishes an engine replica's read-outs to Redis and feeds it the controller's actions.

    `buffer_size` bounds the entries waiting for Redis (overflow drops the oldest: a control
    loop wants fresh read-outs more than stale ones); the stream is trimmed to about
    `stream_maxlen` entries. `block_s` is how long the drainer's BRPOP waits, and so about
    how long `close()` takes.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        redis_url: str,
        replica_id: str,
        *,
        stream: str = READOUT_STREAM,
        stream_maxlen: int = 100_000,
        buffer_size: int = 8192,
        batch_size: int = 512,
        block_s: float = 0.25,
        backoff_max_s: float = 2.0,
    ) -> None:
        if not replica_id:
            raise InvalidRequestError("an engine link needs a non-empty replica id")
        if buffer_size < 1 or batch_size < 1 or stream_maxlen < 1:
            raise InvalidRequestError("buffer_size, batch_size and stream_maxlen must be >= 1")
        self.llm, self.redis_url, self.replica_id = llm, redis_url, replica_id
        self.stream, self.stream_maxlen = stream, stream_maxlen
        self.buffer_size, self.batch_size, self.block_s = buffer_size, batch_size, block_s
        self.queue_key = action_queue_key(replica_id)
        self._backoff_max_s = backoff_max_s

        self._buffer: deque[ReadoutEntry] = deque()
        self._lock = threading.Lock()  # the buffer and every counter below
        self._wake = threading.Event()
        self._stop = threading.Event()

        self.produced = self.published = self.lost = self.publish_errors = 0
        self.received = self.submitted = self.malformed = self.dropped = 0
        self.reconnects = 0
        self.last_error: str | None = None  # while a thread's Redis calls fail; then None
        self.last_rejection: str | None = None
        self._down = {"flusher": False, "drainer": False}

        self._metrics = _RayMetrics.for_replica(replica_id)
        llm.add_listener(self._on_outputs)
        self._threads = [
            threading.Thread(target=self._flush_loop, name=f"link-flush-{replica_id}", daemon=True),
            threading.Thread(target=self._drain_loop, name=f"link-drain-{replica_id}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- engine thread -------------------------------------------------------------------

    def _on_outputs(self, deltas: Sequence[RequestDelta]) -> None:
        """The AsyncLLM listener: buffer this step's new entries, never touching Redis."""
        if self._stop.is_set():
            return
        entries: list[ReadoutEntry] = []
        for delta in deltas:
            for sample in delta.samples:
                entries.extend(self._entries(delta, sample))
        if not entries:
            return
        with self._lock:
            self.produced += len(entries)
            self._buffer.extend(entries)
            overflow = len(self._buffer) - self.buffer_size
            for _ in range(max(0, overflow)):  # the oldest go first
                self._buffer.popleft()
            self.lost += max(0, overflow)
        self._wake.set()

    def _entries(self, delta: RequestDelta, sample: CompletionDelta) -> list[ReadoutEntry]:
        """The entries of one sample's delta: each new token's read-outs (or, without
        read-outs, only the first token of a conversation's request), and its finish."""
        n = len(sample.token_ids)
        if sample.readouts is not None:
            count = n
        elif delta.conversation_id is not None and sample.index == 0:
            count = 1 if sample.token_offset == 0 and n else 0  # token 0 only
        else:
            return []
        finish = sample.finish_reason
        entries = [
            ReadoutEntry(
                replica=self.replica_id,
                request_id=delta.request_id,
                sample=sample.index,
                token=sample.token_offset + i,
                scores=dict(sample.readouts[i]) if sample.readouts is not None else {},
                conversation_id=delta.conversation_id,
                finish_reason=finish if i == n - 1 else None,
            )
            for i in range(count)
        ]
        if finish is not None and (not entries or entries[-1].finish_reason is None):
            entries.append(  # no token carried it
                ReadoutEntry(
                    replica=self.replica_id,
                    request_id=delta.request_id,
                    sample=sample.index,
                    token=None,
                    conversation_id=delta.conversation_id,
                    finish_reason=finish,
                )
            )
        return entries

    # -- background threads --------------------------------------------------------------

    def _flush_loop(self) -> None:
        client = connect(self.redis_url)
        backoff = Backoff(self._stop, max_s=self._backoff_max_s)
        while not self._stop.is_set():
            self._wake.wait(timeout=self.block_s)
            self._wake.clear()
            while not self._stop.is_set() and self._flush_batch(client):
                backoff.reset()
            if self._metrics is not None:
                self._metrics.export(self._totals())
            if self._down["flusher"] and backoff.wait():
                return

    def _flush_batch(self, client: redis.Redis) -> bool:
        """XADD one batch; False when the buffer was empty or Redis failed."""
        with self._lock:
            batch = [self._buffer.popleft() for _ in range(min(self.batch_size, len(self._buffer)))]
        if not batch:
            return False
        try:
            pipe = client.pipeline(transaction=False)
            for entry in batch:
                fields: Any = encode_entry(entry)
                pipe.xadd(self.stream, fields, maxlen=self.stream_maxlen, approximate=True)
            pipe.execute()
        except REDIS_DOWN as e:
            self._failed("flusher", e)
            self._requeue(batch)
            return False
        except Exception as e:  # e.g. WRONGTYPE (the key holds something else): unwritable
            if not isinstance(e, redis.ResponseError):
                log.exception("replica %s: publishing read-outs failed", self.replica_id)
            self._failed("flusher", e)
            with self._lock:
                self.lost += len(batch)
            return False
        self._succeeded("flusher")
        with self._lock:
            self.published += len(batch)
        return True

    def _requeue(self, batch: list[ReadoutEntry]) -> None:
        """Put an unsent batch back in front of newer entries, dropping the oldest on overflow."""
        with self._lock:
            room = self.buffer_size - len(self._buffer)
            keep = batch[len(batch) - room :] if room < len(batch) else batch
            self.lost += len(batch) - len(keep)
            self._buffer.extendleft(reversed(keep))

    def _drain_loop(self) -> None:
        client = connect(self.redis_url, block_s=self.block_s)
        backoff = Backoff(self._stop, max_s=self._backoff_max_s)
        while not self._stop.is_set():
            try:
                popped: Any = client.brpop([self.queue_key], timeout=self.block_s)
                raws = [popped[1]] if popped else []
                if raws:  # take what else is queued in the same round trip's wake
                    more: Any = client.rpop(self.queue_key, self.batch_size - 1)
                    raws += more or []
            except REDIS_ERRORS as e:
                self._failed("drainer", e)
                if backoff.wait():
                    return
                continue
            self._succeeded("drainer")
            backoff.reset()
            for raw in raws:
                self._submit(raw)

    def _submit(self, raw: str) -> None:
        with self._lock:
            self.received += 1
        try:
            action, source = decode_action(raw)
            ok = self.llm.engine.submit_action(action, ACTION_SOURCE_PREFIX + (source or "unnamed"))
        except Exception as e:  # malformed on the wire: rejected, never fatal to the drainer
            reason = str(e) if isinstance(e, InvalidRequestError) else repr(e)
            log.warning("replica %s: rejected an action from Redis: %s", self.replica_id, reason)
            with self._lock:
                self.malformed += 1
                self.last_rejection = reason
            return
        with self._lock:
            if ok:
                self.submitted += 1
            else:  # the engine's own queue is full: it dropped the newest (this one)
                self.dropped += 1

    def _failed(self, who: str, exc: Exception) -> None:
        with self._lock:
            if who == "flusher":
                self.publish_errors += 1
            if not self._down[who]:
                log.warning("replica %s: Redis %s failed: %r", self.replica_id, who, exc)
            self._down[who] = True
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _succeeded(self, who: str) -> None:
        with self._lock:
            if self._down[who]:
                self.reconnects += 1
                log.info("replica %s: Redis %s reconnected", self.replica_id, who)
            self._down[who] = False
            if not any(self._down.values()):
                self.last_error = None  # recovered: the failures stay counted

    def _totals(self) -> dict[tuple[str, str], int]:
        """(metric, outcome) -> count, for `_RayMetrics`."""
        with self._lock:
            return {
                ("readouts", "produced"): self.produced,
                ("readouts", "published"): self.published,
                ("readouts", "lost"): self.lost,
                ("actions", "received"): self.received,
                ("actions", "submitted"): self.submitted,
                ("actions", "malformed"): self.malformed,
                ("actions", "dropped"): self.dropped,
                ("redis_errors", ""): self.publish_errors,
            }

    # -- public --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """False while either thread's last Redis call failed."""
        with self._lock:
            return not any(self._down.values())

    def counters(self) -> dict[str, Any]:
        """Read-out and action counters for dashboards and tests. `applied` and `rejected`
        come from the engine's steering snapshot (all `controller/...` sources); `rejected`
        adds actions that were malformed on the wire. Not callable from the engine thread."""
        queue = self.llm.call(lambda engine: engine.steering_snapshot()["queue"])

        def ours(counts: dict[str, int]) -> int:
            return sum(v for k, v in counts.items() if k.startswith(ACTION_SOURCE_PREFIX))

        engine_rejections = {
            k: v for k, v in queue["last_rejection"].items() if k.startswith(ACTION_SOURCE_PREFIX)
        }
        with self._lock:
            return {
                "replica": self.replica_id,
                "connected": not any(self._down.values()),
                "reconnects": self.reconnects,
                "last_error": self.last_error,
                "readouts": {
                    "produced": self.produced,
                    "published": self.published,
                    "buffered": len(self._buffer),
                    "lost": self.lost,
                    "publish_errors": self.publish_errors,
                },
                "actions": {
                    "received": self.received,
                    "submitted": self.submitted,
                    "applied": ours(queue["applied"]),
                    "rejected": ours(queue["rejected"]) + self.malformed,
                    "malformed": self.malformed,
                    "dropped": self.dropped,
                    "last_rejection": self.last_rejection,
                    "engine_rejections": engine_rejections,
                },
            }

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop both threads after one last attempt to publish what is buffered. The listener
        stays registered with the AsyncLLM but does nothing from now on."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout_s)
        client = connect(self.redis_url, timeout_s=0.5)
        try:
            while self._flush_batch(client):
                pass
        finally:
            client.close()
        if self._metrics is not None:
            self._metrics.export(self._totals())

    def __enter__(self) -> EngineLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RayMetrics:
    """An engine link's counters as Ray metrics (Ray exports them to Prometheus), fed the
    link's running totals: each `export` adds what grew since the last one."""

    def __init__(self, replica_id: str) -> None:
        from ray.util.metrics import Counter

        def counter(name: str, doc: str, outcome: bool = True) -> Counter:
            keys = ("replica", "outcome") if outcome else ("replica",)
            return Counter(f"coxswain_engine_link_{name}", description=doc, tag_keys=keys)

        self.replica_id = replica_id
        self.counters = {
            "readouts": counter("readouts", "Read-outs by outcome: produced, published, lost."),
            "actions": counter(
                "actions", "Controller actions by outcome: received, submitted, malformed, dropped."
            ),
            "redis_errors": counter("redis_errors", "Failed read-out publishes.", outcome=False),
        }
        self._sent: dict[tuple[str, str], int] = {}

    @classmethod
    def for_replica(cls, replica_id: str) -> _RayMetrics | None:
        """Metrics when this process is a Ray worker (else None: nothing would export them)."""
        try:
            import ray
        except ImportError:
            return None
        return cls(replica_id) if ray.is_initialized() else None

    def export(self, totals: dict[tuple[str, str], int]) -> None:
        for (name, outcome), total in totals.items():
            grown = total - self._sent.get((name, outcome), 0)
            if grown > 0:
                tags = {"replica": self.replica_id, **({"outcome": outcome} if outcome else {})}
                self.counters[name].inc(grown, tags=tags)
                self._sent[name, outcome] = total
