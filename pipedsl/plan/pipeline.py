"""One pipeline of a layout, simulated on the schedule's real compiled program.

Every data-parallel replica runs the same program with the same costs, so one pipeline is
simulated (`pipedsl.simulate`), not the cluster.  Programs are compiled once per
(schedule, P, M, parameters) and simulations cached per cost.

Large M: the schedules are periodic in the steady state, so the makespan and the peak live
activations are affine in M once M is past the warmup.  For M beyond `M_CAP_FACTOR`·P + P the
pipeline is simulated at two sizes M₁ < M₂ ≡ M (mod P) past the warmup and both are extended
linearly; tests/plan/test_plan_parts.py checks this against the full simulation (relative error
below 1e-9 for six built-in schedules at P=4, M=24).  A third size M₂ + P checks that the iteration
grows by the same step: where it does not (ZB-V under an MoE model's stage costs), M is simulated
itself (tests/plan/test_moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache

from pipedsl.errors import PipeDSLError
from pipedsl.ir import RECVS, SENDS, Instr, Op, Program
from pipedsl.library import load
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout, LayoutError
from pipedsl.plan.cost import StageCosts
from pipedsl.plan.shared_host import shared_dry_run
from pipedsl.simulate import Cost, simulate, simulated_timeline
from pipedsl.timeline import Timeline

M_CAP_FACTOR = 2  # simulate at most ~4P microbatches
AFFINE_RTOL = 1e-6  # a linear extension's check: two steps of P microbatches add the same time (ZB-V's did not)
BACKGROUND_ROUNDS = 4  # replays to settle how much of the time the node's other pipelines compute


@cache
def _schedule(name: str):
    return load(name)


@lru_cache(maxsize=256)  # asked for every candidate; a schedule's kind is fixed once loaded (`_schedule`)
def is_searched(schedule: str) -> bool:
    """Whether the schedule's order is searched from costs (`order auto`): its program comes with a layout's costs."""
    return _schedule(schedule).searched


@lru_cache(maxsize=1024)
def _compiled_or_error(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...]) -> Program | PipeDSLError:
    try:
        return _schedule(schedule).compile(P=P, M=M, **dict(params))
    except PipeDSLError as err:  # cached too: a requirement fails the same way every time
        return err


def compiled(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...] = (), cost: Cost | None = None
             ) -> Program:
    """The schedule's program for P ranks and M microbatches (cached; raises PipeDSLError).  A searched schedule
    (`order auto`: zb-auto) is searched under `cost`, the layout's own stage costs, as it would run; without one,
    under `Cost()`."""
    if cost is None or not is_searched(schedule):
        return _raised(_compiled_or_error(schedule, P, M, params))
    return _raised(_searched_or_error(schedule, P, M, params, _cost_key(cost)))


@lru_cache(maxsize=256)
def _searched_or_error(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...],
                       cost: tuple) -> Program | PipeDSLError:
    """`compiled` of a searched schedule under the costs `cost` stands for (`_cost_key`)."""
    fields, per_stage = cost
    searched_under = Cost(**dict(fields), per_stage={s: dict(c) for s, c in per_stage})
    try:
        return _schedule(schedule).compile(P=P, M=M, cost=searched_under, **dict(params))
    except PipeDSLError as err:
        return err


def _cost_key(cost: Cost) -> tuple:
    """`cost` as a hashable key: its fields, and its per-stage costs (a dict) as sorted pairs."""
    return (tuple(sorted((k, v) for k, v in vars(cost).items() if k != "per_stage")),
            tuple(sorted((s, tuple(sorted(c.items()))) for s, c in cost.per_stage.items())))


def _raised(out):
    """A cached result, or its cached error raised again."""
    if isinstance(out, PipeDSLError):
        raise out
    return out


@lru_cache(maxsize=1024)
def compiled_peaks(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...] = (),
                   wmem: float = 1.0) -> tuple[float, ...]:
    """`peak_live` of `compiled(...)`, cached."""
    return tuple(peak_live(compiled(schedule, P, M, params), wmem))


def program_peaks(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...] = (),
                  cost: Cost | None = None, wmem: float = 1.0) -> tuple[float, ...]:
    """Per rank, the peak live stage activations of the schedule at M (extended linearly past the cap), a pending W
    counted at `wmem` of one; a searched schedule's as searched under `cost` (`compiled`), at its `Cost.wmem`."""
    if cost is not None and is_searched(schedule):
        return _extended_peaks(M, P, [tuple(peak_live(compiled(schedule, P, m, params, cost), cost.wmem))
                                      for m in simulation_sizes(M, P)])
    if wmem != 1 and not compiled(schedule, P, simulation_sizes(M, P)[0], params).split_backward:
        wmem = 1.0  # no W: the same peaks, one cache entry
    return _program_peaks(schedule, P, M, params, wmem)


