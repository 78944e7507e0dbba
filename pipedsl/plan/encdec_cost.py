"""An encoder-decoder's pipeline stages: which units each holds, what each costs, what each rank holds, and the
search's steps for one layout (`quick_bound`, `prepare`, `finish`, as `plan/search.py` takes them).

Units (`EncDecSpec.units`) are [encoder input, encoder layers…, decoder input, decoder layers…,
head], as `models/hf/seq2seq.py`'s `seq2seq_stages(model, n, by=…, points=…)` spreads them; a
split is the `points` where stages 1 … n−1 begin.  Three splits:

- "count": the runtime's default `by="count"` (⌈U/n⌉ units on the first U mod n stages);
- "params": the runtime's `by="params"`, the same exact DP as `models/split.py` on unit parameters;
- "time" (the planner's): the same DP on each unit's forward + backward seconds, minimising the
  slowest stage, which sets the pipeline's pace, then among the splits that reach it the most even
  (`even_sizes`); pass its points to `seq2seq_stages(points=…)`.

A stage's cost is the sum of its units' (`plan/cost.py`'s rules at tp = 1): GEMM FLOPs at
peak × efficiency, the memory-bound kernels streaming the bytes the unit stores, backward 2×
forward, full recomputation one more forward of each layer; split backward I = forward with the
attention core doubled, W = the GEMMs (the memory-bound part in each).  ZeRO-3 gathers each unit
on entry with the next one prefetched (`cost.prefetched`).  What crosses a boundary:

- inside the encoder part: hidden [b, S, d], the mask [b, S] and the decoder ids [b, T] (int64);
- inside the decoder part: hidden [b, T, d] + the encoder output [b, S, d] + the mask, each way
  (activations forward, gradients back) — every decoder stage relays the encoder output.

The simulator prices every message alike, so a layout's message is its largest boundary's.  The
shared embedding is a weight tied between the stage holding the encoder input and the one holding
the decoder input (`runtime/ties.py`): each copy has its own optimizer state, and the copies'
gradients are summed at the step end (ZeRO 0: an all-reduce of the full gradient over the holding
ranks of every replica; ZeRO 1-3: of the 1/dp slice over the two holding ranks), after the
data-parallel reduction.

Memory of a rank, at its peak (`RankMemory`): the model states of its stages (`memory.model_states`,
ZeRO 0-3 over dp), plus what the runtime keeps beyond them: under ZeRO 2/3 the full gradient
buffer of its stages from the first backward to REDUCE_GRAD (`parallel/zero.py`, reduce="step"),
under ZeRO-3 the gathered units (the running one and the next, prefetched; all of them during a W
of a split-backward schedule, `before_weight_pass`, and through the step with reshard="step"); and
activations: the most bytes alive at once on the rank, each stage's own per microbatch from its F
to its B (or W), walked over the schedule's compiled program (`live_peaks`; the
encoder output counted on decoder stages), plus one layer's whole activations while it is
recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pipedsl.errors import PipeDSLError
from pipedsl.ir import Op, Program
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout, LayoutError
from pipedsl.plan.cost import StageCosts, StageWork, UnitWork, pipeline_link, price_stages
from pipedsl.plan.encdec import ID_BYTES, EncDecSpec, Unit
from pipedsl.plan.memory import PARAM_BYTES, ModelStates, model_states, state_bytes
from pipedsl.plan.partition import balanced_sizes, bounds_of, even_sizes
from pipedsl.plan.pipeline import (
    compiled,
    is_searched,
    layout_skeleton,
    placement_bound,
    run_pipeline,
    sharing,
    simulation_sizes,
    stage_ranks,
)
from pipedsl.simulate import Cost

SPLITS = ("time", "count", "params")


# ------------------------------------------------------------------ splits


def unit_seconds(unit: Unit, cluster: ClusterSpec, samples: float = 1, recompute: str = "none") -> tuple[float, float]:
    """(forward, forward + backward) seconds of one unit on `samples` samples at tp = 1."""
    rate = cluster.peak_flops * cluster.gemm_efficiency
    stream = cluster.activation_passes / cluster.hbm_bandwidth
    fixed = cluster.layer_overhead / 3 if unit.layer else 0.0
    fwd = samples * (unit.flops / rate + unit.stored * stream) + fixed
    return fwd, (4 if recompute == "full" and unit.layer else 3) * fwd


def split_bounds(spec: EncDecSpec, cluster: ClusterSpec, stages: int, how: str = "time",
                 recompute: str = "none") -> tuple[int, ...]:
    """Unit bounds (0, first unit of stage 1, …, U) of `stages` program stages split `how` (see the module)."""
    return _split_bounds(spec, cluster, stages, how, recompute)


@lru_cache(maxsize=4096)
def _split_bounds(spec: EncDecSpec, cluster: ClusterSpec, stages: int, how: str, recompute: str) -> tuple[int, ...]:
    units = spec.units()
    U = len(units)
    if not 1 <= stages <= U:
        raise PipeDSLError(f"cannot split {U} units ({spec.encoder_layers} encoder and {spec.decoder_layers} decoder "
                           f"layers, 2 inputs, a head) into {stages} stages")
    if how == "count":
        return bounds_of([U // stages + (1 if i < U % stages else 0) for i in range(stages)])
    if how == "params":  # as the runtime counts a unit's module: the encoder's final norm (d) is in none of them
        d = spec.d_model
        return bounds_of(balanced_sizes([u.params - (d if u.kind == "decoder input" else 0) for u in units], stages))
    if how == "time":  # seconds are linear in the samples: one split for every microbatch size
        return bounds_of(even_sizes([unit_seconds(u, cluster, 1, recompute)[1] for u in units], stages))
    raise PipeDSLError(f"split is one of {', '.join(SPLITS)}, got {how!r}")


def points(bounds: Sequence[int]) -> tuple[int, ...]:
    """`seq2seq_stages(points=…)`: where stages 1 … n−1 begin."""
    return tuple(bounds[1:-1])


def stage_labels(spec: EncDecSpec, bounds: Sequence[int]) -> list[str]:
    """Per stage, its units in short: 'emb E0-E5', 'E23 dec-emb D0-D3', 'D20-D23 head'."""
    units = spec.units()
    out = []
    for a, b in zip(bounds, bounds[1:]):
        groups: list[list[Unit]] = []
        for u in units[a:b]:
            if groups and u.layer and groups[-1][-1].kind == u.kind:
                groups[-1].append(u)
            else:
                groups.append([u])
        out.append(" ".join(g[0].label if len(g) == 1 else f"{g[0].label}-{g[-1].label}" for g in groups))
    return out


# ------------------------------------------------------------------ costs


@dataclass(frozen=True)
class EncDecStages:
    """A layout's program stages: unit bounds, per-stage costs (`StageCosts`, for the simulator and the
    bound), and what memory needs per stage."""

    bounds: tuple[int, ...]
    costs: StageCosts
    activation: tuple[float, ...]  # bytes a stage keeps per live microbatch
    working: tuple[float, ...]  # bytes of one recomputed layer's whole activations (0 without recomputation)
    largest_units: tuple[float, ...]  # parameters of a stage's largest two consecutive units (ZeRO-3's gathers)
    message_bytes: float  # the largest boundary, forward


def boundary_bytes(spec: EncDecSpec, cut: int, b: int) -> float:
    """Bytes crossing the boundary before unit `cut`, per microbatch of `b` samples."""
    S, T, v, d = spec.source, spec.target, spec.value_bytes, spec.d_model
    in_decoder = cut > spec.encoder_layers + 1  # after the decoder input unit
    ids = ID_BYTES * b * S + (0 if in_decoder else ID_BYTES * b * T)  # the mask [b, S]; the decoder ids [b, T]
    hidden = v * b * d * ((T + S) if in_decoder else S)
    return hidden + ids


def encdec_stage_costs(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, bounds: Sequence[int],
                       replicas: int = 1) -> EncDecStages:
    """Costs of each program stage holding units `bounds[s]:bounds[s+1]` for `layout` (tp = 1) on `cluster`: its
    units summed one by one (`StageWork`), priced by the cost function of every model kind (`cost.price_stages`)."""
    units = spec.units()
    b, mode = layout.microbatch, layout.recompute
    pp_bw, pp_lat = pipeline_link(cluster, layout)
    cuts = list(bounds[1:-1])
    message_bytes = max((boundary_bytes(spec, c, b) for c in cuts), default=0.0)
    # the tied embedding: the stages holding the encoder input and the decoder input, if they differ
    holders = [s for s in range(len(bounds) - 1) for u in units[bounds[s]:bounds[s + 1]] if u.embedding]
    tied = len(set(holders)) > 1
    works, activation, working = [], [], []
    for st in range(len(bounds) - 1):
        mine = units[bounds[st]:bounds[st + 1]]
        works.append(_encdec_stage_work(spec, cluster, layout, mine, spec.embedding_params if tied and st in holders
                                        else 0))
        enc_out = b * spec.encoder_output_bytes if any(u.decoder_layer for u in mine) else 0.0
        kept = [b * (u.kept if mode == "full" else u.stored) for u in mine]
        activation.append(sum(kept) + enc_out)
        working.append(max((b * u.stored - k for u, k in zip(mine, kept) if u.layer), default=0.0)
                       if mode == "full" else 0.0)
    costs = price_stages(cluster, layout, works, pp_lat + message_bytes / pp_bw if cuts else 0.0, replicas)
    return EncDecStages(tuple(bounds), costs, tuple(activation), tuple(working), costs.unit_pairs, message_bytes)


def _encdec_stage_work(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, mine: Sequence[Unit],
                       tied: int) -> StageWork:
    """A stage's units summed one by one at tp = 1; a stage of decoder layers also streams the encoder output their
    cross-attention reads."""
    b, mode = layout.microbatch, layout.recompute
    rate = cluster.peak_flops * cluster.gemm_efficiency
    stream = cluster.activation_passes / cluster.hbm_bandwidth
    fwd_each, again_each, gemm_each, mem_each = [], [], [], []
    for u in mine:
        fwd, _ = unit_seconds(u, cluster, b, mode)
        fwd_each.append(fwd)
        again_each.append(fwd if mode == "full" and u.layer else 0.0)
        gemm_each.append(b * (u.flops - u.core) / rate)
        mem_each.append(b * u.stored * stream + (cluster.layer_overhead / 3 if u.layer else 0.0))
    decoder = any(u.decoder_layer for u in mine)
    enc_out_time = (b * spec.encoder_output_bytes if decoder else 0.0) * stream  # read like a stored tensor
    fwd = sum(fwd_each) + enc_out_time
    core = sum(b * u.core for u in mine) / rate
    gemm = sum(gemm_each)
    mem = sum(mem_each) + enc_out_time
    units = tuple(UnitWork(float(u.params), 0.0, f, 2 * f + a, f + a) for u, f, a in zip(mine, fwd_each, again_each))
    return StageWork(fwd, 0.0, gemm + 2 * core + mem, gemm + mem, recompute=sum(again_each),
                     params=float(sum(u.params for u in mine)), units=units, tied=tied)


# ------------------------------------------------------------------ memory


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak: model states between steps, what the runtime keeps beyond them during the step, and
    activations."""

    rank: int
    stages: tuple[int, ...]
    params_count: float  # parameters of its stages (a tied copy counts on each stage holding it)
    states: ModelStates  # `memory.model_states` over dp: between steps
    gradient_buffer: float  # ZeRO 2/3: the full gradient less the kept shard, first backward → REDUCE_GRAD
    gathered: float  # ZeRO-3: full parameters of the units gathered at once
    activations: float
    peak_live: float

    @property
    def total(self) -> float:
        return self.states.total + self.gradient_buffer + self.gathered + self.activations


