"""Prove a program is safe to run before anything runs.

Checks, in order, each failure naming rank, instruction index and op:
1. fields in range, placement complete, routing valid;
2. every compute op exactly once, on the rank its placement names; every required message
   sent and received exactly once, and no other; REDUCE_GRAD once per stage copy after its
   last backward; OPTIMIZER_STEP last;
3. dependencies within each rank (F after its input exists, B/I after its F and its output
   gradient, W after I, a send after the op producing it);
4. per-pair message order: the k-th receive on b from a is the k-th send from a to b;
5. no deadlock: a dry run of all ranks must reach the end of every stream.
"""

from __future__ import annotations

from collections import defaultdict

from pipedsl.engine import dry_run
from pipedsl.errors import ValidationError
from pipedsl.ir import COMPUTE, Instr, Op, Program


def validate(program: Program) -> Program:
    """Raise `ValidationError` (or `DeadlockError`) if `program` is unsafe; return it otherwise."""
    if program.meta.get("validated"):
        return program
    _check_header(program)
    _check_streams(program)
    _check_pair_order(program)
    dry_run(program, lambda _: 1.0, lambda _: 0.0)
    program.meta["validated"] = True
    return program


def _where(r: int, i: int, ins: Instr) -> str:
    return f"rank {r} instruction {i} ({ins})"


class _Bad(Exception):  # noqa: N818 - internal: a check failed; the caller adds where
    """Raised by per-instruction checks; the loop prefixes rank, index and op."""


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
        _each(p, r, stream, _Placement(p, r, seen).check)
    _check_complete(p, seen)
    for r, stream in enumerate(p.ranks):
        _each(p, r, stream, _dependency_checker(p, r))


def _each(p: Program, r: int, stream: tuple[Instr, ...], check) -> None:
    """Run `check(i, ins)` over a stream; a `_Bad` becomes a ValidationError naming the spot."""
    i = 0
    try:
        for i, ins in enumerate(stream):
            check(i, ins)
    except _Bad as bad:
        raise ValidationError(f"{_where(r, i, stream[i])}: {bad}") from None


class _Placement:
    """Per-instruction checks of one rank: ranges, placement, routing, exactly once."""

    def __init__(self, p: Program, r: int, seen: dict[tuple, tuple[int, int]]) -> None:
        self.p, self.r, self.seen = p, r, seen
        self.done: set[tuple] = set()
        self.last = len(p.ranks[r]) - 1

    def check(self, i: int, ins: Instr) -> None:
        p, r, done = self.p, self.r, self.done
        S, C, rank_of = p.num_stages, p.num_replicas, p.placement
        op, m, s, c = ins.op, ins.mb, ins.stage, ins.replica
        if op is Op.OPTIMIZER_STEP:
            if i != self.last:
                raise _Bad("OPTIMIZER_STEP must be the last instruction of the rank")
            return
        if s is None or not 0 <= s < S or not 0 <= c < C:
            raise _Bad(f"stage {s} replica {c} does not exist ({S} stages, {C} replica(s))")
        if op is Op.REDUCE_GRAD:
            if rank_of[(c, s)] != r:
                raise _Bad(f"stage {s} is placed on rank {rank_of[(c, s)]}")
            self._once((op, None, s, c), r, i)
            return
        if m is None or not 0 <= m < p.num_microbatches:
            raise _Bad(f"microbatch {m} does not exist (M={p.num_microbatches})")
        if p.microbatch_replica[m] != c:
            raise _Bad(f"microbatch {m} is routed to replica {p.microbatch_replica[m]}, not {c}")
        if (Op.REDUCE_GRAD, None, s, c) in done:
            raise _Bad(f"comes after REDUCE_GRAD.{s} of its stage; gradients must be complete before they are reduced")
        if op in COMPUTE:
            if rank_of[(c, s)] != r:
                raise _Bad(f"stage {s} (replica {c}) is placed on rank {rank_of[(c, s)]}, not rank {r}")
        else:
            self._check_message(ins)
        self._once((op, m, s, c), r, i)

    def _check_message(self, ins: Instr) -> None:
        """The only messages allowed are those the placement makes necessary."""
        p, r = self.p, self.r
        op, m, s, c, peer = ins.op, ins.mb, ins.stage, ins.replica, ins.peer
        S, rank_of = p.num_stages, p.placement
        if peer is None or not 0 <= peer < p.num_ranks or peer == r:
            raise _Bad(f"peer {peer} is not another rank (0..{p.num_ranks - 1})")
        forward = op is Op.SEND_F or op is Op.RECV_F
        if op is Op.SEND_F or op is Op.SEND_B:
            other = s + 1 if forward else s - 1
            if rank_of[(c, s)] != r or not 0 <= other < S or rank_of[(c, other)] != peer:
                raise _Bad(f"no such message: stage {s} on rank {rank_of[(c, s)]} does not send "
                           f"{'forward' if forward else 'backward'} to rank {peer}")
            produced = [(Op.F, m, s, c)] if forward else [(Op.B, m, s, c), (Op.I, m, s, c)]
            if not any(k in self.done for k in produced):
                raise _Bad(f"sends a tensor before the op that produces it ({produced[0][0].value}{m}.{s}) "
                           f"ran on this rank")
        else:
            other = s - 1 if forward else s + 1
            if rank_of[(c, s)] != r or not 0 <= other < S or rank_of[(c, other)] != peer:
                raise _Bad(f"no such message: stage {s} on rank {rank_of[(c, s)]} does not receive "
                           f"{'forward' if forward else 'backward'} from rank {peer}")

    def _once(self, key: tuple, r: int, i: int) -> None:
        first = self.seen.setdefault(key, (r, i))
        if first != (r, i):
            raise _Bad(f"repeats rank {first[0]} instruction {first[1]}; each op runs exactly once")
        self.done.add(key)


