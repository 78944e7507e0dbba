"""Per-stage costs of a layout: compute from FLOPs, messages from bytes, collectives from rings.

Times are seconds per microbatch.  Communication follows what the runtime does:
- tensor parallel (Megatron 1-D): two all-reduces of the [b, s, h] activation per block in the
  forward, two in the backward, two more in a fully recomputed forward (one in the attention module
  an HF decoder's selective recomputation runs again) — on the critical path; one more for the
  vocabulary-parallel embedding, three small ones ([b, s]) for the cross-entropy.  Sequence
  parallelism replaces each all-reduce with a reduce-scatter and an all-gather (the same ring
  time) and runs the norms and dropout on 1/t of the sequence (their stored bytes, hence their
  memory-bound time, shrink: `plan/activations.py`); in the backward the built-in GPT gathers
  its column-parallel inputs again (it keeps them as shards, `parallel/tp1d.py`) and an HF
  decoder all-reduces its two norm weights' gradients (`parallel/tp_hf.py`);
  3-D (Bian et al.): per linear, gathers of input and weight and a reduce-scatter of the output,
  (q-1)/q³ of each tensor per rank, forward and backward alike;
- pipeline: one [b, s, h]/t message per hop (Megatron's scatter/gather over InfiniBand, then an
  all-gather over NVLink inside the node);
- data parallel: the stage's gradient all-reduce in the gradients' dtype (`Layout.grads`; ZeRO 1-2:
  reduce-scatter, then the updated parameters all-gathered after the step) issued at REDUCE_GRAD and
  overlapping the rest of the cooldown, as `runtime.reduce` does.  ZeRO-3 gathers unit by unit
  (embedding, each block, head) on entry to its forward and again to its backward and prefetches
  the next unit in execution order (`parallel/zero.py`), so a F, B or I is charged the first
  unit's gather and each later gather's excess over the unit it overlaps (`prefetched`); W
  gathers every unit first (`before_weight_pass`, not overlapped).  With `Layout.reshard` "step"
  (the default in a pipeline) each unit is gathered once a step, in the step's first forward, and
  kept to REDUCE_GRAD: that forward's exposed gathers are charged once a step (`step_gather`), no
  F, B, I or W pays any.  Its gradients are reduce-scattered at REDUCE_GRAD (reduce="step", the
  default), overlapping the rest of the cooldown: at pp = 1 nothing is left to overlap, as in the
  runtime.
- expert parallelism (MoE models, `Layout.ep` ranks of dp): per MoE block two all-to-alls in the
  forward (dispatch, combine) and two in the backward (two more in a fully recomputed forward),
  each tokens·k·h·2·(ep-1)/ep bytes a rank, on NVLink while tp·ep ranks fit in a node, else
  InfiniBand, on the critical path (no overlap with compute); the routed experts' parameters are
  1/ep a rank and their gradients reduce over their dp/ep replicas, the rest over dp;
- compute: forward FLOPs at the tp group's rate; the memory-bound kernels stream the bytes a
  block stores (`plan/activations.py`, so fused attention and SP shrink them); a fused attention
  backward recomputes QKᵀ (half the attention core); a recomputed block or module runs again in B and I.
Ring collectives over N ranks: all-reduce 2(N-1)/N·bytes/bw + 2(N-1)·latency, all-gather and
reduce-scatter half of that (Patarasuk & Yuan; NCCL's ring model).

Every model kind's stages are priced by one function, `price_stages`, from each stage's units summed
(`StageWork`): a decoder sums its blocks by kind (every block of a kind costs the same), an
encoder-decoder its units one by one, each in the order its numbers were always summed in.

An encoder-decoder (`EncDecSpec.units`: [encoder input, encoder layers…, decoder input, decoder
layers…, head], as `models/hf/seq2seq.py`'s `seq2seq_stages(model, n, by=…, points=…)` spreads
them) runs at tp = 1; a split is the `points` where stages 1 … n−1 begin (`split_bounds`):
- "count": the runtime's default `by="count"` (⌈U/n⌉ units on the first U mod n stages);
- "params": the runtime's `by="params"`, the same exact DP as `models/split.py` on unit parameters;
- "time" (the planner's): the same DP on each unit's forward + backward seconds, minimising the
  slowest stage, which sets the pipeline's pace, then among the splits that reach it the most even
  (`even_sizes`); pass its points to `seq2seq_stages(points=…)`.
A unit's forward is its GEMM FLOPs at peak × efficiency and the memory-bound kernels streaming the
bytes it stores, backward 2× forward, full recomputation one more forward of each layer; split
backward I = forward with the attention core doubled, W = the GEMMs (the memory-bound part in each);
a stage of decoder layers streams the encoder output their cross-attention reads.  The simulator
prices every message alike, so a layout's message is its largest boundary's
(`EncDecSpec.boundary_bytes`).  The shared embedding is a weight tied between the stage holding the
encoder input and the one holding the decoder input (`runtime/ties.py`): each copy has its own
optimizer state, and the copies' gradients are summed at the step end (`tie_sync`), after the
data-parallel reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import NamedTuple

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_BALANCED_LAYERS
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout
from pipedsl.plan.memory import OPTIMIZER_BYTES, PARAM_BYTES, state_bytes
from pipedsl.plan.model import BYTES_FP16, EncDecSpec, ModelSpec, Unit
from pipedsl.plan.partition import balanced_sizes, bounds_of, even_sizes
from pipedsl.simulate import Cost

# Adam's step per parameter: fp32 weight, momentum, variance read and written, the fp16 gradient read, the
# fp16 weight written.
ADAM_BYTES_PER_PARAM = 2 * OPTIMIZER_BYTES + BYTES_FP16 + PARAM_BYTES


def all_reduce(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * size / bandwidth + 2 * (ranks - 1) * latency


def all_gather(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Gather (or reduce-scatter) a `size`-byte tensor whose 1/ranks shard each rank holds."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * size / bandwidth + (ranks - 1) * latency


def all_to_all(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Each of `ranks` ranks exchanges a `size`-byte buffer with the others: (ranks-1)/ranks of it leaves
    (and as much arrives) over the link, in ranks-1 pairwise steps."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * size / bandwidth + (ranks - 1) * latency


def moe_all_to_all_bytes(model: ModelSpec, tokens: float, ep: int) -> float:
    """Bytes one rank sends in one all-to-all of an MoE layer (dispatch or combine): its `tokens`' k routed
    copies of h values, the (ep-1)/ep of them whose experts live on the other ranks (balanced routing):
    tokens·k·h·2·(ep-1)/ep."""
    return tokens * model.top_k * model.hidden * BYTES_FP16 * (ep - 1) / ep


@dataclass(frozen=True)
class _Block:
    """One kind of block (dense or MoE) as one GPU runs it, per microbatch."""

    flops: float  # forward FLOPs
    block: float  # forward seconds (GEMMs + memory-bound kernels)
    again: float  # seconds recomputed in the backward
    params: float  # parameters on this GPU (experts / ep)
    experts: float  # of which routed experts
    a2a: float  # forward all-to-alls (dispatch + combine); the backward has as much
    a2a_again: float  # a fully recomputed forward's all-to-alls
    tp_fwd: float = 0.0  # tensor-parallel collectives in the forward
    tp_bwd: float = 0.0  # and in the backward
    summed: float = 0.0  # parameters whose gradient each tp rank holds part of, summed over tp once a step


def tp_degree_3d(tp: int) -> int:
    """q with q³ = tp, or 0 if tp is not a cube."""
    q = round(tp ** (1 / 3))
    return q if q ** 3 == tp else 0


@dataclass(frozen=True)
class StageCosts:
    """Seconds per microbatch per program stage, and the per-iteration extras around the pipeline."""

    F: tuple[float, ...]
    B: tuple[float, ...]
    I: tuple[float, ...]  # noqa: E741 - the papers' name
    W: tuple[float, ...]
    message: float  # one pipeline hop
    reduce: tuple[float, ...]  # per stage: dp (and replica) gradient reduction issued at REDUCE_GRAD
    after_step: tuple[float, ...]  # per stage: ZeRO 1-2 parameter all-gather after the step
    step: tuple[float, ...]  # per stage: the optimizer step (memory-bound)
    stage_params: tuple[float, ...]  # parameters per GPU of each stage
    tp_comm: tuple[float, ...]  # per stage, per microbatch: tensor-parallel time inside F+B
    zero_gather: tuple[float, ...]  # per stage, per microbatch: ZeRO-3 gathers inside F+B
    waits: tuple[dict[str, float], ...] = ()  # per stage, of F/B/I/W: seconds in blocking collectives (no core)
    all_to_all: tuple[float, ...] = ()  # per stage, per microbatch: expert-parallel all-to-alls inside F+B
    expert_params: tuple[float, ...] = ()  # per stage: the routed experts' share of stage_params (already / ep)
    exchanges: tuple[tuple[float, float], ...] = ()  # per stage: the all-to-alls inside F and inside B
    step_gather: tuple[float, ...] = ()  # per stage, per step: ZeRO-3 reshard="step"'s gathers in the first forward
    unit_pairs: tuple[float, ...] = ()  # per stage: parameters per GPU of its largest two consecutive ZeRO-3 units

    def once_a_step(self, stages: Sequence[int]) -> float:
        """Seconds a step of a rank holding `stages` takes beyond its pipeline ops: its optimizer steps and ZeRO 1-2's
        gathers after them; with ZeRO-3 reshard="step" the exposed gathers of every stage up to its last, since the
        step's first microbatch passes the stages in order, each stage's first forward waiting for its own."""
        chain = sum(self.step_gather[:max(stages) + 1]) if self.step_gather and stages else 0.0
        return sum(self.step[s] + self.after_step[s] for s in stages) + chain

    def simulator_cost(self) -> Cost:
        """The pipeline part for `pipedsl.simulate`; REDUCE_GRAD/step are added around it (async).  An overlapped
        pair hides each half's all-to-alls behind the other's compute (runtime/overlap.py): per stage
        `exchange_f` / `exchange_b`."""
        per_stage: dict[int, dict[str, float]] = {
            s: {"F": self.F[s], "B": self.B[s], "I": self.I[s], "W": self.W[s]} for s in range(len(self.F))}
        for s, (f, b) in enumerate(self.exchanges):
            if f or b:
                per_stage[s].update(exchange_f=f, exchange_b=b)
        return Cost(F=self.F[0], B=self.B[0], I=self.I[0], W=self.W[0], comm=self.message, per_stage=per_stage)


def prefetched(gathers: Sequence[float], computes: Sequence[float]) -> float:
    """Seconds of ZeRO-3 gathers left on the critical path when each unit's gather is issued as the
    previous unit starts computing (`parallel/zero.py` prefetches the next unit in execution order):
    the first gather whole, then each one's excess over the compute it overlaps."""
    if not gathers:
        return 0.0
    return gathers[0] + sum(max(0.0, g - c) for g, c in zip(gathers[1:], computes))


