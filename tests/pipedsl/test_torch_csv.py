"""torch.distributed.pipelining's CSV schedules: pipedsl writes them (`--format torch-csv`) and
loads them as programs (torch's own dump included; its runtime test is tests/runtime)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl import ValidationError
from pipedsl.cli import main
from pipedsl.ir import COMPUTE


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


def torchs_1f1b_order(P: int, M: int) -> str:
    """torch's own Schedule1F1B._get_pipeline_order (reads only sizes) as CSV rows: its last rank
    starts at F1, runs B0 before any F0 and ends at F{M} — an order torch's runtime never loads."""
    from torch.distributed.pipelining.schedules import Schedule1F1B

    schedule = Schedule1F1B.__new__(Schedule1F1B)
    schedule._num_stages, schedule._n_microbatches = P, M
    order = schedule._get_pipeline_order()
    return "".join(",".join(str(a) for a in order[r] if a is not None) + "\n" for r in range(P))


@pytest.mark.parametrize("text, error", [
    # the issue's example: rank 1's forward of microbatch 1 needs a forward rank 0 never runs (was a KeyError)
    ("0F0,0B0\n1F1,1B0\n", r"^invalid program: torch CSV row 2 \(rank 1\) cell 1 \(1F1\): needs 0F1, its input "
                           r"\(the forward of stage 0\), which no row runs \(rank 0 holds stage 0\)$"),
    (torchs_1f1b_order(4, 8), r"row 4 \(rank 3\) cell 2 \(3B0\): needs 3F0, its forward, which no row runs"),
    ("0F0,0B0,1F0\n", r"cell 2 \(0B0\): needs 1B0 or 1I0, its output gradient \(the backward of stage 1\), which no "
                      r"row runs"),
    ("0F0,0W0\n", r"cell 2 \(0W0\): needs 0I0, its input-gradient backward, which no row runs"),
    ("0B0,0F0\n", r"cell 1 \(0B0\): runs before 0F0, its forward, which this rank runs later, in cell 2 \(0F0\)"),
    ("0F0,1F0,0B0,1B0\n", r"cell 3 \(0B0\): runs before 1B0 or 1I0, its output gradient .* later, in cell 4"),
    ("(0F0;0B0)OVERLAP_F_B\n", r"runs before 0F0, its forward, which this rank runs in the same pair"),
    ("0F0,0F0,0B0\n", r"row 1 \(rank 0\) cell 2 \(0F0\): 0F0 is also in row 1 \(rank 0\) cell 1 \(0F0\); each action"),
    ("0F0\n1F0,1B0\n", r"^invalid program: torch CSV: no row runs a backward of microbatch 0 through stage 0 "
                       r"\(0B0, or 0I0 and 0W0; rank 0 holds stage 0\)$"),
    ("0F0,0B0,0F2,0B2\n", r"^invalid program: torch CSV: no row runs 0F1, the forward of microbatch 1 through stage 0 "
                          r"\(rank 0 holds stage 0\)$"),
    ("0F0,0I0\n", r"cell 2 \(0I0\): no row runs its weight gradient 0W0 \(rank 0\)"),
    ("0F0,0I0,0W0,0B0\n", r"cell 2 \(0I0\): microbatch 0 stage 0 also has a full backward \(row 1 \(rank 0\) cell 4"),
])
def test_an_order_missing_or_misplacing_an_input_names_the_rank_the_action_and_what_is_missing(text, error):
    with pytest.raises(ValidationError, match=error):
        pipedsl.from_torch_csv(text)


def test_a_torch_csv_program_file_with_a_missing_action_says_what_is_missing(tmp_path):
    """`pipedsl run --program` read "malformed csv program: KeyError: (<Op.F: 'F'>, 0, 1, 0)"."""
    from pipedsl.runtime.program_file import read_program

    path = tmp_path / "torch1f1b.csv"
    path.write_text(torchs_1f1b_order(2, 4))
    with pytest.raises(ValidationError) as err:
        read_program(path)
    assert err.value.message == (f"{path}: torch CSV row 2 (rank 1) cell 2 (1B0): needs 1F0, its forward, which no "
                                 f"row runs (rank 1 holds stage 1)")


def test_ranks_waiting_on_each_other_in_a_torch_csv_are_the_validators_deadlock():
    """Inputs present and in order on each rank, but each rank waits for the other's message."""
    with pytest.raises(pipedsl.DeadlockError, match="the ranks wait on each other in a cycle: rank 0 waits"):
        pipedsl.from_torch_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")


TORCH_BASE = [pipedsl.to_torch_csv(pipedsl.load(name).compile(P=2, M=4)) for name in ("1f1b", "zb-h1", "dualpipev")]


