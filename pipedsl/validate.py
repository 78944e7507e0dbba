"""Prove a program is safe to run before anything runs.

Checks, in order, each failure naming rank, instruction index and op:
1. fields in range, placement complete, routing valid;
2. every compute op exactly once, on the rank its placement names (each microbatch and stage
   has either a full backward B or a split one, I then W: a program may mix the two); every required message
   sent and received exactly once, and no other; REDUCE_GRAD once per stage copy after its
   last backward; OPTIMIZER_STEP last;
3. dependencies within each rank (F after its input exists, B/I after its F and its output
   gradient, W after I, a send after the op producing it; the two halves of an overlapped
   pair F&B run together, so neither may need the other);
4. a dry run of all ranks with blocking receives: per-pair message order (the k-th receive
   on b from a is the k-th send from a to b) and no deadlock (every stream reaches its end);
5. no deadlock under NCCL's semantics with the runtime's communicators (nccl_model.py: a send
   completes only when its receive is reached, one stream per communicator and rank).  With one
   communicator per directed edge, the runtime's layout, a program that passes 4 passes 5 (4 blocks
   the host at each receive's place, NCCL does not; docs/runtime.md, "NCCL"; tests/pipedsl/
   test_nccl_model.py checks it on every built-in and on mutated programs), so 5 runs as its own
   walk up to `NCCL_WALK_UP_TO` instructions and is implied by 4 beyond, where the walk would cost
   ten times the rest of the validation.

Checks 2 and 3 are asked of whole arrays first (`fastcheck.streams_pass`, ~4x faster on a
million instructions); only when an answer is no do the per-instruction passes here run, to
find the first failure and say where it is.
"""

from __future__ import annotations

import sys
from collections import Counter

from pipedsl.engine import run_to_end
from pipedsl.errors import ValidationError
from pipedsl.ir import COMPUTE, Instr, Op, Program
from pipedsl.nccl_model import run_rendezvous
from pipedsl.perf import no_gc

ARRAYS_FROM = 1_000  # instructions: below this the per-instruction passes are faster than numpy's calls
ARRAYS_FROM_COLD = 50_000  # and below this, faster than importing numpy first (~65 ms; 2 µs vs 0.8 µs an instruction)
NCCL_WALK_UP_TO = 20_000  # instructions: check 5's own walk (~4 µs an instruction); beyond, check 4 decides it


def validate(program: Program) -> Program:
    """Raise `ValidationError` (or `DeadlockError`) if `program` is unsafe; return it otherwise."""
    if program.meta.get("validated"):
        return program
    with no_gc():
        _check_header(program)
        cheapest = ARRAYS_FROM if "numpy" in sys.modules else ARRAYS_FROM_COLD
        if program.num_instructions() < cheapest or not _arrays_pass(program):
            _check_streams(program)  # small (numpy's per-call cost would dominate), or a failure to locate
        run_to_end(program)
        if program.num_instructions() <= NCCL_WALK_UP_TO:
            run_rendezvous(program)
    program.meta["validated"] = True
    return program


def _arrays_pass(program: Program) -> bool:
    from pipedsl.fastcheck import streams_pass  # numpy: imported by the programs big enough to use it

    return streams_pass(program)


def _where(r: int, i: int, ins: Instr) -> str:
    return f"rank {r} instruction {i} ({ins})"


class _Bad(Exception):  # noqa: N818 - internal: a check failed; the caller adds where
    """`_Bad(index, message)`: a pass found a problem; `_located` names rank, index and op."""