@lru_cache(maxsize=512)
def _program_peaks(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...],
                   wmem: float = 1.0) -> tuple[float, ...]:
    return _extended_peaks(M, P, [compiled_peaks(schedule, P, m, params, wmem) for m in simulation_sizes(M, P)])


def _extended_peaks(M: int, P: int, peaks: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The peaks at the simulated sizes, extended linearly to M."""
    sizes = simulation_sizes(M, P)
    if len(peaks) == 1:
        return tuple(map(float, peaks[0]))
    k = (M - sizes[0]) / (sizes[1] - sizes[0])
    return tuple(a + k * (b - a) for a, b in zip(*peaks))


def peak_live(program: Program, wmem: float = 1.0) -> list[float]:
    """Per rank, the most stage activations alive at once: `Timeline.peak_activations`' rule (1 from F
    to its B, or to its I when split and `wmem` from I to W) read off the program order, which is the
    execution order."""
    return [_peak((ins.op for ins in stream), wmem) for stream in program.ranks]


def _peak(ops: Iterable[Op], wmem: float = 1.0) -> float:
    live = peak = 0.0
    for op in ops:
        if op is Op.F:
            live += 1
            peak = max(peak, live)
        elif op is Op.B:
            live -= 1
        elif op is Op.I:
            live -= 1 - wmem
            peak = max(peak, live)  # a pending W may hold more than its activation (wmem > 1)
        elif op is Op.W:
            live -= wmem
    return peak


@dataclass(frozen=True)
class Skeleton:
    """A schedule at one size as its plan gives it — placement and compute orders, not lowered or
    validated: what the search's early bounds need, at a fraction of a compile's cost."""

    num_stages: int
    num_replicas: int
    num_ranks: int
    placement: dict[tuple[int, int], int]
    split_backward: bool
    peaks: tuple[float, ...]  # `peak_live` of the compiled program (its compute order is the plan's)
    ops: tuple[tuple[Op, ...], ...]  # each rank's compute order
    _at: dict[float, tuple[float, ...]] = field(default_factory=dict, compare=False, repr=False)  # peaks_at's
    _ranks: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)  # stage_ranks'

    def peaks_at(self, wmem: float) -> tuple[float, ...]:
        """`peaks` with a pending W counted at `wmem` of an activation (once per share: the search asks often)."""
        if wmem == 1 or not self.split_backward:
            return self.peaks
        if wmem not in self._at:
            self._at[wmem] = tuple(_peak(ops, wmem) for ops in self.ops)
        return self._at[wmem]


@lru_cache(maxsize=1024)
def _skeleton_or_error(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...]) -> Skeleton | PipeDSLError:
    try:
        plan = _schedule(schedule).plan(P=P, M=M, **dict(params))
    except PipeDSLError as err:
        return err
    return Skeleton(plan.num_stages, plan.num_replicas, len(plan.orders), dict(plan.placement),
                    any(entry[0] is Op.I for order in plan.orders for entry in order),
                    tuple(_peak(entry[0] for entry in order) for order in plan.orders),
                    tuple(tuple(entry[0] for entry in order) for order in plan.orders))


def skeleton(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...] = ()) -> Skeleton:
    """The schedule's `Skeleton` for P ranks and M microbatches (cached; raises PipeDSLError)."""
    return _raised(_skeleton_or_error(schedule, P, M, params))


@dataclass(frozen=True)
class PipelineRun:
    """What one simulated iteration gives: time, per-rank peaks, and the per-rank stage sets."""

    iteration: float  # seconds: pipeline + exposed gradient reduction + optimizer step
    pipeline: float  # the simulated makespan alone
    peak_live: tuple[float, ...]  # per rank
    busy: float  # the busiest rank's compute seconds


