"""The inline capture sink assembles a request's rows from shared decode blocks and eager
copies: each key's rows in position order, in the dtype asked for. Block rows go into each
request's own buffer on the sink's thread as they come, so a finished request's result is
a view of its rows, not a copy made when it finishes."""

import pickle
import threading
import time

import pytest
import torch

from services.engine.interventions.capture import BlockWrite, InlineCaptureSink
from services.engine.interventions.host_rows import CaptureArena
from services.engine.interventions.planner import CapturedBlock, Readback
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
        sink.write_block(block, [BlockWrite("r", 10 + p, 2, KEYS, torch.float32)])
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
        sink.write_block(block, [BlockWrite("r", p, 1, keys, torch.float32)])
    rows, _ = sink.result("r")
    assert torch.equal(rows["1.post_block"], torch.stack([b.host[1, 3] for b in blocks]))
    assert torch.equal(rows["0.post_attn"], torch.stack([b.host[1, 0] for b in blocks]))


def test_bf16_blocks_widen_exactly_and_eager_positions_fill_their_place():
    sink, blocks = InlineCaptureSink(), _blocks(2, torch.bfloat16)
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


def test_a_position_recomputed_through_a_block_replaces_its_eager_copy():
    sink, blocks = InlineCaptureSink(), _blocks(1)
    for key in KEYS:
        sink.write("r", key, [0], torch.full((1, H), 7.0))
    sink.write_block(blocks[0], [BlockWrite("r", 0, 1, KEYS, torch.float32)])
    rows, positions = sink.result("r")
    assert positions == [0]
    assert torch.equal(rows["1.post_attn"][0], blocks[0].host[1, 2])
    sink.drop("r")
    assert sink.result("r") is None


def test_a_generation_is_its_own_rows_without_a_copy_and_pickles_only_them():
    """Three requests share each step's block; each gets its rows in order, grown past the
    first buffer (doubling): each key's rows contiguous, on the request's buffer (no copy
    when it finishes), pickling to those rows alone."""
    sink, steps = InlineCaptureSink(), 150  # past _BlockRows.FIRST_ROWS
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


def test_bf16_rows_are_kept_in_bf16_when_asked():
    sink, blocks = InlineCaptureSink(), _blocks(2)
    for p, block in enumerate(blocks):
        sink.write_block(block, [BlockWrite("r", p, 0, KEYS, torch.bfloat16)])
    rows, _ = sink.result("r", torch.bfloat16)
    for j, key in enumerate(KEYS):
        assert rows[key].dtype == torch.bfloat16
        assert torch.equal(rows[key], torch.stack([b.host[0, j] for b in blocks]).bfloat16())


def test_a_block_whose_rows_were_lost_fails_its_requests_result():
    """The drain failed for a block: the request's result says so (no silent gap)."""
    sink, (ok, lost) = InlineCaptureSink(), _blocks(2)
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


def test_a_position_recomputed_through_a_later_block_takes_its_rows():
    sink, blocks = InlineCaptureSink(), _blocks(3)
    sink.write_block(blocks[0], [BlockWrite("r", 0, 0, KEYS, torch.float32)])
    sink.write_block(blocks[1], [BlockWrite("r", 1, 0, KEYS, torch.float32)])
    sink.write_block(blocks[2], [BlockWrite("r", 0, 1, KEYS, torch.float32)])  # after a preemption
    rows, positions = sink.result("r")
    assert positions == [0, 1]
    assert torch.equal(rows["0.post_block"][0], blocks[2].host[1, 1])
    assert torch.equal(rows["0.post_block"][1], blocks[1].host[0, 1])


def test_a_prefill_chunk_brings_several_rows_of_a_request_in_one_block_past_its_buffer():
    """A request's rows of one block (a prefill chunk's positions) land even where the
    block takes its buffer past its first size: it grows once, before any row is copied."""
    sink, block = InlineCaptureSink(), CapturedBlock(torch.randn(6, len(SLOTS), H), SLOTS)
    sink.write_block(block, [BlockWrite("r", p, p, KEYS, torch.float32, 2) for p in range(6)])
    rows, positions = sink.result("r")
    assert positions == list(range(6))
    for j, key in enumerate(KEYS):
        assert torch.equal(rows[key], block.host[:, j])


def _placed_step(sink, block: CapturedBlock, writes: list[BlockWrite], finished=()) -> None:
    """One decode step as the engine runs it with an arena: the sink places the block's
    rows before the step, the device writes them (here the reference op, on CPU), and the
    accepted rows (not those of requests `finished` meanwhile) are written after it."""
    placement = sink.place(writes, SLOTS)  # every row of the block: its first len(writes)
    if placement is not None:  # as `Readback.copy_captures` does off CUDA
        Readback.scatter_placed(block.host[: len(writes)].contiguous(), placement)
        placement.queued = True
    host = None if placement is not None and placement.complete else block.host
    accepted = [w for w in writes if w.request_id not in finished]
    sink.write_block(CapturedBlock(host, SLOTS), accepted)


