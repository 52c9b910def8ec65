"""Steering signatures per position, and how they reach the prefix cache's block hashes."""

from __future__ import annotations

from services.engine.kv.block_manager import BlockManager
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import RequestGroup


def _group(tokens: list[int], prefill_sig: bytes = b"", decode_sig: bytes = b"") -> RequestGroup:
    g = RequestGroup("r", None, tokens, SamplingParams(), 0.0)
    g.prefill_sig, g.decode_sig = prefill_sig, decode_sig
    return g


def test_unsteered_positions_add_nothing_to_extra_keys():
    seq = _group(list(range(10))).seqs[0]
    seq.record_kv_sigs(0, 10)
    assert seq.extra_keys(0, 4) == ()


def test_signatures_are_recorded_by_phase_and_fold_into_runs():
    g = _group(list(range(6)), prefill_sig=b"P", decode_sig=b"D")
    seq = g.seqs[0]
    seq.token_ids += [100, 101]
    seq.record_kv_sigs(0, 7)  # 6 prompt positions, then 1 generated one
    assert seq.position_sigs == [b"P"] * 6 + [b"D"]
    assert seq.extra_keys(4, 8) == ((b"P", 2), (b"D", 2))  # position 7: what it would get now
    g.decode_sig = b"D2"  # a controller changed the decode steering
    seq.record_kv_sigs(7, 1)
    assert seq.extra_keys(4, 8) == ((b"P", 2), (b"D", 1), (b"D2", 1))


def test_positions_skipped_by_a_cache_hit_are_backfilled():
    seq = _group(list(range(10)), prefill_sig=b"P").seqs[0]
    seq.record_kv_sigs(8, 2)  # positions 0..7 came from the prefix cache
    assert seq.position_sigs == [b"P"] * 10


def test_steered_and_unsteered_blocks_never_share_a_hash():
    bm = BlockManager(16, 4)
    tokens = list(range(9))
    steered, plain = _group(tokens, prefill_sig=b"P"), _group(tokens)
    for g in (steered, plain):
        seq = g.seqs[0]
        bm.allocate(seq, 9)
        seq.record_kv_sigs(0, 9)
        seq.num_computed = 9
        bm.register_full_blocks(seq)
    assert not set(steered.seqs[0].block_hashes) & set(plain.seqs[0].block_hashes)
    again = _group(tokens, prefill_sig=b"P").seqs[0]
    blocks, _ = bm.match_prefix(again)
    assert blocks == steered.seqs[0].block_table[:2]
