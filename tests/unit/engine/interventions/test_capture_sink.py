"""The inline capture sink assembles a request's rows from shared decode blocks and eager
copies: each key's rows in position order, in the dtype asked for. Block rows go into each
request's own buffer on the sink's thread as they come, so a finished request's result is
a view of its rows, not a copy made when it finishes."""

import pickle
import threading

import pytest
import torch

from services.engine.interventions.capture import BlockWrite, InlineCaptureSink
from services.engine.interventions.planner import CapturedBlock
from services.engine.kernels.capture import capture_slot

H = 8
SLOTS = tuple(capture_slot(layer, site) for layer in (0, 1) for site in ("post_attn", "post_block"))
KEYS = ["0.post_attn", "0.post_block", "1.post_attn", "1.post_block"]


@pytest.fixture(params=[False, True], ids=["per-row", "scatter"])
def new_sink(request):
    """Sinks of both ways of copying block rows (`InlineCaptureSink.scatter`)."""
    return lambda: InlineCaptureSink(scatter=request.param)


def _blocks(n: int, dtype: torch.dtype = torch.float32) -> list[CapturedBlock]:
    g = torch.Generator().manual_seed(0)
    return [
        CapturedBlock(torch.randn(3, len(SLOTS), H, generator=g).to(dtype), SLOTS) for _ in range(n)
    ]


def test_block_rows_come_back_per_key_in_position_order(new_sink):
    sink, blocks = new_sink(), _blocks(4)
    for p, block in reversed(list(enumerate(blocks))):  # written out of order
        sink.write_block(block, [BlockWrite("r", 10 + p, 2, KEYS, torch.float32)])
    got = sink.result("r")
    assert got is not None
    rows, positions = got
    assert positions == [10, 11, 12, 13] and list(rows) == KEYS
    for j, key in enumerate(KEYS):
        want = torch.stack([b.host[2, j] for b in blocks])
        assert torch.equal(rows[key], want)


def test_a_subset_of_the_blocks_keys_in_another_order_reads_their_columns(new_sink):
    sink, blocks = new_sink(), _blocks(3)
    keys = ["1.post_block", "0.post_attn"]  # columns 3 and 0
    for p, block in enumerate(blocks):
        sink.write_block(block, [BlockWrite("r", p, 1, keys, torch.float32)])
    rows, _ = sink.result("r")
    assert torch.equal(rows["1.post_block"], torch.stack([b.host[1, 3] for b in blocks]))
    assert torch.equal(rows["0.post_attn"], torch.stack([b.host[1, 0] for b in blocks]))


def test_bf16_blocks_widen_exactly_and_eager_positions_fill_their_place(new_sink):
    sink, blocks = new_sink(), _blocks(2, torch.bfloat16)
    eager = torch.randn(1, H)
    for key in KEYS:  # the prompt's last token, copied eagerly
        sink.write("r", key, [4], eager + KEYS.index(key))
    for p, block in enumerate(blocks):
        sink.write_block(block, [BlockWrite("r", 5 + p, 0, KEYS, torch.float32)])
    rows, positions = sink.result("r", torch.float32)
    assert positions == [4, 5, 6]
    for j, key in enumerate(KEYS):
        assert rows[key].dtype == torch.float32
        assert torch.equal(rows[key][0], (eager + j)[0])
        assert torch.equal(rows[key][1:], torch.stack([b.host[0, j] for b in blocks]).float())


def test_a_position_recomputed_through_a_block_replaces_its_eager_copy(new_sink):
    sink, blocks = new_sink(), _blocks(1)
    for key in KEYS:
        sink.write("r", key, [0], torch.full((1, H), 7.0))
    sink.write_block(blocks[0], [BlockWrite("r", 0, 1, KEYS, torch.float32)])
    rows, positions = sink.result("r")
    assert positions == [0]
    assert torch.equal(rows["1.post_attn"][0], blocks[0].host[1, 2])
    sink.drop("r")
    assert sink.result("r") is None


