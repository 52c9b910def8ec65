"""The per-site steering op: the reference's semantics, and the Triton kernel against it.

On CPU the kernel runs under the Triton interpreter. Triton decides compiled vs interpreted
once, when it is imported (its own `tl.sum`, `tl.sigmoid` are jitted then), so the kernel
tests run in a fresh pytest process with TRITON_INTERPRET=1 set from the start.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels import steer as steer_module
from services.engine.kernels.steer import steer, steer_reference, steer_triton
from tests.interpreted import INTERPRETED, assert_passes_interpreted

# gate_params columns
ACTIVE, THRESHOLD, SHARPNESS, SCALE, ATTENUATE, BIT, LATCH = range(7)


def off_case(T: int, H: int, R: int = 4) -> dict:
    """Float32 inputs of `steer` with every feature off: a random residual, row 0, prefill."""
    zeros = torch.zeros
    return dict(
        h=torch.randn(T, H, generator=torch.Generator().manual_seed(0)),
        rows=zeros(T, dtype=torch.int32),
        decode=zeros(T),
        vec=zeros(R, H),
        row_scale=zeros(R),
        dyn_vec=zeros(H),
        dyn_gain=zeros(T),
        mon_probe=zeros(H),
        mon_params=zeros(4),
        gate_probe=zeros(R, H),
        gate_vec=zeros(R, H),
        gate_params=zeros(R, 7),
        latched=zeros(T, dtype=torch.int32),
        fired=zeros(T, dtype=torch.int32),
    )


def random_case(T: int, H: int, R: int = 9, dtype=torch.float32, device="cpu", seed=0) -> dict:
    """Inputs with every feature on: monitor gating rows, add and attenuate gates on some
    rows (some latching), latched and already-fired bits, mixed prefill/decode tokens."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    h = randn(T, H)
    decode = (rand(T) < 0.6).float()
    vec = randn(R, H)
    vec[0] = 0
    row_scale = rand(R) * 2
    row_scale[R - 1] = 0
    mon_probe = randn(H) / H**0.5
    # Threshold at the median monitor score, so the monitor gate is open for about half.
    mon_params = torch.tensor([1.0, float((h @ mon_probe).median()), 3.0, 1.0])
    gate_probe = randn(R, H) / H**0.5
    gate_vec = torch.nn.functional.normalize(randn(R, H), dim=-1)
    gate_params = torch.zeros(R, 7)
    gate_params[:, ACTIVE] = (torch.arange(R) % 3 != 0).float()
    gate_params[:, THRESHOLD] = randn(R) * 0.3
    gate_params[:, SHARPNESS] = 4.0
    gate_params[:, SCALE] = rand(R) + 0.5
    gate_params[:, ATTENUATE] = (torch.arange(R) % 2).float()
    gate_params[:, BIT] = torch.randperm(31, generator=g)[:R].float()
    gate_params[:, LATCH] = (rand(R) < 0.5).float()
    case = dict(
        h=h,
        rows=torch.randint(0, R, (T,), generator=g, dtype=torch.int32),
        decode=decode,
        vec=vec,
        row_scale=row_scale,
        dyn_vec=randn(H),
        dyn_gain=rand(T) * decode,
        mon_probe=mon_probe,
        mon_params=mon_params,
        gate_probe=gate_probe,
        gate_vec=gate_vec,
        gate_params=gate_params,
        latched=torch.randint(0, 2**31 - 1, (T,), generator=g, dtype=torch.int32),
        fired=torch.randint(0, 2, (T,), generator=g, dtype=torch.int32) << 30,
    )
    as_h = ("h", "vec", "dyn_vec", "mon_probe", "gate_probe", "gate_vec")
    return {k: v.to(device, dtype if k in as_h else v.dtype) for k, v in case.items()}


