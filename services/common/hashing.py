"""Stable content hashes, identical in every process (Python's hash() is salted per process)."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

BlockHash = bytes


def block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Hash of one full KV block: its parent's hash, its token ids, and what else shaped its KV.

    `extra_keys` holds anything that changes the KV a block holds (prefill steering, a patch,
    an adapter): two blocks with equal tokens but different extra keys never share a hash.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00" * 16)
    h.update(pickle.dumps((tuple(token_ids), extra_keys), protocol=5))
    return h.digest()
