"""The search for an encoder-decoder: dp × pp, ZeRO 0-3, schedule, microbatch, recomputation, unit split.

The same procedure as `plan/search.py` (cheap checks, a lower bound from the schedule's placement,
then simulation of each schedule's real compiled program best bound first until the bound passes
the `top`-th time), over what pipedsl's runtime runs for a Hugging Face encoder-decoder:

- tp = 1: `parallel/tp_hf.py` splits decoders in the Llama layout only, so seq2seq stages are
  never tensor-parallel (`runtime: …` is not even a candidate);
- eager attention (HF's T5 attention adds the relative position bias to the scores; its s²
  tensors are counted, `plan/encdec.py`), recomputation none or full (per layer);
- every program stage gets a contiguous run of units, split by the planner's balanced DP
  (`split="time"`, the default; `encdec_cost.py`), or as the runtime's `by="count"` /
  `by="params"` would.

`zero_table` answers "which ZeRO stage and layout" for several models and GPU counts: per ZeRO
stage the best layout that fits, or the least memory any layout would need.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pipedsl.errors import PipeDSLError
from pipedsl.ir import Op, Program
from pipedsl.library import builtin_names
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout
from pipedsl.plan.encdec import ENCDEC_RECOMPUTE, EncDecSpec
from pipedsl.plan.encdec_cost import EncDecStages, RankMemory, encdec_stage_costs, points, rank_memory, split_bounds
from pipedsl.plan.pipeline import compiled, is_searched, run_pipeline, simulation_sizes, stage_ranks
from pipedsl.plan.search import (
    MICROBATCH_SIZES,
    VARIANTS,
    LayoutError,
    Rejected,
    _placement_bound,
    _sharing,
    _skeleton,
    resharded_to_fit,
)
from pipedsl.simulate import Cost


@dataclass(frozen=True)
class EncDecEstimate:
    """A simulated layout of an encoder-decoder: time, throughput, every rank's memory, the unit split."""

    layout: Layout
    split: str  # "time", "count" or "params"
    bounds: tuple[int, ...]  # unit bounds of the program stages
    iteration: float  # seconds
    pipeline: float  # the simulated makespan alone
    tflops: float  # hardware TFLOP/s per GPU (the recomputed forward included)
    mfu: float  # model FLOPs / (time · peak)
    memory: RankMemory  # the fullest rank
    ranks: tuple[RankMemory, ...]
    stage_seconds: tuple[float, ...]  # F + B of one microbatch, per program stage
    comm: dict[str, float]  # seconds per iteration on rank 0: pp, dp, zero3

    @property
    def points(self) -> tuple[int, ...]:
        """`seq2seq_stages(model, n, points=…)` for this split."""
        return points(self.bounds)