def rank_memory(stages: EncDecStages, layout: Layout, on_rank: dict[int, list[int]], live_bytes: Sequence[float],
                peaks: Sequence[float], split_backward: bool) -> list[RankMemory]:
    """Every rank's `RankMemory` for a program whose ranks hold `on_rank` stages, keep at most `live_bytes` of
    activations at once and `peaks` live microbatch-stages."""
    mode = state_bytes("bf16", layout.grads)
    out = []
    for r, held in on_rank.items():
        if not held:
            continue
        psi = sum(stages.costs.stage_params[s] for s in held)
        states = model_states(psi, layout.dp, layout.zero, mode)
        buffer = mode.grad * psi * (1 - 1 / layout.dp) if layout.zero >= 2 else 0.0
        gathered = 0.0
        if layout.zero >= 3:  # beyond the shard it holds anyway
            whole = split_backward or layout.reshard == "step"  # a W gathers its stage first; "step" holds it
            gathered = PARAM_BYTES * (psi if whole else max(stages.largest_units[s] for s in held))
            gathered *= 1 - 1 / layout.dp
        act = live_bytes[r] + max(stages.working[s] for s in held)
        out.append(RankMemory(r, tuple(held), psi, states, buffer, gathered, act, peaks[r]))
    return out


# ------------------------------------------------------------------ one layout, as the search takes it


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


