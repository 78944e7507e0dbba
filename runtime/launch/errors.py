"""Failures across ranks: what failed where, and how the other ranks learn about it.

A rank whose own work fails (user code, a shape mismatch, a non-finite loss) raises a
`RankFailure` naming its rank and instruction, and writes the message to the process
group's store before it exits.  Its peers then fail too — a receive from a rank that exited
errors at once ("connection closed"), a receive from a stuck rank at the process-group
timeout — and, finding the first rank's message in the store, raise an error that names it.

A rank's own failure keeps the user's part of its traceback (`trace`, user_traceback.py), so
the report shows the line of the user's model that raised, not only its message.  Telling
cause from consequence matters because every rank fails in the end: an error that says a peer
went away (`is_consequence`) never outranks one raised by a rank's own work.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from pipedsl.errors import PipeDSLError, PipeRuntimeError
from pipedsl.ir import RECVS, SENDS, Instr
from pipedsl.runtime.launch.tracebacks import Trace, exception_line, trace_of

_COUNT = "pipedsl/failures"
# what gloo, NCCL and the TCP store say when the other side of a connection went away or went silent
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
              "timed out waiting", "connection refused", "remote worker crashing", "nccl communicator was aborted")


class RankFailure(PipeRuntimeError):  # noqa: N818 - a failure of one rank; the base says Error
    """An error on this rank, with where it happened (`rank`, `index`, `instr`).

    `peer_failure` is set when this rank stopped because another rank went away (the error
    came out of a receive or a collective), so the launcher can tell cause from consequence.
    `trace` is the user's part of the traceback of the error this one wraps (rendered after the message).
    """

    def __init__(self, message: str, rank: int, index: int | None = None, instr: Instr | None = None,
                 peer: int | None = None, peer_failure: bool = False, trace: Trace | None = None) -> None:
        self.rank, self.index, self.instr, self.peer, self.peer_failure = rank, index, instr, peer, peer_failure
        self.trace = trace
        super().__init__(message)

    def render(self) -> str:
        if self.trace is None:
            return super().render()
        lines = [f"{self.kind}: {self.message}", *(f"  {line}" for line in self.trace.lines())]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def failure_at(rank: int, index: int, instr: Instr, err: BaseException) -> RankFailure:
    """`err`, raised while rank `rank` ran instruction `index`, as a RankFailure with the user's traceback.

    A lost connection (a send to a rank that exited, say) is marked a peer failure, to be explained
    by the rank that exited, not reported as this rank's own.
    """
    peer = instr.peer if instr.op in SENDS or instr.op in RECVS else None
    return RankFailure(f"rank {rank} instruction {index} ({instr}): {exception_line(err)}", rank, index, instr,
                       peer=peer, peer_failure=is_consequence(err), trace=trace_of(err))


def is_consequence(err: BaseException) -> bool:
    """Did this error come from a peer going away (a lost connection, a timeout), not from this rank's work?"""
    if isinstance(err, RankFailure):
        return err.peer_failure
    if isinstance(err, PipeDSLError):
        return False
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:  # the error, and the errors it was raised from
        seen.add(id(e))
        if isinstance(e, getattr(dist, "DistNetworkError", ())) or any(p in str(e).lower() for p in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (not initialised, or a custom backend)
        return None


def record_failure(rank: int, message: str) -> None:
    """Tell the other ranks (best effort: the store may be gone with rank 0)."""
    store = _store()
    if store is None:
        return
    try:
        n = store.add(_COUNT, 1)
        store.set(f"{_COUNT}/{n}", f"{rank}\n{message}")
    except Exception:  # noqa: BLE001
        pass


def first_failure(wait: float = 2.0) -> tuple[int, str] | None:
    """The first failure another rank recorded, waiting up to `wait` seconds for one to appear."""
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait
    try:
        while True:
            if store.add(_COUNT, 0) > 0 and store.check([f"{_COUNT}/1"]):
                rank, _, message = store.get(f"{_COUNT}/1").decode().partition("\n")
                return int(rank), message
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went away (its host, rank 0, died)
        return None


def forget_failures(store: dist.Store) -> None:
    """Clear the recorded failures, for a world that outlives a run (the test pool's `same_world`): the next run's
    `first_failure` must not name a rank that failed in an earlier one."""
    for n in range(1, store.add(_COUNT, 0) + 1):
        store.delete_key(f"{_COUNT}/{n}")
    store.delete_key(_COUNT)


def failure_order(store: dist.Store) -> list[int]:
    """The ranks that recorded a failure of their own, first one first (the launcher reads its store)."""
    ranks: list[int] = []
    try:
        for n in range(1, store.add(_COUNT, 0) + 1):
            if not store.check([f"{_COUNT}/{n}"]):  # counted, not yet written (its rank died in between)
                continue
            rank = int(store.get(f"{_COUNT}/{n}").decode().partition("\n")[0])
            if rank not in ranks:
                ranks.append(rank)
    except Exception:  # noqa: BLE001 - the store is closing: the ranks read so far stand
        pass
    return ranks


def explain_peer_failure(err: RankFailure) -> RankFailure:
    """This rank stopped because of another: name that rank and its error if it recorded one."""
    found = first_failure()
    if found is not None and found[0] != err.rank:
        rank, message = found
        text = f"rank {err.rank} stopped because rank {rank} failed: {message}\n  (rank {err.rank}: {err.message})"
        cause = rank
    else:
        who = f"rank {err.peer}" if err.peer is not None else "another rank"
        text = f"{err.message}\n  ({who} is gone or stuck; see its own error)"
        cause = err.peer
    return RankFailure(text, err.rank, err.index, err.instr, peer=cause, peer_failure=True)