@dataclass(frozen=True)
class Zero3Exposed:
    """Seconds of a stage's ZeRO-3 gathers left on the critical path: in each F, B, I and W (reshard="unit"), or
    once a step (reshard="step": in the step's first forward)."""

    F: float = 0.0
    B: float = 0.0
    I: float = 0.0  # noqa: E741 - the papers' name
    W: float = 0.0
    once: float = 0.0


def zero3_exposed(gathers: Sequence[float], forward: Sequence[float], backward: Sequence[float],
                  input_grad: Sequence[float], reshard: str) -> Zero3Exposed:
    """ZeRO-3's exposed gathers for a stage of units whose `gathers` and computes (forward, backward, the input
    gradient of a split backward) are given in forward order, as `parallel/zero.py` runs them: "unit" gathers on
    entry to every F, B and I, the next unit prefetched (`prefetched`; backward in reverse order), and every unit
    first for a W (`before_weight_pass`, one after another); "step" gathers each unit once, in the step's first
    forward, and holds it to the reduction."""
    if reshard == "step":
        return Zero3Exposed(once=prefetched(gathers, forward))
    back = list(gathers)[::-1]
    return Zero3Exposed(prefetched(gathers, forward), prefetched(back, list(backward)[::-1]),
                        prefetched(back, list(input_grad)[::-1]), sum(gathers))


