"""The engine's decode-attention, RMSNorm and rotary kernels compiled on CUDA against their
PyTorch references (bf16, fp16, fp32), and the decode kernel under CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.decode_attention import (
    MAX_SPLITS,
    decode_attention_reference,
    decode_attention_triton,
    decode_rope_attention_reference,
    decode_rope_attention_triton,
    prefill_attention_reference,
    prefill_attention_triton,
)
from services.engine.kernels.gemv import (
    gemv_fused_reference,
    gemv_gated_reference,
    gemv_reference,
    gemv_triton,
)
from services.engine.kernels.norm_rope import (
    rms_norm_reference,
    rms_norm_triton,
    rotary_reference,
    rotary_triton,
    silu_mul_reference,
    silu_mul_triton,
)
from services.engine.kernels.skinny_gemm import (
    MAX_ROWS,
    skinny_linear_reference,
    skinny_linear_triton,
    skinny_norm_linear_reference,
    skinny_norm_linear_triton,
)
from services.engine.kernels.tickets import Tickets
from tests.unit.engine.kernels.test_fused_kernels import (
    paged_case,
    prefill_case,
    rope_decode_case,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _cuda(case):
    return [t.cuda() for t in case]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "hq,hkv,d,lens,window",
    [
        (16, 8, 128, (512,), None),
        (32, 8, 128, (1, 700, 0, 1999, 16, 17, 33), None),
        (14, 2, 64, tuple(range(1, 129, 2)), None),
        (16, 8, 128, (300, 5, 900), 128),
    ],
)
def test_decode_kernel_matches_reference(dtype, hq, hkv, d, lens, window):
    width = -(-max(lens) // 16)
    blocks = len(lens) * width + 3
    case = _cuda(paged_case(hq, hkv, d, 16, lens, width, blocks, seed=len(lens), dtype=dtype))
    got = decode_attention_triton(*case, d**-0.5, window)
    want = decode_attention_reference(*case, d**-0.5, window)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 7])  # None: the launch's own (many, at batch 1-3)
@pytest.mark.parametrize(
    "hq,hkv,d,lens",
    [(16, 8, 128, (512,)), (32, 8, 128, (1, 700, 0, 1999, 16, 17, 33)), (14, 2, 64, (90,) * 64)],
)
def test_one_kernel_decode_matches_two(dtype, splits, hq, hkv, d, lens):
    """With tickets the last split to finish merges (one split writes straight out), on
    the GPU's real concurrency: the two-kernel answer within rounding, and the tickets are
    all zero after, ready for the next launch."""
    width = -(-max(lens) // 16)
    case = _cuda(paged_case(hq, hkv, d, 16, lens, width, len(lens) * width + 3, 5, dtype=dtype))
    tickets = Tickets().get(len(lens) * hkv, torch.device("cuda"))
    for _ in range(3):  # launches after the first find the tickets zeroed
        got = decode_attention_triton(*case, d**-0.5, num_splits=splits, tickets=tickets)
        want = decode_attention_triton(*case, d**-0.5, num_splits=splits)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert not tickets.any().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("splits,window", [(None, None), (1, None), (5, None), (None, 100)])
def test_rope_decode_kernel_matches_reference(dtype, norm, splits, window):
    """From the raw projection, in one kernel on the GPU: the norms, RoPE and the cache
    write (by the program whose tiles hold the new position, read back by it at once),
    then attention and the ticketed merge; against the references' output and cache."""
    case = _cuda(rope_decode_case(16, 8, 128, 16, (1, 300, 0, 77, 512, 16, 17), 40, 300, 2, dtype))
    q, k, v, cos, sin, positions, kc, vc, slots, tables, lens = case
    qw, kw = (torch.rand(128, device="cuda").to(dtype) + 0.5 for _ in "qk")
    qw, kw = (qw, kw) if norm else (None, None)
    kc2, vc2 = kc.clone(), vc.clone()
    want = decode_rope_attention_reference(
        q, k, v, cos, sin, positions, kc, vc, slots, tables, lens, 0.09, window, qw, kw, 1e-6
    )
    tickets = Tickets().get(len(lens) * 8, torch.device("cuda"))
    got = decode_rope_attention_triton(
        q, k, v, cos, sin, positions, kc2, vc2, slots, tables, lens, 0.09, window, qw, kw,
        1e-6, num_splits=splits, tickets=tickets,
    )  # fmt: skip
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    live = slots[lens > 0]
    for mine, theirs in ((kc2, kc), (vc2, vc)):
        flat, ref = mine.view(-1, 8, 128)[live].float(), theirs.view(-1, 8, 128)[live].float()
        torch.testing.assert_close(flat, ref, atol=tol, rtol=tol)
    assert not tickets.any().item()


