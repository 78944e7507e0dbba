"""Check a recorded issue order (`PIPEDSL_P2P_RECORD=DIR`): what each rank issued, communicator by communicator,
read back and checked by rules of its own, not by the validator that proved the program.

    PIPEDSL_P2P=nccl PIPEDSL_P2P_RECORD=out/p2p pipedsl train …      # NCCL's layout and order, gloo's bytes
    python -m pipedsl.runtime.comm_record out/p2p                    # exit 1 on a problem, naming it

Each rank's file (`rank{R}.jsonl`, one line an operation, in issue order) holds the communicator, send or
receive, the peer, the instruction that issued it and the tensors' shapes.  The rules, for every communicator:

1. *matching*: the k-th send from a to b and the k-th receive at b from a are one message — the same number of
   them, the same shapes, and instructions that name one message (SEND_F m.s ↔ RECV_F m.s+1, SEND_B m.s ↔
   RECV_B m.s−1);
2. *one direction a stream*: on no rank does a communicator carry both sends and receives — the condition
   under which NCCL's rendezvous cannot make a send wait behind a receive, or a receive behind a send
   (docs/runtime.md, "NCCL").
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from pipedsl.ir import COMMS, SENDS, Instr, Op

SHAPES_OF = "the shapes of "  # how discovery.py labels the shape message before a first activation


def load(directory: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's recorded operations, by global rank."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        out[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def _message(op: dict[str, Any]) -> tuple[bool, str, int, int, int] | None:
    """(a shape message?, direction, microbatch, the sender's stage, replica) of the instruction `op` is for, or
    None for a label that names no message."""
    label = op.get("at") or ""
    shapes = label.startswith(SHAPES_OF)
    try:
        ins = Instr.parse(label.removeprefix(SHAPES_OF))
    except ValueError:
        return None
    if ins.op not in COMMS:
        return None
    forward = ins.op in (Op.SEND_F, Op.RECV_F)
    sender_stage = ins.stage if ins.op in SENDS else ins.stage - 1 if forward else ins.stage + 1
    return shapes, "F" if forward else "B", ins.mb, sender_stage, ins.replica


def problems(records: dict[int, list[dict[str, Any]]]) -> list[str]:
    """What breaks the module docstring's rules, in words; empty when none."""
    found: list[str] = []
    sends: dict[tuple[str, int, int], list[dict]] = defaultdict(list)  # (comm, src, dst) -> sends in order
    recvs: dict[tuple[str, int, int], list[dict]] = defaultdict(list)
    kinds: dict[tuple[int, str], set[str]] = defaultdict(set)
    for rank, ops in records.items():
        for op in ops:
            kinds[(rank, op["comm"])].add(op["kind"])
            if op["kind"] == "send":
                sends[(op["comm"], rank, op["peer"])].append(op)
            else:
                recvs[(op["comm"], op["peer"], rank)].append(op)
    for (rank, comm), both in sorted(kinds.items()):
        if len(both) > 1:
            found.append(f"rank {rank}: communicator {comm} carries sends and receives on one stream (a send can "
                         f"wait behind a receive under NCCL's rendezvous)")
    for key in sorted(set(sends) | set(recvs)):
        comm, src, dst = key
        out, into = sends.get(key, []), recvs.get(key, [])
        if len(out) != len(into):
            found.append(f"communicator {comm}: rank {src} sent {len(out)} messages to rank {dst}, which received "
                         f"{len(into)}")
        for k, (s, r) in enumerate(zip(out, into)):
            if s["shapes"] != r["shapes"] or _message(s) is None or _message(s) != _message(r):
                found.append(f"communicator {comm}: message {k} from rank {src} to rank {dst} is sent by {s['at']} "
                             f"{s['shapes']} and received by {r['at']} {r['shapes']}")
                break
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pipedsl.runtime.comm_record DIR", file=sys.stderr)
        return 2
    records = load(args[0])
    if not records:
        print(f"error: no rank*.jsonl in {args[0]}", file=sys.stderr)
        return 2
    bad = problems(records)
    for line in bad:
        print(line)
    ops = sum(len(v) for v in records.values())
    comms = len({op["comm"] for v in records.values() for op in v})
    print(f"{len(records)} ranks, {ops} operations on {comms} communicators: "
          f"{'ok' if not bad else f'{len(bad)} problem(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
