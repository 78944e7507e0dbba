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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from pipedsl.limits import MAX_BALANCED_LAYERS
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout
from pipedsl.plan.memory import OPTIMIZER_BYTES, PARAM_BYTES, state_bytes
from pipedsl.plan.model import BYTES_FP16, ModelSpec
from pipedsl.plan.partition import even_sizes
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
    return [0.0, *(model.layer_flops(1, model.is_moe_layer(i)) for i in range(model.layers)), model.logit_flops(1)]


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
    alike = replace(layout, schedule="", microbatches=0, params=(), split="even")
    return _stage_costs(model, cluster, alike, stages, replicas, tuple(layers))


@lru_cache(maxsize=8192)
def _stage_costs(model: ModelSpec, cluster: ClusterSpec, layout: Layout, stages: int, replicas: int,
                 layers: tuple[int, ...]) -> StageCosts:
    b, t, h, s = layout.microbatch, layout.tp, model.hidden, model.seq
    starts = [sum(layers[:st]) for st in range(stages)]
    q = tp_degree_3d(t) if layout.tp_mode == "3d" else 0
    sp, fused, mode = layout.sp, layout.fused, layout.recompute
    rate = cluster.peak_flops * cluster.gemm_efficiency * t  # FLOP/s of the tp group

    gather = all_reduce if cluster.all_gather_as_all_reduce else all_gather  # gloo: as slow as an all-reduce
    act = BYTES_FP16 * b * s * h  # one [b, s, h] activation
    tp_bw, tp_lat = cluster.tp_link(t)
    in_step_gathers = cluster.tp_gather[1] > 0  # calibrated: SP's gathers and scatters priced as timed in a step
    gather_bw, gather_lat = cluster.tp_link(t, gather=True)

    def sp_gather(n: float) -> float:
        return all_gather(n, t, gather_bw, gather_lat) if in_step_gathers else gather(n, t, tp_bw, tp_lat)

    if q:  # per block: activations 16·[b,s,h], weights 12h²; (q-1)/q³ of each moved, 3 collectives per linear
        moved = (q - 1) / q ** 3 * (16 * act + BYTES_FP16 * 12 * h * h)
        tp_block_fwd = moved / tp_bw + 12 * (q - 1) * tp_lat
        tp_block_bwd = tp_block_fwd
    else:  # two all-reduces, or with SP two all-gathers + two reduce-scatters: the same ring time (on NCCL)
        tp_block_fwd = tp_block_bwd = 2 * all_reduce(act, t, tp_bw, tp_lat)
        if sp and in_step_gathers:
            tp_block_fwd = tp_block_bwd = 4 * sp_gather(act)
        elif sp and cluster.reduce_scatter_as_all_reduce:  # gloo: each reduce-scatter an all-reduce
            tp_block_fwd = tp_block_bwd = 2 * all_reduce(act, t, tp_bw, tp_lat) + 2 * sp_gather(act)
        if sp and model.hf:  # torch's SP: each norm weight's Partial gradient all-reduced as it is computed
            tp_block_bwd += 2 * all_reduce(BYTES_FP16 * h, t, tp_bw, tp_lat)
        elif sp:  # Megatron's SP (tp1d.py): the column-parallel inputs, kept as shards, gathered again
            tp_block_bwd += 2 * sp_gather(act)

    dp_bw, dp_lat = cluster.link(t * layout.dp)
    pp_hops_cross_nodes = layout.gpus > cluster.gpus_per_node
    pp_bw, pp_lat = (cluster.inter_bandwidth, cluster.inter_latency) if pp_hops_cross_nodes else \
        (cluster.intra_bandwidth, cluster.intra_latency)
    message = pp_lat + act / t / pp_bw
    if t > 1 and not q and not sp:  # Megatron's scatter/gather; with SP a stage passes its sequence shard
        message += gather(act, t, *cluster.link(t))

    # one block: GEMMs and attention at the tp group's rate, the memory-bound kernels streaming what it stores
    core = model.attention_core_flops(b)
    # per pass of a block: F 1, B 2 (I 1 + W 1); a 1-D tensor-parallel block's own work with it
    own = cluster.sp_own if sp else cluster.tp_own
    tp_own = own[0] + b * own[1] if t > 1 and not q else 0.0
    fixed = (cluster.layer_overhead + tp_own) / 3
    flash_backward = core / 2 / rate if fused else 0.0  # a fused kernel's backward recomputes QKᵀ
    ep = layout.ep
    ep_bw, ep_lat = cluster.link(t * ep)  # ep ranks are dp ranks, t apart
    # an MoE block runs on its tp rank's share of the tokens (parallel/moe_tp.py): its all-to-alls carry 1/t of the
    # microbatch; without SP the share is taken and its outputs all-gathered (the gradients likewise, backward) in
    # place of the MLP's all-reduce; with SP the share is the sequence shard, and the MLP's collectives go
    tokens = b * s / t
    moe_tp = 0.0 if sp or t == 1 else gather(act, t, tp_bw, tp_lat)

    def kind(moe: bool) -> _Block:
        stored = model.layer_activation_bytes(b, t, "none", sp, fused, moe)
        # the tp group's FLOPs (at `rate`, the group's): what every tp rank runs whole counts t times
        flops = model.layer_flops(b, moe) + (t - 1) * model.tp_whole_flops(b)
        block = flops / rate + stored * cluster.activation_passes / cluster.hbm_bandwidth
        a2a = 2 * all_to_all(moe_all_to_all_bytes(model, tokens, ep), ep, ep_bw, ep_lat) if moe else 0.0
        tp_f, tp_b = (tp_block_fwd / 2 + moe_tp, tp_block_bwd / 2 + moe_tp) if moe else (tp_block_fwd, tp_block_bwd)
        if mode == "full":
            again = block + fixed + tp_f
        elif mode == "selective":  # what it recomputes, and the memory-bound kernels on what it no longer stores
            dropped = stored - model.layer_activation_bytes(b, t, "selective", sp, fused, moe)
            again = model.recomputed_flops("selective", fused, b) / rate + \
                dropped * cluster.activation_passes / cluster.hbm_bandwidth
            if model.hf:  # the attention module again, with its collective (all-reduce, or all-gather + reduce-scatter)
                again += tp_block_fwd / 2
        else:
            again = 0.0
        if not moe:
            return _Block(flops, block, again, model.layer_params_per_gpu(t), 0.0, 0.0, 0.0, tp_f, tp_b)
        per_gpu = model.moe_block_params_per_gpu(t, ep)
        summed = model.moe_mlp_params_per_gpu(ep) if t > 1 else 0.0
        return _Block(flops, block, again, per_gpu, model.moe_layer_expert_params / ep, a2a,
                      a2a if mode == "full" else 0.0, tp_f, tp_b, summed)

    kinds = {False: kind(False)}
    if model.moe:
        kinds[True] = kind(True)
    expert_dp = layout.dp // ep  # the ranks holding the same experts
    expert_bw, expert_lat = dp_bw, dp_lat

    F, B, I, W, reduce, after, step, psi, tpc, zg, waits, a2a_time, expert_psi, exchanges, once, pairs = \
        ([] for _ in range(16))
    for st in range(stages):
        n, first = layers[st], starts[st]
        blocks = [kinds[model.is_moe_layer(i)] for i in range(first, first + n)]
        n_moe = model.moe_layers_in(first, n)
        counts = ((n - n_moe, kinds[False]), (n_moe, kinds.get(True, kinds[False])))
        gemm = sum(c * (k.flops - core) for c, k in counts)
        p_gpu = sum(c * k.params for c, k in counts)  # per GPU: over tp, the routed experts over ep
        experts = sum(c * k.experts for c, k in counts)
        summed = sum(c * k.summed for c, k in counts)
        head = 0.0
        if st == 0:
            p_gpu += model.embedding_params / t
        if st == stages - 1:
            head = model.logit_flops(b) / rate
            gemm += model.logit_flops(b)
            p_gpu += (model.vocab * h + 2 * h) / t  # the output layer (the GPT's copy of the word embedding), norm
        blocks_tp_fwd = sum(c * k.tp_fwd for c, k in counts)
        tp_fwd = blocks_tp_fwd
        if t > 1 and not q and st == 0:  # the vocabulary-parallel embedding sums its partial lookups
            tp_fwd += all_reduce(act, t, tp_bw, tp_lat)
        if t > 1 and not q and st == stages - 1:  # vocabulary-parallel cross-entropy: max, Σexp, target logit
            tp_fwd += 3 * all_reduce(4 * b * s, t, tp_bw, tp_lat)
        tp_bwd = sum(c * k.tp_bwd for c, k in counts)
        fwd = sum(c * (k.block + fixed) for c, k in counts) + head
        recompute = sum(c * k.again for c, k in counts)
        a2a_f = sum(c * k.a2a for c, k in counts)  # dispatch + combine of each MoE block
        a2a_b = a2a_f + sum(c * k.a2a_again for c, k in counts)  # their gradients (+ a recomputed forward's)
        op = cluster.op_overhead

        def layer_f(k: _Block) -> float:
            return k.block + fixed + k.tp_fwd + k.a2a

        def layer_b(k: _Block) -> float:
            return 2 * (k.block + fixed) + flash_backward + k.tp_bwd + k.again + k.a2a + k.a2a_again

        def layer_i(k: _Block) -> float:
            split = (cluster.split_backward - 1) * 3 * (k.block + fixed) / 2  # a split backward's extra work
            return ((k.flops + core) / rate + fixed + split + flash_backward + k.tp_bwd + k.again + k.a2a
                    + k.a2a_again)

        embed_first, head_last = st == 0, st == stages - 1
        pairs.append(unit_pair(piece_params(model, layout)[0][0 if embed_first else first + 1:
                                                                first + n + 1 + head_last]))
        z = Zero3Exposed()
        if layout.zero >= 3:  # per unit (embedding, each block, head)
            g = [gather(PARAM_BYTES * (k.params - k.experts), layout.dp, dp_bw, dp_lat)
                 + (gather(PARAM_BYTES * k.experts, expert_dp, expert_bw, expert_lat) if k.experts else 0.0)
                 for k in blocks]
            if embed_first:
                g = [gather(PARAM_BYTES * model.embedding_params / t, layout.dp, dp_bw, dp_lat)] + g
            if head_last:
                g = g + [gather(PARAM_BYTES * (model.vocab * h + 2 * h) / t, layout.dp, dp_bw, dp_lat)]
            lead, tail = [0.0] if embed_first else [], [head] if head_last else []  # the embedding, the head
            z = zero3_exposed(g, lead + [layer_f(k) for k in blocks] + tail,
                              lead + [layer_b(k) for k in blocks] + [2 * x for x in tail],
                              lead + [layer_i(k) for k in blocks] + tail, layout.reshard)
        F.append(fwd + tp_fwd + z.F + op + a2a_f)
        B.append(2 * fwd + n * flash_backward + tp_bwd + recompute + z.B + op + a2a_b)
        stage_split = (cluster.split_backward - 1) * 3 * fwd / 2
        I.append((gemm + 2 * n * core) / rate + n * (fixed + flash_backward) + stage_split + tp_bwd + recompute
                 + z.I + op + a2a_b)
        W.append(gemm / rate + n * fixed + stage_split + z.W + op)
        grad = state_bytes("bf16", layout.grads).grad  # reduced in the dtype they accumulate in
        grad_bytes = grad * (p_gpu - experts)
        replica = all_reduce(grad * p_gpu, replicas, pp_bw, pp_lat)
        replica += all_reduce(grad * summed, t, tp_bw, tp_lat) if summed else 0.0  # MoE blocks' parts, over tp
        scatter = all_reduce if cluster.reduce_scatter_as_all_reduce else all_gather
        if layout.zero == 0:  # the experts' gradients over their own replicas (dp/ep), the rest over dp
            reduce.append(replica + all_reduce(grad_bytes, layout.dp, dp_bw, dp_lat)
                          + (all_reduce(grad * experts, expert_dp, expert_bw, expert_lat) if experts else 0.0))
            after.append(0.0)
        else:  # reduce-scatter at REDUCE_GRAD (ZeRO's reduce="step"), overlapping the rest of the cooldown
            reduce.append(replica + scatter(grad_bytes, layout.dp, dp_bw, dp_lat)
                          + (scatter(grad * experts, expert_dp, expert_bw, expert_lat) if experts else 0.0))
            after.append((gather(PARAM_BYTES * (p_gpu - experts), layout.dp, dp_bw, dp_lat)
                          + (gather(PARAM_BYTES * experts, expert_dp, expert_bw, expert_lat) if experts else 0.0))
                         if layout.zero < 3 else 0.0)
        shard = (p_gpu - experts) / layout.dp + experts / expert_dp if layout.zero >= 1 else p_gpu
        step.append(shard * ADAM_BYTES_PER_PARAM / cluster.hbm_bandwidth)
        psi.append(p_gpu)
        expert_psi.append(experts)
        tp_again = (blocks_tp_fwd if mode == "full" else n * tp_block_fwd / 2 if mode == "selective" and model.hf
                    else 0.0)
        tpc.append(tp_fwd + tp_bwd + tp_again)
        zg.append(z.F + z.B)
        once.append(z.once)
        a2a_time.append(a2a_f + a2a_b)
        exchanges.append((a2a_f, a2a_b))
        waits.append({"F": tp_fwd + z.F + a2a_f, "B": tp_bwd + tp_again + z.B + a2a_b,
                      "I": tp_bwd + tp_again + z.I + a2a_b, "W": z.W})
    return StageCosts(tuple(F), tuple(B), tuple(I), tuple(W), message, tuple(reduce), tuple(after), tuple(step),
                      tuple(psi), tuple(tpc), tuple(zg), tuple(waits), tuple(a2a_time), tuple(expert_psi),
                      tuple(exchanges), tuple(once), tuple(pairs))