def test_one_kernel_decode_survives_many_racing_launches():
    """Batch 1 at the most splits (64 programs a KV head racing for the last ticket), many
    launches back to back with no sync between: an ordering bug in the ticket's publish
    and acquire would show as a wrong merge or a ticket left drawn."""
    q, kc, vc, tables, lens = _cuda(
        paged_case(16, 8, 128, 16, (4000,), 256, 260, 9, torch.bfloat16)
    )
    qs = [q, torch.randn_like(q), torch.randn_like(q)]  # in turn: stale partials would show
    tickets = Tickets().get(8, torch.device("cuda"))
    want = []
    for qi in qs:
        want.append(
            decode_attention_triton(
                qi, kc, vc, tables, lens, 0.09, num_splits=MAX_SPLITS, tickets=tickets
            )
        )
        torch.cuda.synchronize()
    outs = [
        decode_attention_triton(
            qs[i % 3], kc, vc, tables, lens, 0.09, num_splits=MAX_SPLITS, tickets=tickets
        )
        for i in range(300)
    ]
    assert all(
        torch.equal(o, want[i % 3]) for i, o in enumerate(outs)
    )  # the merge's order is fixed
    assert not tickets.any().item()
    two = decode_attention_triton(q, kc, vc, tables, lens, 0.09, num_splits=MAX_SPLITS)
    torch.testing.assert_close(want[0].float(), two.float(), atol=2e-2, rtol=2e-2)


def test_decode_tickets_cannot_grow_inside_a_capture():
    """The counters may not grow inside a capture (a graph would keep a freed buffer's
    address); within their size the same buffer comes back, whether asked for on `cuda` or
    `cuda:0` (a bare `cuda` once made a new buffer at every call)."""
    tickets = Tickets()
    tickets.get(8, torch.device("cuda"))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"), torch.cuda.graph(graph):
        tickets.get(10_000, torch.device("cuda"))
    kept = tickets.get(8, torch.device("cuda"))  # and within its size, it is the same buffer
    assert kept.data_ptr() == tickets.get(1000, torch.device("cuda")).data_ptr()
    assert kept.data_ptr() == tickets.get(1000, torch.device("cuda", 0)).data_ptr()


def test_one_kernel_decode_replays_in_a_cuda_graph():
    q, kc, vc, tables, lens = _cuda(
        paged_case(16, 8, 128, 16, (40, 300, 0), 20, 70, 1, torch.bfloat16)
    )
    tickets = Tickets().get(3 * 8, torch.device("cuda"))
    decode_attention_triton(q, kc, vc, tables, lens, 0.1, tickets=tickets)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q, kc, vc, tables, lens, 0.1, tickets=tickets)
    for new_lens in ((1, 2, 3), (319, 0, 77), (300, 300, 300)):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        want = decode_attention_reference(q, kc, vc, tables, lens, 0.1)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not tickets.any().item()


