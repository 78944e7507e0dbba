"""Failures across ranks: what failed where, and how the other ranks learn about it.

A rank whose own work fails (user code, a shape mismatch, a non-finite loss) raises a
`RankFailure` naming its rank and instruction, and writes the message to the process
group's store before it exits.  Its peers then fail too — a receive from a rank that exited
errors at once ("connection closed"), a receive from a stuck rank at the process-group
timeout — and, finding the first rank's message in the store, raise an error that names it.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import Instr

_COUNT = "pipedsl/failures"


class RankFailure(PipeRuntimeError):  # noqa: N818 - a failure of one rank; the base says Error
    """An error on this rank, with where it happened (`rank`, `index`, `instr`).

    `peer_failure` is set when this rank stopped because another rank went away (the error
    came out of a receive or a collective), so the launcher can tell cause from consequence.
    """

    def __init__(self, message: str, rank: int, index: int | None = None, instr: Instr | None = None,
                 peer: int | None = None, peer_failure: bool = False) -> None:
        self.rank, self.index, self.instr, self.peer, self.peer_failure = rank, index, instr, peer, peer_failure
        super().__init__(message)


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