def simulation_sizes(M: int, P: int, factor: int = M_CAP_FACTOR) -> tuple[int, ...]:
    """Microbatch counts to simulate for M: (M,) if small, else (M₁, M₁ + P) with M₁ ≡ M (mod P), M₁ ≥ factor·P."""
    cap = factor * P
    if M <= cap + P:
        return (M,)
    m1 = cap + (M - cap) % P
    return (m1, m1 + P)


def stage_ranks(program: Program | Skeleton) -> dict[int, list[int]]:
    """Rank -> the program stages placed on it (copies on one rank share one module).  A (cached) skeleton's are
    worked out once, as the search asks for them for every candidate: its callers only read them."""
    if not isinstance(program, Skeleton):
        return _stage_ranks(program)
    if not program._ranks:
        program._ranks.update(_stage_ranks(program))
    return program._ranks


def _stage_ranks(program: Program | Skeleton) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {r: [] for r in range(program.num_ranks)}
    for (_, s), r in sorted(program.placement.items()):
        if s not in out[r]:
            out[r].append(s)
    return out


def iteration_time(timeline: Timeline, program: Program, costs: StageCosts) -> float:
    """Makespan with the data-parallel reduction as the runtime overlaps it: each stage's
    collective starts at its REDUCE_GRAD (after the previous one on that rank) and runs behind
    the rest of the cooldown; the optimizer step waits for all of them, then ZeRO 1-2 gather."""
    return _Replay.of(timeline).iteration(stage_ranks(program), costs)


@dataclass(frozen=True)
class _Replay:
    """What the iteration time reads of a simulated timeline: per rank, each REDUCE_GRAD's end and stage in order
    and its latest end; kept instead of the timeline, so that layouts whose simulations agree share one."""

    start: float
    makespan: float
    busy: float  # the busiest rank's compute seconds
    reduces: tuple[tuple[tuple[float, int], ...], ...]
    last: tuple[float, ...]

    @staticmethod
    def of(timeline: Timeline) -> _Replay:
        start = timeline.start
        reduces = tuple(tuple((e.end, e.instr.stage) for e in events if e.instr.op is Op.REDUCE_GRAD)
                        for events in timeline.ranks)
        last = tuple(max((e.end for e in events), default=start) for events in timeline.ranks)
        return _Replay(start, timeline.makespan, max(timeline.busy, default=0.0), reduces, last)

    def iteration(self, on_rank: dict[int, list[int]], costs: StageCosts) -> float:
        """`iteration_time` under `costs`' reductions and steps, in its order of sums."""
        finish = 0.0
        for r, (reduces, last) in enumerate(zip(self.reduces, self.last)):
            comm_free = 0.0
            for end, stage in reduces:
                comm_free = max(comm_free, end) + costs.reduce[stage]
            finish = max(finish, max(max(last, self.start), comm_free) + costs.once_a_step(on_rank[r]))
        return finish - self.start


REPLAY_CACHE = 2048  # simulations kept (`_replayed`): ZeRO stages and gradient dtypes often simulate alike
_replays: dict[tuple, _Replay] = {}


def _replayed(schedule: str, P: int, M: int, params: tuple, program: Program, cost: Cost, costs: StageCosts,
              sharing: tuple[float, float, float, float] | None) -> _Replay:
    """The simulation of `program` (the schedule's at P, M, `params`) under `cost` (`costs.simulator_cost()`), once
    per everything it depends on: the program, its cost, and where ranks share cores, the sharing and the stages'
    blocking waits."""
    waits = tuple(tuple(sorted(w.items())) for w in costs.waits) if sharing is not None else ()
    key = (schedule, P, M, params, _cost_key(cost), sharing, waits)
    found = _replays.get(key)
    if found is None:
        timeline = simulate(program, cost) if sharing is None else _shared_timeline(program, cost, costs, *sharing)
        if len(_replays) >= REPLAY_CACHE:
            del _replays[next(iter(_replays))]  # the oldest
        found = _replays[key] = _Replay.of(timeline)
    return found