def stage_layers(model: ModelSpec, layout: Layout, stages: int) -> list[int] | None:
    """The decoder layers of each of `stages` program stages, the embedding on the first and the output layer on
    the last.  `layout.split == "even"`: the same number on every stage (Megatron-LM's split; None when they do
    not divide).  `"balanced"`: the pieces [embedding, layers…, head] cut where the heaviest stage's forward
    FLOPs are least and, among those cuts, the most even (`partition.even_sizes`, what `pipedsl train --split
    flops` does): a large vocabulary's head takes the place of layers on the last stage (None when the pieces
    are fewer than the stages, or the layers more than `MAX_BALANCED_LAYERS`)."""
    L = model.layers
    if layout.split == "even":
        return [L // stages] * stages if L % stages == 0 else None
    if stages > L + 2 or L > MAX_BALANCED_LAYERS:
        return None
    return list(_balanced_layers(model, stages))


def piece_flops(model: ModelSpec) -> list[float]:
    """The forward FLOPs of a sample through each piece of [embedding, layers…, head]: what a balanced split
    balances (the embedding's lookup counted as none)."""
    return list(_piece_flops(model))


@lru_cache(maxsize=256)  # a function of the model alone, asked for every fitted split the search tries
def _piece_flops(model: ModelSpec) -> tuple[float, ...]:
    return (0.0, *(model.layer_flops(1, model.is_moe_layer(i)) for i in range(model.layers)), model.logit_flops(1))


@lru_cache(maxsize=4096)
def _balanced_layers(model: ModelSpec, stages: int) -> tuple[int, ...]:
    sizes = even_sizes(piece_flops(model), stages)
    sizes[0] -= 1  # the embedding
    sizes[-1] -= 1  # the head
    return tuple(sizes)


def unit_pair(units: Sequence[float]) -> float:
    """The most parameters ZeRO-3 (reshard="unit") holds gathered at once over `units` in execution order: the
    running unit and the next one, prefetched."""
    return max((a + b for a, b in zip(units, units[1:])), default=units[0] if units else 0.0)


def piece_params(model: ModelSpec, layout: Layout) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per piece of [embedding, layers…, head]: its parameters per GPU, and the routed experts' share of them (already
    / ep): what `stage_costs` gives a stage holding those pieces (`stage_params`, `expert_params`)."""
    return _piece_params(model, layout.tp, layout.ep)


@lru_cache(maxsize=256)
def _piece_params(model: ModelSpec, t: int, ep: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    params, experts = [model.embedding_params / t], [0.0]
    for i in range(model.layers):
        moe = model.is_moe_layer(i)
        params.append(model.moe_block_params_per_gpu(t, ep) if moe else model.layer_params_per_gpu(t))
        experts.append(model.moe_layer_expert_params / ep if moe else 0.0)
    params.append((model.vocab * model.hidden + 2 * model.hidden) / t)  # the output layer, the final norm
    experts.append(0.0)
    return tuple(params), tuple(experts)


def stage_costs(model: ModelSpec, cluster: ClusterSpec, layout: Layout, stages: int, replicas: int = 1,
                layers: Sequence[int] | None = None) -> StageCosts:
    """Costs of each of `stages` program stages (`layers` each, or split by `stage_layers`; embedding on the
    first, output layer on the last) for `layout` on `cluster`.  Cached: they do not depend on the schedule,
    its parameters or the number of microbatches, which the search varies most."""
    layers = list(layers) if layers is not None else stage_layers(model, layout, stages)
    assert layers is not None, "stage_costs: the layers do not split into the stages (search.py checks first)"
    return _stage_costs(model, cluster, tuple(getattr(layout, name) for name in _COST_FIELDS), stages, replicas,
                        tuple(layers))


# The fields of a layout its stage costs depend on: all but the schedule, its parameters, M and the split (the costs
# are given the layers).  The search asks for the costs of every candidate: a tuple of them keys the cache faster
# than a stripped copy of the layout would.
_COST_FIELDS = tuple(f.name for f in fields(Layout) if f.name not in ("schedule", "microbatches", "params", "split"))


_Collective = Callable[[float, int, float, float], float]


@dataclass(frozen=True)
class _Terms:
    """What every stage and block of one layout shares, worked out once so each helper prices a quantity the
    same way: the tp group's rate, the links, and a block's own overheads and tensor-parallel collectives."""

    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    q: int  # 3-D tp: q with q³ = tp; 0 for 1-D
    rate: float  # FLOP/s of the tp group
    gather: _Collective  # ZeRO's and the tp hop's all-gather (gloo: as slow as an all-reduce)
    act: float  # bytes of one [b, s, h] activation
    tp_link: tuple[float, float]  # (bandwidth, latency) of the tp group's all-reduces
    dp_link: tuple[float, float]  # and of the dp group's collectives (the experts' dp/ep replicas alike)
    pp_link: tuple[float, float]  # and of a pipeline hop (the stage replicas' all-reduce too)
    core: float  # a block's attention-core forward FLOPs
    fixed: float  # per pass of a block (F 1, B 2, I 1 + W 1): its overhead and 1-D tp's own work
    flash_backward: float  # a fused attention kernel's backward recomputing QKᵀ
    tp_block_fwd: float  # a block's tensor-parallel collectives in the forward
    tp_block_bwd: float  # and in the backward


def _layout_terms(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> _Terms:
    """The shared terms of `layout` on `cluster` (`_Terms`)."""
    b, t = layout.microbatch, layout.tp
    q = tp_degree_3d(t) if layout.tp_mode == "3d" else 0
    rate = cluster.peak_flops * cluster.gemm_efficiency * t
    act = BYTES_FP16 * b * model.seq * model.hidden
    # one block: GEMMs and attention at the tp group's rate, the memory-bound kernels streaming what it stores
    core = model.attention_core_flops(b)
    own = cluster.sp_own if layout.sp else cluster.tp_own
    tp_own = own[0] + b * own[1] if t > 1 and not q else 0.0
    fixed = (cluster.layer_overhead + tp_own) / 3
    flash_backward = core / 2 / rate if layout.fused else 0.0
    tp_block_fwd, tp_block_bwd = _tp_block_collectives(model, cluster, layout, q, act)
    return _Terms(model, cluster, layout, q, rate, _zero_gather(cluster), act, cluster.tp_link(t),
                  cluster.link(t * layout.dp), pipeline_link(cluster, layout), core, fixed,
                  flash_backward, tp_block_fwd, tp_block_bwd)


def _zero_gather(cluster: ClusterSpec) -> _Collective:
    """The all-gather ZeRO and the tp pipeline hop run: gloo's is as slow as an all-reduce."""
    return all_reduce if cluster.all_gather_as_all_reduce else all_gather


