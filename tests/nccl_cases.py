"""Rank functions run with NCCL's communicators and semantics on CPU (`PIPEDSL_P2P`, runtime/rendezvous.py): any
check of the suite, wrapped, by tests/runtime/test_nccl_transport.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

SWITCHES = ("PIPEDSL_P2P", "PIPEDSL_P2P_LAYOUT", "PIPEDSL_P2P_RECORD")


def under(mode: str, layout: str | None, record: str | None, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with `PIPEDSL_P2P=mode` (and the layout and record switches), restored after: the pool's
    workers outlive the check."""
    before = {k: os.environ.get(k) for k in SWITCHES}
    os.environ["PIPEDSL_P2P"] = mode
    for key, value in (("PIPEDSL_P2P_LAYOUT", layout), ("PIPEDSL_P2P_RECORD", record)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        return fn(*args)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ranked(rank: int, mode: str, layout: str | None, record: str | None, fn: Callable[..., Any], *args: Any) -> Any:
    """`under` for a check that takes its rank first (`RankPool.run`)."""
    return under(mode, layout, record, fn, rank, *args)


def by_rendezvous(rank: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """`fn(rank, *args)` under `PIPEDSL_P2P=rendezvous`, and how many messages this rank sent by rendezvous in it:
    proof that the emulation, not another transport, carried the pipeline's messages."""
    from pipedsl.runtime import rendezvous

    before = rendezvous.rendezvous_count
    out = ranked(rank, "rendezvous", None, None, fn, *args)
    return out, rendezvous.rendezvous_count - before


def transport_kind(rank: int) -> str:
    """The transport a pipeline over this world picks (after `under` has set the switches)."""
    import torch

    import pipedsl

    with pipedsl.Pipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], "1f1b", microbatches=2,
                          loss_fn=torch.nn.functional.mse_loss) as pipe:
        return type(pipe.channels.transport).__name__
