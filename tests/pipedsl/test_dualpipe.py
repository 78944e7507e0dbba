"""DualPipeV is torch.distributed.pipelining's ScheduleDualPipeV, op for op (its own generator,
called at every size tested); `F(next, s)` and `W()` (the language's queues of pending work)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl.errors import PipeSemanticError, PipeSyntaxError


def torch_dualpipev(P: int, M: int) -> list[list[str]]:
    """torch's own ScheduleDualPipeV._calculate_single_rank_operations (it reads only the sizes)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    schedule = ScheduleDualPipeV.__new__(ScheduleDualPipeV)
    schedule.pp_group_size, schedule._n_microbatches = P, M

    def text(action) -> str:
        if action.sub_actions:
            return "&".join(map(text, action.sub_actions))
        return f"{action.computation_type.value}{action.microbatch_index}.{action.stage_index}"

    return [[text(a) for a in schedule._calculate_single_rank_operations(r) if a is not None] for r in range(P)]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_dualpipev_is_torchs_order(P):
    schedule = pipedsl.load("dualpipev")
    for M in (2 * P, 2 * P + 1, 3 * P + 2, 4 * P + 3):
        program = schedule.compile(P=P, M=M)
        assert program.compute_orders() == torch_dualpipev(P, M), (P, M)
        assert program.placement == {(0, s): s if s < P else 2 * P - 1 - s for s in range(2 * P)}
    with pytest.raises(PipeSemanticError, match="M >= 2P"):
        schedule.compile(P=P, M=2 * P - 1)


def test_dualpipev_overlap_cost_shortens_the_step():
    program = pipedsl.load("dualpipev").compile(P=4, M=16)
    plain = pipedsl.simulate(program, "F=1,B=2,I=1,W=1")
    hidden = pipedsl.simulate(program, "F=1,B=2,I=1,W=1,FB=2.5")
    pairs = [sum(i.op.value == "OVERLAP_F_B" for i in stream) for stream in program.ranks]
    # every pair saves 0.5 of busy time on its rank
    assert [a - b for a, b in zip(plain.busy, hidden.busy)] == [0.5 * n for n in pairs]
    assert hidden.makespan < plain.makespan


QUEUED = """schedule q(P, M) {
  compute {
    for i in 0 .. M { F(next, r) }
    I(next, r)  B(next, r)  W()  W()
    for i in 2 .. M { B(next, r) }
  }
}"""


def test_next_and_oldest_w_take_the_pending_work_in_order():
    program = pipedsl.Schedule.from_text(QUEUED).compile(P=2, M=4)
    # W() after nothing pending lists nothing; B and I share the backward queue
    assert program.compute_orders()[0] == ["F0.0", "F1.0", "F2.0", "F3.0", "I0.0", "B1.0", "W0.0", "B2.0", "B3.0"]


def test_next_past_the_end_lists_nothing_and_completeness_still_holds():
    over = "schedule q(P, M) { compute { for i in 0 .. M + 3 { F(next, r) } for i in 0 .. M + 3 { B(next, r) } } }"
    assert pipedsl.Schedule.from_text(over).compile(P=1, M=2).compute_orders() == [["F0.0", "F1.0", "B0.0", "B1.0"]]
    short = "schedule q(P, M) {\n  compute { F(next, r) F(next, r) B(next, r) }\n}"
    with pytest.raises(PipeSemanticError, match=r"never lists B \(or I and W\) for microbatch 1"):
        pipedsl.Schedule.from_text(short).compile(P=1, M=2)
    with pytest.raises(PipeSemanticError, match=r"stage 5 does not exist"):
        pipedsl.Schedule.from_text("schedule q(P, M) { compute { F(next, 5) } }").compile(P=1, M=2)


def test_w_next_takes_the_oldest_pending_w_of_one_stage():
    text = "schedule q(P, M) { stages 2  place 0  compute { F(0, 0) F(0, 1) I(0, 1) I(0, 0) W(next, 0) W() } }"
    assert pipedsl.Schedule.from_text(text).compile(P=1, M=1).compute_orders() == [
        ["F0.0", "F0.1", "I0.1", "I0.0", "W0.0", "W0.1"]]


def test_empty_arguments_only_for_w():
    with pytest.raises(PipeSyntaxError, match="only W\\(\\) takes no"):
        pipedsl.Schedule.from_text("schedule q(P, M) { compute { F() } }")


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([2, 4, 6, 8]), st.integers(0, 3), st.integers(1, 3), st.integers(0, 3), st.integers(0, 2))
def test_dualpipe_meets_deepseeks_table(P, extra, F, w_less, overlap):
    """DeepSeek-V3's table: idle (P/2-1)(F&B + B - 3W) per rank (the most any rank idles), P+1
    activations a rank, two copies of the parameters -- exact whenever T_I = T_F and T_W <= T_F
    (the regime the table assumes), for every pair cost F&B from max(F, B) to F + B."""
    M = 2 * P + 2 * extra
    W = max(1, F - w_less)
    B = F + W
    FB = B + F * overlap / 2  # max(F, B) = B .. F + B
    program = pipedsl.load("dualpipe").compile(P=P, M=M)
    t = pipedsl.simulate(program, pipedsl.Cost(F=F, B=B, I=F, W=W, FB=FB))
    assert max(t.makespan - busy for busy in t.busy) == pytest.approx((P / 2 - 1) * (FB + B - 3 * W))
    assert t.peak_activations == [P + 1] * P
    assert program.num_replicas == 2 and sorted(program.stages_of(0)) == [(0, 0), (1, P - 1)]
    assert program.microbatch_replica == (0,) * (M // 2) + (1,) * (M // 2)  # half the batch at each end


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 5, 8]), st.integers(0, 3), st.integers(1, 3), st.integers(0, 3), st.integers(0, 2))
def test_dualpipev_meets_deepseeks_table(P, extra, F, w_less, overlap):
    """DeepSeek's DualPipe README table, DualPipeV row, with its PP = 2P stages on P ranks: idle
    (PP/2-1)(F&B + B - 3W) = (P-1)(F&B + B - 3W) per rank (the most any rank idles), PP+1 = 2P+1
    chunk activations a rank -- exact for any M >= 2P when T_I = T_F and T_W <= T_F."""
    M = 2 * P + extra
    W = max(1, F - w_less)
    B = F + W
    FB = B + F * overlap / 2
    t = pipedsl.simulate(pipedsl.load("dualpipev").compile(P=P, M=M), pipedsl.Cost(F=F, B=B, I=F, W=W, FB=FB))
    assert max(t.makespan - busy for busy in t.busy) == pytest.approx((P - 1) * (FB + B - 3 * W))
    assert t.peak_activations == [2 * P + 1] * P


def test_dualpipe_is_dualpipev_folded_over_two_copies():
    """Rank r of DualPipe runs DualPipeV's rank min(r, P-1-r) order of P/2 ranks and M/2 microbatches
    (DeepSeek's DualPipe.step and DualPipeV.step are the same eight steps)."""
    P, M = 6, 16
    dual = pipedsl.load("dualpipe").compile(P=P, M=M)
    v = pipedsl.load("dualpipev").compile(P=P // 2, M=M // 2)

    def shape(order: list[str]) -> list[str]:  # the op kinds only: "F", "B", "F&B", "I", "W"
        return ["&".join(part[0] for part in op.split("&")) for op in order]

    for r in range(P):
        assert shape(dual.compute_orders()[r]) == shape(v.compute_orders()[min(r, P - 1 - r)])