def test_decode_kernel_replays_in_a_cuda_graph():
    q, kc, vc, tables, lens = _cuda(
        paged_case(16, 8, 128, 16, (40, 300, 0), 20, 70, 1, torch.bfloat16)
    )
    graph = torch.cuda.CUDAGraph()
    decode_attention_triton(q, kc, vc, tables, lens, 0.1)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q, kc, vc, tables, lens, 0.1)
    for new_lens in ((1, 2, 3), (319, 0, 77)):  # the same graph, other lengths and queries
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        want = decode_attention_reference(q, kc, vc, tables, lens, 0.1)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h", [64, 128, 1024, 4096, 5120])
def test_rms_norm_matches_reference(dtype, h):
    x = torch.randn(37, h, device="cuda", dtype=dtype)
    r = torch.randn(37, h, device="cuda", dtype=dtype)
    w = (torch.rand(h, device="cuda") + 0.5).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), atol=tol, rtol=tol
    )
    y, total = rms_norm_triton(x, w, 1e-6, residual=r)
    y_ref, total_ref = rms_norm_reference(x, w, 1e-6, residual=r)
    assert torch.equal(total, total_ref)  # the add rounds exactly as PyTorch's
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_matches_reference(dtype):
    from services.engine.model.config import RopeConfig
    from services.engine.model.layers import RotaryEmbedding

    rope = RotaryEmbedding(128, 4096, RopeConfig(theta=1e6, scaling=None)).cuda()
    qkv = torch.randn(50, (16 + 2 * 8) * 128, device="cuda", dtype=dtype)
    q = qkv[:, : 16 * 128].view(50, 16, 128)  # strided views, as the model passes them
    k = qkv[:, 16 * 128 : 24 * 128].view(50, 8, 128)
    pos = torch.randint(0, 4096, (50,), device="cuda")
    got = rotary_triton(q, k, rope.cos, rope.sin, pos)
    want = rotary_reference(q, k, rope.cos, rope.sin, pos)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "hq,hkv,d,lens,q_lens,window",
    [
        (16, 8, 128, (512, 700, 40), (512, 100, 1), None),  # fresh, chunk over cache, 1 token
        (32, 8, 128, (1999, 17), (300, 17), None),
        (14, 2, 64, (130, 64), (130, 63), 32),
    ],
)
def test_prefill_kernel_matches_reference(dtype, hq, hkv, d, lens, q_lens, window):
    q, kc, vc, tables, qsl, lens_t = prefill_case(hq, hkv, d, 16, lens, q_lens, seed=len(lens))
    args = [t.cuda() for t in (q.to(dtype), kc.to(dtype), vc.to(dtype), tables, qsl, lens_t)]
    got = prefill_attention_triton(*args, max(q_lens), d**-0.5, window)
    want = prefill_attention_reference(*args, d**-0.5, window)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_prefill_kernel_splitting_long_keys_matches_reference(dtype, splits):
    """A short chunk over a 16k cached prefix (the case key splits are for) beside a fresh
    chunk, at every split count."""
    lens, q_lens = (16384, 700), (64, 700)
    q, kc, vc, tables, qsl, lens_t = prefill_case(32, 8, 128, 16, lens, q_lens, seed=splits)
    args = [t.cuda() for t in (q.to(dtype), kc.to(dtype), vc.to(dtype), tables, qsl, lens_t)]
    got = prefill_attention_triton(*args, max(q_lens), 128**-0.5, None, splits)
    want = prefill_attention_reference(*args, 128**-0.5, None)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_step_at_long_context_matches_the_sdpa_backend(dtype):
    """Four decodes at 16k context (two before a chunk, two after) and a 4,096-token chunk
    over a 12k prefix in one step: the Triton backend's split gives what SDPA gives."""
    from services.engine.attention import SdpaBackend, TritonBackend
    from tests.unit.engine.kernels.test_fused_kernels import mixed_step

    q_lens, lens = (1, 1, 4096, 1, 1), (16384, 16000, 16384, 9000, 16384)
    inputs, (q, k, v), cache = mixed_step(q_lens, lens, 16, 8, 128, 16, device="cuda", dtype=dtype)
    sdpa_cache = [c.clone() for c in cache]
    got = TritonBackend().forward(q, k, v, cache, TritonBackend().prepare(inputs), 0.08, None)
    sdpa = SdpaBackend()
    want = sdpa.forward(q, k, v, sdpa_cache, sdpa.prepare(inputs), 0.08, None)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_rope_cache_kernel_matches_reference(dtype, norm):
    """The Qwen3-0.6B layer's shape (16 q heads, 8 KV heads, head dim 128), five tokens."""
    from services.engine.kernels.norm_rope import qk_rope_cache_reference, qk_rope_cache_triton
    from tests.unit.engine.kernels.test_fused_kernels import qk_rope_case

    args, caches, slots, weights = qk_rope_case(5, 16, 8, 128, 40, 16, norm, dtype)
    args = [a.cuda() for a in args]
    caches, slots = [c.cuda() for c in caches], slots.cuda()
    weights = [w.cuda() if w is not None else None for w in weights]
    want_caches = [c.clone() for c in caches]
    want = qk_rope_cache_reference(*args, *want_caches, slots, *weights, 1e-6)
    got = qk_rope_cache_triton(*args, *caches, slots, *weights, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(
        caches[0].float(), want_caches[0].float(), atol=TOL[dtype], rtol=TOL[dtype]
    )
    assert torch.equal(caches[1], want_caches[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2 * 3072), (37, 2 * 14336), (128, 2 * 1536)])
