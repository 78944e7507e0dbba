"""Consecutive steps of one program, run without a barrier between them (issue 48: post-validated steps).

Where a collective ends every step (the global gradient norm of clipping, the inf/NaN check), each rank waits
there for all others and steps run one after another.  Where those checks are post-validated — each stage steps
as soon as its gradients are final and the checks complete later (the zero-bubble paper's optimizer
post-validation) — a rank starts step k+1 as soon as its own part of step k is done, so the steps overlap and a
step's time is its period, the longest rank span (`Timeline.rank_spans`), not its makespan.

`consecutive(program, steps)` is that run as one program: each rank's stream repeated `steps` times, step j's
microbatches numbered from j·M so every message stays its own; each step's OPTIMIZER_STEP is where that rank's
part of the step ends, local to the rank.  `prove_consecutive` runs both deadlock walks of the validator on it —
blocking receives with buffered sends (engine.py) and NCCL's rendezvous with the runtime's communicators
(nccl_model.py, where each step's end waits for the rank's operations issued before it) — with each step's
gates waiting for every rank's end of the step before (`step_gates`: the post-validated runtime's verdict), so
two steps that overlap are proven hang-free as one step is.  `simulate(program, cost, steps=2)` and
`pipedsl show --steps 2` draw them.

`gates(program)` is where the runtime's post-validated steps (runtime/post_validate.py) check step k's verdict in
step k+1: on each rank, before its first instruction that is not forward work.  Any backward of step k+1 needs
that microbatch's forwards on every stage, so every rank has ended step k by then and the verdict is in.  The
forward work before the gates is a consistent cut — each message received there was sent there — so when the
verdict rolls step k back, every rank can drop what it did and drain the messages sent before the gates that
are received after them, with nothing left in flight, and run step k+1 again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pipedsl.engine import run_to_end
from pipedsl.errors import PipeDSLError, ValidationError
from pipedsl.ir import RECVS, SENDS, Instr, Op, Program
from pipedsl.limits import MAX_INSTRUCTIONS
from pipedsl.nccl_model import run_rendezvous
from pipedsl.perf import no_gc
from pipedsl.timeline import Timeline
from pipedsl.validate import validate

MAX_STEPS = 16  # consecutive steps drawn or proven at once: the period shows by the second


def consecutive(program: Program, steps: int) -> Program:
    """`program` run `steps` times back to back on every rank, step j's microbatch m as j·M + m (see above)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise PipeDSLError(f"steps must be an integer from 1 to {MAX_STEPS} (MAX_STEPS), got {steps!r}")
    if steps == 1:
        return program
    M = program.num_microbatches
    if steps * program.num_instructions() > MAX_INSTRUCTIONS:
        raise PipeDSLError(f"{steps} consecutive steps of {program.num_instructions():,} instructions exceed "
                           f"{MAX_INSTRUCTIONS:,} (MAX_INSTRUCTIONS): draw fewer steps or a smaller program")
    ranks = tuple(tuple(_shifted(ins, j * M) for j in range(steps) for ins in stream) for stream in program.ranks)
    return Program(f"{program.name} ×{steps} steps", {**program.params, "steps": steps}, program.num_stages,
                   program.num_replicas, dict(program.placement), program.microbatch_replica * steps, ranks,
                   {"steps": steps, "step_microbatches": M})


def prove_consecutive(program: Program, steps: int = 2) -> Program:
    """`program` validated, and its `steps` consecutive steps proven hang-free under both transport models (a
    `DeadlockError` or `ValidationError` names ranks and instructions of the repeated streams, step j's
    microbatches numbered from j·M); returns the consecutive program (`program` itself for one step)."""
    validate(program)
    repeated = consecutive(program, steps)
    if repeated is program:
        return program
    waits = step_gates(program, steps)
    with no_gc():  # the rendezvous walk at every size: a step's end waits for its rank's operations there, which
        run_to_end(repeated, waits)  # the buffered walk does not model, so one does not imply the other here
        run_rendezvous(repeated, gates=waits)
    return repeated


