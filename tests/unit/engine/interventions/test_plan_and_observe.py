"""The step's two halves without a model: `StepPlanner` (per-token indices from the schedule
and the steering state) and `StepObserver` (what a step read back, routed)."""

from __future__ import annotations

import numpy as np
import torch

from services.engine.interventions.manager import InterventionManager
from services.engine.interventions.planner import Readback
from services.engine.model_runner import STEER_FIELDS
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledSeq, SchedulerOutput
from services.engine.sequence import RequestGroup

H, L = 8, 2


def _manager() -> InterventionManager:
    return InterventionManager(L, H, torch.device("cpu"), torch.float32, probe_columns=4)


def _request(m: InterventionManager, rid: str, prompt_len: int, **params) -> RequestGroup:
    group = RequestGroup(rid, None, list(range(1, prompt_len + 1)), SamplingParams(**params), 0.0)
    m.resolve(group)  # as LLMEngine.prepare_request, then add_prepared
    m.refresh_sigs(group)
    m.add(group)
    assert m.try_admit(group.seqs[0])
    return group


def _decode(*groups: RequestGroup) -> SchedulerOutput:
    """One decode token each: the last prompt token has been computed and one sampled."""
    out = []
    for g in groups:
        seq = g.seqs[0]
        if seq.num_tokens == seq.num_prompt_tokens:
            seq.token_ids.append(7)
        out.append(ScheduledSeq(seq, seq.num_tokens - 1, 1))
    return SchedulerOutput(out)


def _vec(seed: int) -> list[float]:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)).tolist()


STEER = {"vectors": [{"layers": [0, 1], "vector": _vec(0)}]}
READ = [{"probe": _vec(1), "layer": 1, "name": "p"}, {"probe": _vec(2), "layer": 0, "name": "q"}]
GATE = {
    "when": {"probe": _vec(3), "layer": 1, "threshold": 0.0},
    "scope": "rest_of_request",
    "apply": {"add": {"vector": _vec(4)}},
}


def test_plan_gives_each_token_its_row_phase_read_out_row_and_carry():
    m = _manager()
    steered = _request(m, "s", 3, steering=STEER)
    plain = _request(m, "p", 2)
    reader = _request(m, "r", 4, readouts=READ)
    gated = _request(m, "g", 2, steering={"gates": [GATE]})
    # a prefill chunk of "s" (tokens 0..1 of 3) beside decode tokens of the others
    sched = SchedulerOutput(
        [ScheduledSeq(steered.seqs[0], 0, 2), *_decode(plain, reader, gated).scheduled]
    )
    plan = m.plan_step(sched)
    st = plan.steer_tokens
    iv = steered.interventions
    assert st.rows.tolist() == [
        iv.prefill_row,
        iv.prefill_row,
        0,
        0,
        gated.interventions.effective_decode_row,
    ]
    assert st.decode.tolist() == [0, 0, 1, 1, 1]
    assert st.read_rows.tolist() == [-1, -1, -1, 2, -1]  # the reader's sampled row: its index
    assert st.carry.tolist() == [False, False, False, False, False]  # first step under its gates
    assert [i for i, _ in plan.readers] == [2] and [i for i, _ in plan.gated] == [3]
    # the next step of the gated request carries what this one fired
    assert m.plan_step(_decode(gated)).steer_tokens.carry.tolist() == [True]


def test_steady_decode_reuses_the_plan_until_something_it_reads_changes():
    m = _manager()
    a, b = _request(m, "a", 3, steering=STEER), _request(m, "b", 3, readouts=READ)
    first = m.plan_step(_decode(a, b))
    again = m.plan_step(_decode(a, b))
    assert again.steer_tokens is first.steer_tokens and m.planner.num_cached_plans == 1
    assert m.plan_step(_decode(b, a)).steer_tokens is not first.steer_tokens  # another order
    c = _request(m, "c", 2, steering=STEER)  # an admission: nothing planned before is reused
    assert m.plan_step(_decode(b, a)).steer_tokens is not first.steer_tokens
    assert m.planner.num_cached_plans == 1
    m.release(c)
    m.plan_step(_decode(a, b))
    m.plan_step(_decode(a, b))
    assert m.planner.num_cached_plans == 2


def test_observer_routes_read_outs_aborts_and_latches():
    m = _manager()
    abort = {"probe": _vec(5), "layer": 0, "threshold": 1.0}
    reader = _request(m, "r", 3, readouts=READ, steering={"gates": [GATE], "abort_when": [abort]})
    sched = _decode(reader)
    plan = m.plan_step(sched)
    rb = Readback(4, 4, L, 4, torch.device("cpu"))
    st = plan.steer_tokens
    plan.bind(rb, *(torch.from_numpy(np.asarray(getattr(st, f))) for f in STEER_FIELDS))
    iv = reader.interventions
    flat = rb.scores[0].view(-1)
    flat[torch.from_numpy(iv.probe_flat)] = torch.tensor([0.5, -0.25, 0.75])  # p, q, abort
    bit = iv.decode_content.gates[(1, "post_block")].bit
    rb.fired[0] = 1 << bit
    plan.collect(rb.copy(1, 1, fired=True, scores=True))
    report = m.observe(sched, plan)
    assert report.readouts == [{"p": 0.5, "q": -0.25}]
    assert report.aborts == [None]  # 0.75 is under the abort threshold
    assert reader.seqs[0].latched == 1 << bit
    assert m.snapshot()["gate_firing"] == {"1.post_block": {"tokens": 1, "fired": 1}}
    flat[torch.from_numpy(iv.probe_flat)] = torch.tensor([0.0, 0.0, 2.0])
    plan.collect(rb.copy(1, 1, fired=True, scores=True))
    assert m.observe(sched, plan).aborts == ["0.post_block"]  # the probe's default name
    assert m.snapshot()["probe_aborts"] == 1