def _check_header(p: Program) -> None:
    if p.num_ranks < 1:
        raise ValidationError("a program needs at least one rank")
    if p.num_stages < 1 or p.num_replicas < 1 or p.num_microbatches < 1:
        raise ValidationError("a program needs at least one stage, replica and microbatch")
    for c in range(p.num_replicas):
        for s in range(p.num_stages):
            r = p.placement.get((c, s))
            if r is None:
                raise ValidationError(f"placement names no rank for stage {s} of replica {c}")
            if not 0 <= r < p.num_ranks:
                raise ValidationError(f"stage {s} of replica {c} is placed on rank {r}, "
                                      f"but the program has ranks 0..{p.num_ranks - 1}")
    extra = [k for k in p.placement if not (0 <= k[0] < p.num_replicas and 0 <= k[1] < p.num_stages)]
    if extra:
        raise ValidationError(f"placement names (replica, stage) {extra[0]} outside the program's "
                              f"{p.num_replicas} replica(s) × {p.num_stages} stages")
    for m, c in enumerate(p.microbatch_replica):
        if not 0 <= c < p.num_replicas:
            raise ValidationError(f"microbatch {m} is routed to replica {c}, which does not exist")


def _check_streams(p: Program) -> None:
    """Ranges, placement, exactly-once and completeness; then local dependencies."""
    seen: dict[tuple, tuple[int, int]] = {}  # (op, mb, stage, replica) -> (rank, index)
    for r, stream in enumerate(p.ranks):
        _located(r, stream, _placement_pass, p, r, stream, seen)
    _check_complete(p, seen)
    for r, stream in enumerate(p.ranks):
        _located(r, stream, _dependency_pass, p, r, stream, seen)


def _located(r: int, stream: tuple[Instr, ...], check_pass, *args) -> None:
    """Run a pass that reports failures as `_Bad(index, message)`; name rank, index and op."""
    try:
        check_pass(*args)
    except _Bad as bad:
        i, message = bad.args
        raise ValidationError(f"{_where(r, i, stream[i])}: {message}") from None


def _placement_pass(p: Program, r: int, stream: tuple[Instr, ...], seen: dict[tuple, tuple[int, int]]) -> None:
    """Per instruction: fields in range, on the placed rank, routed right, only once."""
    S, C, M, P = p.num_stages, p.num_replicas, p.num_microbatches, p.num_ranks
    rank_of, route = p.placement, p.microbatch_replica
    done: set[tuple] = set()
    add, first_at = done.add, seen.setdefault
    last = len(stream) - 1
    COMPUTE_, STEP, REDUCE = COMPUTE, Op.OPTIMIZER_STEP, Op.REDUCE_GRAD
    SEND_F, SEND_B, RECV_F = Op.SEND_F, Op.SEND_B, Op.RECV_F
    for i, whole in enumerate(stream):
        for ins in (whole,) if whole.sub is None else whole.sub:
            op, m, s, peer, c, _ = ins
            if op is STEP:
                if i != last:
                    raise _Bad(i, "OPTIMIZER_STEP must be the last instruction of the rank")
                continue
            if s is None or not 0 <= s < S or not 0 <= c < C:
                raise _Bad(i, f"stage {s} replica {c} does not exist ({S} stages, {C} replica(s))")
            home = rank_of[(c, s)]
            if op is REDUCE:
                if home != r:
                    raise _Bad(i, f"stage {s} is placed on rank {home}")
                key = (op, None, s, c)
            else:
                if m is None or not 0 <= m < M:
                    raise _Bad(i, f"microbatch {m} does not exist (M={M})")
                if route[m] != c:
                    raise _Bad(i, f"microbatch {m} is routed to replica {route[m]}, not {c}")
                if home != r:
                    raise _Bad(i, f"stage {s} (replica {c}) is placed on rank {home}, not rank {r}")
                if op not in COMPUTE_:
                    # messages: the only ones allowed are those the placement makes necessary
                    if peer is None or not 0 <= peer < P or peer == r:
                        raise _Bad(i, f"peer {peer} is not another rank (0..{P - 1})")
                    forward = op is SEND_F or op is RECV_F
                    sending = op is SEND_F or op is SEND_B
                    other = s + 1 if forward == sending else s - 1
                    if not 0 <= other < S or rank_of[(c, other)] != peer:
                        raise _Bad(i, f"no such message: stage {s} on rank {home} does not "
                                      f"{'send' if sending else 'receive'} {'forward' if forward else 'backward'} "
                                      f"{'to' if sending else 'from'} rank {peer}")
                    if sending:
                        made = (Op.F, m, s, c) in done if forward else ((Op.B, m, s, c) in done
                                                                         or (Op.I, m, s, c) in done)
                        if not made:
                            raise _Bad(i, f"sends a tensor before the op that produces it "
                                          f"({'F' if forward else 'B'}{m}.{s}) ran on this rank")
                key = (op, m, s, c)
            first = first_at(key, (r, i))
            if first[1] != i or first[0] != r:
                raise _Bad(i, f"repeats rank {first[0]} instruction {first[1]}; each op runs exactly once")
            add(key)