def test_a_generation_is_its_own_rows_without_a_copy_and_pickles_only_them(new_sink):
    """Three requests share each step's block; each gets its rows in order, grown past the
    first buffer (doubling): each key's rows contiguous, on the request's buffer (no copy
    when it finishes), pickling to those rows alone."""
    sink, steps = new_sink(), 150  # past _BlockRows.FIRST_ROWS
    g = torch.Generator().manual_seed(1)
    blocks = [
        CapturedBlock(torch.randn(3, len(SLOTS), 1024, generator=g), SLOTS) for _ in range(steps)
    ]
    for p, block in enumerate(blocks):
        sink.write_block(
            block, [BlockWrite(r, 7 + p, row, KEYS, torch.float32) for row, r in enumerate("abc")]
        )
    for row, r in enumerate("abc"):
        rows, positions = sink.result(r)
        assert positions == list(range(7, 7 + steps))
        for j, key in enumerate(KEYS):
            assert torch.equal(rows[key], torch.stack([b.host[row, j] for b in blocks]))
        ptrs = [t.data_ptr() for t in rows.values()]
        assert all(t.is_contiguous() for t in rows.values())
        assert [b - ptrs[0] for b in ptrs] == [j * 256 * 1024 * 4 for j in range(len(KEYS))]
        want = steps * 1024 * 4  # a key's rows; the buffer holds 256 a key
        assert all(t.untyped_storage().nbytes() == want for t in rows.values())
        assert len(pickle.dumps(rows)) < 1.05 * len(KEYS) * want


def test_bf16_rows_are_kept_in_bf16_when_asked(new_sink):
    sink, blocks = new_sink(), _blocks(2)
    for p, block in enumerate(blocks):
        sink.write_block(block, [BlockWrite("r", p, 0, KEYS, torch.bfloat16)])
    rows, _ = sink.result("r", torch.bfloat16)
    for j, key in enumerate(KEYS):
        assert rows[key].dtype == torch.bfloat16
        assert torch.equal(rows[key], torch.stack([b.host[0, j] for b in blocks]).bfloat16())


def test_a_block_whose_rows_were_lost_fails_its_requests_result(new_sink):
    """The drain failed for a block: the request's result says so (no silent gap)."""
    sink, (ok, lost) = new_sink(), _blocks(2)
    lost.drained, lost.error = threading.Event(), OSError("no memory")
    lost.drained.set()
    sink.write_block(ok, [BlockWrite("r", 0, 0, KEYS, torch.float32)])
    sink.write_block(lost, [BlockWrite("r", 1, 0, KEYS, torch.float32)])
    with pytest.raises(RuntimeError, match=r"capture rows were lost.*no memory"):
        sink.result("r")
    # a later block's rows do not hide the lost one; another request's rows are not lost
    sink.write_block(lost, [BlockWrite("s", 0, 0, KEYS, torch.float32)])
    sink.write_block(ok, [BlockWrite(r, 1, 0, KEYS, torch.float32) for r in "rst"])
    for r in "rs":
        with pytest.raises(RuntimeError, match=r"capture rows were lost"):
            sink.result(r)
    rows, positions = sink.result("t")
    assert positions == [1] and torch.equal(rows[KEYS[0]][0], ok.host[0, 0])


def test_a_position_recomputed_through_a_later_block_takes_its_rows(new_sink):
    sink, blocks = new_sink(), _blocks(3)
    sink.write_block(blocks[0], [BlockWrite("r", 0, 0, KEYS, torch.float32)])
    sink.write_block(blocks[1], [BlockWrite("r", 1, 0, KEYS, torch.float32)])
    sink.write_block(blocks[2], [BlockWrite("r", 0, 1, KEYS, torch.float32)])  # after a preemption
    rows, positions = sink.result("r")
    assert positions == [0, 1]
    assert torch.equal(rows["0.post_block"][0], blocks[2].host[1, 1])
    assert torch.equal(rows["0.post_block"][1], blocks[1].host[0, 1])


