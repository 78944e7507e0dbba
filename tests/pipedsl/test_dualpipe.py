"""DualPipeV is torch.distributed.pipelining's ScheduleDualPipeV, op for op (its own generator,
called at every size tested); `F(next, s)` and `W()` (the language's queues of pending work)."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize(("text", "error", "where"), [
    ("for i in 0 .. M + 1 { F(next, r) }", r"F\(next, 0\) on rank 0: every microbatch's forward of stage 0 is "
                                           r"listed already", "3:27"),
    ("F(next, 5)", r"stage 5 does not exist", "3:5"),
])
def test_next_past_the_end_is_a_located_error(text, error, where):
    source = f"schedule q(P, M) {{\n  compute {{\n    {text}\n  }}\n}}"
    with pytest.raises(PipeSemanticError, match=error) as err:
        pipedsl.Schedule.from_text(source, "q.pipe").compile(P=1, M=2)
    assert f"q.pipe:{where}" in str(err.value)


@pytest.mark.parametrize(("op", "error"), [("W(next, r)", "W takes no 'next'"), ("F()", "only W\\(\\) takes no")])
def test_next_and_empty_arguments_only_where_they_mean_something(op, error):
    with pytest.raises(PipeSyntaxError, match=error):
        pipedsl.Schedule.from_text(f"schedule q(P, M) {{ compute {{ {op} }} }}")
