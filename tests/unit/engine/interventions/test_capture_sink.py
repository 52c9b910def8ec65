"""The inline capture sink assembles a request's rows from shared decode blocks and eager
copies: each key's rows in position order, in the dtype asked for."""

import torch

from services.engine.interventions.capture import InlineCaptureSink
from services.engine.interventions.planner import CapturedBlock
from services.engine.kernels.capture import capture_slot

H = 8
SLOTS = tuple(capture_slot(layer, site) for layer in (0, 1) for site in ("post_attn", "post_block"))
KEYS = ["0.post_attn", "0.post_block", "1.post_attn", "1.post_block"]


def _blocks(n: int, dtype: torch.dtype = torch.float32) -> list[CapturedBlock]:
    g = torch.Generator().manual_seed(0)
    return [
        CapturedBlock(torch.randn(3, len(SLOTS), H, generator=g).to(dtype), SLOTS) for _ in range(n)
    ]


def test_block_rows_come_back_per_key_in_position_order():
    sink, blocks = InlineCaptureSink(), _blocks(4)
    for p, block in reversed(list(enumerate(blocks))):  # written out of order
        sink.write_block("r", 10 + p, block, 2, KEYS)
    got = sink.result("r")
    assert got is not None
    rows, positions = got
    assert positions == [10, 11, 12, 13] and list(rows) == KEYS
    for j, key in enumerate(KEYS):
        want = torch.stack([b.host[2, j] for b in blocks])
        assert torch.equal(rows[key], want)


def test_a_subset_of_the_blocks_keys_in_another_order_reads_their_columns():
    sink, blocks = InlineCaptureSink(), _blocks(3)
    keys = ["1.post_block", "0.post_attn"]  # columns 3 and 0
    for p, block in enumerate(blocks):
        sink.write_block("r", p, block, 1, keys)
    rows, _ = sink.result("r")
    assert torch.equal(rows["1.post_block"], torch.stack([b.host[1, 3] for b in blocks]))
    assert torch.equal(rows["0.post_attn"], torch.stack([b.host[1, 0] for b in blocks]))


def test_bf16_blocks_widen_exactly_and_eager_positions_fill_their_place():
    sink, blocks = InlineCaptureSink(), _blocks(2, torch.bfloat16)
    eager = torch.randn(1, H)
    for key in KEYS:  # the prompt's last token, copied eagerly
        sink.write("r", key, [4], eager + KEYS.index(key))
    for p, block in enumerate(blocks):
        sink.write_block("r", 5 + p, block, 0, KEYS)
    rows, positions = sink.result("r", torch.float32)
    assert positions == [4, 5, 6]
    for j, key in enumerate(KEYS):
        assert rows[key].dtype == torch.float32
        assert torch.equal(rows[key][0], (eager + j)[0])
        assert torch.equal(rows[key][1:], torch.stack([b.host[0, j] for b in blocks]).float())


def test_a_position_recomputed_through_a_block_replaces_its_eager_copy():
    sink, blocks = InlineCaptureSink(), _blocks(1)
    for key in KEYS:
        sink.write("r", key, [0], torch.full((1, H), 7.0))
    sink.write_block("r", 0, blocks[0], 1, KEYS)
    rows, positions = sink.result("r")
    assert positions == [0]
    assert torch.equal(rows["1.post_attn"][0], blocks[0].host[1, 2])
    sink.drop("r")
    assert sink.result("r") is None