def _sp_gather(cluster: ClusterSpec, t: int, size: float) -> float:
    """One of sequence parallelism's all-gathers (or reduce-scatters): as calibration timed them inside a step
    where it did, else a ring over the tp link."""
    if cluster.tp_gather[1] > 0:
        return all_gather(size, t, *cluster.tp_link(t, gather=True))
    return _zero_gather(cluster)(size, t, *cluster.tp_link(t))


def _tp_block_collectives(model: ModelSpec, cluster: ClusterSpec, layout: Layout, q: int,
                          act: float) -> tuple[float, float]:
    """Seconds of one block's tensor-parallel collectives in its forward and in its backward, as the runtime's
    1-D (with or without SP) or 3-D tensor parallelism issues them."""
    t, h, sp = layout.tp, model.hidden, layout.sp
    tp_bw, tp_lat = cluster.tp_link(t)
    if q:  # per block: activations 16·[b,s,h], weights 12h²; (q-1)/q³ of each moved, 3 collectives per linear
        moved = (q - 1) / q ** 3 * (16 * act + BYTES_FP16 * 12 * h * h)
        tp_block_fwd = moved / tp_bw + 12 * (q - 1) * tp_lat
        return tp_block_fwd, tp_block_fwd
    # two all-reduces, or with SP two all-gathers + two reduce-scatters: the same ring time (on NCCL)
    tp_block_fwd = tp_block_bwd = 2 * all_reduce(act, t, tp_bw, tp_lat)
    if sp and cluster.tp_gather[1] > 0:  # calibrated: SP's gathers and scatters priced as timed in a step
        tp_block_fwd = tp_block_bwd = 4 * _sp_gather(cluster, t, act)
    elif sp and cluster.reduce_scatter_as_all_reduce:  # gloo: each reduce-scatter an all-reduce
        tp_block_fwd = tp_block_bwd = 2 * all_reduce(act, t, tp_bw, tp_lat) + 2 * _sp_gather(cluster, t, act)
    if sp and model.hf:  # torch's SP: each norm weight's Partial gradient all-reduced as it is computed
        tp_block_bwd += 2 * all_reduce(BYTES_FP16 * h, t, tp_bw, tp_lat)
    elif sp:  # Megatron's SP (tp1d.py): the column-parallel inputs, kept as shards, gathered again
        tp_block_bwd += 2 * _sp_gather(cluster, t, act)
    return tp_block_fwd, tp_block_bwd


def pipeline_link(cluster: ClusterSpec, layout: Layout) -> tuple[float, float]:
    """(bandwidth, latency) of a pipeline hop: InfiniBand once the layout spans more than a node."""
    if layout.gpus > cluster.gpus_per_node:
        return cluster.inter_bandwidth, cluster.inter_latency
    return cluster.intra_bandwidth, cluster.intra_latency


def _pipeline_message(terms: _Terms) -> float:
    """Seconds of one pipeline hop: a [b, s, h]/t message, then (1-D tp without SP) Megatron's all-gather of it
    inside the node; with SP a stage passes its sequence shard."""
    t, (pp_bw, pp_lat) = terms.layout.tp, terms.pp_link
    message = pp_lat + terms.act / t / pp_bw
    if t > 1 and not terms.q and not terms.layout.sp:
        message += terms.gather(terms.act, t, *terms.cluster.link(t))
    return message


