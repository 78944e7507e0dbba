"""torch.distributed.pipelining's CSV schedules, both ways.

torch writes and reads (`_PipelineScheduleRuntime._load_csv`, format "compute_only") one row
per rank, one action per cell: `{stage}{F|B|I|W}{microbatch}` (`2F0`, `5I3`) and overlapped
pairs `({stage}F{mb};{stage}B{mb})OVERLAP_F_B`; its runtime infers the stage placement and
adds the communication itself.  `to_torch_csv` writes a program's compute order that way,
numbering the microbatches in the order the last stage runs its forwards (`torch_numbering`);
`from_torch_csv` reads such a file (compute_only, or compute_comms whose communication cells
it drops) and lowers it to a validated pipedsl `Program`.  torch's schedules hold one model
copy, so a program with replicas (Chimera, DualPipe) has no torch form.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from typing import NamedTuple

from pipedsl.errors import ValidationError
from pipedsl.ir import Instr, Op, Program, check_size
from pipedsl.limits import MAX_MICROBATCHES, MAX_RANKS, MAX_STAGES, shorten
from pipedsl.lowering import ComputeOp, ComputePlan, lower, parts
from pipedsl.perf import no_gc
from pipedsl.validate import validate

_ACTION = re.compile(r"(\d+)(F|B|I|W)(\d+)")
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMMS = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")


def to_torch_csv(program: Program) -> str:
    """The program's compute order in torch's compute_only CSV (one row per rank), microbatches
    numbered as torch's runtime needs them (`torch_numbering`)."""
    number = torch_numbering(program)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for stream in program.ranks:
        writer.writerow([_action(i, number) for i in stream if i.op in _KINDS or i.op is Op.OVERLAP])
    return out.getvalue()


def torch_numbering(program: Program) -> tuple[int, ...]:
    """torch's number for each microbatch of a one-copy program: the position of its forward
    among the last stage's forwards.

    torch's `_PipelineScheduleRuntime` appends the last stage's losses in the order its forwards
    run but looks a backward's loss up by microbatch number (`_maybe_compute_loss`,
    `_maybe_get_loss`), so a last stage running forwards out of number order gets another
    microbatch's loss: wrong gradients, or an error.  Microbatches are interchangeable (each
    takes its own chunk of inputs and targets; the gradients sum), so numbering them in that
    order makes torch compute what pipedsl does, with the losses and outputs in chunk order."""
    if program.num_replicas != 1:
        raise ValidationError(f"{program.name} runs {program.num_replicas} model copies; torch.distributed."
                              f"pipelining schedules hold one, so it has no torch CSV form")
    validate(program)  # every microbatch once on the last stage
    last = program.num_stages - 1
    number = [0] * program.num_microbatches
    forwards = (p.mb for ins in program.ranks[program.placement[(0, last)]] for p in ins.parts
                if p.op is Op.F and p.stage == last)
    for k, m in enumerate(forwards):
        number[m] = k
    return tuple(number)


_KINDS = {Op.F: "F", Op.B: "B", Op.I: "I", Op.W: "W"}


def _action(i: Instr, number: tuple[int, ...]) -> str:
    if i.sub is not None:
        return f"({';'.join(_action(part, number) for part in i.sub)})OVERLAP_F_B"
    return f"{i.stage}{_KINDS[i.op]}{number[i.mb]}"


@no_gc()  # a million tuples without cycles: collections would only rescan them
def from_torch_csv(text: str, name: str = "torch") -> Program:
    """A torch CSV schedule (one row per rank) as a lowered, validated program."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as err:
        raise ValidationError(f"not CSV: {err}") from None
    if len(rows) > MAX_RANKS:
        raise ValidationError(f"torch CSV has {len(rows):,} rows (one a rank), over the limit of {MAX_RANKS:,} "
                              f"(MAX_RANKS)")
    orders: list[list[ComputeOp]] = []
    placement: dict[tuple[int, int], int] = {}
    cells: dict[tuple[Op, int, int], _Cell] = {}  # (kind, mb, stage) -> where the CSV runs it
    for r, row in enumerate(rows):
        order: list[ComputeOp] = []
        for col, cell in enumerate(row, 1):
            cell = cell.strip()
            if not cell:
                continue
            try:
                op = _compute(cell)
            except ValueError as err:
                if _COMMS.fullmatch(cell):
                    continue  # torch's communication: lowering derives pipedsl's own
                raise ValidationError(f"torch CSV row {r + 1} (rank {r}) cell {col}: {err}") from None
            where = _Cell(r, col, cell)
            for kind, mb, s, _ in parts(op):
                if placement.setdefault((0, s), r) != r:
                    raise ValidationError(f"{where}: stage {s} also has actions on rank {placement[(0, s)]}")
                first = cells.setdefault((kind, mb, s), where)
                if first is not where:
                    raise ValidationError(f"{where}: {_name(kind, mb, s)} is also in {first.place}; each action "
                                          f"runs once")
            order.append(op)
        orders.append(order)
    if not cells:
        raise ValidationError("torch CSV has no compute action")
    S, M = max(s for _, s in placement) + 1, max(mb for _, mb, _ in cells) + 1
    check_size(len(orders), M, S, 1)  # before anything loops over stages or microbatches
    missing = [s for s in range(S) if (0, s) not in placement]
    if missing:
        raise ValidationError(f"torch CSV: stage {missing[0]} has no action on any rank")
    _check_orders(orders, cells, placement, S, M)
    plan = ComputePlan(name, {"P": len(orders), "M": M}, S, 1, placement, (0,) * M, orders)
    return validate(lower(plan))


class _Cell(NamedTuple):
    """Where a torch CSV runs an action: row `rank + 1`, 1-based column, the cell's text."""

    rank: int
    col: int
    text: str

    @property
    def place(self) -> str:
        return f"row {self.rank + 1} (rank {self.rank}) cell {self.col} ({self.text})"

    def __str__(self) -> str:
        return f"torch CSV {self.place}"