def _run_exact(schedule: str, P: int, M: int, params: tuple, costs: StageCosts,
               sharing: tuple[float, float, float, float] | None) -> tuple[float, float, Sequence[float], float]:
    cost = costs.simulator_cost()
    program = compiled(schedule, P, M, params, cost)
    replay = _replayed(schedule, P, M, params, program, cost, costs, sharing)
    # a built-in order's peaks are its program's whatever the costs: read once (`compiled_peaks`)
    peaks = peak_live(program) if is_searched(schedule) else compiled_peaks(schedule, P, M, params)
    return replay.iteration(stage_ranks(program), costs), replay.makespan, peaks, replay.busy


def _shared_timeline(program: Program, cost: Cost, costs: StageCosts, cores: float, efficiency: float,
                     busy: float = 0.0, others: float = 0.0) -> Timeline:
    """The program replayed on `cores` shared processors (`shared_host`) beside `others` identical pipelines:
    an op's blocking collectives (`costs.waits`) take time, and a core for only the `busy` share of it.  The
    other pipelines compete for the cores the share of the time this one's ranks compute: while a tp pair
    waits in its collectives the others run faster, which a fixed share of the cores would not let them.
    That share is found by replaying again until it settles."""
    def work(ins: Instr) -> tuple[float, float]:
        if ins.sub is not None:  # an overlapped pair: its halves' work and waits
            halves = [work(x) for x in ins.sub]
            return sum(h[0] for h in halves), sum(h[1] for h in halves)
        total = cost.compute_time(ins)
        waits = costs.waits[ins.stage] if costs.waits and ins.stage is not None else {}
        wait = min(waits.get(ins.op.value, 0.0), total) * (1 - busy)
        return total - wait, wait

    computing = 1.0  # of the time, the share a rank occupies a core: at first, all of it
    for _ in range(BACKGROUND_ROUNDS):
        starts, ends = shared_dry_run(program, work, cost.message_time, cores, efficiency,
                                      others * program.num_ranks * computing)
        if not others:
            break
        makespan = max((e[-1] for e in ends if e), default=0.0)
        occupied = sum(end - start - work(ins)[1] for stream, s_r, e_r in zip(program.ranks, starts, ends)
                       for ins, start, end in zip(stream, s_r, e_r) if ins.op not in RECVS and ins.op not in SENDS)
        settled = occupied / (program.num_ranks * makespan) if makespan > 0 else 1.0
        if abs(settled - computing) < 0.01:
            break
        computing = settled
    return simulated_timeline(program, starts, ends, {"cores": cores})


def run_pipeline(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...], costs: StageCosts,
                 sharing: tuple[float, float, float, float] | None = None,
                 extend_from: int = M_CAP_FACTOR) -> PipelineRun:
    """Simulate (or extend linearly from two simulations from `extend_from`·P microbatches on) one
    pipeline's iteration; with `sharing` (the cores, their efficiency, a blocking collective's busy
    share, how many other pipelines share them), on processors its ranks share."""
    sizes = simulation_sizes(M, P, extend_from)
    runs = [_run_exact(schedule, P, m, params, costs, sharing) for m in sizes]
    if len(runs) == 1:
        it, mk, peaks, busy = runs[0]
        return PipelineRun(it, mk, tuple(map(float, peaks)), busy)
    (m1, m2), (a, b) = sizes, runs
    if m2 + P < M:  # a third size: extend only where the iteration grows by the same step twice (affine)
        c = _run_exact(schedule, P, m2 + P, params, costs, sharing)
        if abs((c[0] - b[0]) - (b[0] - a[0])) > AFFINE_RTOL * c[0]:
            it, mk, peaks, busy = _run_exact(schedule, P, M, params, costs, sharing)
            return PipelineRun(it, mk, tuple(map(float, peaks)), busy)
    k = (M - m1) / (m2 - m1)

    def extend(x: float, y: float) -> float:
        return x + k * (y - x)

    return PipelineRun(extend(a[0], b[0]), extend(a[1], b[1]),
                       tuple(extend(x, y) for x, y in zip(a[2], b[2])), extend(a[3], b[3]))


# ------------------------------------------------------------------ what every model kind's search asks of a layout