def _block_kind(terms: _Terms, moe: bool) -> _Block:
    """One dense or MoE block as one GPU runs it: every block of a kind costs the same, so it is priced once."""
    model, cluster, layout = terms.model, terms.cluster, terms.layout
    b, t = layout.microbatch, layout.tp
    stored = model.layer_activation_bytes(b, t, "none", layout.sp, layout.fused, moe)
    # the tp group's FLOPs (at `rate`, the group's): what every tp rank runs whole counts t times
    flops = model.layer_flops(b, moe) + (t - 1) * model.tp_whole_flops(b)
    block = flops / terms.rate + stored * cluster.activation_passes / cluster.hbm_bandwidth
    if not moe:
        again = _recomputed(terms, moe, stored, block + terms.fixed + terms.tp_block_fwd)
        return _Block(flops, block, again, model.layer_params_per_gpu(t), 0.0, 0.0, 0.0, terms.tp_block_fwd,
                      terms.tp_block_bwd)
    # an MoE block runs on its tp rank's share of the tokens (parallel/moe_tp.py): without SP the share is taken
    # and its outputs all-gathered (the gradients likewise, backward) in place of the MLP's all-reduce; with SP
    # the share is the sequence shard, and the MLP's collectives go
    moe_tp = 0.0 if layout.sp or t == 1 else terms.gather(terms.act, t, *terms.tp_link)
    tp_f, tp_b = terms.tp_block_fwd / 2 + moe_tp, terms.tp_block_bwd / 2 + moe_tp
    a2a = _moe_exchange(terms)
    again = _recomputed(terms, moe, stored, block + terms.fixed + tp_f)
    summed = model.moe_mlp_params_per_gpu(layout.ep) if t > 1 else 0.0
    return _Block(flops, block, again, model.moe_block_params_per_gpu(t, layout.ep),
                  model.moe_layer_expert_params / layout.ep, a2a, a2a if layout.recompute == "full" else 0.0, tp_f,
                  tp_b, summed)


def _moe_exchange(terms: _Terms) -> float:
    """Seconds of an MoE block's forward all-to-alls (dispatch, combine) over its ep ranks (dp ranks, t apart),
    each carrying its tp rank's 1/t of the microbatch's tokens."""
    model, layout = terms.model, terms.layout
    ep, t = layout.ep, layout.tp
    ep_bw, ep_lat = terms.cluster.link(t * ep)
    tokens = layout.microbatch * model.seq / t
    return 2 * all_to_all(moe_all_to_all_bytes(model, tokens, ep), ep, ep_bw, ep_lat)


def _recomputed(terms: _Terms, moe: bool, stored: float, full: float) -> float:
    """Seconds a block runs again in its backward: the whole forward (`full`) under full recomputation; under
    selective what it recomputes and the memory-bound kernels on what it no longer stores."""
    model, cluster, layout = terms.model, terms.cluster, terms.layout
    if layout.recompute == "full":
        return full
    if layout.recompute != "selective":
        return 0.0
    b, t = layout.microbatch, layout.tp
    dropped = stored - model.layer_activation_bytes(b, t, "selective", layout.sp, layout.fused, moe)
    again = model.recomputed_flops("selective", layout.fused, b) / terms.rate + \
        dropped * cluster.activation_passes / cluster.hbm_bandwidth
    if model.hf:  # the attention module again, with its collective (all-reduce, or all-gather + reduce-scatter)
        again += terms.tp_block_fwd / 2
    return again

class UnitWork(NamedTuple):
    """One unit of a stage (an embedding, a layer, a head) as ZeRO-3 gathers and runs it: its parameters per GPU
    (`experts` of them routed experts, already / ep) and its seconds in F, B and I."""

    params: float
    experts: float
    forward: float
    backward: float
    input_grad: float


@dataclass(frozen=True)
class StageWork:
    """One program stage's units summed, per microbatch on one GPU, for any model kind: what its F, B, I, W and its
    once-a-step terms are made of (`price_stages`).  Each kind sums its own units in its own order — a decoder by
    block kind (`_decoder_stage_work`), an encoder-decoder unit by unit (`encdec_stage_costs`) — so each keeps its
    rounding; what is not in a kind (tp, MoE, a tied weight) is 0."""

    forward: float  # compute seconds of F
    backward_extra: float  # compute seconds B adds to twice the forward (a fused attention's recomputed QKᵀ)
    input_grad: float  # compute seconds of I (a split backward's input gradient)
    weight_grad: float  # and of W
    recompute: float  # seconds recomputed in the backward
    params: float  # parameters per GPU (over tp, the routed experts over ep)
    units: tuple[UnitWork, ...]  # in forward order
    experts: float = 0.0  # of which routed experts
    summed: float = 0.0  # parameters whose gradient each tp rank holds part of, summed over tp once a step
    tied: float = 0.0  # parameters of a weight tied to a copy on another stage (summed at the step end)
    tp_fwd: float = 0.0  # tensor-parallel seconds in the forward
    tp_bwd: float = 0.0  # and in the backward
    tp_again: float = 0.0  # and in a recomputed forward
    a2a_f: float = 0.0  # expert-parallel all-to-alls in the forward
    a2a_b: float = 0.0  # and in the backward (+ a recomputed forward's)


class StageHoldings(NamedTuple):
    """The parameters each program stage of a decoder holds per GPU: the columns of `StageCosts` a rank's memory
    reads (named alike), without its times, so that the search tests the memory before it prices anything."""

    stage_params: tuple[float, ...]
    expert_params: tuple[float, ...]  # the routed experts' share of stage_params (already / ep)
    unit_pairs: tuple[float, ...]  # parameters of a stage's largest two consecutive ZeRO-3 units


def stage_holdings(model: ModelSpec, layout: Layout, stages: int, layers: Sequence[int]) -> StageHoldings:
    """`StageHoldings` of `stages` program stages holding `layers` decoder layers each: the very numbers
    `stage_costs` gives (`_held` sums them for both)."""
    return _stage_holdings(model, layout.tp, layout.ep, stages, tuple(layers))


