"""The overlapped pair F&B (torch's OVERLAP_F_B, DeepSeek's F&B): one instruction holding a
forward and another microbatch's full backward, in the IR, the language, the validator and
the simulator (its own cost)."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipedsl
from pipedsl import Instr, Program, ValidationError
from pipedsl.errors import PipeSyntaxError
from pipedsl.ir import Op

OVERLAP = str(Path(__file__).parents[1] / "runtime" / "schedules" / "overlap.pipe")


def test_the_pair_round_trips_through_text_json_and_csv():
    pair = Instr.parse("F4.0&B1.7r1")
    assert pair.op is Op.OVERLAP and [str(p) for p in pair.parts] == ["F4.0", "B1.7r1"]
    assert str(pair) == "F4.0&B1.7r1" and Instr.from_dict(pair.to_dict(True)) == pair
    program = pipedsl.load(OVERLAP).compile(P=3, M=6)
    assert "F3.1&B1.1" in program.compute_orders()[1]
    for dump, load in ((program.to_text, Program.from_text), (program.to_json, Program.from_json),
                       (program.to_csv, Program.from_csv)):
        assert pipedsl.validate(load(dump())).ranks == program.ranks


@pytest.mark.parametrize("text", ["I4.0&B1.7", "F4.0&W1.7", "F4.0&F1.7", "SEND_F4.0>1&B1.7"])
def test_a_pair_is_a_forward_and_a_full_backward(text):
    with pytest.raises(ValueError, match="forward and a full backward"):
        Instr.parse(text)


def test_the_halves_of_a_pair_may_not_need_each_other():
    # F1.0 & B1.0 on one stage: the backward needs the forward the pair runs at the same time
    stream = "F0.0 F1.0&B1.0 B0.0 REDUCE_GRAD.0 OPTIMIZER_STEP"
    with pytest.raises(ValidationError, match=r"instruction 1 \(F1\.0&B1\.0\): B1\.0, in the pair, a backward "
                                              r"needs its forward F1\.0"):
        pipedsl.validate(Program.from_text(f"r0: {stream}"))
    pipedsl.validate(Program.from_text("r0: F0.0 F1.0&B0.0 B1.0 REDUCE_GRAD.0 OPTIMIZER_STEP"))


def test_the_language_writes_pairs_and_rejects_other_kinds():
    pipedsl.Schedule.from_text("schedule s(P, M) { compute { F(0, r)  F(1, r) & B(0, r)  B(1, r) } }").compile(P=1, M=2)
    with pytest.raises(PipeSyntaxError, match=r"t.pipe:1:39: .*F\(…\) & B\(…\), not F\(…\) & I\(…\)"):
        pipedsl.Schedule.from_text("schedule s(P, M) { compute { F(0, r)  F(1, r) & I(0, r) W(0, r) B(1, r) } }",
                                   "t.pipe")


def test_the_pair_has_its_own_cost_so_overlap_can_be_modelled():
    program = pipedsl.load(OVERLAP).compile(P=2, M=4)
    pairs = sum(i.op is Op.OVERLAP for s in program.ranks for i in s)
    sequential = pipedsl.simulate(program, "F=1,B=2")
    assert pipedsl.simulate(program, "F=1,B=2,FB=3").makespan == sequential.makespan  # default FB = F + B
    hidden = pipedsl.simulate(program, "F=1,B=2,FB=2")
    # rank 0 is busy throughout its steady phase: each pair saves it exactly one unit
    assert sequential.busy[0] - hidden.busy[0] == pairs // 2
    assert hidden.makespan < sequential.makespan
    assert pipedsl.Cost.fit(hidden).FB == 2
    # the pair holds its forward's activation before its backward frees one: 1F1B's peak + 1
    assert sequential.peak_activations == [3, 2]