def test_placed_rows_land_in_each_requests_arena_buffer_in_its_keys_and_dtype():
    """Each request of a block gets a segment of the arena the first time it captures (the
    positions its capture brings, at most `FIRST_SEGMENT_ROWS`, of its keys, in its dtype);
    the device writes its row there by the request's own column map, and the result is its
    rows in position order, copied out once: its segments go back when it is dropped."""
    arena = CaptureArena(H, 4 * CaptureArena.CHUNK_BYTES, pin=False)
    sink, blocks = InlineCaptureSink(arena), _blocks(3)
    sub = ["1.post_block", "0.post_attn"]  # columns 3 and 0
    for p, block in enumerate(blocks):
        _placed_step(
            sink,
            block,
            [
                BlockWrite("r", 10 + p, 0, KEYS, torch.float32, 4),
                BlockWrite("s", 3 + p, 1, sub, torch.bfloat16, 3),
                BlockWrite("t", p, 2, KEYS, torch.float32, None),  # how many is not known
            ],
        )
    assert {dtype: len(c) for dtype, c in arena.chunks.items()} == {
        torch.float32: 1,
        torch.bfloat16: 1,
    }
    assert arena.num_bytes == 2 * CaptureArena.CHUNK_BYTES and arena.num_chunks == 2
    capacity = {rid: [seg.capacity for seg in b.segments] for rid, b in sink._blocks.items()}
    assert capacity == {"r": [4], "s": [3], "t": [InlineCaptureSink.FIRST_SEGMENT_ROWS]}
    rows, positions = sink.result("r")
    assert positions == [10, 11, 12]
    for j, key in enumerate(KEYS):
        assert torch.equal(rows[key], torch.stack([b.host[0, j] for b in blocks]))
    rows, positions = sink.result("s", torch.bfloat16)
    assert positions == [3, 4, 5] and list(rows) == sub
    assert torch.equal(rows["1.post_block"], torch.stack([b.host[1, 3] for b in blocks]).bfloat16())
    assert torch.equal(rows["0.post_attn"], torch.stack([b.host[1, 0] for b in blocks]).bfloat16())
    rows, _ = sink.result("t")
    assert torch.equal(rows["1.post_attn"], torch.stack([b.host[2, 2] for b in blocks]))
    chunks = [c for cs in arena.chunks.values() for c in cs]
    assert any(c.num_free < c.num_rows for c in chunks)
    for rid in "rst":
        sink.drop(rid)
    assert all(c.num_free == c.num_rows for c in chunks)  # every segment went back
    assert torch.equal(rows["1.post_attn"], torch.stack([b.host[2, 2] for b in blocks]))


def test_placed_rows_outgrowing_a_segment_go_on_in_a_new_one_and_past_the_arena_spill(
    monkeypatch,
):
    """A request whose rows outgrow its segment gets another (twice its rows so far); where
    the arena has no room for one, its later rows come home with their blocks and are
    assembled, and its result is every row in order all the same."""
    monkeypatch.setattr(InlineCaptureSink, "FIRST_SEGMENT_ROWS", 2)
    keys = len(KEYS)
    monkeypatch.setattr(CaptureArena, "CHUNK_BYTES", 4 * keys * H * 4)  # 4 rows a chunk
    arena = CaptureArena(H, 2 * CaptureArena.CHUNK_BYTES, pin=False)
    sink, blocks = InlineCaptureSink(arena), _blocks(9)
    for p, block in enumerate(blocks):
        _placed_step(sink, block, [BlockWrite("r", p, 0, KEYS, torch.float32, None)])
    rows = sink._blocks["r"]
    # 2 rows, 2 more (what it had), 4 more (a chunk's most) in a second chunk; then no
    # room for a third chunk under the cap: the ninth row spills
    assert [(seg.start, seg.capacity) for seg in rows.segments] == [(0, 2), (2, 2), (4, 4)]
    assert rows.spilled_at == 8 and arena.num_refused == 1
    got, positions = sink.result("r")
    assert positions == list(range(9))
    for j, key in enumerate(KEYS):
        assert torch.equal(got[key], torch.stack([b.host[0, j] for b in blocks]))


def test_an_arena_without_room_places_nothing_and_the_rows_are_assembled():
    sink, blocks = InlineCaptureSink(CaptureArena(H, 0, pin=False)), _blocks(2)
    for p, block in enumerate(blocks):
        _placed_step(sink, block, [BlockWrite("r", p, 0, KEYS, torch.float32, 2)])
    assert not sink._blocks["r"].direct
    got, positions = sink.result("r")
    assert positions == [0, 1]
    assert torch.equal(got["0.post_block"], torch.stack([b.host[0, 1] for b in blocks]))


