"""The engine's own attention, norm and rotary kernels against their PyTorch references:
the references against a dense oracle here, the Triton kernels interpreted on CPU in a fresh
process (as in test_steer.py), and in bf16 on the device (tests/gpu/test_fused_kernels_bf16.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels.decode_attention import (
    decode_attention_reference,
    decode_attention_triton,
    decode_rope_attention_reference,
    decode_rope_attention_triton,
    prefill_attention_reference,
    prefill_attention_triton,
)
from services.engine.kernels.norm_rope import (
    qk_rope_cache_reference,
    qk_rope_cache_triton,
    rms_norm_reference,
    rms_norm_triton,
    rotary_reference,
    rotary_triton,
    silu_mul,
    silu_mul_reference,
    silu_mul_triton,
)
from services.engine.kernels.steer import INTERPRET
from services.engine.kernels.tickets import Tickets
from tests.interpreted import assert_passes_interpreted

interpreted_only = pytest.mark.skipif(
    not INTERPRET, reason="run under TRITON_INTERPRET=1 by test_triton_under_interpreter"
)


def paged_case(
    hq=4, hkv=2, d=64, page=4, lens=(23, 1, 0), width=6, blocks=24, seed=0, dtype=torch.float32
):
    """A scrambled paged cache and each request's block table."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, page, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    return q, k_cache, v_cache, tables.int(), torch.tensor(lens, dtype=torch.int32)


def dense_attention(q, k_cache, v_cache, tables, lens, scale, window=None):
    """The oracle: each request's keys laid out densely, SDPA with an explicit mask."""
    out = torch.zeros_like(q)
    page = k_cache.shape[1]
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        k = torch.cat([k_cache[int(blk)] for blk in tables[b]])[:n]  # [n, Hkv, D]
        v = torch.cat([v_cache[int(blk)] for blk in tables[b]])[:n]
        assert k.shape[0] == n and page > 0
        mask = torch.ones(1, n, dtype=torch.bool)
        if window is not None:
            mask[0, : max(0, n - window)] = False
        o = F.scaled_dot_product_attention(
            q[b][:, None],
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # [Hq, 1, D]
        out[b] = o[:, 0]
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (8, 1)])
def test_decode_reference_matches_dense_attention(hq, hkv, window):
    case = paged_case(hq=hq, hkv=hkv)
    want = dense_attention(*case, 0.125, window)
    got = decode_attention_reference(*case, 0.125, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # a padding row gives zeros


def prefill_case(hq=4, hkv=2, d=64, page=4, lens=(70, 5, 33), q_lens=(70, 2, 10), seed=0):
    """Chunks over cached context: request r's queries are its last q_lens[r] positions."""
    g = torch.Generator().manual_seed(seed)
    blocks, width = 3 * (-(-max(lens) // page)) + 2, -(-max(lens) // page)
    k_cache = torch.randn(blocks, page, hkv, d, generator=g)
    v_cache = torch.randn(blocks, page, hkv, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    return q, k_cache, v_cache, tables.int(), qsl, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_reference_equals_decoding_each_query_on_its_own(window):
    """A chunk's query at position p sees exactly what a decode at length p + 1 sees."""
    q, kc, vc, tables, qsl, lens = prefill_case()
    got = prefill_attention_reference(q, kc, vc, tables, qsl, lens, 0.125, window)
    for r in range(len(lens)):
        for i in range(int(qsl[r]), int(qsl[r + 1])):
            pos_len = int(lens[r]) - (int(qsl[r + 1]) - i) + 1
            want = dense_attention(
                q[i : i + 1], kc, vc, tables[r : r + 1], torch.tensor([pos_len]), 0.125, window
            )
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)


def test_norm_and_rotary_references_are_the_model_math():
    x, w = torch.randn(3, 32), torch.rand(32) + 0.5
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), want)
    r = torch.randn(3, 32)
    y, total = rms_norm_reference(x, w, 1e-6, residual=r)
    assert torch.equal(total, x + r) and torch.equal(y, rms_norm_reference(x + r, w, 1e-6))
    # rotating by position 0 (cos 1, sin 0) is the identity
    cos, sin = torch.ones(4, 16), torch.zeros(4, 16)
    q, k = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    qr, kr = rotary_reference(q, k, cos, sin, torch.tensor([0, 3]))
    assert torch.equal(qr, q) and torch.equal(kr, k)


def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "interpreted")