def test_silu_mul_matches_reference(dtype, shape):
    """One decode token, a 37-token step at Llama-3-8B's intermediate size, 128 tokens; the
    kernel rounds where PyTorch rounds, so the result is equal or within an ulp."""
    x = 4 * torch.randn(*shape, device="cuda", dtype=dtype)
    got = silu_mul_triton(x)
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got, silu_mul_reference(x), atol=tol, rtol=tol)
    strided = x[:, : shape[1] - 2]  # row-strided, and N no longer a multiple of the block
    torch.testing.assert_close(
        silu_mul_triton(strided), silu_mul_reference(strided), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "k,n,bias",
    [
        (1024, 4096, False),  # Qwen3-0.6B's qkv at batch 1
        (2048, 1024, False),  # its o_proj: K tiles of 1,024
        (1024, 151936, False),  # its LM head
        (4096, 3072, True),  # Llama-3-8B's qkv on one of two TP ranks, with a bias
        (7168, 4096, False),  # its down projection on one of two ranks
        (896, 4864 + 3, True),  # ragged: K not a multiple of the tile, N of the row block
    ],
)
def test_gemv_matches_reference(dtype, k, n, bias):
    """The one-row Linear against the float32 reference, rounded once to the input's dtype."""
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    got = gemv_triton(x, w, b)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), gemv_reference(x, w, b).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "k,n,bias",
    [
        (1024, 2 * 3072, False),  # Qwen3-0.6B's gate-up at batch 1
        (4096, 2 * 7168, False),  # Llama-3-8B's on one of two TP ranks
        (896, 2 * 4867, True),  # ragged: K not a multiple of the tile, N of the row block
    ],
)
def test_gemv_gated_matches_reference(dtype, k, n, bias):
    """The gate-up Linear and the MLP's activation in one launch (`gemv_activation`) against
    the reference, and against the unfused launch followed by `silu_mul`."""
    from services.engine.kernels.norm_rope import silu_mul_triton

    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    got = gemv_triton(x, w, b, gated=True)
    tol = TOL[dtype]
    want = gemv_gated_reference(x, w, b).float()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    unfused = silu_mul_triton(gemv_triton(x, w, b)).float()
    torch.testing.assert_close(got.float(), unfused, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "k,n,gated,fold",
    [
        (1024, 4096, False, "norm"),  # Qwen3-0.6B's qkv with its input norm
        (1024, 2 * 3072, True, "norm"),  # its gate-up, norm and activation
        (2048, 1024, False, "residual"),  # its o_proj and the residual add
        (4096, 2 * 14336, True, "norm"),  # Llama-3-8B's gate-up
        (14336, 4096, False, "residual"),  # its down projection and the add
        (896, 4864 + 3, False, "norm"),  # ragged
    ],
)
def test_gemv_folded_norm_and_residual_match_reference(dtype, k, n, gated, fold):
    """A decode layer's norm in the Linear after it, or its residual add in the Linear
    before it (`gemv_fold_norms`), against the reference, and against the norm kernel and
    the plain launch (and the add) within the dtype's rounding."""
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    norm = res = None
    if fold == "norm":
        norm = ((torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype), 1e-6)
    else:
        res = torch.randn(1, n, device="cuda", generator=g).to(dtype)
    got = gemv_triton(x, w, gated=gated, norm=norm, residual=res).float()
    tol = TOL[dtype]
    want = gemv_fused_reference(x, w, gated=gated, norm=norm, residual=res).float()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    unfused = gemv_triton(rms_norm_triton(x, *norm) if norm else x, w, gated=gated)
    unfused = (unfused + res if res is not None else unfused).float()
    torch.testing.assert_close(got, unfused, atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "m,k,n,gated,bias",
    [
        (1, 1024, 4096, False, False),  # Qwen3-0.6B's qkv at batch 1
        (1, 1024, 2 * 3072, True, False),  # its gate-up with the activation
        (MAX_ROWS, 3072, 1024, False, False),  # its down projection, a full tile of rows
        (5, 896, 2 * 4864, True, True),  # ragged rows, a bias on both halves (Qwen2 style)
        (3, 4096, 2 * 14336, True, False),  # Llama-3-8B's gate-up
        (1, 2048, 1024, False, False),  # Qwen3-0.6B's o_proj: 64 column blocks, split 8
        (1, 14336, 4096, False, False),  # Llama-3-8B's down at batch 1
    ],
)
@pytest.mark.parametrize("split", [False, True])
def test_skinny_linear_matches_reference(dtype, m, k, n, gated, bias, split):
    """One program down all of K, or (with tickets) K split to fill the GPU, the last
    program of each column block summing the partials."""
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    tickets = Tickets() if split else None
    got = skinny_linear_triton(x, w, b, gated, tickets)
    want = skinny_linear_reference(x, w, b, gated)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert tickets is None or not tickets.get(1, x.device).any().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "m,k,n,gated,residual",
    [
        (1, 1024, 4096, False, True),  # Qwen3-0.6B's input norm into qkv
        (1, 1024, 2 * 3072, True, True),  # its post-attention norm into gate-up
        (MAX_ROWS, 4096, 6144, False, False),  # Llama-3-8B's first layer: no residual yet
        (3, 4096, 2 * 14336, True, True),  # Llama-3-8B's gate-up
    ],
)
@pytest.mark.parametrize("split", [False, True])
def test_skinny_norm_linear_matches_reference(dtype, m, k, n, gated, residual, split):
    """The RMSNorm (and the residual add) inside the Linear's launch: the norm-then-GEMM
    reference within the dtype's tolerance (the normed row is not rounded before the
    products), and the stream x + residual bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    res = torch.randn(m, k, device="cuda", generator=g).to(dtype) if residual else None
    norm_weight = (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    tickets = Tickets() if split else None
    got, stream = skinny_norm_linear_triton(x, res, norm_weight, 1e-6, w, None, gated, tickets)
    want, want_stream = skinny_norm_linear_reference(x, res, norm_weight, 1e-6, w, None, gated)
    # bf16: the reference rounds the normed row twice, the kernel x ⊙ g once; over 30 seeds
    # the 8B gate-up case's error reaches 0.85 of this bound (a CPU emulation of both)
    tol = 3e-2 if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(stream, want_stream)


def test_split_skinny_linear_survives_many_racing_launches():
    """Sixteen splits a column block racing for the last ticket, 300 launches back to back
    over three inputs in turn (so a sum that read a partial before it landed would read
    the launch before's, which differs): each equals its input's launch run alone (the
    sum's order is fixed), and no ticket is left drawn."""
    xs = [torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    w = torch.randn(1024, 8192, device="cuda", dtype=torch.bfloat16) / 8192**0.5
    tickets = Tickets()
    want = []
    for x in xs:
        want.append(skinny_linear_triton(x, w, tickets=tickets, splits=16))
        torch.cuda.synchronize()
    outs = [skinny_linear_triton(xs[i % 3], w, tickets=tickets, splits=16) for i in range(300)]
    assert all(torch.equal(o, want[i % 3]) for i, o in enumerate(outs))
    assert not tickets.get(1, w.device).any().item()


@pytest.mark.parametrize("split", [False, True])
def test_skinny_linear_replays_in_a_cuda_graph(split):
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 256, 1024, device="cuda", dtype=torch.bfloat16) / 1024**0.5
    tickets = Tickets() if split else None
    skinny_linear_triton(x, w, gated=True, tickets=tickets)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear_triton(x, w, gated=True, tickets=tickets)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = skinny_linear_reference(x, w, gated=True)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [1024, 4096])
def test_scatter_rows_writes_a_device_block_into_pinned_host_memory(dst_dtype, H):
    """The capture block's rows go from the device straight into page-locked host chunks
    (the device addresses them directly): exactly what the reference writes, on a side
    stream, with two requests' column maps and a row of nobody's."""
    from services.engine.kernels.capture import scatter_rows_reference, scatter_rows_triton
    from tests.unit.engine.kernels.test_capture import _dest, _scatter_case

    src, want, dest, maps = _scatter_case(5, 6, H, dst_dtype)
    got = [t.clone().pin_memory() for t in want]  # two chunks: one launch reaches both
    scatter_rows_reference(src, want, dest, maps)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        table = _dest(got, 4 * H, H).cuda()
        scatter_rows_triton(src.cuda(), got, table, maps.cuda(), programs=4)
    stream.synchronize()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(), w.nan_to_num())  # a copy: bit for bit