def test_a_placed_row_of_a_request_finished_meanwhile_is_not_among_its_positions():
    """With overlapped steps the next step is placed before the step before is accepted: a
    request that finished in between had a row written for a position it never keeps."""
    arena = CaptureArena(H, 4 * CaptureArena.CHUNK_BYTES, pin=False)
    sink, blocks = InlineCaptureSink(arena), _blocks(3)
    for p, block in enumerate(blocks):
        writes = [BlockWrite("r", p, 0, KEYS, torch.float32, 3)]
        _placed_step(sink, block, writes, finished={"r"} if p == 2 else ())
    rows, positions = sink.result("r")
    assert positions == [0, 1]
    assert torch.equal(rows["0.post_block"], torch.stack([b.host[0, 1] for b in blocks[:2]]))


def test_the_arena_takes_chunks_as_needed_up_to_its_cap_and_refuses_beyond():
    rows_a_chunk = CaptureArena.CHUNK_BYTES // (H * 4)
    arena = CaptureArena(H, 2 * CaptureArena.CHUNK_BYTES, pin=False)
    held = [arena.take(rows_a_chunk // 2, torch.float32) for _ in range(4)]
    assert all(h is not None for h in held) and arena.num_bytes == 2 * CaptureArena.CHUNK_BYTES
    assert arena.num_chunks == 2
    assert arena.take(1, torch.float32) is None  # full, and no room for a third chunk
    assert arena.take(rows_a_chunk + 1, torch.float32) is None  # larger than a chunk
    assert arena.num_refused == 2
    del held[0]  # its run goes back
    assert arena.take(rows_a_chunk // 2, torch.float32) is not None


def test_many_slot_orders_start_the_column_maps_again_before_a_step_is_placed():
    """After requests asking keys in more than 256 orders (an engine's long life, here put
    in place by hand), the sink starts its column maps again before a step's rows are
    given theirs, so every row's map is in the step's table and reads its own columns."""
    sink = InlineCaptureSink(CaptureArena(H, 4 * CaptureArena.CHUNK_BYTES, pin=False))
    sink._maps.update({(1000 + i,): i for i in range(300)})  # orders of requests long gone
    block = _blocks(1)[0]
    sub = ["1.post_block", "0.post_attn"]
    writes = [
        BlockWrite("a", 0, 0, KEYS, torch.float32, 2),
        BlockWrite("b", 0, 1, sub, torch.float32, 2),
        BlockWrite("c", 0, 2, KEYS, torch.float32, 2),
    ]
    _placed_step(sink, block, writes)
    assert len(sink._maps) == 2  # the step's two orders alone
    for j, w in enumerate(writes):
        rows, _ = sink.result(w.request_id)
        for key in w.keys:
            assert torch.equal(rows[key][0], block.host[j, KEYS.index(key)])


def test_a_placement_whose_step_never_ran_says_so():
    """A step placed and then not launched (it failed) writes nothing: its requests' rows
    are lost, which their results say, instead of reading rows no one wrote."""
    sink = InlineCaptureSink(CaptureArena(H, 4 * CaptureArena.CHUNK_BYTES, pin=False))
    writes = [BlockWrite("r", 0, 0, KEYS, torch.float32, 4)]
    placement = sink.place(writes, SLOTS)
    assert placement is not None and placement.done()  # nothing queued: nothing to wait for
    sink.write_block(CapturedBlock(None, SLOTS), writes)
    with pytest.raises(RuntimeError, match="the step that was to write them did not run"):
        sink.result("r")


@pytest.mark.parametrize("on_pool", [True, False], ids=["large", "small"])
def test_a_finished_placed_request_is_gathered_off_the_callers_thread_once(monkeypatch, on_pool):
    """Asked whether a finished request's rows are home, the sink copies large ones out of
    its arena segments on its own thread (megabytes a request, off the engine's), and the
    result then takes that copy rather than making another; small ones are home at once,
    and the result copies them on the caller's thread (no step's wait for a thread)."""
    calls: list[str] = []
    gathered = InlineCaptureSink._gathered

    def counted(blocks, n):
        calls.append(threading.current_thread().name)
        return gathered(blocks, n)

    monkeypatch.setattr(InlineCaptureSink, "_gathered", staticmethod(counted))
    if on_pool:  # these rows count as large
        monkeypatch.setattr(InlineCaptureSink, "GATHER_ON_POOL", 0)
    sink = InlineCaptureSink(CaptureArena(H, 4 * CaptureArena.CHUNK_BYTES, pin=False))
    blocks = _blocks(3)
    for p, block in enumerate(blocks):
        _placed_step(sink, block, [BlockWrite("r", p, 0, KEYS, torch.float32, 8)])
    for _ in range(200):
        if sink.ready("r"):
            break
        time.sleep(0.01)
    assert sink.ready("r")
    rows, positions = sink.result("r")
    assert positions == [0, 1, 2]
    assert torch.equal(rows["1.post_block"], torch.stack([b.host[0, 3] for b in blocks]))
    assert len(calls) == 1
    assert calls[0].startswith("capture-assemble" if on_pool else "MainThread")
