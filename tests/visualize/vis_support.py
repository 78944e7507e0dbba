"""Shared by the visualize tests: small schedules of every shape, and the one golden grid reused.

GPipe and 1F1B are built in; the split-backward, interleaved and two-replica schedules are
written here so these tests do not depend on schedules other people are still adding.
(A uniquely named module rather than `conftest`, which several test folders have.)
"""

from __future__ import annotations

import pipedsl

SPLIT = """
schedule Split(P, M) {
  doc "1F1B with the backward split into I and W; rank r runs each W r backwards after its I"
  stages P
  place s
  order F by m
  order B by m
  warmup min(P - r - 1, M)
  wlag r
}
"""

INTERLEAVED = """
schedule Interleaved(P, M, V = 2) {
  doc "Megatron interleaved 1F1B"
  require M % P == 0 : "microbatches must be a multiple of ranks"
  stages P * V
  place s % P
  order F by (m / P, v, m % P)
  order B by (m / P, V - 1 - v, m % P)
  warmup min((V - 1) * P + 2 * (P - 1 - r), V * M)
}
"""

REPLICAS = """
schedule Bidirectional(P, M) {
  doc "two replicas in opposite directions, GPipe order: first half of microbatches down, second half up"
  replicas 2
  route if m < M / 2 then 0 else 1
  stages P
  place if c == 0 then s else P - 1 - s
  order F by m
  order B by m
  warmup M
}
"""



def simulated(name: str, P: int, M: int, **params: int) -> pipedsl.Timeline:
    """A schedule at P, M under the default cost (F=1, B=2, I=W=1)."""
    return pipedsl.simulate(pipedsl.load(name).compile(P=P, M=M, **params), pipedsl.Cost(F=1, B=2, I=1, W=1))


# 1F1B, P=2, M=2, written by hand from the definition.  Rank 0: warmup 1 -> F0 F1 B0 B1;
# rank 1: warmup 0 -> F0 B0 F1 B1.
# r0: F0 [0,1] F1 [1,2] (waits for r1's B0) B0 [4,6] (waits for r1's B1) B1 [7,9]
# r1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]                makespan 9, busy 6 + 6 of 18.
# Drawn 32 characters wide: 27 columns, 3 per time unit.
ONE_F_ONE_B_3_PER_UNIT = """\
1F1B  P=2 M=2
r0 |F0-F1-......B0----...B1----|
r1 |...F0-B0----F1-B1----......|
    0                         9
makespan 9  bubble 33.3%  peak activations 2 1
F forward  B backward  (number = microbatch)  . idle
"""