def test_a_prefill_chunk_brings_several_rows_of_a_request_in_one_block_past_its_buffer(new_sink):
    """A request's rows of one block (a prefill chunk's positions) land even where the
    block takes its buffer past its first size: it grows once, before any row is copied."""
    sink, block = new_sink(), CapturedBlock(torch.randn(6, len(SLOTS), H), SLOTS)
    sink.write_block(block, [BlockWrite("r", p, p, KEYS, torch.float32, 2) for p in range(6)])
    rows, positions = sink.result("r")
    assert positions == list(range(6))
    for j, key in enumerate(KEYS):
        assert torch.equal(rows[key], block.host[:, j])


def test_a_blocks_rows_reach_every_request_across_chunks_with_rows_nobody_takes(monkeypatch):
    """A few `index_copy_` calls carry a block's rows to the requests that take them whole
    (`_scatter`: one a run of consecutive rows whose buffers share a chunk): a row nobody
    takes (its request finished) or one taken alone ends a run, requests whose buffers are
    in two chunks (a chunk filled mid-batch) each get theirs, and a request asking other
    keys or another dtype is copied alone beside them."""
    from services.engine.interventions.capture import _Arena

    # A chunk holds 3 buffers of 4 keys x 4 rows (16 rows each).
    monkeypatch.setattr(_Arena, "CHUNK_BYTES", 60 * H * 4)
    g = torch.Generator().manual_seed(1)
    blocks = [
        CapturedBlock(torch.randn(8, len(SLOTS), H, generator=g), SLOTS) for _ in range(3)
    ]  # row 7: a request that finished while the step ran (no write)
    runs = []
    scatter = InlineCaptureSink._scatter
    monkeypatch.setattr(
        InlineCaptureSink,
        "_scatter",
        staticmethod(lambda host, jobs: runs.append(len(jobs)) or scatter(host, jobs)),
    )
    calls = []
    index_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(
        torch.Tensor,
        "index_copy_",
        lambda t, dim, index, src: calls.append(len(index)) or index_copy(t, dim, index, src),
    )
    sink = InlineCaptureSink(scatter=True)
    subset = [KEYS[3], KEYS[0]]
    for p, block in enumerate(blocks):
        writes = [BlockWrite(f"r{t}", p, t, KEYS, torch.float32, 4) for t in (0, 1, 3, 4, 6)]
        writes.append(BlockWrite("sub", p, 2, subset, torch.float32, 4))  # row 5: nobody's
        writes.append(BlockWrite("half", p, 5, KEYS, torch.bfloat16, 4))
        sink.write_block(block, writes)
    for t in (0, 1, 3, 4, 6):
        rows, positions = sink.result(f"r{t}")
        assert positions == [0, 1, 2]
        for k, key in enumerate(KEYS):
            want = torch.stack([b.host[t, k] for b in blocks])
            assert torch.equal(rows[key], want), (t, key)
    rows, _ = sink.result("sub")
    assert torch.equal(rows[KEYS[3]], torch.stack([b.host[2, 3] for b in blocks]))
    assert torch.equal(rows[KEYS[0]], torch.stack([b.host[2, 0] for b in blocks]))
    rows, _ = sink.result("half", torch.bfloat16)
    assert torch.equal(rows[KEYS[1]], torch.stack([b.host[5, 1] for b in blocks]).bfloat16())
    chunks = {sink._blocks[f"r{t}"].buf.untyped_storage().data_ptr() for t in (0, 1, 3, 4, 6)}
    assert len(chunks) > 1  # the batch's buffers spanned chunks
    assert runs == [5, 5, 5]  # every block's whole-row requests in one `_scatter`
    # ... by runs of rows 0-1, 3-4 and 6 (2 and 5 are taken alone, 7 by nobody), split again
    # where a run's buffers change chunk: at least three calls a block, not five
    assert sum(calls) == 5 * 3 * len(KEYS) and 9 <= len(calls) < 15
