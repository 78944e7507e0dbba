"""The runtime's dictionary keys, with named fields: which microbatch, stage, replica or shape kind a key is about.

Bare tuples came in several orders — (microbatch, stage, replica) for activations, (op, microbatch, stage,
replica) for messages, (shape kind, replica, stage) for the shapes learned per input shape, (replica, stage) for
`Program.placement` — so a swapped pair of fields was a silent miss or a wrong hit.  These are named
tuples: they hash and compare as the plain tuple of their fields in the order declared here, and cost
what a tuple costs to look up.  Read them by name (`key.stage`).  Build them by name
(`Slot(microbatch=m, stage=s, replica=c)`), or positionally in the executor's per-instruction paths
(keyword construction is slower), always in the declared order.

`Copy` keeps `Program.placement`'s order (replica, stage), so `placement[Copy(replica=c, stage=s)]`
reads the compiler's IR, keyed by plain (replica, stage) tuples, as it is.
"""

from __future__ import annotations

from typing import NamedTuple


class Copy(NamedTuple):
    """One copy of a stage (replicas: Chimera's copies of every stage); `Program.placement`'s key order."""

    replica: int
    stage: int


class Slot(NamedTuple):
    """One microbatch on one stage copy: its activation, its gradient's receive buffers, the tensors handed to it
    by a stage on the same rank or waiting in a receive for it, the tensors it sends."""

    microbatch: int
    stage: int
    replica: int


class ShapeKey(NamedTuple):
    """One stage copy's tensors for the microbatches of one shape kind (the input and output
    metadata; kind k is the k-th distinct microbatch shape of a step)."""

    kind: int
    replica: int
    stage: int
