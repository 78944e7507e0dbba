"""Per-rank compute orders → `Program`: insert messages, gradient reductions and the step.

Rules (docs/architecture.md, "Receives follow the sender's order"):
- a SEND goes right after the op that produces the tensor; adjacent stages on one rank hand
  over locally, without messages;
- a RECV sits before the op that consumes it, but never after a later message from the same
  peer: receives from one peer appear in exactly the order that peer sends them (NCCL and
  gloo match point-to-point messages per pair in issue order, without tags).  Hoisting a
  receive earlier never creates a wait the consumer did not already have;
- REDUCE_GRAD follows the last backward of each stage copy, OPTIMIZER_STEP ends each stream.

An overlapped pair `(Op.OVERLAP, forward, backward, 0)` in a compute order is one instruction:
the receives of both halves come before it, the sends of both (the forward's first) after it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipedsl.ir import Instr, Op, Program

_new = tuple.__new__  # an Instr from a tuple of its fields, without NamedTuple's Python-level __new__

ComputeOp = tuple[Op, int, int, int]  # (kind, mb, stage, replica); a pair: (OVERLAP, F op, B op, 0)


def parts(op: ComputeOp) -> tuple[ComputeOp, ...]:
    """The compute ops an order entry runs: both halves of an overlapped pair, else itself."""
    return (op[1], op[2]) if op[0] is Op.OVERLAP else (op,)  # type: ignore[return-value]


@dataclass
class ComputePlan:
    """A bound schedule before lowering: placement, routing and each rank's compute order."""

    name: str
    params: dict[str, int]
    num_stages: int
    num_replicas: int
    placement: dict[tuple[int, int], int]
    microbatch_replica: tuple[int, ...]
    orders: list[list[ComputeOp]]
    meta: dict[str, Any] = field(default_factory=dict)


def lower(plan: ComputePlan) -> Program:
    """Lower compute orders into full instruction streams (see the module docstring).

    Three passes: find each message's sender and consumer, place the receives, then build the
    streams.  Only the last one allocates instructions; the first pass's scratch is freed before
    it and the receives' positions rank by rank as they are used: at 10⁶ instructions, scratch
    freed from between the instructions left ~200 MB of half-empty memory arenas (measured)."""
    S, orders = plan.num_stages, plan.orders
    rank_of = [[plan.placement[(c, s)] for s in range(S)] for c in range(plan.num_replicas)]
    F, B, W = Op.F, Op.B, Op.W

    # Which message each compute op consumes and sends, in each pair's send order.  A message is
    # its sender's op (kind F or B, mb, stage, replica); the consumer is an entry's index.
    sends_by_pair: dict[tuple[int, int], list[ComputeOp]] = defaultdict(list)
    consumer_index: dict[ComputeOp, int] = {}
    reduce_after: list[dict[int, tuple[int, int]]] = []  # per rank: entry index -> (replica, stage) reduced
    for r, order in enumerate(orders):
        last_backward: dict[tuple[int, int], int] = {}
        for i, op in _numbered(order):
            kind, m, s, c = op
            stage_rank = rank_of[c]
            if kind is F:
                if s > 0 and stage_rank[s - 1] != r:
                    consumer_index[(F, m, s - 1, c)] = i
                if s < S - 1 and stage_rank[s + 1] != r:
                    sends_by_pair[(r, stage_rank[s + 1])].append(op)
                continue
            if kind is not W:  # B or I: consumes the output gradient, sends the input gradient
                if s < S - 1 and stage_rank[s + 1] != r:
                    consumer_index[(B, m, s + 1, c)] = i
                if s > 0 and stage_rank[s - 1] != r:
                    sends_by_pair[(r, stage_rank[s - 1])].append(op if kind is B else (B, m, s, c))
            if kind is B or kind is W:
                last_backward[(c, s)] = i
        reduce_after.append({i: copy for copy, i in last_backward.items()})

    # Receives from one peer in that peer's send order, each as late as that allows; before one
    # entry, by sender rank, then send order.
    recvs_at: list[dict[int, list[ComputeOp]]] = [defaultdict(list) for _ in orders]
    for (_, dst), msgs in sorted(sends_by_pair.items()):
        latest = len(orders[dst])
        positions = []
        for msg in reversed(msgs):
            consumer = consumer_index[msg]
            if consumer < latest:
                latest = consumer
            positions.append(latest)
        at = recvs_at[dst]
        for msg, pos in zip(msgs, reversed(positions)):
            at[pos].append(msg)
    del sends_by_pair, consumer_index

    ranks = []
    for r, order in enumerate(orders):
        stream: list[Instr] = []
        emit = stream.append
        at, reduces = recvs_at[r], reduce_after[r]
        recvs_at[r] = None  # type: ignore[call-overload]  # freed as soon as used
        for i, (kind, m, s, c) in enumerate(order):
            if i in at:
                for mk, mm, ms, mc in at[i]:
                    emit(_new(Instr, (Op.RECV_F, mm, ms + 1, rank_of[mc][ms], mc, None) if mk is F
                                     else (Op.RECV_B, mm, ms - 1, rank_of[mc][ms], mc, None)))
            if kind is Op.OVERLAP:  # (OVERLAP, forward, backward, 0)
                emit(Instr.pair(_compute(m), _compute(s)))
                for part in (m, s):
                    send = _send(part, r, rank_of, S)
                    if send is not None:
                        emit(send)
            else:
                emit(_new(Instr, (kind, m, s, None, c, None)))
                stage_rank = rank_of[c]  # _send, inline: the common entry of the hot loop
                if kind is F:
                    if s < S - 1 and stage_rank[s + 1] != r:
                        emit(_new(Instr, (Op.SEND_F, m, s, stage_rank[s + 1], c, None)))
                elif kind is not W and s > 0 and stage_rank[s - 1] != r:
                    emit(_new(Instr, (Op.SEND_B, m, s, stage_rank[s - 1], c, None)))
            if i in reduces:
                emit(_new(Instr, (Op.REDUCE_GRAD, None, reduces[i][1], None, reduces[i][0], None)))
        emit(Instr(Op.OPTIMIZER_STEP))
        ranks.append(tuple(stream))

    return Program(plan.name, dict(plan.params), S, plan.num_replicas, dict(plan.placement),
                   tuple(plan.microbatch_replica), tuple(ranks), dict(plan.meta))


def _numbered(order: list[ComputeOp]) -> Iterable[tuple[int, ComputeOp]]:
    """(entry index, compute op) of each op an order runs: both halves of a pair at the pair's index."""
    if not any(entry[0] is Op.OVERLAP for entry in order):
        return enumerate(order)
    return [(i, part) for i, entry in enumerate(order) for part in parts(entry)]


def _compute(op: ComputeOp) -> Instr:
    kind, m, s, c = op
    return _new(Instr, (kind, m, s, None, c, None))


def _send(op: ComputeOp, r: int, rank_of: list[list[int]], S: int) -> Instr | None:
    """The message compute op `op` on rank r sends, if its consumer is on another rank."""
    kind, m, s, c = op
    if kind is Op.F:
        if s < S - 1 and rank_of[c][s + 1] != r:
            return _new(Instr, (Op.SEND_F, m, s, rank_of[c][s + 1], c, None))
    elif kind is not Op.W and s > 0 and rank_of[c][s - 1] != r:
        return _new(Instr, (Op.SEND_B, m, s, rank_of[c][s - 1], c, None))
    return None