def layout_skeleton(layout: Layout) -> Skeleton:
    """The schedule at a small size (M = min(M, P)), planned but not compiled: placement, stages, early peaks."""
    P, M = layout.pp, layout.microbatches
    try:
        return skeleton(layout.schedule, P, min(M, P), layout.params)
    except PipeDSLError as err:
        if M <= P:
            raise LayoutError(f"schedule: {err.message}") from None
    try:  # a requirement the small size breaks but M meets
        return skeleton(layout.schedule, P, simulation_sizes(M, P)[0], layout.params)
    except PipeDSLError as err:
        raise LayoutError(f"schedule: {err.message}") from None


def placement_bound(program: Program | Skeleton, costs: StageCosts, M: int) -> float:
    """No schedule with this placement beats: for each rank, the forward chain that must run before
    its first stage can start (Σ F of the stages below), its own work, and the backward chain
    below its lowest stage that must follow its last backward (split: its last I — its W's may run
    meanwhile); plus the optimizer step.  For 1F1B with equal stages this is (M + P - 1)(F + B), its
    exact makespan; for ZB-H1 with F = I = W, M(F + I + W) + (P - 1)(F + I − W), its exact makespan too."""
    S = program.num_stages
    split = program.split_backward
    back = costs.I if split else costs.B
    below_f = [0.0] * (S + 1)
    below_b = [0.0] * (S + 1)
    for st in range(S):
        below_f[st + 1] = below_f[st] + costs.F[st]
        below_b[st + 1] = below_b[st] + back[st]
    share = M / program.num_replicas
    bound = 0.0
    for stages in stage_ranks(program).values():
        if not stages:
            continue
        lowest = min(stages)
        work = sum(costs.F[x] + (costs.I[x] + costs.W[x] if split else costs.B[x]) for x in stages) * share
        deferrable = sum(costs.W[x] for x in stages) * share if split else 0.0
        tail = costs.once_a_step(stages)
        bound = max(bound, below_f[lowest] + max(work, work - deferrable + below_b[lowest]) + tail)
    return bound


def sharing(cluster: ClusterSpec, layout: Layout) -> tuple[float, float, float, float] | None:
    """(the cores this pipeline's ranks share, their efficiency, the busy share of a blocking collective, how many
    other pipelines share them) where ranks share cores, else None: the node runs ranks / pp identical pipelines
    side by side (a tp group's ranks each count as one); a pipeline longer than a node gets its share of each."""
    ranks = cluster.shared_ranks(layout.gpus)
    if not ranks:
        return None
    pipelines = ranks / layout.pp
    if pipelines <= 1:
        return cluster.cores_per_node * layout.pp / ranks, cluster.sharing_efficiency, cluster.collective_busy, 0.0
    return cluster.cores_per_node, cluster.sharing_efficiency, cluster.collective_busy, pipelines - 1


def _live(program: Program, per_stage: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per rank, the most microbatch-stages and the most activation bytes alive at once: a stage's bytes from its
    F to its B or W (`peak_live`'s rule, in program order, which is the execution order); an overlapped
    F&B pair adds its forward before its backward frees."""
    counts, sizes = [], []
    for stream in program.ranks:
        live = peak = held = most = 0.0
        for ins in stream:
            for part in ins.parts:
                if part.op is Op.F:
                    live, held = live + 1, held + per_stage[part.stage]
                    peak, most = max(peak, live), max(most, held)
                elif part.op is Op.B or part.op is Op.W:
                    live, held = live - 1, held - per_stage[part.stage]
        counts.append(peak)
        sizes.append(most)
    return counts, sizes


def live_peaks(schedule: str, P: int, M: int, params: tuple[tuple[str, int], ...],
               per_stage: Sequence[float], cost: Cost | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`_live` of the schedule's program at M, extended linearly past the simulated sizes (as `program_peaks`); a
    searched schedule's as searched under `cost`."""
    sizes = simulation_sizes(M, P)
    runs = [_live(compiled(schedule, P, m, params, cost), per_stage) for m in sizes]
    if len(runs) == 1:
        return tuple(runs[0][0]), tuple(runs[0][1])
    k = (M - sizes[0]) / (sizes[1] - sizes[0])
    (c1, b1), (c2, b2) = runs
    return tuple(a + k * (b - a) for a, b in zip(c1, c2)), tuple(a + k * (b - a) for a, b in zip(b1, b2))
