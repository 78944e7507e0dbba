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
from dataclasses import dataclass, field
from typing import Any

from pipedsl.ir import Instr, Op, Program

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
    """Lower compute orders into full instruction streams (see the module docstring)."""
    S = plan.num_stages
    rank_of = [[plan.placement[(c, s)] for s in range(S)] for c in range(plan.num_replicas)]
    F, B, I, W = Op.F, Op.B, Op.I, Op.W

    # Which message each compute op consumes and sends, and the per-pair send order.
    sends_by_pair: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    consumer_index: dict[tuple, int] = {}
    for r, order in enumerate(plan.orders):
        for i, (kind, m, s, c) in ((i, part) for i, entry in enumerate(order) for part in parts(entry)):
            stage_rank = rank_of[c]
            if kind is F:
                if s > 0 and stage_rank[s - 1] != r:
                    consumer_index[(F, m, s - 1, c)] = i
                if s < S - 1 and stage_rank[s + 1] != r:
                    sends_by_pair[(r, stage_rank[s + 1])].append((F, m, s, c))
            elif kind is B or kind is I:
                if s < S - 1 and stage_rank[s + 1] != r:
                    consumer_index[(B, m, s + 1, c)] = i
                if s > 0 and stage_rank[s - 1] != r:
                    sends_by_pair[(r, stage_rank[s - 1])].append((B, m, s, c))

    # Receives from one peer in that peer's send order, each as late as that allows.
    recvs_at: list[dict[int, list[tuple]]] = [defaultdict(list) for _ in plan.orders]
    for (src, dst), msgs in sends_by_pair.items():
        latest = len(plan.orders[dst])
        placed = []
        for msg in reversed(msgs):
            latest = min(latest, consumer_index[msg])
            placed.append((latest, msg))
        for seq, (pos, msg) in enumerate(reversed(placed)):
            recvs_at[dst][pos].append((src, seq, msg))

    ranks = []
    for r, order in enumerate(plan.orders):
        last_backward = {}
        for i, (kind, _, s, c) in ((i, part) for i, entry in enumerate(order) for part in parts(entry)):
            if kind is B or kind is W:
                last_backward[(c, s)] = i
        stream: list[Instr] = []
        emit = stream.append
        at = recvs_at[r]
        for i, entry in enumerate(order):
            if i in at:
                for src, _, (mk, mm, ms, mc) in sorted(at[i], key=lambda x: x[:2]):
                    if mk is F:
                        emit(Instr(Op.RECV_F, mm, ms + 1, src, mc))
                    else:
                        emit(Instr(Op.RECV_B, mm, ms - 1, src, mc))
            if entry[0] is Op.OVERLAP:
                (fk, fm, fs, fc), (bk, bm, bs, bc) = entry[1], entry[2]
                emit(Instr.pair(Instr(fk, fm, fs, None, fc), Instr(bk, bm, bs, None, bc)))
            else:
                emit(Instr(entry[0], entry[1], entry[2], None, entry[3]))
            for kind, m, s, c in parts(entry):
                stage_rank = rank_of[c]
                if kind is F:
                    if s < S - 1 and stage_rank[s + 1] != r:
                        emit(Instr(Op.SEND_F, m, s, stage_rank[s + 1], c))
                elif (kind is B or kind is I) and s > 0 and stage_rank[s - 1] != r:
                    emit(Instr(Op.SEND_B, m, s, stage_rank[s - 1], c))
            for kind, _, s, c in parts(entry):
                if last_backward.get((c, s)) == i and kind is not F:
                    emit(Instr(Op.REDUCE_GRAD, None, s, None, c))
        emit(Instr(Op.OPTIMIZER_STEP))
        ranks.append(tuple(stream))

    return Program(plan.name, dict(plan.params), S, plan.num_replicas, dict(plan.placement),
                   tuple(plan.microbatch_replica), tuple(ranks), dict(plan.meta))
