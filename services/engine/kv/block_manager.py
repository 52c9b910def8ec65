"""Paged KV blocks: allocation, ref counts, and prefix caching by a hash chain.

A full block's hash is `hash(parent_hash, block_token_ids, extra_keys)`. Blocks whose ref
count drops to zero stay in the cache (and can be revived by a later request with the
same prefix) until the allocator needs them: free blocks are handed out least recently
freed first, uncached ones before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from services.common.hashing import BlockHash, block_hash
from services.engine.sequence import Sequence


class BlockManager:
    """Owns every KV block id of one engine replica."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Free blocks in eviction order: the front is handed out next.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[BlockHash]]:
        """The cached blocks holding the longest prefix of `seq`'s full blocks.

        At least one token is always left uncached so the step that follows has a position
        to sample from.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            h = block_hash(
                parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_keys(i * bs, (i + 1) * bs)
            )
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        self.prefix_queries += max_blocks * bs
        self.prefix_hits += len(blocks) * bs
        return blocks, hashes

    def num_free_after_touch(self, blocks: list[int]) -> int:
        """Free blocks left once `blocks` (cache hits, some maybe free) are referenced."""
        return self.num_free_blocks - sum(1 for b in blocks if self.ref_counts[b] == 0)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        known = min(seq.num_computed, seq.num_tokens - seq.num_pending)  # overlapped steps
        for i in range(len(seq.block_hashes), known // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(
                parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_keys(i * bs, (i + 1) * bs)
            )
            seq.block_hashes.append(h)
            b = seq.block_table[i]
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h

    # -- allocation ---------------------------------------------------------------------

    def admit(self, seq: Sequence, cached_blocks: list[int], hashes: list[BlockHash]) -> None:
        """Start a sequence on its prefix-cache hits."""
        assert not seq.block_table
        for b in cached_blocks:
            self._ref(b)
        seq.block_table = list(cached_blocks)
        seq.block_hashes = list(hashes)
        seq.num_computed = len(cached_blocks) * self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens of KV."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, have {self.num_free_blocks}")
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the block's cached content is overwritten now
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_counts[b] = 1
            seq.block_table.append(b)

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Let `child` share the first `num_blocks` (full, computed) blocks of `parent`."""
        assert not child.block_table and num_blocks * self.block_size <= parent.num_computed
        for b in parent.block_table[:num_blocks]:
            self._ref(b)
        child.block_table = parent.block_table[:num_blocks]
        child.block_hashes = parent.block_hashes[:num_blocks]
        child.position_sigs = parent.position_sigs[: num_blocks * self.block_size]
        child.num_computed = num_blocks * self.block_size

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references; its cached blocks stay revivable until evicted."""
        # Tail blocks first, so a prefix shared by many outlives the tails that follow it.
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)  # nothing to keep: reuse first
        seq.block_table = []
        seq.block_hashes = []

    def _ref(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.free[b]
        self.ref_counts[b] += 1


def num_kv_blocks(cfg: Any, bytes_per_block: int, device: torch.device, max_model_len: int) -> int:
    """How many KV blocks an engine with `EngineConfig` `cfg` allocates: `num_kv_blocks`
    if set, else what fits in `gpu_memory_utilization` of the free CUDA memory (on CPU,
    `kv_cache_memory_gb`), capped at four times what `max_num_seqs` full-length sequences
    need."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cfg.gpu_memory_utilization
    else:
        budget = cfg.kv_cache_memory_gb * 2**30
    blocks_per_seq = -(-max_model_len // cfg.block_size)
    cap = 4 * cfg.max_num_seqs * blocks_per_seq
    return max(1, min(int(budget // max(bytes_per_block, 1)), cap))