def run(fn, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn` on a copy of `case`: the output and the updated `fired`."""
    case = {k: v if v is None else v.clone() for k, v in case.items()}
    return fn(**case), case["fired"]


# --- the Triton kernel, interpreted, against the reference ---

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="run under TRITON_INTERPRET=1 by test_triton_under_interpreter"
)


@pytest.mark.skipif(INTERPRETED, reason="already interpreting: the kernel tests run here")
def test_triton_under_interpreter():
    pytest.importorskip("triton")
    assert_passes_interpreted(__file__, "triton and not under_interpreter")


@interpreted_only
def test_triton_matches_reference_with_a_patched_base():
    case = random_case(12, 40, seed=3)
    case["base"] = case["h"].clone()
    case["base"][::3] = torch.randn(4, 40)
    want, want_fired = run(steer_reference, case)
    got, got_fired = run(steer_triton, case)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_fired, want_fired)


def test_add_folds_the_residual_add_before_the_site():
    """`add` is the residual add the model did not do: the op on (h, add) is the op on h + add
    (probes read it, terms add to it), exactly."""
    case = random_case(6, 16, seed=5)
    add = torch.randn(6, 16)
    want, want_fired = run(steer_reference, {**case, "h": case["h"] + add})
    got, got_fired = run(steer_reference, {**case, "add": add})
    assert torch.equal(got, want) and torch.equal(got_fired, want_fired)
    assert not torch.equal(got, run(steer_reference, case)[0])


@interpreted_only
def test_triton_matches_reference_with_a_residual_add():
    case = random_case(12, 40, seed=6)
    case["add"] = torch.randn(12, 40)
    want, want_fired = run(steer_reference, case)
    got, got_fired = run(steer_triton, case)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # float32, other sum order
    assert torch.equal(got_fired, want_fired)


def with_readback(case: dict, C: int = 8, live: int = 5, seed: int = 7) -> dict:
    """`case` plus a probe bank of `C` columns (`live` in use) read by every other token into
    its own scores row, and a latch carry from the step before on every third token."""
    g = torch.Generator().manual_seed(seed)
    T, H = case["h"].shape
    bank = torch.zeros(C, H)
    bank[:live] = torch.randn(live, H, generator=g)
    read_rows = torch.full((T,), -1, dtype=torch.int32)
    read_rows[::2] = torch.randperm(T, generator=g)[: len(read_rows[::2])].to(torch.int32)
    carry = torch.full((T,), -1, dtype=torch.int32)
    carry[::3] = torch.randint(0, 4, (len(carry[::3]),), generator=g, dtype=torch.int32)
    return {
        **case,
        "probe_bank": bank.to(case["h"].device),
        "probe_count": torch.tensor([live], dtype=torch.int32),
        "read_rows": read_rows,
        # poisoned: every entry a token reads must be written
        "scores": torch.full((T, C), float("nan")),
        "carry": carry,
        "last_fired": torch.randint(0, 2**31 - 1, (4,), generator=g, dtype=torch.int32),
    }


def run_readback(fn, case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    case = {k: v if v is None else v.clone() for k, v in case.items()}
    return fn(**case), case["fired"], case["scores"]


def test_readouts_are_dot_products_of_the_pristine_residual():
    case = with_readback(random_case(10, 16, seed=8))
    x = case["h"].float()
    _, _, scores = run_readback(steer_reference, case)
    reading = case["read_rows"] >= 0
    want = x[reading] @ case["probe_bank"][:5].t()
    got = scores[case["read_rows"][reading].long(), :5]
    assert torch.equal(got, want)  # the same product of the same float32 values
    assert scores[:, 5:].isnan().all(), "columns past the live count are never written"


def test_carry_latches_the_bits_the_step_before_fired():
    """A token that carries row j of `last_fired` is gated exactly as if those bits were in
    its own `latched`."""
    case = with_readback(random_case(12, 16, seed=9))
    case["latched"].zero_()  # so only the carried bits latch
    case["decode"].fill_(1.0)  # gates act on decode tokens
    case["carry"][::2] = torch.arange(6, dtype=torch.int32) % 4
    carry, last = case["carry"], case["last_fired"]
    carried = case["latched"] | last[carry.clamp(min=0).long()]
    folded = torch.where(carry >= 0, carried, case["latched"])
    want, want_fired = run(steer_reference, {**case, "carry": None, "latched": folded})
    got, got_fired, _ = run_readback(steer_reference, case)
    assert torch.equal(got, want) and torch.equal(got_fired, want_fired)
    assert not torch.equal(got, run(steer_reference, {**case, "carry": None})[0])


@interpreted_only
def test_triton_matches_reference_with_readouts_and_carry():
    case = with_readback(random_case(12, 40, seed=10))
    want, want_fired, want_scores = run_readback(steer_reference, case)
    got, got_fired, got_scores = run_readback(steer_triton, case)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # float32, other sum order
    assert torch.equal(got_fired, want_fired)
    read = case["read_rows"][case["read_rows"] >= 0].long()
    torch.testing.assert_close(got_scores[read, :5], want_scores[read, :5], atol=1e-4, rtol=1e-4)
    assert got_scores[:, 5:].isnan().all() and not got_scores[read, :5].isnan().any()


@pytest.mark.parametrize(
    "fn",
    [steer_reference, pytest.param(steer_triton, marks=interpreted_only)],
    ids=["reference", "triton"],
)
def test_a_site_with_an_empty_bank_writes_no_scores_and_steers_the_same(fn):
    """Reading tokens meet every site of the graph; where the site's bank is empty they
    write nothing (the scores stay poisoned) and the output is the op's without a bank."""
    case = with_readback(random_case(12, 40, seed=12), live=0)
    out, fired, scores = run_readback(fn, case)
    assert scores.isnan().all()
    no_bank = {**case, "probe_bank": None, "probe_count": None, "read_rows": None}
    want, want_fired, _ = run_readback(fn, {**no_bank, "scores": None})
    assert torch.equal(out, want) and torch.equal(fired, want_fired)


def test_norm_is_the_rms_norm_of_the_output():
    """With `norm_weight` the op also returns the next norm of its output, exactly as the
    norm would compute it from the output."""
    from services.engine.kernels.norm_rope import rms_norm_reference

    case = random_case(6, 16, seed=11)
    case["add"] = torch.randn(6, 16)
    w = torch.rand(16) + 0.5
    out, normed = steer_reference(**case, norm_weight=w, eps=1e-6)
    assert torch.equal(out, steer_reference(**case))
    assert torch.equal(normed, rms_norm_reference(out, w, 1e-6))


@interpreted_only
@pytest.mark.parametrize("H", [48, 1500])  # 1500: the norm over two H tiles
def test_triton_matches_reference_with_the_next_norm(H):
    case = random_case(10, H, seed=12)
    case["add"] = torch.randn(10, H)
    w = torch.rand(H) + 0.5
    want_out, want_normed = steer_reference(**case, norm_weight=w, eps=1e-6)
    got_out, got_normed = steer_triton(**case, norm_weight=w, eps=1e-6)
    torch.testing.assert_close(got_out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_normed, want_normed, atol=1e-4, rtol=1e-4)


def with_capture(case: dict, slots: int = 5, seed: int = 13) -> dict:
    """`case` plus a capture buffer (poisoned with NaN) that every third token writes to,
    into rows in another order than the tokens'."""
    T, H = case["h"].shape
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((T,), -1, dtype=torch.int32)
    rows[::3] = torch.randperm(len(rows[::3]), generator=g).to(torch.int32)
    out = torch.full((T, slots, H), float("nan"), dtype=case["h"].dtype)
    return {**case, "capture_rows": rows, "capture_out": out, "capture_slot": 3}


def test_capture_writes_the_pristine_residual_and_the_output_of_capturing_tokens():
    case = with_capture(random_case(9, 16, seed=14))
    case["add"] = torch.randn(9, 16)
    out = steer_reference(**case, capture_next=4)
    buf, rows = case["capture_out"], case["capture_rows"]
    tokens = (rows >= 0).nonzero().flatten()
    assert torch.equal(buf[rows[tokens].long(), 3], (case["h"] + case["add"])[tokens])
    assert torch.equal(buf[rows[tokens].long(), 4], out[tokens])  # the next site: post-steer
    written = torch.zeros(buf.shape[:2], dtype=torch.bool)
    written[rows[tokens].long(), 3] = written[rows[tokens].long(), 4] = True
    assert buf[~written].isnan().all(), "nothing else is written"
    plain = {k: v for k, v in case.items() if not k.startswith("capture")}
    assert torch.equal(out, steer_reference(**plain))  # capturing changes no output


@interpreted_only
@pytest.mark.parametrize("capture_next", [4, -1])
def test_triton_matches_reference_with_captures(capture_next):
    case = with_capture(with_readback(random_case(12, 40, seed=15)))
    case["add"] = torch.randn(12, 40)
    want_buf, got_buf = case["capture_out"].clone(), case["capture_out"].clone()
    want = steer_reference(**{**case, "capture_out": want_buf}, capture_next=capture_next)
    got = steer_triton(**{**case, "capture_out": got_buf}, capture_next=capture_next)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_buf, want_buf, atol=1e-4, rtol=1e-4, equal_nan=True)
    assert not got_buf[case["capture_rows"][::3].long(), 3].isnan().any()


def test_probes_read_h_and_terms_add_to_base():
    case = random_case(6, 16, seed=4)
    shift = torch.randn(6, 16)
    plain, _ = run(steer_reference, case)
    shifted, _ = run(steer_reference, {**case, "base": case["h"] + shift})
    torch.testing.assert_close(shifted, plain + shift, atol=1e-5, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize("T,H", [(24, 48), (24, 100), (16, 1500)])  # 1500: two H tiles
def test_triton_matches_reference(T, H):
    case = random_case(T, H)
    ref, ref_fired = run(steer_reference, case)
    out, fired = run(steer_triton, case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(fired, ref_fired)
    assert ref_fired.ne(case["fired"]).any(), "the case should fire some gates"


@interpreted_only
def test_triton_is_dispatched_when_interpreting(monkeypatch):
    # The reference is swapped out, so a match proves the kernel ran.
    monkeypatch.setattr(steer_module, "steer_reference", None)
    case = random_case(8, 48)
    ref, ref_fired = run(steer_reference, case)
    out, fired = run(steer, case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(fired, ref_fired)


@interpreted_only
def test_triton_empty_batch():
    case = random_case(0, 48)
    assert run(steer_triton, case)[0].shape == (0, 48)


# --- semantics of the reference ---


def test_everything_off_returns_residual_exactly():
    case = off_case(6, 16)
    out, fired = run(steer_reference, case)
    assert torch.equal(out, case["h"])
    assert not fired.any()


def test_zero_scale_suppresses_exactly_that_row():
    case = off_case(4, 16, R=5)
    case["rows"][:] = torch.tensor([3, 3, 4, 4], dtype=torch.int32)
    case["vec"][3:] = torch.randn(2, 16)
    case["row_scale"][3:] = 1.0
    full, _ = run(steer_reference, case)
    case["row_scale"][3] = 0.0
    out, _ = run(steer_reference, case)
    assert torch.equal(out[:2], case["h"][:2])
    assert torch.equal(out[2:], full[2:])


def test_prefill_is_never_gated():
    case = off_case(3, 16)
    h = case["h"]
    case["rows"][:] = 3
    case["vec"][3] = torch.randn(16)
    case["row_scale"][3] = 1.0
    case["dyn_vec"][:] = torch.randn(16)
    case["dyn_gain"][:] = 0.5
    # The monitor would close everything and the gate would fire on every token.
    case["mon_params"][:] = torch.tensor([1.0, 1e6, 10.0, 1.0])
    case["gate_probe"][3] = h[0]
    case["gate_vec"][3] = torch.randn(16)
    case["gate_params"][3] = torch.tensor([1.0, -1e6, 10.0, 1.0, 0.0, 5.0, 1.0])
    case["latched"][:] = 1 << 5
    out, fired = run(steer_reference, case)
    torch.testing.assert_close(out, h + case["vec"][3] + 0.5 * case["dyn_vec"])
    assert not fired.any()


@pytest.mark.parametrize("open_", [True, False])
def test_monitor_threshold_switches_the_gate(open_):
    case = off_case(1, 16)
    h = case["h"]
    case["decode"][:] = 1.0
    case["rows"][:] = 3
    case["vec"][3] = torch.randn(16)
    case["row_scale"][3] = 1.0
    case["dyn_vec"][:] = torch.randn(16)
    case["dyn_gain"][:] = 1.0
    case["mon_probe"][:] = torch.randn(16)
    score = float(h[0] @ case["mon_probe"])
    threshold = score - 1 if open_ else score + 1
    case["mon_params"][:] = torch.tensor([1.0, threshold, 1e4, 1.0])
    out, _ = run(steer_reference, case)
    steered = h + case["vec"][3] + case["dyn_vec"]
    torch.testing.assert_close(out, steered if open_ else h)


@pytest.mark.parametrize("latched", [True, False])
def test_latched_bit_forces_gate_on(latched):
    case = off_case(1, 16)
    h = case["h"]
    case["decode"][:] = 1.0
    case["rows"][:] = 3
    case["gate_probe"][3] = h[0]
    case["gate_vec"][3] = torch.randn(16)
    # The probe score |x|² is far below the threshold: only the latch can open the gate.
    case["gate_params"][3] = torch.tensor([1.0, 1e6, 10.0, 0.5, 0.0, 7.0, 1.0])
    case["latched"][:] = (1 << 7) if latched else (1 << 6)
    out, fired = run(steer_reference, case)
    expected = h + 0.5 * case["gate_vec"][3] if latched else h
    torch.testing.assert_close(out, expected)
    assert not fired.any()  # a latch holds the gate open; it does not count as firing


def test_gate_fires_its_bit():
    case = off_case(2, 16)
    case["decode"][:] = 1.0
    case["rows"][:] = 3
    case["gate_probe"][3] = case["h"][0]
    case["gate_params"][3] = torch.tensor([1.0, 0.0, 10.0, 1.0, 0.0, 9.0, 0.0])
    case["fired"][:] = 1 << 2
    _, fired = run(steer_reference, case)
    score = case["h"] @ case["h"][0]
    assert fired.tolist() == [(1 << 2) | ((1 << 9) if s > 0 else 0) for s in score.tolist()]
    assert fired[0] == (1 << 2) | (1 << 9)


def test_attenuate_removes_component():
    case = off_case(3, 16)
    h = case["h"]
    u = torch.nn.functional.normalize(torch.randn(16), dim=0)
    case["decode"][:] = 1.0
    case["rows"][:] = 3
    case["gate_vec"][3] = u
    case["gate_params"][3] = torch.tensor([1.0, -1e6, 10.0, 1.0, 1.0, 0.0, 0.0])
    out, _ = run(steer_reference, case)
    torch.testing.assert_close(out, h - (h @ u)[:, None] * u)
    torch.testing.assert_close(out @ u, torch.zeros(3), atol=1e-6, rtol=0)