def _dependency_pass(p: Program, r: int, stream: tuple[Instr, ...], seen: dict[tuple, tuple[int, int]]) -> None:
    """Per compute op: its inputs exist on this rank when it runs; REDUCE_GRAD after every
    backward of its stage (gradients must be complete before they are reduced).  `seen` says
    where each op runs (the placement pass proved each runs once, on its stage's rank)."""
    finished: Counter[tuple[int, int]] = Counter()  # (stage, replica) -> backwards completed
    per_replica = Counter(p.microbatch_replica)
    released = (Op.B, Op.W)
    for i, whole in enumerate(stream):
        op = whole.op
        if op in COMPUTE:
            for ins in (whole,) if whole.sub is None else whole.sub:  # a pair's halves run together:
                message = _missing_input(p, r, ins, i, seen)          # neither may need the other
                if message:
                    raise _Bad(i, message if whole.sub is None else f"{ins}, in the pair, {message}")
                if ins.op in released:
                    finished[(ins.stage, ins.replica)] += 1
        elif op is Op.REDUCE_GRAD:
            have, need = finished[(whole.stage, whole.replica)], per_replica[whole.replica]
            if have != need:
                raise _Bad(i, f"reduces stage {whole.stage}'s gradients after {have} of its {need} backwards; "
                              f"gradients must be complete before they are reduced")


def _before(seen: dict[tuple, tuple[int, int]], key: tuple, r: int, i: int) -> bool:
    """Does op `key` run on rank r before its instruction i?"""
    at = seen.get(key)
    return at is not None and at[0] == r and at[1] < i


def _missing_input(p: Program, r: int, ins: Instr, i: int, seen: dict[tuple, tuple[int, int]]) -> str | None:
    """Why a compute op at instruction i of rank r cannot run yet, or None."""
    op, m, s, _, c, _ = ins
    if op is Op.F:
        if s > 0:
            local = p.placement[(c, s - 1)] == r
            if not _before(seen, (Op.F, m, s - 1, c) if local else (Op.RECV_F, m, s, c), r, i):
                return ("runs before its input exists: "
                        + (f"F{m}.{s - 1} must run first on this rank" if local else f"RECV_F{m}.{s} must come first"))
        return None
    if op is Op.W:
        if not _before(seen, (Op.I, m, s, c), r, i):
            return f"the weight gradient needs I{m}.{s} first on this rank"
        return None
    if not _before(seen, (Op.F, m, s, c), r, i):
        return f"a backward needs its forward F{m}.{s} first on this rank"
    if s < p.num_stages - 1:
        if p.placement[(c, s + 1)] == r:
            if not (_before(seen, (Op.B, m, s + 1, c), r, i) or _before(seen, (Op.I, m, s + 1, c), r, i)):
                return (f"runs before its output gradient exists: "
                        f"the backward of stage {s + 1} must run first on this rank")
        elif not _before(seen, (Op.RECV_B, m, s, c), r, i):
            return f"runs before its output gradient arrives: RECV_B{m}.{s} must come first"
    return None


