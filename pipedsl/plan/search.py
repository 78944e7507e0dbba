"""The search: every layout of a model on a cluster, checked, costed, simulated and ranked.

Candidates are dp × pp × tp (1-D, and 3-D when tp is a cube), for an MoE model each expert-parallel
degree ep (a divisor of dp that divides the expert count), ZeRO 0-3, each schedule with
its chunk variants, microbatch sizes (the count follows from the global batch), recomputation
(none, selective, full), sequence parallelism (with 1-D tp > 1) and the attention kernel (eager
or fused).  Cheap checks reject first (divisibility, what the runtime can run for this model
(`plan/runnable.py`), schedule requirements, memory, with the reason); the survivors get a lower
bound — the busiest rank's compute plus its optimizer step, which no schedule can beat — and are
simulated best bound first until the bound exceeds the `top`-th best simulated time: the ranking
of the top is exact, the rest are counted as pruned.  An encoder-decoder takes the same steps with its
units split `split` (`cost.split_bounds`) and each rank's memory walked over the program (`RankMemory`); every
kind's prepared layout (`_Prepared`) is simulated alike (`_finish`), checked against the memory by one test
(`_check_memory`, each kind's record saying what its total holds) and ranked by one key (`rank_key`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple

from pipedsl.errors import PipeDSLError
from pipedsl.ir import Program
from pipedsl.library import builtin_names, load
from pipedsl.limits import MAX_BALANCED_LAYERS
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout, LayoutError, resharded_to_fit
from pipedsl.plan.cost import (
    EncDecStages,
    StageCosts,
    StageHoldings,
    encdec_stage_costs,
    piece_flops,
    piece_params,
    split_bounds,
    stage_costs,
    stage_holdings,
    stage_layers,
    tp_degree_3d,
    unit_pair,
)
from pipedsl.plan.memory import (
    MemoryReport,
    ModelStates,
    PeakMemory,
    RankMemory,
    StateBytes,
    model_states,
    moe_model_states,
    rank_memory,
    state_bytes,
)
from pipedsl.plan.model import EncDecSpec, ModelSpec, PlannedModel
from pipedsl.plan.partition import even_sizes
from pipedsl.plan.pipeline import (
    M_CAP_FACTOR,
    Skeleton,
    compiled,
    is_searched,
    layout_skeleton,
    live_peaks,
    placement_bound,
    program_peaks,
    run_pipeline,
    sharing,
    simulation_sizes,
    stage_ranks,
)
from pipedsl.plan.runnable import NotRunnableError, check_runnable

# Chunk variants searched per built-in (parameter name, values); others run with their defaults.
VARIANTS: dict[str, tuple[tuple[tuple[str, int], ...], ...]] = {
    "interleaved": ((("V", 2),), (("V", 4),)),
    "looped-bfs": ((("V", 2),),),
    "hanayo": ((("W", 1),), (("W", 2),)),
}
MICROBATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Estimate:
    """A simulated layout of any model kind: time, throughput, every pipeline rank's peak memory (the fullest's
    apart: the ranking's tie-break), communication per kind, and where the model was cut into stages."""

    layout: Layout
    iteration: float  # seconds
    pipeline: float  # the simulated pipeline makespan (without the exposed reduction and the step)
    tflops: float  # hardware TFLOP/s per GPU, SC'21's count (the recomputed forward included)
    mfu: float  # model FLOPs (no recomputation) / (time · peak)
    memory: PeakMemory  # the fullest rank's
    comm: dict[str, float]  # seconds per iteration on rank 0, the kinds its model has (`spec.comm_kinds`)
    ranks: tuple[PeakMemory, ...] = ()  # each pipeline rank's peak (states + step buffers + activations), by rank
    stage_seconds: tuple[float, ...] = ()  # F + B of one microbatch, per program stage
    layers: tuple[int, ...] = ()  # a decoder's: its layers on each program stage
    split: str = ""  # an encoder-decoder's: how its units were split ("time", "count" or "params")
    bounds: tuple[int, ...] = ()  # an encoder-decoder's: the unit bounds of the program stages

    @property
    def rank_memory(self) -> tuple[float, ...]:
        """Each pipeline rank's peak bytes."""
        return tuple(m.total for m in self.ranks)

    @property
    def memory_balance(self) -> float:
        """The lightest pipeline rank's peak over the fullest's (1: even)."""
        totals = self.rank_memory
        return min(totals) / max(totals) if totals else 1.0

    @property
    def points(self) -> tuple[int, ...]:
        """An encoder-decoder's `seq2seq_stages(model, n, points=…)` for this split: where stages 1 … n−1 begin."""
        return tuple(self.bounds[1:-1])


EncDecEstimate = Estimate  # the name an encoder-decoder's estimate had


@dataclass(frozen=True)
class Rejected:
    layout: Layout
    reason: str


