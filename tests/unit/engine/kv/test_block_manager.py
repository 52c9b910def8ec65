"""Block manager: ref counts, forks, the prefix-cache hash chain and LRU eviction."""

from __future__ import annotations

from services.common.hashing import block_hash
from services.engine.kv.block_manager import BlockManager
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import RequestGroup


def _seq(tokens: list[int], salt: tuple = ()):
    group = RequestGroup("r", None, tokens, SamplingParams(), 0.0, cache_salt=salt)
    return group.seqs[0]


def _run(bm: BlockManager, seq) -> None:
    """Admit on cache hits, allocate the rest, mark it all computed, publish full blocks."""
    blocks, hashes = bm.match_prefix(seq)
    bm.admit(seq, blocks, hashes)
    n = seq.num_tokens - seq.num_computed
    bm.allocate(seq, n)
    seq.num_computed += n
    bm.register_full_blocks(seq)


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    a = block_hash(None, [1, 2, 3])
    assert a == block_hash(None, [1, 2, 3])
    assert a != block_hash(None, [1, 2, 4])
    assert a != block_hash(None, [1, 2, 3], ("steer", 1))
    assert block_hash(a, [4]) != block_hash(block_hash(None, [9]), [4])


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = _seq(list(range(12)))
    _run(bm, first)
    assert len(bm.cached) == 3
    second = _seq(list(range(12)))  # identical: the last block must be recomputed
    blocks, _ = bm.match_prefix(second)
    assert blocks == first.block_table[:2]
    third = _seq([*range(8), 99, 98, 97, 96, 95])
    blocks, _ = bm.match_prefix(third)
    assert blocks == first.block_table[:2]
    bm.admit(third, blocks, _)
    assert [bm.ref_counts[b] for b in blocks] == [2, 2]
    assert third.num_computed == 8


def test_extra_keys_keep_blocks_apart():
    bm = BlockManager(num_blocks=16, block_size=4)
    _run(bm, _seq(list(range(9))))
    blocks, _ = bm.match_prefix(_seq(list(range(9)), salt=("steered",)))
    assert blocks == []


def test_free_keeps_cached_blocks_revivable_until_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    old = _seq([1, 2, 3, 4, 5])  # 2 full blocks + 1 partial
    _run(bm, old)
    bm.free_seq(old)
    new = _seq([7, 8, 9, 10, 11])
    _run(bm, new)
    bm.free_seq(new)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 4
    # Partial (uncached) blocks are reused before any cached block is evicted.
    filler = _seq([20, 21])
    bm.allocate(filler, 4)  # two blocks: both former partial blocks
    assert bm.num_evictions == 0
    # Then the least recently freed cached blocks go first: `old`'s, tail first.
    bm.allocate(filler, 6)
    assert bm.num_evictions == 1
    hit_new, _ = bm.match_prefix(_seq([7, 8, 9, 10, 11]))
    assert len(hit_new) == 2  # the newer prefix survived
    hit_old, _ = bm.match_prefix(_seq([1, 2, 3, 4, 5]))
    assert len(hit_old) == 1  # the older one lost its tail block


def test_fork_shares_prompt_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    group = RequestGroup("r", None, list(range(10)), SamplingParams(n=2), 0.0)
    parent, child = group.seqs
    bm.allocate(parent, 10)
    parent.num_computed = 10
    bm.fork(parent, child, 2)
    assert child.block_table == parent.block_table[:2]
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    bm.free_seq(parent)
    assert [bm.ref_counts[b] for b in child.block_table] == [1, 1]
    assert bm.num_free_blocks == 8 - 2
    bm.free_seq(child)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)