@dataclass
class EncDecResult:
    model: EncDecSpec
    cluster: ClusterSpec
    ranked: list[EncDecEstimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    pruned: int = 0
    simulated: int = 0
    seconds: float = 0.0
    least_memory: float = float("inf")  # the least peak memory of any candidate (at least; the ones that fit too)


def encdec_layouts(spec: EncDecSpec, cluster: ClusterSpec, schedules: Iterable[str] | None = None,
                   zero: Iterable[int] = (0, 1, 2, 3), microbatch_sizes: Iterable[int] = MICROBATCH_SIZES,
                   recompute: Iterable[str] = ENCDEC_RECOMPUTE, pp: Iterable[int] | None = None,
                   grads: str = "bf16") -> list[Layout]:
    """Every candidate with dp · pp = cluster.gpus (tp = 1) and dp · M · microbatch = the global batch."""
    names = list(schedules) if schedules is not None else builtin_names()
    modes = list(recompute)
    for mode in modes:
        if mode not in ENCDEC_RECOMPUTE:
            raise PipeDSLError(f"encoder-decoders are planned with recomputation {' or '.join(ENCDEC_RECOMPUTE)}, "
                               f"got {mode!r}")
    N = cluster.gpus
    out = []
    for p in (_divisors(N) if pp is None else pp):
        if N % p:
            continue
        d = N // p
        for b in microbatch_sizes:
            if spec.global_batch % (d * b):
                continue
            M = spec.global_batch // (d * b)
            for name in (names if p > 1 else names[:1] if schedules is not None else ["1f1b"]):
                for params in VARIANTS.get(name, ((),)):
                    for z in (zero if d > 1 else (0,)):
                        for mode in modes:
                            out.append(Layout(d, p, 1, name, b, M, z, mode, "1d", params, grads))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Prepared:
    layout: Layout
    stages: EncDecStages
    ranks: tuple[RankMemory, ...]
    bound: float
    on_rank: dict[int, list[int]]


def _live(program: Program, per_stage: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per rank, the most microbatch-stages and the most activation bytes alive at once: a stage's bytes from its
    F to its B or W (`pipeline.peak_live`'s rule, in program order, which is the execution order); an overlapped
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


# × P microbatches: where `run_pipeline` starts its linear extension.  With stages of unequal cost a schedule needs
# more microbatches to reach its periodic steady state: extended from 2P and 3P, mT5-Base on 64 GPUs under looped BFS
# V=2 (M = 64) was predicted 14 % fast and Hanayo W=1 on 8 (M = 256) 2.2 % fast, under the placement bound; from 8P
# and 9P both equal the full simulation (tests/plan/test_encoder_decoder.py).
EXTEND_FROM = 8


def _fullest(ranks: Sequence[RankMemory]) -> RankMemory:
    return max(ranks, key=lambda m: m.total)


def _check_memory(cluster: ClusterSpec, memory: RankMemory, qualifier: str = "") -> None:
    usable = cluster.memory - cluster.reserved_memory
    if memory.total > usable:
        gb = 1e9
        st = memory.states
        raise LayoutError(f"out of memory: {qualifier}{memory.total / gb:.1f} GB > {usable / gb:.0f} GB usable on rank "
                          f"{memory.rank} (params {st.params / gb:.1f}, grads {st.grads / gb:.1f}, optimizer "
                          f"{st.optimizer / gb:.1f}, gradient buffer {memory.gradient_buffer / gb:.1f}, gathered "
                          f"{memory.gathered / gb:.1f}, activations {memory.activations / gb:.1f} for "
                          f"{memory.peak_live:g} live)")


def _stages(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, num_stages: int, replicas: int,
            split: str) -> EncDecStages:
    if num_stages > len(spec.units()):
        raise LayoutError(f"split: {len(spec.units())} units ({spec.encoder_layers} encoder and "
                          f"{spec.decoder_layers} decoder layers, 2 inputs, a head) cannot fill {num_stages} stages")
    bounds = split_bounds(spec, cluster, num_stages, split, layout.recompute)
    return encdec_stage_costs(spec, cluster, layout, bounds, replicas)


def _quick(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str,
           result: EncDecResult | None = None) -> float:
    """The cheap checks on the schedule's small program (peaks only grow with M), and the placement bound."""
    if layout.tp != 1:
        raise LayoutError("runtime: encoder-decoder stages are not tensor-parallel (parallel/tp_hf.py splits "
                          "Llama-layout decoders only)")
    if layout.dp * layout.microbatches * layout.microbatch != spec.global_batch:
        raise LayoutError(f"batch: dp {layout.dp} × M {layout.microbatches} × microbatch {layout.microbatch} "
                          f"!= global batch {spec.global_batch}")
    program = _skeleton(layout)
    stages = _stages(spec, cluster, layout, program.num_stages, program.num_replicas, split)
    on_rank = stage_ranks(program)
    at_least = [n * min((stages.activation[s] for s in on_rank[r]), default=0.0) for r, n in enumerate(program.peaks)]
    fullest = _fullest(rank_memory(stages, layout, on_rank, at_least, program.peaks, program.split_backward))
    if result is not None:
        result.least_memory = min(result.least_memory, fullest.total)
    if not is_searched(layout.schedule):  # a searched order's peaks come with the costs: checked in `_prepare`
        _check_memory(cluster, fullest, "at least ")
    return _placement_bound(program, stages.costs, layout.microbatches)


def _prepare(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str) -> _Prepared:
    P, M = layout.pp, layout.microbatches
    if is_searched(layout.schedule):  # placed without its order: `live_peaks` searches it under the costs
        program = _skeleton(layout)
    else:
        try:
            program = compiled(layout.schedule, P, simulation_sizes(M, P)[0], layout.params)
        except PipeDSLError as err:
            raise LayoutError(f"schedule: {err.message}") from None
    stages = _stages(spec, cluster, layout, program.num_stages, program.num_replicas, split)
    on_rank = stage_ranks(program)
    try:
        peaks, live = live_peaks(layout.schedule, P, M, layout.params, stages.activation,
                                 stages.costs.simulator_cost())
    except PipeDSLError as err:
        raise LayoutError(f"schedule: {err.message}") from None
    ranks = tuple(rank_memory(stages, layout, on_rank, live, peaks, program.split_backward))
    _check_memory(cluster, _fullest(ranks))
    return _Prepared(layout, stages, ranks, _placement_bound(program, stages.costs, M), on_rank)


def _finish(spec: EncDecSpec, cluster: ClusterSpec, prep: _Prepared, split: str) -> EncDecEstimate:
    layout, costs = prep.layout, prep.stages.costs
    run = run_pipeline(layout.schedule, layout.pp, layout.microbatches, layout.params, costs, _sharing(cluster, layout),
                       EXTEND_FROM)
    gpus, M = layout.gpus, layout.microbatches
    mine = prep.on_rank[0]
    comm = {"pp": 2 * M * len(mine) * costs.message if layout.pp > 1 else 0.0,
            "dp": sum(costs.reduce[s] + costs.after_step[s] for s in mine),
            "zero3": sum(M * costs.zero_gather[s] + costs.step_gather[s] for s in mine)}
    return EncDecEstimate(layout, split, prep.stages.bounds, run.iteration, run.pipeline,
                          spec.iteration_flops(layout.recompute) / run.iteration / gpus / 1e12,
                          spec.iteration_flops("none") / run.iteration / gpus / cluster.peak_flops,
                          _fullest(prep.ranks), prep.ranks,
                          tuple(f + b for f, b in zip(costs.F, costs.B)), comm)


def encdec_evaluate(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str = "time") -> EncDecEstimate:
    """Predict one layout with the units split `split` (ZeRO-3 on "auto": `search.resharded_to_fit`); `LayoutError`
    says why it cannot run."""
    def attempt(lay: Layout) -> _Prepared:
        _quick(spec, cluster, lay, split)
        return _prepare(spec, cluster, lay, split)
    return _finish(spec, cluster, resharded_to_fit(layout, attempt)[1], split)


def rank_key(e: EncDecEstimate) -> tuple[float, float, int]:
    """Predicted time; equal times (to 9 digits: microbatch sizes at pp 1 differ by rounding only) by the fullest
    GPU's memory, then by GPU count (as `search.rank_key`)."""
    return (float(f"{e.iteration:.9g}"), e.memory.total, e.layout.gpus)


def encdec_search(spec: EncDecSpec, cluster: ClusterSpec, top: int = 10, candidates: Sequence[Layout] | None = None,
                  split: str = "time", **space) -> EncDecResult:
    """Rank the layouts (`candidates`, or `encdec_layouts(spec, cluster, **space)`); the best `top` exactly."""
    began = time.perf_counter()
    result = EncDecResult(spec, cluster)
    bounded: list[tuple[float, int, Layout]] = []
    for i, layout in enumerate(candidates if candidates is not None else encdec_layouts(spec, cluster, **space)):
        try:
            layout, bound = resharded_to_fit(layout, lambda lay: _quick(spec, cluster, lay, split, result))
            bounded.append((bound, i, layout))
        except LayoutError as err:
            result.rejected.append(Rejected(layout, err.message))
    bounded.sort()
    for i, (bound, _, layout) in enumerate(bounded):
        if len(result.ranked) >= top and bound > result.ranked[top - 1].iteration:
            result.pruned = len(bounded) - i
            break
        try:
            layout, prep = resharded_to_fit(layout, lambda lay: _prepare(spec, cluster, lay, split))
        except LayoutError as err:
            result.rejected.append(Rejected(layout, err.message))
            continue
        if len(result.ranked) >= top and prep.bound > result.ranked[top - 1].iteration:
            continue
        result.ranked.append(_finish(spec, cluster, prep, split))
        result.simulated += 1
        result.ranked.sort(key=rank_key)
    result.ranked = result.ranked[:top]
    result.seconds = time.perf_counter() - began
    return result


# ------------------------------------------------------------------ which ZeRO stage


@dataclass(frozen=True)
class ZeroRow:
    """One model on one GPU count: the best layout of each ZeRO stage (None: nothing fits) and, per stage, the
    least memory any of its layouts needs."""

    model: EncDecSpec
    gpus: int
    per_zero: dict[int, EncDecEstimate | None]
    least_memory: dict[int, float]
    data_parallel: EncDecEstimate | None = None  # the best with pp = 1 (pure data parallelism, any ZeRO stage)
    data_parallel_least: float = float("inf")

    @property
    def best(self) -> EncDecEstimate | None:
        found = [e for e in self.per_zero.values() if e is not None]
        return min(found, key=rank_key) if found else None


def zero_table(specs: Sequence[EncDecSpec], cluster: ClusterSpec, gpu_counts: Sequence[int],
               zero: Sequence[int] = (0, 1, 2, 3), **space) -> list[ZeroRow]:
    """For each model and GPU count, the best layout of each ZeRO stage (ZeRO 1-3 only with dp > 1), and the best
    pure data-parallel one (pp = 1, the layout ZeRO is usually run with)."""
    rows = []
    for spec in specs:
        for n in gpu_counts:
            c = cluster.with_gpus(n)
            per_zero: dict[int, EncDecEstimate | None] = {}
            least: dict[int, float] = {}
            for z in zero:
                found = encdec_search(spec, c, top=1, zero=(z,), **space)
                per_zero[z] = found.ranked[0] if found.ranked else None
                least[z] = found.least_memory
            flat = encdec_search(spec, c, top=1, zero=tuple(zero), pp=[1], **space)
            rows.append(ZeroRow(spec, n, per_zero, least, flat.ranked[0] if flat.ranked else None, flat.least_memory))
    return rows
