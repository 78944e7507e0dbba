"""torch.distributed.pipelining's CSV schedules, both ways.

torch writes and reads (`_PipelineScheduleRuntime._load_csv`, format "compute_only") one row
per rank, one action per cell: `{stage}{F|B|I|W}{microbatch}` (`2F0`, `5I3`) and overlapped
pairs `({stage}F{mb};{stage}B{mb})OVERLAP_F_B`; its runtime infers the stage placement and
adds the communication itself.  `to_torch_csv` writes a program's compute order that way;
`from_torch_csv` reads such a file (compute_only, or compute_comms whose communication cells
it drops) and lowers it to a validated pipedsl `Program`.  torch's schedules hold one model
copy, so a program with replicas (Chimera, DualPipe) has no torch form.
"""

from __future__ import annotations

import csv
import io
import re

from pipedsl.errors import ValidationError
from pipedsl.ir import Instr, Op, Program, check_size
from pipedsl.limits import MAX_MICROBATCHES, MAX_RANKS, MAX_STAGES, shorten
from pipedsl.lowering import ComputeOp, ComputePlan, lower
from pipedsl.validate import validate

_ACTION = re.compile(r"(\d+)(F|B|I|W)(\d+)")
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMMS = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")


def to_torch_csv(program: Program) -> str:
    """The program's compute order in torch's compute_only CSV (one row per rank)."""
    if program.num_replicas != 1:
        raise ValidationError(f"{program.name} runs {program.num_replicas} model copies; torch.distributed."
                              f"pipelining schedules hold one, so it has no torch CSV form")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for stream in program.ranks:
        writer.writerow([_action(i) for i in stream if i.op in _KINDS or i.op is Op.OVERLAP])
    return out.getvalue()


_KINDS = {Op.F: "F", Op.B: "B", Op.I: "I", Op.W: "W"}


def _action(i: Instr) -> str:
    if i.sub is not None:
        return f"({';'.join(map(_action, i.sub))})OVERLAP_F_B"
    return f"{i.stage}{_KINDS[i.op]}{i.mb}"


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
    for r, row in enumerate(rows):
        order: list[ComputeOp] = []
        for col, cell in enumerate(row, 1):
            cell = cell.strip()
            if not cell or _COMMS.fullmatch(cell):
                continue
            try:
                op = _compute(cell)
            except ValueError as err:
                raise ValidationError(f"torch CSV row {r + 1} (rank {r}) cell {col}: {err}") from None
            for _, _, s, _ in (op[1], op[2]) if op[0] is Op.OVERLAP else (op,):
                if placement.setdefault((0, s), r) != r:
                    raise ValidationError(f"torch CSV row {r + 1} (rank {r}) cell {col} ({cell}): stage {s} "
                                          f"also has actions on rank {placement[(0, s)]}")
            order.append(op)
        orders.append(order)
    mbs = [m for order in orders for op in order for (_, m, _, _) in ((op[1], op[2]) if op[0] is Op.OVERLAP
                                                                     else (op,))]
    if not mbs:
        raise ValidationError("torch CSV has no compute action")
    S, M = max(s for _, s in placement) + 1, max(mbs) + 1
    check_size(len(orders), M, S, 1)  # before anything loops over stages or microbatches
    missing = [s for s in range(S) if (0, s) not in placement]
    if missing:
        raise ValidationError(f"torch CSV: stage {missing[0]} has no action on any rank")
    plan = ComputePlan(name, {"P": len(orders), "M": M}, S, 1, placement, (0,) * M, orders)
    return validate(lower(plan))


def _compute(cell: str) -> ComputeOp:
    pair = _PAIR.fullmatch(cell)
    if pair:
        halves = pair[1].split(";")
        parts = [_compute(p.strip()) for p in halves] if len(halves) == 2 and "(" not in pair[1] else []
        if len(parts) != 2 or parts[0][0] is not Op.F or parts[1][0] is not Op.B:
            raise ValueError(f"{shorten(cell)}: an OVERLAP_F_B pair is a forward and a full backward")
        return (Op.OVERLAP, parts[0], parts[1], 0)  # type: ignore[return-value]
    m = _ACTION.fullmatch(cell)
    if not m:
        raise ValueError(f"{shorten(cell)} is not a torch action (e.g. 2F0, 5I3, (0F3;7B1)OVERLAP_F_B)")
    stage, mb = int(m[1]), int(m[3])
    if stage >= MAX_STAGES or mb >= MAX_MICROBATCHES:
        raise ValueError(f"{shorten(cell)}: stages are below {MAX_STAGES:,} (MAX_STAGES), microbatches below "
                         f"{MAX_MICROBATCHES:,} (MAX_MICROBATCHES)")
    return ({"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}[m[2]], mb, stage, 0)
