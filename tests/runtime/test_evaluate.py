"""`Pipeline.evaluate`: a forward-only pass of any schedule equals the one-process model in eval mode."""

from __future__ import annotations

import pytest
import runtime_cases as cases
from test_pipeline import SCHEDULES, _name, compile_for

import pipedsl
from pipedsl.ir import Op


@pytest.mark.parametrize("schedule", SCHEDULES, ids=_name)
def test_evaluate_equals_one_process(schedule: str, pool2) -> None:
    """Every built-in and test schedule (replicas, split backward, overlapped F&B pairs, local hand-over): `evaluate()`
    equals one process's loss in eval mode (rtol 1e-5) and changes nothing."""
    results = pool2.run(cases.evaluation, compile_for(schedule, 2).to_json())
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:6])
    assert all(r["handshakes"] == 2 for r in results)  # one per input shape, none for evaluation itself


def test_evaluate_per_token(pool4) -> None:
    results = pool4.run(cases.evaluation, compile_for("interleaved", 4).to_json(), True)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:6])


def test_forward_only_program_keeps_forwards_in_order() -> None:
    program = pipedsl.load("dualpipev").compile(P=2, M=4)
    fwd = program.forward_only()
    for stream, kept in zip(program.ranks, fwd.ranks):
        forwards = [i.sub[0] if i.op is Op.OVERLAP else i for i in stream if i.op in (Op.F, Op.OVERLAP)]
        assert [i for i in kept if i.op is Op.F] == forwards
        assert {i.op for i in kept} <= {Op.F, Op.SEND_F, Op.RECV_F, Op.OPTIMIZER_STEP}
        assert kept[-1].op is Op.OPTIMIZER_STEP
    assert sum(i.op is Op.OVERLAP for s in program.ranks for i in s) > 0  # the pairs were there to split