@dataclass(frozen=True)
class Prepared:
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


def quick_bound(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str, result: Any = None) -> float:
    """The cheap checks on the schedule's small program (peaks only grow with M), and the placement bound; the fullest
    rank's memory lowers `result.least_memory` where given."""
    if layout.tp != 1:
        raise LayoutError("runtime: encoder-decoder stages are not tensor-parallel (models/hf/parallelize.py splits "
                          "Llama-layout decoders only)")
    if layout.dp * layout.microbatches * layout.microbatch != spec.global_batch:
        raise LayoutError(f"batch: dp {layout.dp} × M {layout.microbatches} × microbatch {layout.microbatch} "
                          f"!= global batch {spec.global_batch}")
    program = layout_skeleton(layout)
    stages = _stages(spec, cluster, layout, program.num_stages, program.num_replicas, split)
    on_rank = stage_ranks(program)
    at_least = [n * min((stages.activation[s] for s in on_rank[r]), default=0.0) for r, n in enumerate(program.peaks)]
    fullest = _fullest(rank_memory(stages, layout, on_rank, at_least, program.peaks, program.split_backward))
    if result is not None:
        result.least_memory = min(result.least_memory, fullest.total)
    if not is_searched(layout.schedule):  # a searched order's peaks come with the costs: checked in `_prepare`
        _check_memory(cluster, fullest, "at least ")
    return placement_bound(program, stages.costs, layout.microbatches)


def prepare(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str) -> Prepared:
    P, M = layout.pp, layout.microbatches
    if is_searched(layout.schedule):  # placed without its order: `live_peaks` searches it under the costs
        program = layout_skeleton(layout)
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
    return Prepared(layout, stages, ranks, placement_bound(program, stages.costs, M), on_rank)


def finish(spec: EncDecSpec, cluster: ClusterSpec, prep: Prepared, split: str) -> EncDecEstimate:
    layout, costs = prep.layout, prep.stages.costs
    run = run_pipeline(layout.schedule, layout.pp, layout.microbatches, layout.params, costs, sharing(cluster, layout),
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


def rank_key(e: EncDecEstimate) -> tuple[float, float, int]:
    """Predicted time; equal times (to 9 digits: microbatch sizes at pp 1 differ by rounding only) by the fullest
    GPU's memory, then by GPU count (as `search.rank_key`)."""
    return (float(f"{e.iteration:.9g}"), e.memory.total, e.layout.gpus)