@lru_cache(maxsize=4096)  # a function of the split and two of a layout's fields, asked for every candidate
def _stage_holdings(model: ModelSpec, t: int, ep: int, stages: int, layers: tuple[int, ...]) -> StageHoldings:
    firsts = [sum(layers[:st]) for st in range(stages)]
    held = [_held(model, t, ep, first, n, st == 0, st == stages - 1)
            for st, (first, n) in enumerate(zip(firsts, layers))]
    return StageHoldings(tuple(h[0] for h in held), tuple(h[1] for h in held), tuple(unit_pair(h[2]) for h in held))


@lru_cache(maxsize=4096)
def _held(model: ModelSpec, t: int, ep: int, first: int, n: int, embed_first: bool,
          head_last: bool) -> tuple[float, float, tuple[float, ...]]:
    """A stage's parameters per GPU (over tp, the routed experts over ep), its routed experts' and each of its units'
    in forward order: the `n` blocks from layer `first` summed by kind, the embedding and head where it holds them."""
    dense = model.layer_params_per_gpu(t)
    moe, routed = (model.moe_block_params_per_gpu(t, ep), model.moe_layer_expert_params / ep) if model.moe \
        else (dense, 0.0)
    n_moe = model.moe_layers_in(first, n)
    counts = ((n - n_moe, dense, 0.0), (n_moe, moe, routed))
    params = sum(c * p for c, p, _ in counts)
    units = tuple(moe if model.is_moe_layer(i) else dense for i in range(first, first + n))
    if embed_first:
        params += model.embedding_params / t
        units = (model.embedding_params / t, *units)
    if head_last:
        params += _head_params(model, t)
        units = (*units, _head_params(model, t))
    return params, sum(c * e for c, _, e in counts), units


def _decoder_stage_work(terms: _Terms, kinds: dict[bool, _Block], first: int, n: int, embed_first: bool,
                        head_last: bool) -> StageWork:
    """Sum the `n` blocks from layer `first` by kind, and add the embedding and head where the stage holds them."""
    model, layout = terms.model, terms.layout
    b, t = layout.microbatch, layout.tp
    n_moe = model.moe_layers_in(first, n)
    counts = ((n - n_moe, kinds[False]), (n_moe, kinds.get(True, kinds[False])))
    gemm = sum(c * (k.flops - terms.core) for c, k in counts)  # the tp group's FLOPs outside the attention cores
    params, experts, _ = _held(model, t, layout.ep, first, n, embed_first, head_last)
    head = 0.0
    if head_last:
        head = model.logit_flops(b) / terms.rate
        gemm += model.logit_flops(b)
    blocks_tp_fwd = sum(c * k.tp_fwd for c, k in counts)
    a2a_f = sum(c * k.a2a for c, k in counts)
    fwd = sum(c * (k.block + terms.fixed) for c, k in counts) + head
    fb = terms.flash_backward
    split = (terms.cluster.split_backward - 1) * 3 * fwd / 2  # a split backward's extra work
    per_kind = {moe: UnitWork(k.params, k.experts, _block_forward(terms, k), _block_backward(terms, k),
                              _block_input_grad(terms, k)) for moe, k in kinds.items()}
    units = tuple(per_kind[model.is_moe_layer(i)] for i in range(first, first + n))
    if embed_first:
        units = (UnitWork(model.embedding_params / t, 0.0, 0.0, 0.0, 0.0), *units)
    if head_last:
        units = (*units, UnitWork(_head_params(model, t), 0.0, head, 2 * head, head))
    return StageWork(fwd, n * fb, (gemm + 2 * n * terms.core) / terms.rate + n * (terms.fixed + fb) + split,
                     gemm / terms.rate + n * terms.fixed + split,
                     recompute=sum(c * k.again for c, k in counts),
                     params=params, units=units,
                     experts=experts,
                     summed=sum(c * k.summed for c, k in counts),
                     tp_fwd=_stage_tp_forward(terms, blocks_tp_fwd, embed_first, head_last),
                     tp_bwd=sum(c * k.tp_bwd for c, k in counts),
                     tp_again=_tp_recomputed(terms, blocks_tp_fwd, n),
                     a2a_f=a2a_f,
                     a2a_b=a2a_f + sum(c * k.a2a_again for c, k in counts))


def _head_params(model: ModelSpec, t: int) -> float:
    """Parameters per GPU of the last stage's output layer (the GPT's copy of the word embedding) and final norm."""
    h = model.hidden
    return (model.vocab * h + 2 * h) / t


def _stage_tp_forward(terms: _Terms, blocks_tp_fwd: float, embed_first: bool, head_last: bool) -> float:
    """The stage's tensor-parallel seconds in the forward: its blocks', and 1-D tp's vocabulary-parallel embedding
    and cross-entropy where it holds them."""
    t, b = terms.layout.tp, terms.layout.microbatch
    tp_bw, tp_lat = terms.tp_link
    tp_fwd = blocks_tp_fwd
    if t > 1 and not terms.q and embed_first:  # the vocabulary-parallel embedding sums its partial lookups
        tp_fwd += all_reduce(terms.act, t, tp_bw, tp_lat)
    if t > 1 and not terms.q and head_last:  # vocabulary-parallel cross-entropy: max, Σexp, target logit
        tp_fwd += 3 * all_reduce(4 * b * terms.model.seq, t, tp_bw, tp_lat)
    return tp_fwd


def _block_forward(terms: _Terms, k: _Block) -> float:
    """Seconds of one block's F: what a ZeRO-3 prefetch of the next unit overlaps."""
    return k.block + terms.fixed + k.tp_fwd + k.a2a


def _block_backward(terms: _Terms, k: _Block) -> float:
    """Seconds of one block's B."""
    return 2 * (k.block + terms.fixed) + terms.flash_backward + k.tp_bwd + k.again + k.a2a + k.a2a_again


