"""The NCCL model (pipedsl/nccl_model.py): every built-in is hang-free under NCCL's semantics with the runtime's
communicators, the layouts peers use are caught hanging, and under the runtime's layout whatever the buffered walk
(engine.run_to_end) runs, the model runs — what the validator relies on beyond NCCL_WALK_UP_TO."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl import DeadlockError, Program, ValidationError
from pipedsl.engine import run_to_end
from pipedsl.ir import COMMS, RECVS, Instr, Op
from pipedsl.nccl_model import LAYOUT, edges, run_rendezvous
from pipedsl.validate import NCCL_WALK_UP_TO

SIZES = [(P, M) for P in (2, 4, 8, 16) for M in sorted({1, P, 2 * P, 4 * P})]


def compiled(name: str, P: int, M: int) -> Program | None:
    """The built-in at (P, M), or None where the schedule refuses the size (M < P for some, P odd for V's)."""
    try:
        return pipedsl.load(name).compile(P, M)
    except pipedsl.PipeDSLError:
        return None


@pytest.mark.parametrize("name", pipedsl.builtin_names())
def test_every_builtin_is_hang_free_under_nccl_with_the_runtimes_communicators(name):
    """The issue's grid: P in {2, 4, 8, 16}, M in {1, P, 2P, 4P}, wherever the schedule compiles — the model's own
    walk, at sizes the validator leaves to the buffered walk too."""
    checked = 0
    for P, M in SIZES:
        program = compiled(name, P, M)
        if program is None:
            continue
        run_rendezvous(program, LAYOUT)
        checked += 1
    assert checked >= 8, f"{name} compiled at only {checked} of the sizes"


def test_one_stream_per_pair_hangs_1f1b_at_two_ranks_and_names_the_cycle():
    """The model's negative control: torch's default (one NCCL stream per pair of ranks, both directions, in
    program order) deadlocks 1F1B at P = 2, M = 2 on its second message — each rank sends, and each send waits for
    a receive queued behind the other rank's send."""
    program = pipedsl.load("1f1b").compile(2, 2)
    run_to_end(program)  # buffered sends: fine
    with pytest.raises(DeadlockError) as caught:
        run_rendezvous(program, "pair")
    text = str(caught.value)
    assert ("rank 0 instruction 3 (SEND_F1.0>1) on communicator {0,1} waits for rank 1 to reach its receive, but "
            "rank 1's stream of {0,1} is at instruction 3 (SEND_B0.1>0)") in text, text
    assert ("rank 1 instruction 3 (SEND_B0.1>0) on communicator {0,1} waits for rank 0 to reach its receive, but "
            "rank 0's stream of {0,1} is at instruction 3 (SEND_F1.0>1)") in text, text
    with pytest.raises(DeadlockError, match="communicators per group: one"):
        run_rendezvous(program, "group")


def test_only_gpipe_survives_one_stream_per_pair():
    """What the issue measured: of the 14 built-ins at P = 2, M = 4, one stream per pair hangs all but GPipe (its
    forwards and backwards never cross); one stream per directed edge hangs none."""
    programs = {name: pipedsl.load(name).compile(2, 4) for name in pipedsl.builtin_names()}
    hang = {name for name, program in programs.items() if _hangs(program, "pair")}
    assert hang == set(programs) - {"gpipe"}, hang
    assert not any(_hangs(program, LAYOUT) for program in programs.values())


def _hangs(program: Program, layout: str, order=None) -> bool:
    try:
        run_rendezvous(program, layout, order)
    except DeadlockError:
        return True
    return False


def test_the_validator_runs_the_nccl_walk_itself_on_programs_of_ordinary_size():
    program = pipedsl.load("dualpipev").compile(8, 32)
    assert program.num_instructions() <= NCCL_WALK_UP_TO
    assert len(edges(program)) == 14  # 7 neighbour pairs, both directions


def _mutated(program: Program, rng: random.Random) -> Program:
    """`program` with messages moved within their rank as far as local dependencies allow — a receive anywhere
    before the op that reads it, a send anywhere after the op that makes it — which can break the per-pair order
    or deadlock, but keeps every rank's own dependencies."""
    ranks = [list(stream) for stream in program.ranks]
    for stream in ranks:
        for _ in range(3):
            comms = [i for i, ins in enumerate(stream) if ins.op in COMMS]
            if not comms:
                break
            i = rng.choice(comms)
            ins = stream.pop(i)
            if ins.op in RECVS:
                reader = next(k for k, other in enumerate(stream) if _reads(other, ins))
                stream.insert(rng.randint(0, reader), ins)
            else:
                maker = max(k for k, other in enumerate(stream) if _makes(other, ins))
                stream.insert(rng.randint(maker + 1, len(stream) - 1), ins)  # before OPTIMIZER_STEP
    return Program.from_dict({**program.to_dict(), "ranks": [[ins.to_dict(True) for ins in s] for s in ranks]})


def _reads(op: Instr, recv: Instr) -> bool:
    want = (Op.F,) if recv.op is Op.RECV_F else (Op.B, Op.I)
    return any(part.op in want and part.key == recv.key for part in op.parts)


def _makes(op: Instr, send: Instr) -> bool:
    want = (Op.F,) if send.op is Op.SEND_F else (Op.B, Op.I)
    return any(part.op in want and part.key == send.key for part in op.parts)


def _early_receives(program: Program, rng: random.Random) -> list[list[int]]:
    """An issue order in which each receive is posted earlier than its place, by up to 8 instructions, keeping
    the receives from each peer in order — what the runtime's look-ahead may do."""
    order = []
    for stream in program.ranks:
        at = {i: i - (rng.randint(0, 8) if ins.op in RECVS else 0) - (0.5 if ins.op in RECVS else 0)
              for i, ins in enumerate(stream)}
        per_peer: dict[int, float] = {}
        for i, ins in enumerate(stream):  # per peer, no receive before an earlier one from it
            if ins.op in RECVS:
                at[i] = max(at[i], per_peer.get(ins.peer, -1.0) + 0.01)
                per_peer[ins.peer] = at[i]
        order.append(sorted(range(len(stream)), key=lambda i: at[i]))
    return order


BASE = [pipedsl.load(name).compile(P, M) for name in ("1f1b", "interleaved", "zb-v", "dualpipev", "chimera")
        for P, M in ((2, 4), (4, 8))]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(BASE), st.integers(0, 2**32 - 1))
def test_under_directed_edges_what_buffered_sends_run_nccl_runs(program, seed):
    """What the validator relies on beyond NCCL_WALK_UP_TO: with one communicator per directed edge, a program
    the buffered walk runs (it blocks at each receive's place) runs under NCCL's rendezvous too, whatever the
    receives' issue order; one stream per pair can only add hangs.  The converse need not hold: NCCL's host
    does not wait at a receive's place, so the walk is the stricter of the two."""
    rng = random.Random(seed)
    mutated = _mutated(program, rng)
    try:
        run_to_end(mutated)
        buffered = True
    except DeadlockError:
        buffered = False
    except ValidationError:  # messages out of per-pair order: refused before any transport matters
        return
    edge = _hangs(mutated, LAYOUT)
    if buffered:
        assert not edge and not _hangs(mutated, LAYOUT, _early_receives(mutated, rng))
    if edge:
        assert _hangs(mutated, "pair") and _hangs(mutated, "group")
