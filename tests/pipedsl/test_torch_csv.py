"""torch.distributed.pipelining's CSV schedules: pipedsl writes them (`--format torch-csv`) and
loads them as programs (torch's own dump included; its runtime test is tests/runtime)."""

from __future__ import annotations

import pytest

import pipedsl
from pipedsl import ValidationError
from pipedsl.cli import main


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "dualpipev", "interleaved", "v-half"])
def test_a_program_round_trips_through_torch_csv(name):
    program = pipedsl.load(name).compile(P=4, M=8)
    back = pipedsl.from_torch_csv(pipedsl.to_torch_csv(program))
    assert back.compute_orders() == program.compute_orders() and back.placement == program.placement


def test_torchs_own_dualpipev_dump_loads_as_our_dualpipev(tmp_path):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleDualPipeV

    P, M = 3, 8
    sched = ScheduleDualPipeV.__new__(ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = P, M
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(P)}
    PipelineScheduleMulti._dump_csv(sched, tmp_path / "dualpipev.csv")  # torch's writer
    program = pipedsl.from_torch_csv((tmp_path / "dualpipev.csv").read_text())
    assert program.compute_orders() == pipedsl.load("dualpipev").compile(P=P, M=M).compute_orders()


def test_torch_csv_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["compile", "dualpipev", "-P", "2", "-M", "4", "--format", "torch-csv", "-o", str(out)]) == 0
    assert "(0F3;3B1)OVERLAP_F_B" in out.read_text().splitlines()[0]
    from pipedsl.runtime.program_file import read_program  # what `pipedsl run` and Pipeline(program=path) use
    assert read_program(out).compute_orders() == pipedsl.load("dualpipev").compile(P=2, M=4).compute_orders()
    assert main(["compile", "chimera", "-P", "2", "-M", "4", "--format", "torch-csv"]) == 2
    assert "2 model copies" in capsys.readouterr().err


@pytest.mark.parametrize("text, error", [
    ("0F0,0X1\n", r"row 1 \(rank 0\) cell 2: '0X1' is not a torch action"),
    ("0F0,0B0\n1F0,1B0,0F1\n", r"row 2 \(rank 1\) cell 3 \(0F1\): stage 0 also has actions on rank 0"),
    ("(0F0;0I0)OVERLAP_F_B\n", "pair is a forward and a full backward"),
    ("\n", "no compute action"),
])
def test_bad_torch_csv_is_one_clear_error(text, error):
    with pytest.raises(ValidationError, match=error):
        pipedsl.from_torch_csv(text)