def _dependency_checker(p: Program, r: int):
    """Per-instruction dependency check of rank r, remembering what already ran."""
    done: set[tuple] = set()

    def check(i: int, ins: Instr) -> None:
        if ins.op in COMPUTE:
            _check_dependencies(p, r, ins, done)
        done.add((ins.op, ins.mb, ins.stage, ins.replica))

    return check


def _check_dependencies(p: Program, r: int, ins: Instr, done: set[tuple]) -> None:
    op, m, s, c = ins.op, ins.mb, ins.stage, ins.replica
    S = p.num_stages
    if op is Op.F:
        if s > 0:
            local = p.placement[(c, s - 1)] == r
            need = (Op.F, m, s - 1, c) if local else (Op.RECV_F, m, s, c)
            if need not in done:
                raise _Bad("runs before its input exists: "
                                      + (f"F{m}.{s - 1} must run first on this rank" if local
                                         else f"RECV_F{m}.{s} must come first"))
        return
    if op is Op.W:
        if (Op.I, m, s, c) not in done:
            raise _Bad(f"the weight gradient needs I{m}.{s} first on this rank")
        return
    if (Op.F, m, s, c) not in done:
        raise _Bad(f"a backward needs its forward F{m}.{s} first on this rank")
    if s < S - 1:
        if p.placement[(c, s + 1)] == r:
            if (Op.B, m, s + 1, c) not in done and (Op.I, m, s + 1, c) not in done:
                raise _Bad(f"runs before its output gradient exists: "
                                      f"the backward of stage {s + 1} must run first on this rank")
        elif (Op.RECV_B, m, s, c) not in done:
            raise _Bad(f"runs before its output gradient arrives: RECV_B{m}.{s} must come first")


def _check_complete(p: Program, seen: dict[tuple, tuple[int, int]]) -> None:
    S, P = p.num_stages, p.num_ranks
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
    for r in range(P):
        if not p.ranks[r] or p.ranks[r][-1].op is not Op.OPTIMIZER_STEP:
            raise ValidationError(f"rank {r}: the stream must end with OPTIMIZER_STEP")


def _check_pair_order(p: Program) -> None:
    """The k-th receive on b from a must be the message a sends k-th to b."""
    sends: dict[tuple[int, int], list[tuple[int, Instr]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Instr]]] = defaultdict(list)
    for r, stream in enumerate(p.ranks):
        for i, ins in enumerate(stream):
            if ins.op is Op.SEND_F or ins.op is Op.SEND_B:
                sends[(r, ins.peer)].append((i, ins))
            elif ins.op is Op.RECV_F or ins.op is Op.RECV_B:
                recvs[(ins.peer, r)].append((i, ins))
    for (a, b), sent in sends.items():
        got = recvs.get((a, b), [])
        for k, ((si, s_ins), (ri, r_ins)) in enumerate(zip(sent, got)):
            if not _matches(s_ins, r_ins):
                raise ValidationError(
                    f"rank {b} instruction {ri} ({r_ins}) is receive #{k} from rank {a}, but send #{k} from rank {a} "
                    f"is instruction {si} ({s_ins}): point-to-point messages match per pair in order, "
                    f"so the receives on rank {b} must follow rank {a}'s send order")
        if len(got) != len(sent):  # pragma: no cover - exactly-once checks catch this first
            raise ValidationError(f"rank {a} sends {len(sent)} messages to rank {b}, which receives {len(got)}")


def _matches(send: Instr, recv: Instr) -> bool:
    if send.mb != recv.mb or send.replica != recv.replica:
        return False
    if send.op is Op.SEND_F:
        return recv.op is Op.RECV_F and recv.stage == send.stage + 1
    return recv.op is Op.RECV_B and recv.stage == send.stage - 1