@dataclass
class PlanResult:
    """What `search` found for a model of any kind: the ranked estimates, the rejected layouts with their reasons,
    how many were pruned and simulated."""

    model: PlannedModel
    cluster: ClusterSpec
    ranked: list[Estimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    pruned: int = 0
    simulated: int = 0
    seconds: float = 0.0
    least_memory: float = float("inf")  # an encoder-decoder's: the least peak memory of any candidate (at least)


# ------------------------------------------------------------------ one layout


@dataclass(frozen=True)
class _Prepared:
    """A layout's compiled program priced, every rank's memory checked: what the simulation (`_finish`) needs."""

    layout: Layout
    costs: StageCosts
    memory: PeakMemory  # the fullest rank's
    ranks: tuple[PeakMemory, ...]  # by pipeline rank
    bound: float  # the placement bound: the busiest rank's compute and step
    on_rank: dict[int, list[int]]
    extend_from: int = M_CAP_FACTOR  # × P microbatches: where `run_pipeline` starts its linear extension
    layers: tuple[int, ...] = ()  # a decoder's: its layers on each program stage
    stages: EncDecStages | None = None  # an encoder-decoder's: its units' stages
    split: str = ""  # an encoder-decoder's: how its units were split


def _check_batch(global_batch: int, layout: Layout) -> None:
    """The global batch is dp × M × microbatch, for every model kind."""
    if layout.dp * layout.microbatches * layout.microbatch != global_batch:
        raise LayoutError(f"batch: dp {layout.dp} × M {layout.microbatches} × microbatch {layout.microbatch} "
                          f"!= global batch {global_batch}")


def _check_shape(model: ModelSpec, layout: Layout) -> None:
    t = layout.tp
    _check_batch(model.global_batch, layout)
    if layout.tp_mode == "3d":
        q = tp_degree_3d(t)
        if q < 2:
            raise LayoutError(f"divisibility: 3-D tensor parallelism needs tp = q³ (q ≥ 2), got {t}")
        if model.hidden % (q * q) or model.heads % q or model.ffn_size % (q * q) or model.vocab % (q * q):
            raise LayoutError(f"divisibility: 3-D tp q={q} needs hidden, ffn and vocab divisible by q²={q * q} "
                            f"and heads by q")
        if layout.microbatch % (q * q):
            raise LayoutError(f"divisibility: 3-D tp q={q} splits a microbatch by whole samples: "
                            f"microbatch {layout.microbatch} % q² != 0")
    elif model.heads % t or model.hidden % t or model.ffn_size % t or (model.kv_heads or model.heads) % t:
        raise LayoutError(f"divisibility: tp {t} must divide heads {model.heads}, kv heads and hidden {model.hidden}")
    if layout.split == "even" and model.layers % layout.pp:
        raise LayoutError(f"divisibility: {model.layers} layers do not split evenly over pp {layout.pp}")
    if layout.ep > 1 and not model.moe:
        raise LayoutError(f"divisibility: ep {layout.ep} needs a Mixture-of-Experts model")
    if model.moe and (model.experts % layout.ep or layout.dp % layout.ep):
        raise LayoutError(f"divisibility: ep {layout.ep} must divide dp {layout.dp} and the {model.experts} experts")
    if model.moe and model.expert_ffn % t:
        raise LayoutError(f"divisibility: tp {t} must divide the expert width {model.expert_ffn}")
    try:
        check_runnable(model, layout)
    except NotRunnableError as err:
        raise LayoutError(err.message) from None


def _check_states(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> None:
    """Before compiling anything: even the lightest rank's model states must fit."""
    refusal = _states_refusal(model, cluster.memory - cluster.reserved_memory, layout.dp, layout.pp, layout.tp,
                              layout.ep, layout.zero, layout.grads, layout.split)
    if refusal is not None:
        raise LayoutError(refusal)


@lru_cache(maxsize=4096)  # candidates differing only in their schedule, batch or kernels share the answer
def _states_refusal(model: ModelSpec, usable: float, dp: int, pp: int, tp: int, ep: int, zero: int, grads: str,
                    split: str) -> str | None:
    """`_check_states`' refusal, or None: a function of these fields only, asked for every candidate."""
    layout = Layout(dp, pp, tp, "", 1, 1, zero, grads=grads, ep=ep, split=split)  # the fields the states depend on
    n, mode = _lightest(model, layout), state_bytes("bf16", layout.grads)
    if model.moe:  # the lightest stage: the fewest MoE layers
        moe = min(model.moe_layers_in(st * n, n) for st in range(layout.pp))
        psi = ((n - moe) * model.layer_params + moe * model.moe_layer_params) / layout.tp
        states = moe_model_states(psi, moe * model.moe_layer_expert_params / layout.tp, layout.dp, layout.ep,
                                  layout.zero, mode)
    else:
        psi = n * model.layer_params / layout.tp
        states = model_states(psi, layout.dp, layout.zero, mode)
    if states.total > usable:
        return f"out of memory: the model states alone take {states.total / 1e9:.1f} GB > {usable / 1e9:.0f} GB usable"
    return None


def _lightest(model: ModelSpec, layout: Layout) -> int:
    """The fewest layers a pipeline rank holds: the even split's, or the balanced split's over pp stages (whatever
    the schedule's stages a rank, it holds at least that share)."""
    layers = stage_layers(model, layout, layout.pp)
    return min(layers) if layers else model.layers // layout.pp


def _layers(model: ModelSpec, layout: Layout, stages: int) -> list[int]:
    """`stage_layers`, or the `LayoutError` saying why the layers do not split into the program's stages."""
    layers = stage_layers(model, layout, stages)
    if layers is None:
        if layout.split == "even":
            raise LayoutError(f"divisibility: {model.layers} layers do not split into {stages} stages")
        if model.layers > MAX_BALANCED_LAYERS:
            raise LayoutError(f"size: balanced splits are searched up to {MAX_BALANCED_LAYERS} layers (limits.py), "
                              f"this model has {model.layers}")
        raise LayoutError(f"divisibility: an embedding, {model.layers} layers and a head do not fill {stages} stages")
    if layout.split != "even" and len(set(layers)) == 1:
        raise LayoutError(f"duplicate: the balanced split of {model.layers} layers into {stages} stages is the "
                          f"even one")
    return layers


def _quick_bound(model: ModelSpec, cluster: ClusterSpec, layout: Layout, split: str = "time",
                 result: PlanResult | None = None) -> float:
    """Before compiling at full size: the cheap checks, an early out-of-memory test with the
    small program's peaks (peaks only grow with M), and the placement bound (`split`, `result`: an
    encoder-decoder's, `_encdec_quick_bound`)."""
    _check_shape(model, layout)
    _check_states(model, cluster, layout)
    program = layout_skeleton(layout)
    if is_searched(layout.schedule):  # its order, and so its peaks, come with the costs: checked in `_prepare`
        layers = _layers(model, layout, program.num_stages)
        return placement_bound(program, stage_costs(model, cluster, layout, program.num_stages,
                                                     program.num_replicas, layers), layout.microbatches)
    layers, _, _ = _costed(model, cluster, layout, program, program.peaks_at(w_share(model, layout)), "at least ")
    if layers != stage_layers(model, layout, program.num_stages):  # fitted to the small size's peaks: the full
        return 0.0  # size's may take other layers, whose bound this one is not
    return placement_bound(program, stage_costs(model, cluster, layout, program.num_stages, program.num_replicas,
                                                layers), layout.microbatches)


def _fits_at_small_size(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> bool:
    """Whether the layout's own split fits at the schedule's small size (the quick bound's check): only a layout
    that does not is fitted (`_costed`), so the quick bound of every other is its split's, which `_prepare` keeps."""
    program = layout_skeleton(layout)
    S = program.num_stages
    layers = _layers(model, layout, S)
    memory = _memory(model, layout, stage_holdings(model, layout, S, layers), stage_ranks(program),
                     program.peaks_at(w_share(model, layout)), layers, program.split_backward)[0]
    return memory.total <= cluster.memory - cluster.reserved_memory


def _check_memory(cluster: ClusterSpec, memory: PeakMemory, qualifier: str = "", note: str = "") -> None:
    """The one out-of-memory test of every model kind: the fullest rank within the usable memory, else why not."""
    usable = cluster.memory - cluster.reserved_memory
    if memory.total > usable:
        raise LayoutError(f"out of memory: {qualifier}{memory.total / 1e9:.1f} GB > {usable / 1e9:.0f} GB usable"
                          f"{memory.describe()}{note}")


def _prepare(model: ModelSpec, cluster: ClusterSpec, layout: Layout, split: str = "time") -> _Prepared:
    """The compiled program's stage costs (its layers fitted to the memory where a balanced split does not fit) and
    every rank's memory; a `LayoutError` where the fullest does not fit (`split`: an encoder-decoder's)."""
    P, M = layout.pp, layout.microbatches
    program, peaks = _program(layout), ()  # a searched order's peaks: `_costed` searches it under the costs
    if not is_searched(layout.schedule):
        try:
            peaks = program_peaks(layout.schedule, P, M, layout.params, wmem=w_share(model, layout))
        except PipeDSLError as err:
            raise LayoutError(f"schedule: {err.message}") from None
    layers, memory, per_rank = _costed(model, cluster, layout, program, peaks,
                                       may_fit=lambda: not _fits_at_small_size(model, cluster, layout))
    costs = stage_costs(model, cluster, layout, program.num_stages, program.num_replicas, layers)
    on_rank = stage_ranks(program)
    return _Prepared(layout, costs, memory, per_rank, placement_bound(program, costs, M), on_rank,
                     layers=tuple(layers))


def _program(layout: Layout) -> Program | Skeleton:
    """The layout's program at the simulation's size, or a searched schedule's placement without its order (every
    model kind's: its order needs the kind's stage costs); a `LayoutError` where the schedule cannot run it."""
    if is_searched(layout.schedule):
        return layout_skeleton(layout)
    P, M = layout.pp, layout.microbatches
    try:
        return compiled(layout.schedule, P, simulation_sizes(M, P)[0], layout.params)
    except PipeDSLError as err:
        raise LayoutError(f"schedule: {err.message}") from None


def _memory(model: ModelSpec, layout: Layout, costs: StageHoldings | StageCosts, on_rank: dict[int, list[int]],
            peaks: Sequence[float], layers: Sequence[int],
            split: bool) -> tuple[MemoryReport, tuple[MemoryReport, ...]]:
    """The fullest rank (and every rank's, by pipeline rank): `_rank_memory` of the stages on it, their
    activations counted at its largest stage's layers (`layers`: each stage's); `split`: the program has W ops.
    `costs`: the stages' parameter columns (`stage_holdings`, or the same columns of their `StageCosts`)."""
    terms = _activation_terms(model, layout)
    # the largest units matter only where ZeRO-3 gathers them one by one (`_rank_memory`)
    by_unit = layout.zero >= 3 and not _whole_stage_gathered(layout, split)
    held = _rank_holdings(costs.stage_params, costs.expert_params, costs.unit_pairs if by_unit else None,
                          tuple(map(tuple, on_rank.values())), tuple(layers))
    per_rank = tuple(_rank_memory(model, layout, params, experts, peaks[r], most, last, terms, units)
                     for r, (params, experts, units, most, last) in zip(on_rank, held))
    worst = max(per_rank, key=lambda report: report.total)  # the first of equal ones, as before
    return worst, per_rank


@lru_cache(maxsize=4096)  # a few hundred splits and placements recur across tens of thousands of candidates
def _rank_holdings(stage_params: tuple[float, ...], expert_params: tuple[float, ...],
                   unit_pairs: tuple[float, ...] | None, placement: tuple[tuple[int, ...], ...],
                   layers: tuple[int, ...]) -> tuple[tuple[float, float, float | None, int, bool], ...]:
    """Per rank (holding `placement[r]`'s stages, in rank order): its parameters, its routed experts, its largest
    stage's unit pair (None: not asked), its largest stage's layers and whether it holds the last stage."""
    return tuple((sum(stage_params[s] for s in st), sum(expert_params[s] for s in st) if expert_params else 0.0,
                  max(unit_pairs[s] for s in st) if unit_pairs is not None else None,
                  max(layers[s] for s in st), len(layers) - 1 in st) for st in placement)


def _whole_stage_gathered(layout: Layout, split: bool) -> bool:
    """Whether ZeRO-3 holds a rank's whole stages gathered at its peak: reshard="step" keeps them so through the step,
    and a split backward's W gathers every unit of its stage first (`before_weight_pass`)."""
    return layout.reshard == "step" or split


def _rank_memory(model: ModelSpec, layout: Layout, params: float, experts: float, peak: float, layers: int,
                 last: bool, terms: tuple[float, float, float] | None = None,
                 units: float | None = None) -> MemoryReport:
    """One rank's peak: the model states of its `params` per GPU (`memory.model_states`, the function the runtime's
    byte tests check; `experts` of them routed experts, already / ep: `memory.moe_model_states` over their dp/ep
    replicas), what ZeRO holds beyond them during the step (`parallel/zero.py`: ZeRO 2-3 the full gradient buffer
    from the first backward to REDUCE_GRAD, ZeRO-3 the parameters of `units` gathered at once, None: all of
    `params`), plus its `peak` live microbatch activations of `layers` layers each and one recomputed region's
    working set (the last stage: the fp32 logits of the microbatch in flight too); `terms`: `_activation_terms`."""
    per_layer, extra, logits = terms or _activation_terms(model, layout)
    states, beyond, mode = _rank_states(params, experts, layout.dp, layout.ep, layout.zero, layout.grads)
    buffer = mode.grad * beyond if layout.zero >= 2 else 0.0
    gathered = 0.0
    if layout.zero >= 3:
        gathered = mode.param * (beyond if units is None else units * (1 - 1 / layout.dp))
    return MemoryReport(states, peak * layers * per_layer + extra + (logits if last else 0.0), round(peak),
                        buffer, gathered)


@lru_cache(maxsize=8192, typed=True)  # ranks of the same stage recur across schedules, batches and kernels
def _rank_states(params: float, experts: float, dp: int, ep: int, zero: int,
                 grads: str) -> tuple[ModelStates, float, StateBytes]:
    """`_rank_memory`'s model states, the parameters a rank holds beyond its shard, and the precision mode."""
    routed = experts * ep
    mode = state_bytes("bf16", grads)
    states = moe_model_states(params - experts + routed, routed, dp, ep, zero, mode)
    # the part of a full copy a rank holds beyond its shard: dense over dp, the routed experts over their dp/ep replicas
    beyond = (params - experts) * (1 - 1 / dp) + experts * (1 - ep / dp)
    return states, beyond, mode


def w_share(model: ModelSpec, layout: Layout) -> float:
    """The share of a layer's stored activation a pending W holds from its I to its W (`Cost.wmem`: the schedules'
    peaks count it so), from `plan/activations.py`'s bytes; 1 under recomputation (a region is held whole until W).
    An MoE model: the larger of a dense and an MoE layer's."""
    if layout.recompute != "none":
        return 1.0
    return _w_share(model, layout.microbatch, layout.tp, layout.sp, layout.fused)


@lru_cache(maxsize=1024)  # the search asks once per layout; it depends on four of a layout's fields
def _w_share(model: ModelSpec, b: int, t: int, sp: bool, fused: bool) -> float:
    return max(model.layer_w_held_bytes(b, t, "none", sp, fused, moe) / model.layer_activation_bytes(b, t, "none", sp,
                                                                                                       fused, moe)
               for moe in ((False, True) if model.moe else (False,)))


def _activation_terms(model: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    """(one layer's stored activation bytes a microbatch, one recomputed region's working set, the last stage's fp32
    logits of the microbatch in flight).  An MoE model: each layer's the larger of a dense and an MoE layer's."""
    return _activation_terms_cached(model, layout.microbatch, layout.tp, layout.recompute, layout.sp, layout.fused)


@lru_cache(maxsize=1024)  # as `_w_share`: asked per layout, a function of five of its fields
def _activation_terms_cached(model: ModelSpec, b: int, t: int, recompute: str, sp: bool,
                             fused: bool) -> tuple[float, float, float]:
    kinds = (False, True) if model.moe else (False,)
    per_layer = max(model.layer_activation_bytes(b, t, recompute, sp, fused, moe) for moe in kinds)
    whole = max(model.layer_activation_bytes(b, t, "none", sp, fused, moe) for moe in kinds)
    working = whole - per_layer if recompute != "none" else 0.0  # one block (or attention module) again
    return per_layer, working, 4 * b * model.seq * model.vocab / t


def _fitted_layers(model: ModelSpec, cluster: ClusterSpec, layout: Layout, on_rank: dict[int, list[int]],
                   peaks: Sequence[float], stages: int, split: bool) -> list[int] | None:
    """A balanced split's layers when the FLOP-balanced one leaves a rank out of memory: the FLOP-balanced split
    among those where every rank fits (`partition.even_sizes` held to them).  A schedule's first ranks hold the
    most activations, so they give up layers (Megatron's smaller first stage, for memory).  One stage a rank
    only; None when no split fits."""
    if not _fittable(model, layout, on_rank):
        return None
    rank_of = {st[0]: r for r, st in on_rank.items()}
    params, experts = piece_params(model, layout)
    # keyed on the numbers a rank's bytes are made of, so that layouts of the same memory share the answer
    fitted = _fitted(model, params, experts, _linear_bytes(model, layout, params, _whole_stage_gathered(layout, split)),
                     cluster.memory - cluster.reserved_memory, tuple(peaks[rank_of[s]] for s in range(stages)))
    return None if fitted is None else list(fitted)


class _LinearBytes(NamedTuple):
    """A rank's bytes are linear in its parameters, its routed experts and its layers: each priced once."""

    base: float  # what a rank holds with none of them: the recomputed working set
    per_param: float
    per_expert: float
    per_layer: float  # a layer's stored activation, per live microbatch
    logits: float  # the last stage's fp32 logits


def _linear_bytes(model: ModelSpec, layout: Layout, params: Sequence[float], whole: bool) -> _LinearBytes:
    """`_LinearBytes` of `layout`, its pieces holding `params` each; `whole`: ZeRO-3 holds a stage gathered whole
    (`_whole_stage_gathered`), else its largest two units, here the model's."""
    units = None if whole else unit_pair(params)
    base = _rank_memory(model, layout, 0.0, 0.0, 0.0, 0, False, None, units).total
    per_param = _rank_memory(model, layout, 1.0, 0.0, 0.0, 0, False, None, units).total - base
    per_expert = _rank_memory(model, layout, 1.0, 1.0, 0.0, 0, False, None, units).total - base - per_param
    per_layer, _, logits = _activation_terms(model, layout)
    return _LinearBytes(base, per_param, per_expert, per_layer, logits)


def _fittable(model: ModelSpec, layout: Layout, on_rank: dict[int, list[int]]) -> bool:
    """Whether `_fitted_layers` may re-split this layout: a balanced split, one stage a rank, a depth it searches."""
    return (layout.split == "balanced" and all(len(st) == 1 for st in on_rank.values())
            and model.layers <= MAX_BALANCED_LAYERS)


@lru_cache(maxsize=4096)
def _fitted(model: ModelSpec, params: tuple[float, ...], experts: tuple[float, ...], linear: _LinearBytes,
            usable: float, peaks: tuple[float, ...]) -> tuple[int, ...] | None:
    """`_fitted_layers` for stage s's rank holding `peaks[s]` activations at most, in `usable` bytes; the pieces
    [embedding, layers…, head] hold `params` each per GPU, `experts` of them routed experts (`piece_params`)."""
    p_sum, e_sum = list(accumulate(params, initial=0.0)), list(accumulate(experts, initial=0.0))
    pieces = model.layers + 2
    base, per_param, per_expert, per_layer, logits = linear

    def fits(s: int, a: int, b: int) -> bool:  # stage s holds pieces a..b-1 of [embedding, layers…, head]
        layers = min(b, pieces - 1) - max(a, 1)
        total = (base + per_param * (p_sum[b] - p_sum[a]) + per_expert * (e_sum[b] - e_sum[a])
                 + peaks[s] * layers * per_layer + (logits if b == pieces else 0.0))
        return total <= usable

    try:
        sizes = even_sizes(piece_flops(model), len(peaks), fits)
    except PipeDSLError:
        return None
    return (sizes[0] - 1, *sizes[1:-1], sizes[-1] - 1)  # less the embedding and the head


def _costed(model: ModelSpec, cluster: ClusterSpec, layout: Layout, program, peaks: Sequence[float],
            qualifier: str = "", may_fit: Callable[[], bool] = lambda: True
            ) -> tuple[list[int], MemoryReport, tuple[MemoryReport, ...]]:
    """The layers of each stage, the fullest rank's memory and every rank's: the layout's split, or where its
    balanced split leaves a rank out of memory and `may_fit()`, the balanced split that fits (`_fitted_layers`);
    a `LayoutError` when the memory does not hold it.  A searched schedule's peaks are its program's as searched
    under the costs of the split (`pipeline.compiled`), not `peaks`; it is not fitted.  Only a searched schedule's
    times are priced here: the memory needs the stages' parameters alone (`stage_holdings`)."""
    S = program.num_stages
    on_rank = stage_ranks(program)
    searched = is_searched(layout.schedule)

    def priced(layers: list[int] | None) -> tuple[list[int], Sequence[float], MemoryReport,
                                                  tuple[MemoryReport, ...]]:
        layers = layers if layers is not None else _layers(model, layout, S)
        if not searched:
            held = stage_holdings(model, layout, S, layers)
            return (layers, peaks, *_memory(model, layout, held, on_rank, peaks, layers, program.split_backward))
        costs = stage_costs(model, cluster, layout, S, program.num_replicas, layers)
        try:
            live = program_peaks(layout.schedule, layout.pp, layout.microbatches, layout.params,
                                 replace(costs.simulator_cost(), wmem=w_share(model, layout)))
        except PipeDSLError as err:
            raise LayoutError(f"schedule: {err.message}") from None
        return (layers, live, *_memory(model, layout, costs, on_rank, live, layers, program.split_backward))

    layers, live, memory, per_rank = priced(None)
    note = ""
    if memory.total > cluster.memory - cluster.reserved_memory and not searched and may_fit():
        fitted = _fitted_layers(model, cluster, layout, on_rank, live, S, program.split_backward)
        if fitted is None and _fittable(model, layout, on_rank):
            note = "; no other split of the layers fits either"
        elif fitted is not None and len(set(fitted)) == 1:
            raise LayoutError(f"duplicate: the balanced split of {model.layers} layers that fits the memory is the "
                              f"even one")
        elif fitted is not None:
            layers, live, memory, per_rank = priced(fitted)
    _check_memory(cluster, memory, qualifier, note)
    return layers, memory, per_rank


def _finish(model: PlannedModel, cluster: ClusterSpec, prep: _Prepared) -> Estimate:
    """The simulation of a prepared layout of any model kind, and what it predicts."""
    layout, costs = prep.layout, prep.costs
    run = run_pipeline(layout.schedule, layout.pp, layout.microbatches, layout.params, costs, sharing(cluster, layout),
                       prep.extend_from)
    gpus = layout.gpus
    hardware = model.iteration_flops(layout.recompute, layout.fused)
    useful = model.iteration_flops("none")
    return Estimate(layout, run.iteration, run.pipeline, hardware / run.iteration / gpus / 1e12,
                    useful / run.iteration / gpus / cluster.peak_flops, prep.memory,
                    _comm(costs, layout, prep.on_rank[0], model.comm_kinds), prep.ranks,
                    tuple(f + b for f, b in zip(costs.F, costs.B)), prep.layers, prep.split,
                    prep.stages.bounds if prep.stages is not None else ())


def _comm(costs: StageCosts, layout: Layout, stages: Sequence[int], kinds: Sequence[str]) -> dict[str, float]:
    """Seconds per iteration a rank holding `stages` communicates, of each of `kinds` its model has: tp, pp, dp,
    zero3, ep (MoE all-to-alls)."""
    M = layout.microbatches
    every = {"tp": lambda: M * sum(costs.tp_comm[s] for s in stages),
             "pp": lambda: 2 * M * len(stages) * costs.message if layout.pp > 1 else 0.0,
             "dp": lambda: sum(costs.reduce[s] + costs.after_step[s] for s in stages),
             "zero3": lambda: sum(M * costs.zero_gather[s] + (costs.step_gather[s] if costs.step_gather else 0.0)
                                  for s in stages),
             "ep": lambda: M * sum(costs.all_to_all[s] for s in stages) if costs.all_to_all else 0.0}
    return {kind: every[kind]() for kind in kinds}


# ------------------------------------------------------------------ one layout of an encoder-decoder


# × P microbatches: where `run_pipeline` starts its linear extension.  With stages of unequal cost a schedule needs
# more microbatches to reach its periodic steady state: extended from 2P and 3P, mT5-Base on 64 GPUs under looped BFS
# V=2 (M = 64) was predicted 14 % fast and Hanayo W=1 on 8 (M = 256) 2.2 % fast, under the placement bound; from 8P
# and 9P both equal the full simulation (tests/plan/test_encoder_decoder.py).
EXTEND_FROM = 8


def _fullest(ranks: Sequence[RankMemory]) -> RankMemory:
    """The first of the fullest ranks: the one the out-of-memory message names."""
    return max(ranks, key=lambda m: m.total)


def _encdec_stages(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, num_stages: int, replicas: int,
                   split: str) -> EncDecStages:
    """The layout's program stages, its units split `split`; a `LayoutError` where they are fewer than the stages."""
    units = len(spec.units())
    if num_stages > units:
        raise LayoutError(f"split: {units} units ({spec.encoder_layers} encoder and "
                          f"{spec.decoder_layers} decoder layers, 2 inputs, a head) cannot fill {num_stages} stages")
    bounds = split_bounds(spec, cluster, num_stages, split, layout.recompute)
    return encdec_stage_costs(spec, cluster, layout, bounds, replicas)


def _encdec_quick_bound(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str,
                        result: PlanResult | None = None) -> float:
    """The cheap checks on the schedule's small program (peaks only grow with M), and the placement bound; the fullest
    rank's memory lowers `result.least_memory` where given."""
    if layout.tp != 1:
        raise LayoutError("runtime: encoder-decoder stages are not tensor-parallel (models/hf/parallelize.py splits "
                          "Llama-layout decoders only)")
    _check_batch(spec.global_batch, layout)
    program = layout_skeleton(layout)
    stages = _encdec_stages(spec, cluster, layout, program.num_stages, program.num_replicas, split)
    on_rank = stage_ranks(program)
    at_least = [n * min((stages.activation[s] for s in on_rank[r]), default=0.0) for r, n in enumerate(program.peaks)]
    fullest = _fullest(rank_memory(stages, layout, on_rank, at_least, program.peaks, program.split_backward))
    if result is not None:
        result.least_memory = min(result.least_memory, fullest.total)
    if not is_searched(layout.schedule):  # a searched order's peaks come with the costs: checked in `_encdec_prepare`
        _check_memory(cluster, fullest, "at least ")
    return placement_bound(program, stages.costs, layout.microbatches)


def _encdec_prepare(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, split: str) -> _Prepared:
    """The compiled program's stage costs and every rank's memory, its activations walked over the program
    (`live_peaks`); a `LayoutError` where a rank does not fit."""
    P, M = layout.pp, layout.microbatches
    program = _program(layout)  # a searched order: `live_peaks` searches it under the costs
    stages = _encdec_stages(spec, cluster, layout, program.num_stages, program.num_replicas, split)
    on_rank = stage_ranks(program)
    try:
        peaks, live = live_peaks(layout.schedule, P, M, layout.params, stages.activation,
                                 stages.costs.simulator_cost())
    except PipeDSLError as err:
        raise LayoutError(f"schedule: {err.message}") from None
    ranks = tuple(rank_memory(stages, layout, on_rank, live, peaks, program.split_backward))
    fullest = _fullest(ranks)
    _check_memory(cluster, fullest)
    return _Prepared(layout, stages.costs, fullest, ranks, placement_bound(program, stages.costs, M), on_rank,
                     EXTEND_FROM, stages=stages, split=split)


class _Steps(NamedTuple):
    """One model kind's steps for one layout, as the search takes them: the cheap checks and the placement bound
    (`quick`), the compiled program's costs and memory (`prepare`), the simulation (`finish`)."""

    quick: Callable[[Layout], float]
    prepare: Callable[[Layout], _Prepared]
    finish: Callable[[_Prepared], Estimate]


# How each model kind (`PlannedModel.kind`) is checked and bounded, and costed into a `_Prepared`: a decoder by its
# layers per stage (dense and MoE blocks summed by kind), an encoder-decoder by its units split `split`; the rest
# of the search is the same for both.
_KINDS: dict[str, tuple[Callable[..., float], Callable[..., _Prepared]]] = {
    "decoder": (_quick_bound, _prepare),
    "encoder-decoder": (_encdec_quick_bound, _encdec_prepare),
}


def _steps(model: PlannedModel, cluster: ClusterSpec, split: str = "time", result: PlanResult | None = None) -> _Steps:
    """`model`'s steps (`_KINDS`), an encoder-decoder's units split `split`, the least memory of any candidate kept in
    `result`; one simulation (`_finish`)."""
    quick, prepare = _KINDS[model.kind]
    return _Steps(lambda lay: quick(model, cluster, lay, split, result),
                  lambda lay: prepare(model, cluster, lay, split), lambda prep: _finish(model, cluster, prep))


def evaluate(model: PlannedModel, cluster: ClusterSpec, layout: Layout, split: str = "time") -> Estimate:
    """Predict one layout (a ZeRO-3 pipeline left on "auto": `resharded_to_fit`): an `Estimate`, or for an
    encoder-decoder, its units split `split` ("time", "count", "params"); `LayoutError` says why it cannot run."""
    steps = _steps(model, cluster, split)

    def attempt(lay: Layout) -> _Prepared:
        steps.quick(lay)
        return steps.prepare(lay)
    return steps.finish(resharded_to_fit(layout, attempt)[1])


# ------------------------------------------------------------------ the space


ENCDEC_SPACE = EncDecSpec.space  # where an encoder-decoder's space was defined


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: PlannedModel, cluster: ClusterSpec, schedules: Iterable[str] | None = None,
            zero: Iterable[int] = (0, 1, 2, 3), microbatch_sizes: Iterable[int] = MICROBATCH_SIZES,
            recompute: Iterable[str | bool] | None = None, tp: Iterable[int] | None = None,
            pp: Iterable[int] | None = None, tp_modes: Iterable[str] | None = None,
            grads: str = "bf16", sequence_parallel: Iterable[bool] | None = None,
            attention: Iterable[str] | None = None, ep: Iterable[int] | None = None,
            splits: Iterable[str] | None = None) -> list[Layout]:
    """Every candidate with dp · pp · tp = cluster.gpus and dp · M · microbatch = global batch; `grads`: the
    gradients' dtype under bf16 parameters with fp32 main parameters (runtime: --grad-dtype).  Sequence
    parallelism is tried only with 1-D tp > 1; `attention` defaults to the cluster's (`fused_attention`).
    An MoE model also tries each expert-parallel degree (`ep`, default every one) that divides dp and its
    expert count; a dense model runs ep 1.  Pipelines whose layers split evenly over pp also try each other of
    `splits` (cost.py's `stage_layers`: balanced by FLOPs, the head counted).  ZeRO-3 layouts reshard "auto"
    (`resharded_to_fit` tries "step", then "unit" where that does not fit).  The defaults are the model kind's
    (`PlannedModel.space`)."""
    given = {"recompute": recompute, "tp": tp, "tp_modes": tp_modes, "sequence_parallel": sequence_parallel,
             "attention": attention, "splits": splits}
    space = {k: v if v is not None else model.space.get(k) for k, v in given.items()}
    if model.space.get("recompute_only"):
        _check_recompute(model, space["recompute"])
    kernels = list(space["attention"]) if space["attention"] is not None else \
        ["fused" if cluster.fused_attention else "eager"]
    # searched schedules (`order auto`, zb-auto) need the stage costs to compile: a decoder's only when named
    names = list(schedules) if schedules is not None else builtin_names() if model.space.get("searched") else \
        [n for n in builtin_names() if not load(n).searched]
    N = cluster.gpus
    tps = [t for t in _divisors(N) if t <= cluster.gpus_per_node] if space["tp"] is None else list(space["tp"])
    out = []
    for t in tps:
        for mode in space["tp_modes"]:
            if mode == "3d" and tp_degree_3d(t) < 2:
                continue
            for p in (_divisors(N // t) if pp is None else pp):
                if (N // t) % p:
                    continue
                d = N // (t * p)
                # balanced beside even where the layers split evenly: the space twice as large, not the pp values
                # only an uneven split allows (each a new program to compile for every schedule)
                layer_splits = tuple(space["splits"]) if p > 1 and model.layers % p == 0 else ("even",)
                eps = [e for e in (_divisors(d) if ep is None else ep) if d % e == 0 and model.experts % e == 0] \
                    if model.moe else [1]
                for b in microbatch_sizes:
                    if model.global_batch % (d * b):
                        continue
                    M = model.global_batch // (d * b)
                    for name in (names if p > 1 else names[:1] if schedules is not None else ["1f1b"]):
                        for params in VARIANTS.get(name, ((),)):
                            for z in (zero if d > 1 else (0,)):
                                for rc in space["recompute"]:
                                    for sp in (space["sequence_parallel"] if t > 1 and mode == "1d" else (False,)):
                                        for kernel in kernels:
                                            out.extend(Layout(d, p, t, name, b, M, z, rc, mode, params, grads,
                                                              sp, kernel, e, split) for e in eps
                                                       for split in layer_splits)
    return out


def _check_recompute(model: PlannedModel, modes: Iterable[str | bool]) -> None:
    """A model kind that runs only some recomputation modes (`space["recompute_only"]`) is planned with those."""
    allowed = model.space["recompute"]
    for mode in modes:
        if mode not in allowed:
            raise PipeDSLError(f"{model.kind}s are planned with recomputation {' or '.join(allowed)}, got {mode!r}")


TIES = "equal times: less memory first, then fewer GPUs"


def rank_key(e: Estimate) -> tuple[float, float, int]:
    """The ranking of every model kind: predicted iteration time; equal times (ZeRO-1 and -2 often predict the same)
    by the fullest GPU's memory, then by GPU count, so the table's order says something.  An encoder-decoder's times
    (`bounds`: its unit split) count to 9 digits: its microbatch sizes at pp 1 differ by rounding only."""
    return (float(f"{e.iteration:.9g}") if e.bounds else e.iteration, e.memory.total, e.layout.gpus)


encdec_rank_key = rank_key  # the name an encoder-decoder's ranking had


def search(model: PlannedModel, cluster: ClusterSpec, top: int = 10,
           candidates: Sequence[Layout] | None = None, split: str = "time", **space) -> PlanResult:
    """Rank the layouts of a model of any kind (`candidates`, or `layouts(model, cluster, **space)`); the best `top`
    exactly.  An encoder-decoder's units are split `split` ("time", "count" or "params", `cost.split_bounds`)."""
    began = time.perf_counter()
    result = PlanResult(model, cluster)
    steps, key = _steps(model, cluster, split, result), rank_key
    bounded: list[tuple[float, int, Layout]] = []
    for i, layout in enumerate(candidates if candidates is not None else layouts(model, cluster, **space)):
        try:
            layout, bound = resharded_to_fit(layout, steps.quick)
            bounded.append((bound, i, layout))
        except LayoutError as err:
            result.rejected.append(Rejected(layout, err.message))
    bounded.sort()
    for i, (bound, _, layout) in enumerate(bounded):
        if len(result.ranked) >= top and bound > result.ranked[top - 1].iteration:
            result.pruned = len(bounded) - i
            break
        try:
            layout, prep = resharded_to_fit(layout, steps.prepare)
        except LayoutError as err:
            result.rejected.append(Rejected(layout, err.message))
            continue
        if len(result.ranked) >= top and prep.bound > result.ranked[top - 1].iteration:
            continue  # its own program's busiest rank already loses
        result.ranked.append(steps.finish(prep))
        result.simulated += 1
        result.ranked.sort(key=key)
    result.ranked = result.ranked[:top] if top else result.ranked
    result.seconds = time.perf_counter() - began
    return result


# ------------------------------------------------------------------ which ZeRO stage


@dataclass(frozen=True)
class ZeroRow:
    """One model on one GPU count: the best layout of each ZeRO stage (None: nothing fits) and, per stage, the
    least memory any of its layouts needs (an encoder-decoder's; a decoder's search does not keep it)."""

    model: PlannedModel
    gpus: int
    per_zero: dict[int, Estimate | None]
    least_memory: dict[int, float]
    data_parallel: Estimate | None = None  # the best with pp = 1 (pure data parallelism, any ZeRO stage)
    data_parallel_least: float = float("inf")

    @property
    def best(self) -> Estimate | None:
        found = [e for e in self.per_zero.values() if e is not None]
        return min(found, key=rank_key) if found else None


def zero_table(specs: Sequence[PlannedModel], cluster: ClusterSpec, gpu_counts: Sequence[int],
               zero: Sequence[int] = (0, 1, 2, 3), **space) -> list[ZeroRow]:
    """For each model and GPU count, the best layout of each ZeRO stage (ZeRO 1-3 only with dp > 1), and the best
    pure data-parallel one (pp = 1, the layout ZeRO is usually run with)."""
    rows = []
    for spec in specs:
        for n in gpu_counts:
            c = cluster.with_gpus(n)
            per_zero: dict[int, Estimate | None] = {}
            least: dict[int, float] = {}
            for z in zero:
                found = search(spec, c, top=1, zero=(z,), **space)
                per_zero[z] = found.ranked[0] if found.ranked else None
                least[z] = found.least_memory
            flat = search(spec, c, top=1, zero=tuple(zero), pp=[1], **space)
            rows.append(ZeroRow(spec, n, per_zero, least, flat.ranked[0] if flat.ranked else None, flat.least_memory))
    return rows
