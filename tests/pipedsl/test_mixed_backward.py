"""Programs mixing full backwards (B) with split ones (I then W): valid everywhere, per
microbatch and stage one or the other (DualPipeV runs B in its steady phase, I/W in its cooldown)."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipedsl
from pipedsl import Program, ValidationError
from pipedsl.errors import PipeSemanticError
from pipedsl.ir import Op

SPLIT_1F1B = """schedule s(P, M) {
  order F by m
  order B by m
  warmup min(P - r - 1, M)
  wlag 0
}"""
MIXED = Path(__file__).parents[1] / "runtime" / "schedules" / "mixed_backward.pipe"


def test_a_mixed_program_compiles_validates_and_simulates():
    program = pipedsl.load(str(MIXED)).compile(P=3, M=6)
    ops = [i.op for stream in program.ranks for i in stream]
    assert ops.count(Op.B) == 3 * 3 and ops.count(Op.I) == 3 * 3 and ops.count(Op.W) == 3 * 3
    for fmt in ("text", "json", "csv"):  # every form loads back and validates
        text = {"text": program.to_text, "json": program.to_json, "csv": program.to_csv}[fmt]()
        back = {"text": Program.from_text, "json": Program.from_json, "csv": Program.from_csv}[fmt](text)
        assert pipedsl.validate(back).ranks == program.ranks
    timeline = pipedsl.simulate(program, "F=1,B=2,I=1,W=1")
    # I+W = B: between 1F1B (every backward full) and 1F1B with every backward split (an I
    # hands its gradient on one W earlier); 1F1B's activations (W frees like B)
    full = pipedsl.simulate(pipedsl.load("1f1b").compile(P=3, M=6), "F=1,B=2")
    split = pipedsl.Schedule.from_text(SPLIT_1F1B).compile(P=3, M=6)
    assert pipedsl.simulate(split, "F=1,I=1,W=1").makespan < timeline.makespan < full.makespan
    assert timeline.peak_activations == full.peak_activations == [3, 2, 1]


@pytest.mark.parametrize("stream", [
    "F0.0 F1.0 B0.0 I0.0 W0.0 REDUCE_GRAD.0 OPTIMIZER_STEP",  # counts add up: microbatch 1 has none
    "F0.0 F1.0 B0.0 I0.0 W0.0 B1.0 REDUCE_GRAD.0 OPTIMIZER_STEP",
])
def test_both_a_full_and_a_split_backward_for_one_microbatch_is_named(stream):
    with pytest.raises(ValidationError, match=r"instruction 2 \(B0\.0\).*both a full backward and a split one"):
        pipedsl.validate(Program.from_text(f"r0: {stream}"))


def test_a_compute_block_listing_b_and_i_for_one_op_is_a_located_error():
    text = """schedule s(P, M) {
  compute {
    for i in 0 .. M { F(i, r) }
    for i in 0 .. M { B(i, r) }
    I(0, r)  W(0, r)
  }
}"""
    with pytest.raises(PipeSemanticError, match=r"lists both B and I for microbatch 0 stage 0") as err:
        pipedsl.Schedule.from_text(text, "t.pipe").compile(P=2, M=2)
    assert "t.pipe:4:" in str(err.value)