def _check_complete(p: Program, seen: dict[tuple, tuple[int, int]]) -> None:
    """Every required op and message is present.  `seen` holds only valid, unique keys,
    so matching counts prove completeness; otherwise search for what is missing."""
    counts = Counter(k[0] for k in seen)
    S = p.num_stages
    cuts = [sum(p.placement[(c, s)] != p.placement[(c, s + 1)] for s in range(S - 1))
            for c in range(p.num_replicas)]
    messages = sum(cuts[c] for c in p.microbatch_replica)
    work = p.num_microbatches * S
    split = counts[Op.I]
    if (counts[Op.F] == work and counts[Op.B] + split == work and counts[Op.W] == split
            and not (split and counts[Op.B] and _full_and_split(seen))
            and all(counts[op] == messages for op in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B))
            and counts[Op.REDUCE_GRAD] == len(p.placement)):
        _check_step_last(p)
        return
    _find_missing(p, seen)
    raise AssertionError("counts disagree but nothing is missing")  # pragma: no cover


def _full_and_split(seen: dict[tuple, tuple[int, int]]) -> bool:
    """Does some (microbatch, stage) have both a full backward B and a split one (I)?

    A program may mix the two (DualPipeV: B in its steady phase, I then W in its cooldown), but
    each microbatch and stage takes one or the other.  With B + I counting every (mb, stage)
    once only when no key has both, the count check alone cannot tell."""
    full = {k[1:] for k in seen if k[0] is Op.B}
    return any(k[0] is Op.I and k[1:] in full for k in seen)


def _check_step_last(p: Program) -> None:
    for r in range(p.num_ranks):
        if not p.ranks[r] or p.ranks[r][-1].op is not Op.OPTIMIZER_STEP:
            raise ValidationError(f"rank {r}: the stream must end with OPTIMIZER_STEP")


def _find_missing(p: Program, seen: dict[tuple, tuple[int, int]]) -> None:
    S = p.num_stages
    for m, c in enumerate(p.microbatch_replica):
        for s in range(S):
            home = p.placement[(c, s)]
            tag = f"r{c}" if c else ""
            if (Op.F, m, s, c) not in seen:
                raise ValidationError(f"F{m}.{s}{tag} is missing: stage {s} needs it on rank {home}")
            full, split = (Op.B, m, s, c) in seen, (Op.I, m, s, c) in seen or (Op.W, m, s, c) in seen
            if full and split:
                r, i = seen[(Op.B, m, s, c)]
                raise ValidationError(f"rank {r} instruction {i} (B{m}.{s}{tag}): microbatch {m} stage {s} has "
                                      f"both a full backward and a split one (I/W)")
            if not full and not split:
                raise ValidationError(f"B{m}.{s}{tag} is missing: stage {s} needs a backward on rank {home}")
            if split:
                for op in (Op.I, Op.W):
                    if (op, m, s, c) not in seen:
                        raise ValidationError(f"{op.value}{m}.{s}{tag} is missing on rank {home}")
            for op, nxt in ((Op.SEND_F, s + 1), (Op.SEND_B, s - 1)):
                if 0 <= nxt < S and p.placement[(c, nxt)] != home:
                    recv = Op.RECV_F if op is Op.SEND_F else Op.RECV_B
                    if (op, m, s, c) not in seen:
                        raise ValidationError(f"{op.value}{m}.{s}{tag} is missing on rank {home}")
                    if (recv, m, nxt, c) not in seen:
                        raise ValidationError(f"{recv.value}{m}.{nxt}{tag} is missing on rank "
                                              f"{p.placement[(c, nxt)]}")
    for (c, s), home in p.placement.items():
        if (Op.REDUCE_GRAD, None, s, c) not in seen:
            raise ValidationError(f"REDUCE_GRAD.{s}{f'r{c}' if c else ''} is missing on rank {home}")
    _check_step_last(p)