@interpreted_only
@pytest.mark.parametrize(
    "hq,hkv,d,page,window,splits",
    [(4, 2, 64, 4, None, 1), (4, 2, 64, 4, None, 3), (2, 2, 128, 16, None, 2), (8, 1, 64, 8, 5, 2)],
)
def test_interpreted_decode_kernel_matches_reference(hq, hkv, d, page, window, splits):
    lens = (6 * page - 1, 1, 0, 2 * page + 3)
    case = paged_case(hq=hq, hkv=hkv, d=d, page=page, lens=lens, width=6, blocks=30, seed=d + page)
    want = decode_attention_reference(*case, 0.1, window)
    got = decode_attention_triton(*case, 0.1, window, num_splits=splits)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@interpreted_only
@pytest.mark.parametrize(
    "hq,hkv,d,page,window,splits",
    [(4, 2, 64, 4, None, 1), (4, 2, 64, 4, None, 3), (8, 1, 64, 8, 5, 2), (2, 2, 64, 4, None, 7)],
)
def test_interpreted_one_kernel_decode_merges_like_two(hq, hkv, d, page, window, splits):
    """With tickets the last split merges (or one split writes straight out): the two-kernel
    answer, and every ticket is back at zero for the next launch, so a second launch over
    other lengths (a graph replay) is right too."""
    lens = (6 * page - 1, 1, 0, 2 * page + 3)
    case = paged_case(hq=hq, hkv=hkv, d=d, page=page, lens=lens, width=6, blocks=30, seed=d + page)
    tickets = Tickets().get(len(lens) * hkv, torch.device("cpu"))
    for lens_now in (lens, (0, 5, 2 * page, 6 * page)):
        case[-1].copy_(torch.tensor(lens_now, dtype=torch.int32))
        want = decode_attention_triton(*case, 0.1, window, num_splits=splits)
        got = decode_attention_triton(*case, 0.1, window, num_splits=splits, tickets=tickets)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # float32, other kernels
        ref = decode_attention_reference(*case, 0.1, window)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert not tickets.any(), "a ticket was left drawn"


