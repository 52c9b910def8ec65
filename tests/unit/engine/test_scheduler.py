"""Scheduling decisions, without a model: budgets, chunking, admission, preemption."""

from __future__ import annotations

from services.engine.kv.block_manager import BlockManager
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import PLACEHOLDER, RequestGroup, SeqStatus


def _group(rid: str, n_tokens: int, **params) -> RequestGroup:
    # Distinct tokens per request, so no prefix-cache hits unless a test wants them.
    first = 1000 * (ord(rid[0]) - ord("a") + 1)
    tokens = list(range(first, first + n_tokens))
    return RequestGroup(rid, None, tokens, SamplingParams(**params), 0.0)


def _step(sched: Scheduler, sampled: int = 7):
    """Schedule, pretend the model ran, and append a token to every sampling sequence."""
    out = sched.schedule()
    sched.update(out)
    for s in out.scheduled:
        if s.seq.num_computed == s.seq.num_tokens:
            s.seq.token_ids.append(sampled)
    return out


def test_chunked_prefill_respects_token_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(_group("a", 25))
    spans = [[(s.start, s.num_tokens) for s in _step(sched).scheduled] for _ in range(4)]
    assert spans == [[(0, 10)], [(10, 10)], [(20, 5)], [(25, 1)]]


def test_decodes_first_then_new_prefills_share_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(_group("a", 6))
    _step(sched)
    sched.add(_group("b", 20))
    out = _step(sched)
    assert [(s.seq.group.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_caps_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        sched.add(_group(rid, 3))
    out = _step(sched)
    assert {s.seq.group.request_id for s in out.scheduled} == {"a", "b"}
    assert len(sched.waiting) == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = Scheduler(
        BlockManager(64, 4),
        max_num_seqs=8,
        max_num_batched_tokens=10,
        enable_chunked_prefill=False,
    )
    sched.add(_group("a", 4))
    sched.add(_group("b", 8))
    out = _step(sched)
    assert [s.seq.group.request_id for s in out.scheduled] == ["a"]  # b (8) > 10 - 4
    out = _step(sched)
    assert [(s.seq.group.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]


def test_preemption_recomputes_latest_admitted_first():
    bm = BlockManager(4, 4)  # 16 slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _group("a", 7), _group("b", 7)
    sched.add(a)
    sched.add(b)
    _step(sched)  # both prefilled: 2 blocks each, every block in use
    assert bm.num_free_blocks == 0
    _step(sched)  # both decode into their 8th slot: still fits
    out = _step(sched)  # a needs a 3rd block: b is preempted
    assert out.preempted == [b.seqs[0]]
    assert b.seqs[0].status is SeqStatus.WAITING and b.seqs[0].num_computed == 0
    assert b.seqs[0].num_tokens == 9  # its generated tokens are kept, to be recomputed
    assert sched.num_preemptions == 1
    assert sched.waiting[0] is b.seqs[0]


def test_waiting_request_starts_on_prefix_cache_hits():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = _group("a", 9)
    sched.add(a)
    _step(sched)
    b = RequestGroup("b", None, [*a.prompt_token_ids[:8], 5, 6], SamplingParams(), 0.0)
    sched.add(b)
    out = _step(sched)
    assert [(s.start, s.num_tokens) for s in out.scheduled if s.seq.group is b] == [(8, 2)]
    assert b.num_cached_tokens == 8


def test_finish_frees_blocks_and_forks_share_prompt_blocks():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    g = _group("a", 10, n=3)
    sched.add(g)
    _step(sched)
    sched.fork_samples(g.seqs[0])
    for child in g.seqs[1:]:
        assert child.block_table == g.seqs[0].block_table[:2]
        assert child.num_computed == 8  # recomputes only the partial last prompt block
    out = _step(sched)
    assert sorted(s.num_tokens for s in out.scheduled) == [1, 2, 2]
    for seq in g.seqs:
        sched.finish(seq, "abort")
    assert bm.num_free_blocks == 16 and not sched.running and not sched.waiting


def test_admit_hook_makes_the_queue_wait_in_order():
    """A refused admission (no steering row free) holds that request and those behind it."""
    allowed = {"a"}
    sched = Scheduler(
        BlockManager(64, 4),
        max_num_seqs=8,
        max_num_batched_tokens=100,
        admit_hook=lambda seq: seq.group.request_id in allowed,
    )
    for rid in "abc":
        sched.add(_group(rid, 5))
    assert [s.seq.group.request_id for s in _step(sched).scheduled] == ["a"]
    assert [s.group.request_id for s in sched.waiting] == ["b", "c"]
    allowed |= {"b", "c"}
    assert [s.seq.group.request_id for s in _step(sched).scheduled] == ["a", "b", "c"]


def _launch(sched: Scheduler, parts: int = 1, step: int = 0):
    """Schedule and launch overlapped step `step`: each sampling sequence holds a
    placeholder for the token still on the device."""
    out = sched.schedule(parts, step)
    sched.advance(out)
    for s in out.scheduled:
        if s.seq.num_computed == s.seq.num_tokens:
            s.seq.token_ids.append(PLACEHOLDER)
            s.seq.num_pending += 1
            s.seq.pending_step = step
    return out


def _accept(out, sampled: int = 7) -> None:
    """A step's tokens reach the host: each takes its sequence's oldest placeholder."""
    for s in out.scheduled:
        if s.seq.num_pending:
            s.seq.token_ids[len(s.seq.token_ids) - s.seq.num_pending] = sampled
            s.seq.num_pending -= 1


def test_microbatches_split_overlapped_decodes_into_disjoint_parts():
    """Two microbatches, two steps in flight (the engine accepts a step after launching
    the one two later): steps alternate between halves of the running batch, each taking
    no sequence the step before sampled, though its own token from two steps back is still
    a placeholder; one microbatch takes them all every step."""
    for microbatches, want in ((2, [set("abc"), set("de")] * 3), (1, None)):
        sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100)
        for rid in "abcde":
            sched.add(_group(rid, 3))
        _accept(_launch(sched, microbatches))  # the prefills
        got, in_flight = [], []
        for step in range(1, 7):
            in_flight.append(_launch(sched, microbatches, step))
            if len(in_flight) > microbatches:  # before the later steps' tokens are in
                _accept(in_flight.pop(0))
            got.append({s.seq.group.request_id for s in in_flight[-1].scheduled})
        if want is None:  # every sequence waits for its placeholder: all of them each step
            assert got == [set("abcde")] * 6
        else:
            assert got == want