def _block_input_grad(terms: _Terms, k: _Block) -> float:
    """Seconds of one block's I, a split backward's extra work included."""
    split = (terms.cluster.split_backward - 1) * 3 * (k.block + terms.fixed) / 2
    return ((k.flops + terms.core) / terms.rate + terms.fixed + split + terms.flash_backward + k.tp_bwd + k.again
            + k.a2a + k.a2a_again)


def _tp_recomputed(terms: _Terms, blocks_tp_fwd: float, n: int) -> float:
    """Tensor-parallel seconds a recomputed forward adds to the backward of a stage of `n` blocks."""
    if terms.layout.recompute == "full":
        return blocks_tp_fwd
    if terms.layout.recompute == "selective" and terms.model.hf:
        return n * terms.tp_block_fwd / 2
    return 0.0


def param_gather(cluster: ClusterSpec, layout: Layout, dense: float, experts: float = 0.0) -> float:
    """Seconds to all-gather `dense` parameters over dp and `experts` routed-expert parameters over their own
    dp/ep replicas (ZeRO-3's unit gathers, ZeRO 1-2's after the step): every model kind's."""
    gather, (dp_bw, dp_lat) = _zero_gather(cluster), cluster.link(layout.tp * layout.dp)
    return (gather(PARAM_BYTES * dense, layout.dp, dp_bw, dp_lat)
            + (gather(PARAM_BYTES * experts, layout.dp // layout.ep, dp_bw, dp_lat) if experts else 0.0))


def _stage_zero3(cluster: ClusterSpec, layout: Layout, units: Sequence[UnitWork]) -> Zero3Exposed:
    """A stage's exposed ZeRO-3 gathers, unit by unit; none below ZeRO-3."""
    if layout.zero < 3:
        return Zero3Exposed()
    gathers = [param_gather(cluster, layout, u.params - u.experts, u.experts) for u in units]
    return zero3_exposed(gathers, [u.forward for u in units], [u.backward for u in units],
                         [u.input_grad for u in units], layout.reshard)


def gradient_sync(cluster: ClusterSpec, layout: Layout, params: float, experts: float = 0.0, summed: float = 0.0,
                  replicas: int = 1) -> tuple[float, float]:
    """Seconds of a stage's gradient reduction at REDUCE_GRAD (its `replicas` in the pipeline, the MoE parts over tp,
    then dp: all-reduce, or ZeRO's reduce-scatter) and of ZeRO 1-2's parameter all-gather after the step, for
    `params` parameters per GPU, `experts` of them routed experts (already / ep), `summed` of them held in part by
    each tp rank: every model kind's."""
    dp_bw, dp_lat = cluster.link(layout.tp * layout.dp)
    expert_dp = layout.dp // layout.ep
    grad = state_bytes("bf16", layout.grads).grad  # reduced in the dtype they accumulate in
    grad_bytes = grad * (params - experts)
    replica = all_reduce(grad * params, replicas, *pipeline_link(cluster, layout))
    replica += all_reduce(grad * summed, layout.tp, *cluster.tp_link(layout.tp)) if summed else 0.0
    if layout.zero == 0:  # the experts' gradients over their own replicas (dp/ep), the rest over dp
        return (replica + all_reduce(grad_bytes, layout.dp, dp_bw, dp_lat)
                + (all_reduce(grad * experts, expert_dp, dp_bw, dp_lat) if experts else 0.0)), 0.0
    # reduce-scatter at REDUCE_GRAD (ZeRO's reduce="step"), overlapping the rest of the cooldown
    scatter = all_reduce if cluster.reduce_scatter_as_all_reduce else all_gather
    reduce = (replica + scatter(grad_bytes, layout.dp, dp_bw, dp_lat)
              + (scatter(grad * experts, expert_dp, dp_bw, dp_lat) if experts else 0.0))
    return reduce, (param_gather(cluster, layout, params - experts, experts) if layout.zero < 3 else 0.0)


def tie_sync(cluster: ClusterSpec, layout: Layout, tied: float) -> float:
    """Seconds to sum the gradients of a weight of `tied` parameters whose two copies live on two stages
    (`runtime/ties.py`), after the data-parallel reduction: ZeRO 0 all-reduces the full gradient over the holding
    ranks of every replica, ZeRO 1-3 the 1/dp slice over the two holding ranks."""
    if not tied:
        return 0.0
    tie_bytes = state_bytes("bf16", layout.grads).grad * tied
    if layout.zero == 0:
        return all_reduce(tie_bytes, 2 * layout.dp, *cluster.link(layout.gpus))
    return all_reduce(tie_bytes / layout.dp, 2, *pipeline_link(cluster, layout))


def optimizer_step(cluster: ClusterSpec, layout: Layout, params: float, experts: float = 0.0) -> float:
    """Seconds of a stage's Adam step, memory-bound, over the parameters its rank updates (a 1/dp shard with ZeRO;
    the routed experts' 1/(dp/ep)): every model kind's."""
    shard = (params - experts) / layout.dp + experts / (layout.dp // layout.ep) if layout.zero >= 1 else params
    return shard * ADAM_BYTES_PER_PARAM / cluster.hbm_bandwidth


class _StageRow(NamedTuple):
    """One stage's entry of each per-stage field of `StageCosts` (named alike)."""

    F: float
    B: float
    I: float  # noqa: E741 - the papers' name
    W: float
    reduce: float
    after_step: float
    step: float
    stage_params: float
    tp_comm: float
    zero_gather: float
    waits: dict[str, float]
    all_to_all: float
    expert_params: float
    exchanges: tuple[float, float]
    step_gather: float
    unit_pairs: float


def _stage_row(cluster: ClusterSpec, layout: Layout, work: StageWork, replicas: int) -> _StageRow:
    """Every per-stage cost of a stage (`StageCosts`'s fields but the message): compute, collectives on the critical
    path, the exposed ZeRO-3 gathers and the per-op overhead in F, B, I and W; the once-a-step terms."""
    z = _stage_zero3(cluster, layout, work.units)
    op = cluster.op_overhead
    F = work.forward + work.tp_fwd + z.F + op + work.a2a_f
    B = 2 * work.forward + work.backward_extra + work.tp_bwd + work.recompute + z.B + op + work.a2a_b
    I = work.input_grad + work.tp_bwd + work.recompute + z.I + op + work.a2a_b  # noqa: E741 - the papers' name
    W = work.weight_grad + z.W + op
    reduce, after = gradient_sync(cluster, layout, work.params, work.experts, work.summed, replicas)
    step = optimizer_step(cluster, layout, work.params, work.experts)
    tp_again = work.tp_again
    waits = {"F": work.tp_fwd + z.F + work.a2a_f, "B": work.tp_bwd + tp_again + z.B + work.a2a_b,
             "I": work.tp_bwd + tp_again + z.I + work.a2a_b, "W": z.W}
    return _StageRow(F, B, I, W, reduce, tie_sync(cluster, layout, work.tied) + after, step, work.params,
                     work.tp_fwd + work.tp_bwd + tp_again, z.F + z.B, waits, work.a2a_f + work.a2a_b, work.experts,
                     (work.a2a_f, work.a2a_b), z.once, unit_pair([u.params for u in work.units]))


def price_stages(cluster: ClusterSpec, layout: Layout, works: Sequence[StageWork], message: float,
                 replicas: int = 1) -> StageCosts:
    """The cost function of every model kind: `StageCosts` of the program stages whose units sum to `works`, one
    pipeline hop taking `message` seconds, each stage in `replicas` copies in the pipeline."""
    once: dict[int, _StageRow] = {}  # a stage whose work is another's (`_stage_costs`: alike stages) is priced once
    for work in works:
        if id(work) not in once:
            once[id(work)] = _stage_row(cluster, layout, work, replicas)
    rows = [once[id(work)] for work in works]
    if not rows:
        return StageCosts(message=message, **{name: () for name in _StageRow._fields})
    columns = dict(zip(_StageRow._fields, map(tuple, zip(*rows))))
    columns["waits"] = _unshared(columns["waits"])
    return StageCosts(message=message, **columns)


def _unshared(dicts: Sequence[dict[str, float]]) -> tuple[dict[str, float], ...]:
    """`dicts`, each one a stage's own: a stage priced as an earlier one (`price_stages`) gets a copy."""
    seen: set[int] = set()
    out = []
    for d in dicts:
        out.append(dict(d) if id(d) in seen else d)
        seen.add(id(d))
    return tuple(out)


@lru_cache(maxsize=8192)
def _stage_costs(model: ModelSpec, cluster: ClusterSpec, values: tuple, stages: int, replicas: int,
                 layers: tuple[int, ...]) -> StageCosts:
    """`stage_costs` of a layout of these `_COST_FIELDS` `values`, so the cache hits across schedules.  The stages'
    work does not depend on ZeRO (`_stage_works`): only its pricing does."""
    layout = Layout(**dict(zip(_COST_FIELDS, values)), schedule="", microbatches=0, params=(), split="even")
    works, message = _stage_works(model, cluster, replace(layout, zero=0, grads="bf16", zero_reshard="auto"), stages,
                                  layers)
    return price_stages(cluster, layout, works, message, replicas)


@lru_cache(maxsize=4096)  # the ZeRO stages and gradient dtypes of a layout share it
def _stage_works(model: ModelSpec, cluster: ClusterSpec, layout: Layout, stages: int,
                 layers: tuple[int, ...]) -> tuple[tuple[StageWork, ...], float]:
    """Each stage's `StageWork` (alike stages one object) and the pipeline hop's seconds.  Each kind of block is
    priced once, then every stage sums its own."""
    terms = _layout_terms(model, cluster, layout)
    kinds = {False: _block_kind(terms, False)}
    if model.moe:
        kinds[True] = _block_kind(terms, True)
    firsts = [sum(layers[:st]) for st in range(stages)]
    # a stage's work depends on `first` only through which of its layers are MoE: stages alike are summed once
    keys = [(tuple(model.is_moe_layer(i) for i in range(first, first + n)), st == 0, st == stages - 1)
            for st, (first, n) in enumerate(zip(firsts, layers))]
    once: dict[tuple, StageWork] = {}
    for key, first, n in zip(keys, firsts, layers):
        if key not in once:
            once[key] = _decoder_stage_work(terms, kinds, first, n, *key[1:])
    return tuple(once[key] for key in keys), _pipeline_message(terms)


# ------------------------------------------------------------------ encoder-decoders: units at tp = 1


SPLITS = ("time", "count", "params")


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


def encdec_stage_costs(spec: EncDecSpec, cluster: ClusterSpec, layout: Layout, bounds: Sequence[int],
                       replicas: int = 1) -> EncDecStages:
    """Costs of each program stage holding units `bounds[s]:bounds[s+1]` for `layout` (tp = 1) on `cluster`: its
    units summed one by one (`StageWork`), priced by the cost function of every model kind (`price_stages`)."""
    units = spec.units()
    b, mode = layout.microbatch, layout.recompute
    pp_bw, pp_lat = pipeline_link(cluster, layout)
    cuts = list(bounds[1:-1])
    message_bytes = max((spec.boundary_bytes(c, b) for c in cuts), default=0.0)
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
