"""Request state the scheduler and engine share: a request group and its sample sequences."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine.detokenizer import PROMPT_WINDOW
from services.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    PENDING_FORK = "pending_fork"  # a sample n>1 waiting for sample 0 to finish the prompt
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()

# A sampled token not yet back from the device (see `Sequence.num_pending`).
PLACEHOLDER = -1


class Sequence:
    """One sample of a request: its tokens, how many have KV computed, and its block table.

    Tokens at index >= `num_computed` have no KV yet. Each step computes a span of them; when
    the span reaches the last token, the step samples a new one. Prefill, chunked prefill,
    decode and recompute after preemption are all the same operation.
    """

    def __init__(self, group: RequestGroup, index: int):
        self.seq_id = next(_seq_ids)
        self.group = group
        self.index = index
        self.token_ids: list[int] = list(group.prompt_token_ids)
        self.num_prompt_tokens = len(group.prompt_token_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of this sequence's full, computed blocks
        self.status = SeqStatus.WAITING if index == 0 else SeqStatus.PENDING_FORK
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        # What the engine's deltas have sent of this sample (see `LLMEngine._delta`); the
        # logprobs and read-outs of accepted tokens wait in `unsent_*` until then.
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.finish_sent = False
        self.unsent_logprobs: list[dict[int, float]] | None = (
            [] if group.params.logprobs is not None or group.params.logprob_token_ids else None
        )
        self.unsent_readouts: list[dict[str, float]] | None = [] if group.params.readouts else None
        # Incremental detokenization window (`detokenizer.decode_window`): decode
        # ids[prefix_offset:] and subtract the text of ids[prefix_offset:read_offset].
        # Starts a few prompt tokens back.
        self.prefix_offset = max(0, self.num_prompt_tokens - PROMPT_WINDOW)
        self.read_offset = self.num_prompt_tokens
        self.generator: torch.Generator | None = None  # set by the engine for seeded requests
        # The steering signature each computed position's KV was made under (b"": none).
        self.position_sigs: list[bytes] = []
        self.latched = 0  # bits of this sample's `rest_of_request` gates that have fired
        # The decode content (RowContent) with gates its last planned step ran under: the
        # latch carry applies only while it stays the same (interventions.manager).
        self.gate_content: object | None = None
        # Overlapped steps: tokens sampled by a step still on the GPU are held as
        # PLACEHOLDER at the end of `token_ids` until the engine accepts them.
        self.num_pending = 0
        self.pending_step = 0  # the engine step that sampled its newest pending token
        self.final_pending = False  # its pending token ends it by length: schedule no more

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Generated tokens the engine has accepted (pending placeholders not counted)."""
        return len(self.token_ids) - self.num_pending - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def kv_sig(self, position: int) -> bytes:
        """The steering signature of `position`'s KV: as recorded, else what it would get now."""
        if position < len(self.position_sigs):
            return self.position_sigs[position]
        g = self.group
        if position < self.num_prompt_tokens:
            sig = g.prefill_sig
        else:
            sig = g.decode_sig
            if self.latched:  # latched gates steer this sample's later tokens
                sig += b"latched" + self.latched.to_bytes(4, "little")
        if g.patch_from is not None and position >= g.patch_from:
            sig += g.patch_sig  # a patch changes every position from its first one on
        return sig + g.adapter_sig

    def record_kv_sigs(self, start: int, num_tokens: int) -> None:
        """Note the signatures positions [start, start + num_tokens) are computed under now.

        Positions before `start` not yet recorded (prefix-cache hits, blocks shared by a
        fork) matched under the signatures they would get now, so those are recorded.
        """
        sigs = self.position_sigs
        if start == len(sigs) and num_tokens == 1:  # the common case: one decode token
            sigs.append(self.kv_sig(start))
            return
        sigs.extend(self.kv_sig(p) for p in range(len(sigs), start))
        del sigs[start:]
        # The signature only changes at the prompt's end and at a patch's first position.
        end = start + num_tokens
        cuts = sorted(
            {start, end}
            | {
                b
                for b in (self.num_prompt_tokens, self.group.patch_from)
                if b is not None and start < b < end
            }
        )
        for a, b in itertools.pairwise(cuts):
            sigs += [self.kv_sig(a)] * (b - a)

    def resign_kv_from(self, position: int) -> None:
        """Record anew the signatures of positions from `position` on that a step in flight
        already recorded (gate bits it latched on the device are now in `latched`)."""
        sigs = self.position_sigs
        if position < len(sigs):
            end = len(sigs)
            del sigs[position:]
            sigs.extend(self.kv_sig(p) for p in range(position, end))

    def extra_keys(self, start: int, end: int) -> tuple:
        """What besides tokens shaped the KV of positions [start, end): the cache salt and the
        steering signatures as runs (empty when nothing steered them)."""
        runs: list[tuple[bytes, int]] = []
        for p in range(start, end):
            sig = self.kv_sig(p)
            if runs and runs[-1][0] == sig:
                runs[-1] = (sig, runs[-1][1] + 1)
            else:
                runs.append((sig, 1))
        if all(sig == b"" for sig, _ in runs):
            return self.group.cache_salt
        return (*self.group.cache_salt, *runs)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.group.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, {self.status.value})"
        )


@dataclass(eq=False)
class RequestGroup:
    """A user request: one prompt, its sampling params, and `params.n` sample sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: tuple = ()
    adapter_row: int = 0  # its row in every adapted Linear's coefficient table (0: none)
    adapter_sig: bytes = b""  # the version of its adapter, in the KV signature of positions
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_sent_prompt_logprobs: int = 0
    announced: bool = False  # its first delta (with the prompt) has been made
    interventions: Any = None  # RequestInterventions, set by the engine's InterventionManager
    prefill_sig: bytes = b""  # KV signature of prompt positions computed now
    decode_sig: bytes = b""  # KV signature of generated positions computed now
    skip_prefix_cache: bool = False  # every prompt position must be computed (logprobs, capture)
    patch_from: int | None = None  # the first patched position, if the request patches
    patch_sig: bytes = b""  # the hash of the request's patches, folded in from `patch_from`

    def __post_init__(self) -> None:
        self.seqs = [Sequence(self, i) for i in range(self.params.n)]
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
            self.skip_prefix_cache = True

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs  # asked per request on every step: n == 1 without a generator
        if len(seqs) == 1:
            return seqs[0].status is SeqStatus.FINISHED
        return all(s.status is SeqStatus.FINISHED for s in seqs)
