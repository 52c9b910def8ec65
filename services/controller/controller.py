"""The async steering controller: read-outs from a Redis stream, policies, actions to replicas.

One background thread reads the read-out stream as a member of a consumer group (so several
controllers share the work and a dead one's entries are reclaimed), runs every policy on
every entry, writes the actions to each replica's bounded queue, and only then acknowledges
the entries: a controller that dies mid-batch leaves them pending for the next one, which
claims them (XAUTOCLAIM) when they have been idle for `claim_idle_ms`.

Policies and latched conversations live in Redis as well as in memory (`saved_state`): an
admin change is saved before it returns, a latch before the entry that caused it is
acknowledged, and a controller that starts (or restarts: a new process, or Ray restarting
its actor) loads them before it reads a single entry, so no read-out is consumed without
the policies it was meant for. The policies a controller is constructed with only seed a
group that has none saved. A Redis that restarted empty gets them written back.

A replica's queue holds at most `max_queue_len` actions: a push into a full queue drops the
newest actions and counts them, and never waits for the engine. Each push renews the
queue's expiry (`action_ttl_s`): a live replica drains its queue long before, while the
queue of a replica that died goes away with it instead of staying in Redis. When Redis goes away the
thread backs off and reconnects; a batch whose actions were not yet written is kept and
written after the reconnect. A Redis that restarted empty has lost the stream and the group:
the controller recreates the group from the start of the new stream and counts a reset.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

import services.controller.saved_state as saved_state
from services.common.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from services.controller.connection import REDIS_DOWN, REDIS_ERRORS, Backoff, connect
from services.controller.messages import (
    READOUT_STREAM,
    action_queue_key,
    decode_entry,
    encode_action,
)
from services.controller.policies import LatchPolicy, Policy, build_policy, parse_policy

log = logging.getLogger(__name__)

# LPUSH as many of ARGV[3..] as fit under the bound ARGV[1]; the rest (the newest) are
# dropped; the queue then expires ARGV[2] seconds after this push. One script, so the length
# check and the pushes cannot interleave with another controller's.
_BOUNDED_PUSH = """
local room = tonumber(ARGV[1]) - redis.call('LLEN', KEYS[1])
local n = 0
for i = 3, #ARGV do
  if n >= room then break end
  redis.call('LPUSH', KEYS[1], ARGV[i])
  n = n + 1
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return n
"""

StreamEntries = list[tuple[str, dict[str, str]]]


@dataclass
class _Batch:
    """Entries read but not yet acknowledged, and their actions not yet written (by replica)."""

    ids: list[str]
    reclaimed: bool = False  # taken over from a previous life or another consumer
    actions: dict[str, list[str]] = field(default_factory=dict)
    # latch policy -> conversations it latched (with when) and evicted: saved before the ack
    latched: dict[LatchPolicy, dict[str, float]] = field(default_factory=dict)
    evicted: dict[LatchPolicy, list[str]] = field(default_factory=dict)


class Controller:
    """Runs `policies` over the read-out stream at `redis_url` (see the module docstring).

    `group` is the consumer group every controller of a cluster joins; `consumer` names this
    one (default: host and pid). `start_id` is where a newly created group begins (`$`: only
    entries published from now on). `policies` seed a group with no saved policies (a saved
    list, even an empty one, wins). `start()` runs it; `status()` reports it.
    """

    def __init__(
        self,
        redis_url: str,
        policies: Iterable[Any] = (),
        *,
        group: str = "coxswain-controller",
        consumer: str | None = None,
        stream: str = READOUT_STREAM,
        max_queue_len: int = 1024,
        batch_size: int = 256,
        block_ms: int = 200,
        claim_idle_ms: int = 30_000,
        reclaim_interval_s: float = 10.0,
        start_id: str = "$",
        backoff_max_s: float = 2.0,
        action_ttl_s: int = 300,
    ) -> None:
        if max_queue_len < 1 or batch_size < 1 or action_ttl_s < 1:
            raise InvalidRequestError("max_queue_len, batch_size and action_ttl_s must be >= 1")
        self.redis_url, self.group, self.stream = redis_url, group, stream
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.max_queue_len, self.batch_size, self.block_ms = max_queue_len, batch_size, block_ms
        self.claim_idle_ms, self.reclaim_interval_s = claim_idle_ms, reclaim_interval_s
        self.start_id, self._backoff_max_s = start_id, backoff_max_s
        self.action_ttl_s = action_ttl_s

        self._lock = threading.Lock()  # the policy table and the counters
        # Loading and admin changes, which talk to Redis while they hold it: one at a time.
        self._admin = threading.Lock()
        self._loaded = False  # the saved policies and latches are in `_policies`
        self._resave = False  # Redis restarted empty: write them back
        self._policies: dict[str, Policy] = {}
        self._policies, _ = self._table(policies, replace=True)  # the seed, until loaded
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: _Batch | None = None

        self.processed = self.reclaimed = self.malformed = 0
        self.redis_errors = self.reconnects = self.stream_resets = self.lost_entries = 0
        self.actions_written: Counter[str] = Counter()  # by replica
        self.actions_dropped: Counter[str] = Counter()
        self.connected = False
        # The loop's current failure (None while it runs well); `last_rejection` keeps the
        # last entry or action it had to skip.
        self.last_error: str | None = None
        self.last_rejection: str | None = None

    # -- policies ------------------------------------------------------------------------

    def _table(
        self, configs: Iterable[Any], *, replace: bool
    ) -> tuple[dict[str, Policy], list[str]]:
        """The policy table after adding or replacing `configs` (all checked first), and the
        names whose state goes (replaced by a changed config, or dropped by `replace`)."""
        parsed = [parse_policy(c) for c in configs]
        names = [c.name for c in parsed]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise InvalidRequestError(f"policy names must be unique: {', '.join(dupes)}")
        with self._lock:
            current = dict(self._policies)
        table = {} if replace else dict(current)
        dropped = [n for n in current if n not in names] if replace else []
        for cfg in parsed:
            old = current.get(cfg.name)
            if old is not None and old.config == cfg:
                table[cfg.name] = old  # unchanged: keeps its state
            else:
                table[cfg.name] = build_policy(cfg)
                if old is not None:
                    dropped.append(cfg.name)
        return table, dropped

    def set_policies(self, configs: Iterable[Any], *, replace: bool = False) -> list[Any]:
        """Add or replace policies by name (`replace=True`: these become the only ones).
        A policy whose config is unchanged keeps its state. All configs are checked before
        any is applied, and the result is saved in Redis before it applies
        (ServiceUnavailableError, and nothing changed, when Redis cannot be reached);
        returns the configs now active."""
        with self._saving("change the policies") as client, self._admin:
            table, dropped = self._table(configs, replace=replace)
            active = [p.config for p in table.values()]
            saved_state.save_policies(client, self.group, active, dropped)
            with self._lock:
                self._policies = table
            return active

    def list_policies(self) -> list[Any]:
        """The active policy configs, in the order they were added (the saved ones: loaded
        first if the loop has not yet)."""
        with self._saving("read the policies"), self._lock:
            return [p.config for p in self._policies.values()]

    def remove_policy(self, name: str) -> None:
        """Drop a policy and its state; NotFoundError when no policy has that name."""
        with self._saving("remove a policy") as client, self._admin:
            with self._lock:
                if name not in self._policies:
                    raise NotFoundError(f"no policy named {name!r}")
                table = {k: v for k, v in self._policies.items() if k != name}
            active = [p.config for p in table.values()]
            saved_state.save_policies(client, self.group, active, [name])
            with self._lock:
                self._policies = table

    @contextlib.contextmanager
    def _saving(self, what: str) -> Iterator[redis.Redis]:
        """A Redis client for an admin call, with the saved state loaded; a Redis failure
        becomes ServiceUnavailableError saying `what` did not happen."""
        client = connect(self.redis_url)
        try:
            self._load(client)
            yield client
        except REDIS_ERRORS as e:
            raise ServiceUnavailableError(
                f"the controller cannot {what}: Redis failed ({type(e).__name__}); "
                "nothing changed, retry once Redis is back"
            ) from None
        finally:
            client.close()

    def _load(self, client: redis.Redis) -> None:
        """Once: take the saved policies and latches, or save the seed policies when the
        group has none saved (and after Redis restarted empty, write them all back)."""
        with self._admin:
            if self._loaded and not self._resave:
                return
            stored = saved_state.load_policies(client, self.group)
            if self._loaded or stored is None:  # nothing saved: save what we hold
                self._save_all(client)
            else:
                table: dict[str, Policy] = {}
                for config in stored:
                    policy = build_policy(config)
                    if isinstance(policy, LatchPolicy):
                        limit = policy.config.max_conversations
                        policy.restore(
                            saved_state.load_latched(client, self.group, policy.name, limit)
                        )
                    table[policy.name] = policy
                with self._lock:
                    self._policies = table
                log.info("controller %s: loaded %d saved policies", self.consumer, len(table))
            self._loaded, self._resave = True, False

    def _save_all(self, client: redis.Redis) -> None:
        with self._lock:
            policies = list(self._policies.values())
        saved_state.save_policies(client, self.group, [p.config for p in policies])
        now = time.time()
        latched = {
            p.name: {c: now + i * 1e-6 for i, c in enumerate(p.latched_conversations())}
            for p in policies
            if isinstance(p, LatchPolicy)
        }
        saved_state.save_latches(client, self.group, latched, {})

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> Controller:
        """Start the consuming thread (Redis need not be up yet: it keeps retrying)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"controller-{self.consumer}", daemon=True
            )
            self._thread.start()
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """True once the consumer group exists and the pending entries were reclaimed."""
        return self._ready.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop consuming. Entries read but not yet acknowledged stay pending in the group,
        for this consumer's next start or another controller to claim."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None
        self._held = None
        self._ready.clear()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        client = connect(self.redis_url, block_s=self.block_ms / 1000)
        push = client.register_script(_BOUNDED_PUSH)
        backoff = Backoff(self._stop, max_s=self._backoff_max_s)
        set_up = recovered = False
        start_id, next_reclaim = self.start_id, 0.0
        while not self._stop.is_set():
            try:
                if not self._loaded or self._resave:  # before any entry is read
                    self._load(client)
                if not set_up:
                    self._create_group(client, start_id)
                    set_up = True
                if not recovered:  # once: a failed batch is retried from `_held`, not re-read
                    pending = self._own_pending(client)
                    recovered = True
                    self._handle(client, push, pending, reclaimed=True)
                if self._held is not None:
                    self._finish(client, push, self._held)
                if time.monotonic() >= next_reclaim:
                    self._reclaim(client, push)
                    next_reclaim = time.monotonic() + self.reclaim_interval_s
                    self._succeeded()
                    self._ready.set()
                entries = self._read(client)
                if entries:
                    self._handle(client, push, entries)
                self._succeeded()
                backoff.reset()
            except redis.ResponseError as e:
                if str(e).startswith("NOGROUP"):  # Redis restarted empty: stream and group gone
                    self._group_lost()
                    self._resave = True  # and the saved policies and latches with them
                    # recreate it from "0": what engines published since the restart is unread
                    set_up, start_id = False, "0"
                    continue
                self._failed(e)
                if backoff.wait():
                    break
            except REDIS_DOWN as e:
                self._failed(e)
                if backoff.wait():
                    break
            except Exception as e:  # a bug: logged and counted, the loop goes on
                log.exception("controller %s: unexpected failure", self.consumer)
                self._failed(e)
                if backoff.wait():
                    break
        client.close()

    def _create_group(self, client: redis.Redis, start_id: str) -> None:
        """Create the group unless it exists (asked first: creating is a write, which a Redis
        refusing writes, e.g. out of memory, would fail even for an existing group)."""
        try:
            groups: Any = client.xinfo_groups(self.stream)
            if any(g["name"] == self.group for g in groups):
                return
        except redis.ResponseError:  # no such stream yet
            pass
        try:
            client.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except redis.ResponseError as e:
            if not str(e).startswith("BUSYGROUP"):  # BUSYGROUP: another controller made it
                raise

    def _group_lost(self) -> None:
        with self._lock:
            self.stream_resets += 1
        log.warning(
            "controller %s: group %s is gone (Redis restarted empty?); recreating it",
            self.consumer,
            self.group,
        )

    def _own_pending(self, client: redis.Redis) -> StreamEntries:
        """Entries this consumer name read in a previous life and never acknowledged."""
        out: StreamEntries = []
        last = "0"
        while True:
            resp: Any = client.xreadgroup(
                self.group, self.consumer, {self.stream: last}, count=self.batch_size
            )
            got = [(i, f) for i, f in (resp[0][1] if resp else []) if f]
            if not got:
                return out
            out += got
            last = got[-1][0]

    def _reclaim(self, client: redis.Redis, push: Any) -> None:
        """Claim entries other (dead) consumers read but left unacknowledged."""
        start = "0-0"
        while not self._stop.is_set():
            resp: Any = client.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                min_idle_time=self.claim_idle_ms,
                start_id=start,
                count=self.batch_size,
            )
            start, claimed = resp[0], [(i, f) for i, f in resp[1] if f]
            if len(resp) > 2 and resp[2]:  # trimmed from the stream before anyone processed them
                with self._lock:
                    self.lost_entries += len(resp[2])
            if claimed:
                log.info("controller %s: reclaimed %d pending entries", self.consumer, len(claimed))
                self._handle(client, push, claimed, reclaimed=True)
            if start == "0-0":
                return

    def _read(self, client: redis.Redis) -> StreamEntries:
        resp: Any = client.xreadgroup(
            self.group,
            self.consumer,
            {self.stream: ">"},
            count=self.batch_size,
            block=self.block_ms,
        )
        return list(resp[0][1]) if resp else []

    def _handle(
        self, client: redis.Redis, push: Any, entries: StreamEntries, *, reclaimed: bool = False
    ) -> None:
        """Run the policies over `entries`, write their actions, acknowledge the entries."""
        if not entries:
            return
        with self._lock:
            policies = list(self._policies.values())
        batch = _Batch(ids=[i for i, _ in entries], reclaimed=reclaimed)
        malformed = 0
        for stream_id, fields in entries:
            try:
                entry = decode_entry(stream_id, fields)
            except InvalidRequestError as e:
                malformed += 1
                self.last_rejection = str(e)
                continue
            for policy in policies:
                for action in policy.process(entry):
                    try:
                        wire = encode_action(action, policy.name)
                    except (InvalidRequestError, ValueError) as e:  # e.g. a NaN gain
                        policy.errors += 1
                        policy.last_error = f"unencodable action: {e}"
                        continue
                    batch.actions.setdefault(entry.replica, []).append(wire)
        now = time.time()
        for policy in policies:
            if isinstance(policy, LatchPolicy):
                latched, evicted = policy.take_changes()
                if latched:
                    batch.latched[policy] = {c: now + i * 1e-6 for i, c in enumerate(latched)}
                if evicted:
                    batch.evicted[policy] = evicted
        with self._lock:
            self.malformed += malformed
        self._held = batch  # kept until written and acknowledged, across a Redis outage
        self._finish(client, push, batch)

    def _finish(self, client: redis.Redis, push: Any, batch: _Batch) -> None:
        if batch.latched or batch.evicted:  # saved first: acknowledged entries stay latched
            with self._lock:  # a policy removed or replaced since keeps nothing
                current = set(self._policies.values())
            saved_state.save_latches(
                client,
                self.group,
                {p.name: c for p, c in batch.latched.items() if p in current},
                {p.name: c for p, c in batch.evicted.items() if p in current},
            )
            batch.latched, batch.evicted = {}, {}
        while batch.actions:  # replica by replica, so a retry never pushes one twice
            replica, payloads = next(iter(batch.actions.items()))
            key = action_queue_key(replica)
            try:
                args = [self.max_queue_len, self.action_ttl_s, *payloads]
                pushed = int(push(keys=[key], args=args))
            except redis.ResponseError as e:
                if not str(e).startswith("WRONGTYPE"):
                    raise  # e.g. OOM: Redis may take them later; the batch is kept
                # The key holds something else: these actions can never be written, and
                # retrying would stall every other replica behind this one.
                pushed = 0
                self.last_rejection = f"cannot write actions to {key}: {e}"
            with self._lock:
                self.actions_written[replica] += pushed
                self.actions_dropped[replica] += len(payloads) - pushed
            if pushed < len(payloads):
                log.warning(
                    "controller %s: queue of replica %s is full: dropped %d actions",
                    self.consumer,
                    replica,
                    len(payloads) - pushed,
                )
            del batch.actions[replica]
        client.xack(self.stream, self.group, *batch.ids)
        self._held = None
        with self._lock:
            self.processed += len(batch.ids)
            if batch.reclaimed:
                self.reclaimed += len(batch.ids)

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self.redis_errors += 1
            if self.connected:
                log.warning("controller %s: Redis failed: %r", self.consumer, exc)
            self.connected = False
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _succeeded(self) -> None:
        with self._lock:
            if not self.connected and self.redis_errors:
                self.reconnects += 1
            self.connected = True
            self.last_error = None  # recovered: the failure is history (see `redis_errors`)

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Counters, the group's lag and pending count (None when Redis cannot be asked),
        per-policy counters, and the number of latched conversations."""
        lag = pending = None
        try:
            client = connect(self.redis_url, timeout_s=0.5)
            try:
                for g in client.xinfo_groups(self.stream):
                    if g["name"] == self.group:
                        lag, pending = g.get("lag"), g["pending"]
            finally:
                client.close()
        except REDIS_ERRORS:
            pass
        with self._lock:
            policies = list(self._policies.values())
            return {
                "running": self.running,
                "ready": self._ready.is_set(),
                "connected": self.connected,
                "stream": self.stream,
                "group": self.group,
                "consumer": self.consumer,
                "lag": lag,
                "pending": pending,
                "processed": self.processed,
                "reclaimed": self.reclaimed,
                "malformed": self.malformed,
                "actions_written": dict(self.actions_written),
                "actions_dropped": dict(self.actions_dropped),
                "redis_errors": self.redis_errors,
                "reconnects": self.reconnects,
                "stream_resets": self.stream_resets,
                "lost_entries": self.lost_entries,
                "latched_conversations": sum(
                    p.latched for p in policies if isinstance(p, LatchPolicy)
                ),
                "last_error": self.last_error,
                "last_rejection": self.last_rejection,
                "policies_loaded": self._loaded,
                "policies": [p.status() for p in policies],
            }
