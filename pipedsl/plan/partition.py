"""Contiguous partitions of weighted units into stages: the exact DPs the runtime's splits and the planner share.

A stage is a run of consecutive units (layers, an embedding, a head); its weight is the sum of its
units' (parameters, or seconds).  `balanced_sizes` minimises the heaviest stage; `even_sizes`, among
those, the spread (Σ stage²).  Both may be held to the splits where every stage `fits` (what its rank's memory
holds: plan/recut.py).  `bounds_of` turns sizes into unit boundaries [0, …, L].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import accumulate

from pipedsl.errors import PipeDSLError

# (stage, first unit, end unit) -> whether the stage may hold those units; a part that fits still fits with fewer
Fits = Callable[[int, int, int], bool]


def balanced_sizes(weights: Sequence[float], n: int, fits: Fits | None = None) -> list[int]:
    """Sizes of `n` contiguous non-empty parts of `weights` minimising the heaviest part (exact DP; ties go
    to the earliest cut), among the splits where every part `fits` (all, without it; an error when none does).
    `split_sequential(by="params")` and the seq2seq/causal stages' `by="params"` cut with it, so the planner's
    "params" split is the runtime's."""
    L = len(weights)
    if not 1 <= n <= L:
        raise PipeDSLError(f"cannot split {L} units into {n} non-empty stages")
    if fits is not None and not _coverable(L, n, fits):
        raise PipeDSLError(f"no split of {L} units into {n} stages fits")
    prefix = _prefix(weights)

    def parts(i: int, k: int) -> Iterator[tuple[int, float]]:  # (cut j, part j:i) in the order ties favour
        first = k - 1
        if fits is not None:  # the longest part j:i that fits: fewer units fit too
            first = i
            while first > k - 1 and fits(k - 1, first - 1, i):
                first -= 1
        for j in range(first, i):
            yield j, prefix[i] - prefix[j]

    return _cheapest(L, n, parts, max)


def even_sizes(weights: Sequence[float], n: int, fits: Fits | None = None) -> list[int]:
    """Among the splits of `weights` into `n` contiguous parts whose heaviest part is the least possible
    (`balanced_sizes`, under the same `fits`), the most even one: the least Σ part² (a second exact DP, capped
    at that heaviest part).  The slowest stage sets a pipeline's pace, but when one unit is the bottleneck (a
    250k-vocabulary head) many splits share it, and with several stages a rank (interleaved, V-shapes) the even
    one keeps the ranks even."""
    sizes = balanced_sizes(weights, n, fits)
    prefix = _prefix(weights)
    edges = bounds_of(sizes)
    cap = max(prefix[b] - prefix[a] for a, b in zip(edges, edges[1:])) * (1 + 1e-9)

    def parts(i: int, k: int) -> Iterator[tuple[int, float]]:
        for j in range(i - 1, k - 2, -1):  # the part j:i grows as j falls: stop past the cap
            part = prefix[i] - prefix[j]
            if part > cap or (fits is not None and not fits(k - 1, j, i)):  # longer parts neither
                return
            yield j, part

    return _cheapest(len(weights), n, parts, lambda before, part: before + part * part)


def _coverable(L: int, n: int, fits: Fits) -> bool:
    """Whether some split of L units into n non-empty parts fits (exact, O(n·L) calls of `fits`): the ends part k
    can reach from each start part k−1 reached.  From a later start a part reaches at least as far (fewer units fit
    too), so one pointer sweeps each part's ends."""
    reached = [True] + [False] * L  # after the parts so far: which unit counts their split can end at
    for k in range(n):
        opens = [0] * (L + 2)  # a difference array of the ends part k reaches
        end = 0
        for a in range(L):
            if not reached[a]:
                continue
            end = max(end, a)
            while end < L and fits(k, a, end + 1):
                end += 1
            if end > a:
                opens[a + 1] += 1
                opens[end + 1] -= 1
        running, reached = 0, [False] * (L + 1)
        for i in range(1, L + 1):
            running += opens[i]
            reached[i] = running > 0
    return reached[L]


def _prefix(weights: Sequence[float]) -> list[float]:
    return list(accumulate(weights, initial=0.0))


def _cheapest(L: int, n: int, parts: Callable[[int, int], Iterator[tuple[int, float]]],
              combine: Callable[[float, float], float]) -> list[int]:
    """The DP both splits share: best[k][i], the cheapest cost of the first i units in k parts, where a split's
    cost is `combine`(the cost before the last part, the last part's weight); the sizes of the cheapest split."""
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        row, prev = best[k], best[k - 1]
        for i in range(k, L - (n - k) + 1):
            for j, part in parts(i, k):
                cost = combine(prev[j], part)
                if cost < row[i]:
                    row[i], cut[k][i] = cost, j
    if best[n][L] == inf:
        raise PipeDSLError(f"no split of {L} units into {n} stages fits")
    sizes, i = [], L
    for k in range(n, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def bounds_of(sizes: Sequence[int]) -> tuple[int, ...]:
    """Stage sizes as unit boundaries: [2, 3] → (0, 2, 5)."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return tuple(out)


KINDS = ("F", "B", "I", "W")  # the compute kinds a stage's measured costs split among its units


def unit_costs(stage_costs: Mapping[int, Mapping[str, float]], unit_seconds: Mapping[int, float],
               bounds: Sequence[int]) -> list[dict[str, float]]:
    """Each unit's share of its stage's measured op times: stage s (units bounds[s] … bounds[s+1]−1) costs
    `stage_costs[s]` ({"F": …, "I": …, "W": …} a microbatch, `Cost.fit(timeline).per_stage`), split among its
    units in proportion to their measured forward seconds (`unit_seconds`, runtime/unit_clock.py).  What is
    the stage's own beyond its units (the loss after the head) goes with them in proportion."""
    out: list[dict[str, float]] = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        times = [max(unit_seconds.get(u, 0.0), 0.0) for u in range(a, b)]
        total = sum(times)
        shares = [t / total for t in times] if total > 0 else [1.0 / (b - a)] * (b - a)
        costs = stage_costs.get(s, {})
        out += [{k: costs[k] * share for k in KINDS if k in costs} for share in shares]
    return out


def stage_costs_of(per_unit: Sequence[Mapping[str, float]], bounds: Sequence[int]) -> dict[int, dict[str, float]]:
    """{stage: {kind: seconds}} of a partition (`bounds`) from per-unit costs (`unit_costs`)."""
    return {s: {k: sum(per_unit[u].get(k, 0.0) for u in range(a, b)) for k in KINDS
                if any(k in per_unit[u] for u in range(a, b))}
            for s, (a, b) in enumerate(zip(bounds, bounds[1:]))}