def rope_decode_case(hq=4, hkv=2, d=64, page=4, lens=(23, 1, 0, 11), width=6, blocks=30, seed=0,
                     dtype=torch.float32):  # fmt: skip
    """A decode step before its norms, RoPE and cache writes: raw q, k, v as strided views of
    one qkv row (as the projection leaves them), cos/sin tables, each row's position (its
    length - 1) and the slot it writes (a scratch slot no table holds, for a padding row),
    over `paged_case`'s scrambled cache."""
    q, k_cache, v_cache, tables, lens_t = paged_case(
        hq, hkv, d, page, lens, width, blocks, seed, dtype
    )
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max(lens) + 1).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    unused = sorted(set(range(blocks)) - set(tables.flatten().tolist()))
    positions = (lens_t - 1).clamp(min=0).long()
    slots = [
        int(tables[b, p // page]) * page + p % page if n else unused[0] * page
        for b, (n, p) in enumerate(zip(lens, positions.tolist(), strict=True))
    ]
    return q, k, v, cos, sin, positions, k_cache, v_cache, torch.tensor(slots), tables, lens_t


@interpreted_only
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    "hq,hkv,d,page,window,splits,merge",
    [(4, 2, 64, 4, None, 1, True), (4, 2, 64, 4, None, 3, True), (8, 1, 32, 8, 5, 2, True),
     (4, 2, 64, 4, None, 7, False), (2, 2, 64, 4, None, None, True)],
)  # fmt: skip
def test_interpreted_rope_decode_kernel_matches_reference(
    hq, hkv, d, page, window, splits, merge, norm
):
    """The one-kernel decode from the raw projection: the q/k norms, RoPE and K/V cache
    writes, then attention, as the two references compute them; the cache holds what
    `qk_rope_cache_reference` writes (and a padding row writes nothing)."""
    case = rope_decode_case(hq, hkv, d, page, seed=d + page)
    q, k, v, cos, sin, positions, kc, vc, slots, tables, lens = case
    g = torch.Generator().manual_seed(3)
    qw, kw = (
        (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5)
        if norm
        else (None, None)
    )
    kc2, vc2 = kc.clone(), vc.clone()
    want = decode_rope_attention_reference(
        q, k, v, cos, sin, positions, kc, vc, slots, tables, lens, 0.1, window, qw, kw, 1e-6
    )
    tickets = Tickets().get(len(lens) * hkv, torch.device("cpu")) if merge else None
    got = decode_rope_attention_triton(
        q, k, v, cos, sin, positions, kc2, vc2, slots, tables, lens, 0.1, window, qw, kw, 1e-6,
        num_splits=splits, tickets=tickets,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    scratch = slots[lens == 0]
    keep = torch.ones(kc.numel() // (hkv * d), dtype=torch.bool)
    keep[scratch] = False  # the reference writes padding rows to the scratch slot; we do not
    for mine, theirs in ((kc2, kc), (vc2, vc)):
        torch.testing.assert_close(mine.view(-1, hkv, d)[keep], theirs.view(-1, hkv, d)[keep])
    assert tickets is None or not tickets.any()


@interpreted_only
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_interpreted_rope_decode_kernel_rounds_as_the_separate_kernels(norm, splits):
    """In float16 (which the interpreter rounds as the GPU does) the one kernel writes the
    cache the reference writes, bit for bit, and attends to exactly what the norm-RoPE-cache
    kernel and the two-kernel decode give: it rounds where they round."""
    dtype, d, hkv = torch.float16, 64, 2
    case = rope_decode_case(4, hkv, d, 4, seed=7, dtype=dtype)
    q, k, v, cos, sin, positions, kc, vc, slots, tables, lens = case
    g = torch.Generator().manual_seed(3)
    qw, kw = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in "qk")
    qw, kw = (qw, kw) if norm else (None, None)
    kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    qk_rope_cache_reference(q, k, v, cos, sin, positions, kc, vc, slots, qw, kw, 1e-6)
    rotated = qk_rope_cache_triton(q, k, v, cos, sin, positions, kc3, vc3, slots, qw, kw, 1e-6)
    want = decode_attention_triton(rotated, kc3, vc3, tables, lens, 0.1, num_splits=splits)
    tickets = Tickets().get(len(lens) * hkv, torch.device("cpu"))
    got = decode_rope_attention_triton(
        q, k, v, cos, sin, positions, kc2, vc2, slots, tables, lens, 0.1, None, qw, kw, 1e-6,
        num_splits=splits, tickets=tickets,
    )  # fmt: skip
    assert torch.equal(got, want)
    live = slots[lens > 0]
    for mine, theirs in ((kc2, kc), (vc2, vc)):
        assert torch.equal(mine.view(-1, hkv, d)[live], theirs.view(-1, hkv, d)[live])


@interpreted_only
@pytest.mark.parametrize(
    "hq,hkv,d,page,window", [(4, 2, 64, 4, None), (2, 2, 128, 16, None), (4, 1, 64, 8, 5)]
)
def test_interpreted_prefill_kernel_matches_reference(hq, hkv, d, page, window):
    q, kc, vc, tables, qsl, lens = prefill_case(hq, hkv, d, page, seed=d + page)
    want = prefill_attention_reference(q, kc, vc, tables, qsl, lens, 0.1, window)
    got = prefill_attention_triton(q, kc, vc, tables, qsl, lens, 70, 0.1, window)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@interpreted_only
@pytest.mark.parametrize("splits", [2, 5])
def test_interpreted_prefill_kernel_splitting_the_keys_matches_reference(splits):
    """A short chunk over a long cached prefix, beside a long chunk and a one-token chunk: the
    keys walked in `splits` parts and merged give the unsplit answer."""
    q, kc, vc, tables, qsl, lens = prefill_case(lens=(300, 290, 140), q_lens=(3, 130, 1), seed=3)
    want = prefill_attention_reference(q, kc, vc, tables, qsl, lens, 0.1, None)
    got = prefill_attention_triton(q, kc, vc, tables, qsl, lens, 130, 0.1, None, splits)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    got = prefill_attention_triton(q, kc, vc, tables, qsl, lens, 130, 0.1, 40, splits)
    want = prefill_attention_reference(q, kc, vc, tables, qsl, lens, 0.1, 40)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def mixed_step(q_lens, lens, hq=4, hkv=2, d=64, page=4, seed=0, device="cpu", dtype=None):
    """A step's attention inputs over a scrambled paged cache: request r computes its last
    q_lens[r] positions of lens[r], and its new K/V go to those positions' slots. Returns
    the inputs, [q, k, v] and [k_cache, v_cache] on `device`, in `dtype` (float32)."""
    from services.engine.attention import StepAttentionInputs

    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // page)
    blocks = len(lens) * width + 1
    tables = torch.randperm(blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    qsl = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    slots = [
        int(tables[r, p // page]) * page + p % page
        for r, (n, ql) in enumerate(zip(lens, q_lens, strict=True))
        for p in range(n - ql, n)
    ]
    inputs = StepAttentionInputs(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.int().to(device),
        block_size=page,
        query_start_loc_host=qsl,
        seq_lens_host=list(lens),
        max_query_len=max(q_lens),
    )
    t = qsl[-1]
    qkv = [torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv)]
    cache = [torch.randn(blocks, page, hkv, d, generator=g) for _ in range(2)]
    like = dict(device=device, dtype=dtype or torch.float32)
    return inputs, [x.to(**like) for x in qkv], [c.to(**like) for c in cache]


@interpreted_only
@pytest.mark.parametrize(
    "q_lens,lens",
    [
        ((1, 1, 9, 1), (300, 41, 9, 77)),  # decodes before and after a chunk: an index
        ((1, 1, 70, 5), (300, 41, 70, 260)),  # decodes first, then chunks: slices
        ((6, 1), (200, 250)),  # a chunk over a cached prefix, then a decode
    ],
)
def test_interpreted_mixed_step_matches_the_sdpa_backend(q_lens, lens):
    """A step mixing decodes and prefill chunks: the Triton backend sends each one-token
    request to the decode kernel and the chunks to the prefill kernel, and gives what SDPA
    over the gathered keys gives, writing the same K/V."""
    from services.engine.attention import SdpaBackend, TritonBackend

    inputs, (q, k, v), cache = mixed_step(q_lens, lens)
    triton_cache = [c.clone() for c in cache]
    backend = TritonBackend()
    meta = backend.prepare(inputs)
    got = backend.forward(q, k, v, triton_cache, meta, 0.1, None)
    want = SdpaBackend().forward(q, k, v, cache, SdpaBackend().prepare(inputs), 0.1, None)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(triton_cache, cache, strict=True))
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    decode_tokens = torch.arange(sum(q_lens))[meta.decode_tokens].tolist()
    assert decode_tokens == [inputs.query_start_loc_host[r] for r in decode_rows]


@interpreted_only
def test_interpreted_norm_and_rotary_kernels_match_reference():
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    w = torch.rand(48, generator=g) + 0.5
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    y, total = rms_norm_triton(x, w, 1e-6, residual=r)
    y_ref, total_ref = rms_norm_reference(x, w, 1e-6, residual=r)
    torch.testing.assert_close(y, y_ref)
    assert torch.equal(total, total_ref)
    # per-head norm of a strided view, as q_norm reads the fused qkv output
    qkv = torch.randn(5, 3 * 64, generator=g)
    heads = qkv[:, :128].view(5, 2, 64)
    wh = torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(
        rms_norm_triton(heads, wh, 1e-6), rms_norm_reference(heads, wh, 1e-6)
    )
    half = torch.randn(20, 8, generator=g)
    cos, sin = torch.cat([half.cos(), half.cos()], 1), torch.cat([half.sin(), half.sin()], 1)
    q = torch.randn(5, 4, 16, generator=g)
    k = torch.randn(5, 2, 16, generator=g)
    pos = torch.tensor([3, 0, 19, 7, 7])
    kernel, reference = rotary_triton(q, k, cos, sin, pos), rotary_reference(q, k, cos, sin, pos)
    for got, want in zip(kernel, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def qk_rope_case(t=5, hq=4, hkv=2, d=16, blocks=6, page=4, norm=True, dtype=torch.float32):
    """Views of one fused qkv output, scrambled cache slots, a cos/sin table and weights."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    half = torch.randn(40, d // 2, generator=g)
    cos, sin = torch.cat([half.cos(), half.cos()], 1), torch.cat([half.sin(), half.sin()], 1)
    positions = torch.tensor([3, 0, 39, 7, 7][:t])
    slots = torch.randperm(blocks * page, generator=g)[:t]
    caches = [torch.randn(blocks, page, hkv, d, generator=g).to(dtype) for _ in range(2)]
    weights = [(torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None for _ in "qk"]
    return (q, k, v, cos, sin, positions), caches, slots, weights


def test_qk_rope_cache_reference_is_norm_then_rotary_then_the_cache_writes():
    (q, k, v, cos, sin, pos), (kc, vc), slots, (qw, kw) = qk_rope_case()
    got = qk_rope_cache_reference(q, k, v, cos, sin, pos, kc, vc, slots, qw, kw, 1e-6)
    q2, k2 = rotary_reference(
        rms_norm_reference(q, qw, 1e-6), rms_norm_reference(k, kw, 1e-6), cos, sin, pos
    )
    assert torch.equal(got, q2)
    assert torch.equal(kc.view(-1, 2, 16)[slots], k2)
    assert torch.equal(vc.view(-1, 2, 16)[slots], v)


@interpreted_only
@pytest.mark.parametrize("norm", [True, False])
def test_interpreted_qk_rope_cache_kernel_matches_reference(norm):
    """One kernel: per-head norms (Qwen3) or none, RoPE, and K/V written at their slots
    of the paged cache; every other slot keeps what it held."""
    args, (kc, vc), slots, weights = qk_rope_case(norm=norm)
    want_k, want_v = kc.clone(), vc.clone()
    want = qk_rope_cache_reference(*args, want_k, want_v, slots, *weights, 1e-6)
    got = qk_rope_cache_triton(*args, kc, vc, slots, *weights, 1e-6)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # another sum-of-squares order
    torch.testing.assert_close(kc, want_k, atol=1e-4, rtol=1e-4)
    assert torch.equal(vc, want_v)


def test_silu_mul_with_grad_takes_the_reference_and_backpropagates():
    """Autograd (the trainer's forward) gets the PyTorch ops, which have a backward."""
    x = torch.randn(3, 2 * 40, requires_grad=True)
    y = silu_mul(x)
    gate, up = x.detach().chunk(2, dim=-1)
    assert torch.equal(y.detach(), F.silu(gate) * up)
    y.sum().backward()
    want = torch.cat(
        [torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate))) * up, F.silu(gate)], -1
    )
    torch.testing.assert_close(x.grad, want)


@interpreted_only
@pytest.mark.parametrize("n", [96, 1500])  # one partial block; two blocks of 1024, the last partial
@pytest.mark.parametrize("rows", [1, 5])
def test_interpreted_silu_mul_kernel_matches_reference(n, rows):
    g = torch.Generator().manual_seed(n + rows)
    x = 3 * torch.randn(rows, 2 * n, generator=g)
    torch.testing.assert_close(silu_mul_triton(x), silu_mul_reference(x), atol=1e-4, rtol=1e-4)
    # a row-strided input: the gate_up columns of a wider tensor, read in place
    wide = 3 * torch.randn(rows, 2 * n + 10, generator=g)
    x = wide[:, 7 : 7 + 2 * n]
    got = silu_mul_triton(x)
    assert got.is_contiguous() and got.shape == (rows, n)
    torch.testing.assert_close(got, silu_mul_reference(x), atol=1e-4, rtol=1e-4)
    # leading dims beyond one
    x = torch.randn(2, rows, 2 * n, generator=g)
    torch.testing.assert_close(silu_mul_triton(x), silu_mul_reference(x), atol=1e-4, rtol=1e-4)