def step_gates(program: Program, steps: int) -> list[dict[int, int]] | None:
    """Per rank of `consecutive(program, steps)`: {instruction index: j} for each step j ≥ 1's gate, where the rank
    waits for step j-1's verdict, i.e. for every rank's j-th OPTIMIZER_STEP (post-validated steps); None when
    the program's forward work before its gates is no consistent cut (it cannot run post-validated)."""
    try:
        at = gates(program).at
    except ValidationError:
        return None
    return [{j * len(stream) + at[r]: j for j in range(1, steps)} for r, stream in enumerate(program.ranks)]


def period(timeline: Timeline) -> float:
    """What each step adds to the makespan of a timeline of consecutive steps (`simulate(..., steps=N)`, N > 1):
    the step's time where steps overlap.  Every rank's first step ends where it would alone (its ops precede the
    next step's and need nothing from them), so one simulation gives both."""
    steps = timeline.meta["steps"]
    first = max(events[len(events) // steps - 1].end for events in timeline.ranks if events) - timeline.start
    return (timeline.makespan - first) / (steps - 1)


def _shifted(ins: Instr, by: int) -> Instr:
    """`ins` with its microbatch (its pair's halves' too) moved up by `by`; step markers keep theirs (None)."""
    if not by:
        return ins
    if ins.sub is not None:
        return ins._replace(sub=(_shifted(ins.sub[0], by), _shifted(ins.sub[1], by)))
    if ins.mb is None:  # REDUCE_GRAD, OPTIMIZER_STEP
        return ins
    return ins._replace(mb=ins.mb + by)


FORWARD_WORK = frozenset({Op.F, Op.SEND_F, Op.RECV_F})  # what a rank may run of step k+1 before step k's verdict


@dataclass(frozen=True)
class Gates:
    """Per rank: `at`, the index of its first instruction that is not forward work (where it waits for the previous
    step's verdict); `drains`, the receives at or after its gate whose messages are sent before their senders'
    gates (received and dropped when the previous step is redone)."""

    at: tuple[int, ...]
    drains: tuple[tuple[int, ...], ...]


def gates(program: Program) -> Gates:
    """Each rank's gate and drains (see the module docstring); a `ValidationError` naming the receive when the
    forward work before the gates is not a consistent cut (a custom order receiving, before its gate, a message
    its sender sends after its own)."""
    at = tuple(next((i for i, ins in enumerate(stream) if ins.op not in FORWARD_WORK), len(stream))
               for stream in program.ranks)
    sent: dict[tuple[int, int], int] = defaultdict(int)  # (sender, receiver) -> messages sent before the gate
    for r, stream in enumerate(program.ranks):
        for ins in stream[:at[r]]:
            if ins.op in SENDS:
                sent[(r, ins.peer)] += 1
    drains = []
    for r, stream in enumerate(program.ranks):
        got: dict[int, int] = defaultdict(int)
        for i, ins in enumerate(stream[:at[r]]):
            if ins.op in RECVS:
                got[ins.peer] += 1
                if got[ins.peer] > sent[(ins.peer, r)]:
                    raise ValidationError(
                        f"rank {r} instruction {i} ({ins}) receives before rank {r}'s first backward a message rank "
                        f"{ins.peer} sends after its own first backward: the forwards before the backwards are not a "
                        f"consistent cut, so a post-validated step could not be rolled back there")
        due = {peer: n - got[peer] for (src, dst), n in sent.items() if dst == r for peer in [src] if n > got[peer]}
        drain = []
        for i in range(at[r], len(stream)):
            ins = stream[i]
            if ins.op in RECVS and due.get(ins.peer, 0) > 0:
                drain.append(i)
                due[ins.peer] -= 1
        drains.append(tuple(drain))
    return Gates(at, tuple(drains))
