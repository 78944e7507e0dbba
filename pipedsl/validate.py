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
    S, M, C, P = p.num_stages, p.num_microbatches, p.num_replicas, p.num_ranks
    rank_of = p.placement
    route = p.microbatch_replica
    seen: dict[tuple, tuple[int, int]] = {}  # (op, mb, stage, replica) -> (rank, index)
    F, B, I, W = Op.F, Op.B, Op.I, Op.W
    for r, stream in enumerate(p.ranks):
        done: set[tuple] = set()
        for i, ins in enumerate(stream):
            op, m, s, c = ins.op, ins.mb, ins.stage, ins.replica
            where = _where(r, i, ins)
            if op is Op.OPTIMIZER_STEP:
                if i != len(stream) - 1:
                    raise ValidationError(f"{where}: OPTIMIZER_STEP must be the last instruction of the rank")
                continue
            if s is None or not 0 <= s < S or not 0 <= c < C:
                raise ValidationError(f"{where}: stage {s} replica {c} does not exist "
                                      f"({S} stages, {C} replica(s))")
            if op is Op.REDUCE_GRAD:
                _once(seen, (op, None, s, c), r, i, where)
                if rank_of[(c, s)] != r:
                    raise ValidationError(f"{where}: stage {s} is placed on rank {rank_of[(c, s)]}")
                done.add((op, None, s, c))
                continue
            if m is None or not 0 <= m < M:
                raise ValidationError(f"{where}: microbatch {m} does not exist (M={M})")
            if route[m] != c:
                raise ValidationError(f"{where}: microbatch {m} is routed to replica {route[m]}, not {c}")
            if (Op.REDUCE_GRAD, None, s, c) in done:
                raise ValidationError(f"{where}: comes after REDUCE_GRAD.{s} of its stage; "
                                      f"gradients must be complete before they are reduced")
            if op in COMPUTE:
                if rank_of[(c, s)] != r:
                    raise ValidationError(f"{where}: stage {s} (replica {c}) is placed on rank {rank_of[(c, s)]}, "
                                          f"not rank {r}")
                _once(seen, (op, m, s, c), r, i, where)
                done.add((op, m, s, c))
                continue
            # messages: the only ones allowed are those the placement makes necessary
            peer = ins.peer
            if peer is None or not 0 <= peer < P or peer == r:
                raise ValidationError(f"{where}: peer {peer} is not another rank (0..{P - 1})")
            if op is Op.SEND_F or op is Op.SEND_B:
                nxt = s + 1 if op is Op.SEND_F else s - 1
                if rank_of[(c, s)] != r or not 0 <= nxt < S or rank_of[(c, nxt)] != peer:
                    raise ValidationError(f"{where}: no such message: stage {s} on rank {rank_of[(c, s)]} "
                                          f"does not send {'forward' if op is Op.SEND_F else 'backward'} to "
                                          f"rank {peer}")
                produced = (F, m, s, c) if op is Op.SEND_F else ((B, m, s, c) if (B, m, s, c) in done else (I, m, s, c))
                if produced not in done:
                    raise ValidationError(f"{where}: sends a tensor before the op that produces it "
                                          f"({produced[0].value}{m}.{s}) ran on this rank")
            else:
                prev = s - 1 if op is Op.RECV_F else s + 1
                if rank_of[(c, s)] != r or not 0 <= prev < S or rank_of[(c, prev)] != peer:
                    raise ValidationError(f"{where}: no such message: stage {s} on rank {rank_of[(c, s)]} "
                                          f"does not receive {'forward' if op is Op.RECV_F else 'backward'} "
                                          f"from rank {peer}")
            _once(seen, (op, m, s, c), r, i, where)
            done.add((op, m, s, c))
    _check_complete(p, seen)
    for r, stream in enumerate(p.ranks):
        done = set()
        for i, ins in enumerate(stream):
            if ins.op in COMPUTE:
                _check_dependencies(p, r, i, ins, done)
            done.add((ins.op, ins.mb, ins.stage, ins.replica))


def _once(seen: dict, key: tuple, r: int, i: int, where: str) -> None:
    first = seen.setdefault(key, (r, i))
    if first != (r, i):
        raise ValidationError(f"{where}: repeats rank {first[0]} instruction {first[1]}; each op runs exactly once")


def _check_dependencies(p: Program, r: int, i: int, ins: Instr, done: set[tuple]) -> None:
    op, m, s, c = ins.op, ins.mb, ins.stage, ins.replica
    where = _where(r, i, ins)
    S = p.num_stages
    if op is Op.F:
        if s > 0:
            local = p.placement[(c, s - 1)] == r
            need = (Op.F, m, s - 1, c) if local else (Op.RECV_F, m, s, c)
            if need not in done:
                raise ValidationError(f"{where}: runs before its input exists: "
                                      + (f"F{m}.{s - 1} must run first on this rank" if local
                                         else f"RECV_F{m}.{s} must come first"))
        return
    if op is Op.W:
        if (Op.I, m, s, c) not in done:
            raise ValidationError(f"{where}: the weight gradient needs I{m}.{s} first on this rank")
        return
    if (Op.F, m, s, c) not in done:
        raise ValidationError(f"{where}: a backward needs its forward F{m}.{s} first on this rank")
    if s < S - 1:
        if p.placement[(c, s + 1)] == r:
            if (Op.B, m, s + 1, c) not in done and (Op.I, m, s + 1, c) not in done:
                raise ValidationError(f"{where}: runs before its output gradient exists: "
                                      f"the backward of stage {s + 1} must run first on this rank")
        elif (Op.RECV_B, m, s, c) not in done:
            raise ValidationError(f"{where}: runs before its output gradient arrives: RECV_B{m}.{s} must come first")


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