@given(st.sampled_from(TORCH_BASE), st.lists(st.tuples(st.sampled_from(["drop", "dup", "swap", "move"]),
                                                       st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=3))
def test_every_mutated_torch_order_loads_or_is_one_validation_error(text, edits):
    """Cells dropped, repeated, swapped within a row or moved to another: never a bare exception."""
    rows = [line.split(",") for line in text.splitlines()]
    for what, a, b in edits:
        row = rows[a % len(rows)]
        if not row:
            continue
        i, j = a % len(row), b % len(row)
        if what == "drop":
            del row[i]
        elif what == "dup":
            row.insert(j, row[i])
        elif what == "swap":
            row[i], row[j] = row[j], row[i]
        else:
            rows[b % len(rows)].insert(j, row.pop(i))
    try:
        program = pipedsl.from_torch_csv("".join(",".join(row) + "\n" for row in rows))
    except ValidationError as err:
        assert str(err).startswith(("invalid program: torch CSV", "deadlock:", "invalid program: rank")), str(err)
    else:
        assert program.meta["validated"]


REVERSED = """schedule Reversed(P, M) {
  stages P
  place s
  order F by -m    # every stage, the last included, runs its forwards from the last microbatch down
  order B by -m
  warmup min(P - r - 1, M)
}"""


def test_the_csv_numbers_microbatches_in_the_order_the_last_stage_runs_its_forwards(tmp_path, capsys):
    """torch's runtime looks the last stage's losses up by microbatch number but stores them in forward order."""
    program = pipedsl.Schedule.from_text(REVERSED).compile(P=3, M=5)
    number = pipedsl.torch_csv.torch_numbering(program)
    assert number == (4, 3, 2, 1, 0)
    back = pipedsl.from_torch_csv(pipedsl.to_torch_csv(program))
    last = [i.mb for i in back.ranks[2] if i.op is pipedsl.Op.F]
    assert last == [0, 1, 2, 3, 4]  # torch's k-th loss is microbatch k's
    renumbered = [[str(i._replace(mb=number[i.mb])) for i in stream if i.op in COMPUTE] for stream in program.ranks]
    assert back.compute_orders() == renumbered  # the same schedule, only the names of the microbatches differ
    (tmp_path / "rev.pipe").write_text(REVERSED)
    assert main(["compile", str(tmp_path / "rev.pipe"), "-P", "3", "-M", "5", "--format", "torch-csv"]) == 0
    err = capsys.readouterr().err
    assert "the CSV numbers microbatches in that order (pipedsl→torch: 0→4, 1→3, 3→1, 4→0)" in err


@pytest.mark.parametrize("name", [n for n in pipedsl.builtin_names() if n not in ("chimera", "dualpipe")])
def test_no_builtin_is_renumbered(name, capsys):
    for P, M in ((2, 4), (3, 6), (4, 8), (4, 12)):
        program = pipedsl.load(name).compile(P=P, M=M)
        assert pipedsl.torch_csv.torch_numbering(program) == tuple(range(M)), (name, P, M)
    assert main(["compile", name, "-P", "4", "-M", "8", "--format", "torch-csv", "-o", os.devnull]) == 0
    assert capsys.readouterr().err == ""


TORCH_RUN = """
import copy, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))

def loss_fn(out, y):  # saves y only: torch detaching a stage output in place cannot turn a wrong loss into an error
    return (out * y).mean()

def gradient_error(path, M=3, S=2):
    torch.manual_seed(0)
    model = torch.nn.ModuleList(Block() for _ in range(S))
    ref = copy.deepcopy(model)
    sched = _PipelineScheduleRuntime([PipelineStage(model[s], s, S, torch.device("cpu")) for s in range(S)],
                                     n_microbatches=M, loss_fn=loss_fn)
    sched._load_csv(path)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * M, 4, generator=g), torch.randn(2 * M, 4, generator=g)
    sched.step(x, target=y)
    (sum(loss_fn(ref[1](ref[0](xm)), ym) for xm, ym in zip(x.chunk(M), y.chunk(M))) / M).backward()
    return max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters()))

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
print(gradient_error(sys.argv[1]), gradient_error(sys.argv[2]))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_torchs_runtime_gets_one_process_gradients_from_the_renumbered_csv(tmp_path):
    """One rank holding both stages, its last stage running forwards 2, 1, 0: torch's runtime pairs
    each backward with another microbatch's loss from the order as written, and is exact on the export."""
    order = "0F0,0F1,0F2,1F2,1F1,1F0,1B0,0B0,1B1,0B1,1B2,0B2\n"
    (tmp_path / "as_written.csv").write_text(order)
    (tmp_path / "exported.csv").write_text(pipedsl.to_torch_csv(pipedsl.from_torch_csv(order)))
    assert (tmp_path / "exported.csv").read_text() == "0F2,0F1,0F0,1F0,1F1,1F2,1B2,0B2,1B1,0B1,1B0,0B0\n"
    run = subprocess.run([sys.executable, "-c", TORCH_RUN, str(tmp_path / "as_written.csv"),
                          str(tmp_path / "exported.csv")], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    as_written, exported = map(float, run.stdout.split())
    assert as_written > 0.1 and exported < 1e-6, (as_written, exported)