def _name(kind: Op, mb: int, stage: int) -> str:
    return f"{stage}{_KINDS[kind]}{mb}"


def _needs(kind: Op, s: int, S: int) -> tuple[tuple[tuple[Op, ...], int], ...]:
    """What an action on stage s consumes: (the kinds that make it, their stage) for each input."""
    if kind is Op.F:
        return (((Op.F,), s - 1),) if s > 0 else ()
    if kind is Op.W:
        return (((Op.I,), s),)
    return (((Op.F,), s), ((Op.B, Op.I), s + 1)) if s < S - 1 else (((Op.F,), s),)


def _what(kinds: tuple[Op, ...], src: int, s: int) -> str:
    if kinds == (Op.I,):
        return "its input-gradient backward"
    if kinds != (Op.F,):
        return f"its output gradient (the backward of stage {src})"
    return "its forward" if src == s else f"its input (the forward of stage {src})"


def _check_orders(orders: list[list[ComputeOp]], cells: dict[tuple[Op, int, int], _Cell],
                  placement: dict[tuple[int, int], int], S: int, M: int) -> None:
    """Before lowering: every action's inputs are somewhere in the CSV and, when made on the same
    rank, earlier in its row; every microbatch and stage gets a forward and one backward, full (B)
    or split (I then W).  Waits between ranks are the validator's (a dry run after lowering)."""
    rank_of = [placement[(0, s)] for s in range(S)]
    for r, order in enumerate(orders):
        done: set[tuple[Op, int, int]] = set()
        for entry in order:
            halves = parts(entry)
            for kind, mb, s, _ in halves:
                for kinds, src in _needs(kind, s, S):
                    home = rank_of[src]
                    if any((k, mb, src) in (done if home == r else cells) for k in kinds):
                        continue  # made earlier on this rank, or on another (when it arrives is the dry run's)
                    made = [cells[(k, mb, src)] for k in kinds if (k, mb, src) in cells]
                    at, wanted = cells[(kind, mb, s)], " or ".join(_name(k, mb, src) for k in kinds)
                    what = _what(kinds, src, s)
                    if not made:
                        raise ValidationError(f"{at}: needs {wanted}, {what}, which no row runs (rank {home} "
                                              f"holds stage {src})")
                    where = ("in the same pair: the halves of a pair run together, so neither may need the other"
                             if made[0] == at else f"later, in cell {made[0].col} ({made[0].text})")
                    raise ValidationError(f"{at}: runs before {wanted}, {what}, which this rank runs {where}")
            done.update((kind, mb, s) for kind, mb, s, _ in halves)
    counts = Counter(kind for kind, _, _ in cells)
    if (counts[Op.F] == M * S and counts[Op.B] + counts[Op.I] == M * S and counts[Op.W] == counts[Op.I]
            and all((Op.W, m, s) in cells and (Op.B, m, s) not in cells for k, m, s in cells if k is Op.I)):
        return  # the keys are distinct and in range: the counts prove every action is there once
    for mb in range(M):
        for s in range(S):
            home = placement[(0, s)]
            if (Op.F, mb, s) not in cells:
                raise ValidationError(f"torch CSV: no row runs {_name(Op.F, mb, s)}, the forward of microbatch {mb} "
                                      f"through stage {s} (rank {home} holds stage {s})")
            full, split = cells.get((Op.B, mb, s)), cells.get((Op.I, mb, s))
            if full and split:
                raise ValidationError(f"{split}: microbatch {mb} stage {s} also has a full backward ({full.place}); "
                                      f"a backward is either full (B) or split (I then W)")
            if not full and not split:
                raise ValidationError(f"torch CSV: no row runs a backward of microbatch {mb} through stage {s} "
                                      f"({_name(Op.B, mb, s)}, or {_name(Op.I, mb, s)} and {_name(Op.W, mb, s)}; "
                                      f"rank {home} holds stage {s})")
            if split and (Op.W, mb, s) not in cells:
                raise ValidationError(f"{split}: no row runs its weight gradient {_name(Op.W, mb, s)} (rank {home})")
    raise AssertionError("the counts disagree but nothing is missing")  # pragma: no cover


def _compute(cell: str) -> ComputeOp:
    m = _ACTION.fullmatch(cell)
    if m:
        stage, mb = int(m[1]), int(m[3])
        if stage >= MAX_STAGES or mb >= MAX_MICROBATCHES:
            raise ValueError(f"{shorten(cell)}: stages are below {MAX_STAGES:,} (MAX_STAGES), microbatches below "
                             f"{MAX_MICROBATCHES:,} (MAX_MICROBATCHES)")
        return (_BY_LETTER[m[2]], mb, stage, 0)
    pair = _PAIR.fullmatch(cell)
    if pair:
        halves = pair[1].split(";")
        parts = [_compute(p.strip()) for p in halves] if len(halves) == 2 and "(" not in pair[1] else []
        if len(parts) != 2 or parts[0][0] is not Op.F or parts[1][0] is not Op.B:
            raise ValueError(f"{shorten(cell)}: an OVERLAP_F_B pair is a forward and a full backward")
        return (Op.OVERLAP, parts[0], parts[1], 0)  # type: ignore[return-value]
    raise ValueError(f"{shorten(cell)} is not a torch action (e.g. 2F0, 5I3, (0F3;7B1)OVERLAP_F_B)")


_BY_LETTER = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}
