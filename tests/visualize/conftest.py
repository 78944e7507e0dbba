"""Small schedules of every shape the renderers must handle, independent of the built-in files.

GPipe and 1F1B are built in; the split-backward, interleaved and two-replica schedules are
written here so these tests do not depend on schedules other people are still adding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def pipes(tmp_path_factory) -> dict[str, str]:
    """Paths of the local test schedules by short name: split, interleaved, replicas."""
    folder: Path = tmp_path_factory.mktemp("pipes")
    paths = {}
    for name, text in (("split", SPLIT), ("interleaved", INTERLEAVED), ("replicas", REPLICAS)):
        path = folder / f"{name}.pipe"
        path.write_text(text)
        paths[name] = str(path)
    return paths


def simulated(name: str, P: int, M: int, **params: int) -> pipedsl.Timeline:
    """A schedule at P, M under the default cost (F=1, B=2, I=W=1)."""
    return pipedsl.simulate(pipedsl.load(name).compile(P=P, M=M, **params), pipedsl.Cost(F=1, B=2, I=1, W=1))
