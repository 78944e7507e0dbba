"""Per-stage costs of a layout: compute from FLOPs, messages from bytes, collectives from rings.

Times are seconds per microbatch.  Communication follows what the runtime does:
- tensor parallel (Megatron 1-D): two all-reduces of the [b, s, h] activation per block in the
  forward, two in the backward, two more in the recomputed forward — on the critical path; one
  more for the vocabulary-parallel embedding, three small ones ([b, s]) for the cross-entropy;
  3-D (Bian et al.): per linear, gathers of input and weight and a reduce-scatter of the output,
  (q-1)/q³ of each tensor per rank, forward and backward alike;
- pipeline: one [b, s, h]/t message per hop (Megatron's scatter/gather over InfiniBand, then an
  all-gather over NVLink inside the node);
- data parallel: the stage's gradient all-reduce in the gradients' dtype (`Layout.grads`; ZeRO 1-2:
  reduce-scatter, then the updated parameters all-gathered after the step) issued at REDUCE_GRAD and
  overlapping the rest of the cooldown, as `runtime.reduce` does; ZeRO-3 gathers the stage's
  parameters inside every F, B, I and W (the runtime's hooks do not prefetch) and reduce-scatters
  gradients at REDUCE_GRAD.
Ring collectives over N ranks: all-reduce 2(N-1)/N·bytes/bw + 2(N-1)·latency, all-gather and
reduce-scatter half of that (Patarasuk & Yuan; NCCL's ring model).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.config import Layout
from pipedsl.plan.memory import OPTIMIZER_BYTES, PARAM_BYTES, state_bytes
from pipedsl.plan.model import BYTES_FP16, ModelSpec
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

    def simulator_cost(self) -> Cost:
        """The pipeline part for `pipedsl.simulate`; REDUCE_GRAD/step are added around it (async)."""
        per_stage = {s: {"F": self.F[s], "B": self.B[s], "I": self.I[s], "W": self.W[s]} for s in range(len(self.F))}
        return Cost(F=self.F[0], B=self.B[0], I=self.I[0], W=self.W[0], comm=self.message, per_stage=per_stage)


def stage_costs(model: ModelSpec, cluster: ClusterSpec, layout: Layout, stages: int, replicas: int = 1) -> StageCosts:
    """Costs of each of `stages` program stages (layers split evenly; embedding on the first,
    output layer on the last) for `layout` on `cluster`."""
    b, t, h, s = layout.microbatch, layout.tp, model.hidden, model.seq
    per_stage_layers = model.layers // stages
    q = tp_degree_3d(t) if layout.tp_mode == "3d" else 0
    rate = cluster.peak_flops * cluster.gemm_efficiency * t  # FLOP/s of the tp group

    act = BYTES_FP16 * b * s * h  # one [b, s, h] activation
    tp_bw, tp_lat = cluster.link(t)
    if q:  # per block: activations 16·[b,s,h], weights 12h²; (q-1)/q³ of each moved, 3 collectives per linear
        moved = (q - 1) / q ** 3 * (16 * act + BYTES_FP16 * 12 * h * h)
        tp_block_fwd = moved / tp_bw + 12 * (q - 1) * tp_lat
        tp_block_bwd = tp_block_fwd
    else:
        tp_block_fwd = 2 * all_reduce(act, t, tp_bw, tp_lat)
        tp_block_bwd = tp_block_fwd

    dp_bw, dp_lat = cluster.link(t * layout.dp)
    pp_hops_cross_nodes = layout.gpus > cluster.gpus_per_node
    pp_bw, pp_lat = (cluster.inter_bandwidth, cluster.inter_latency) if pp_hops_cross_nodes else \
        (cluster.intra_bandwidth, cluster.intra_latency)
    message = pp_lat + act / t / pp_bw
    if t > 1 and not q:
        message += all_gather(act, t, *cluster.link(t))

    F, B, I, W, reduce, after, step, psi, tpc, zg, waits = ([] for _ in range(11))
    for st in range(stages):
        gemm = per_stage_layers * (model.layer_flops(b) - 4 * b * s * s * h)
        attn = per_stage_layers * 4 * b * s * s * h
        params = per_stage_layers * model.layer_params
        if st == 0:
            params += model.embedding_params
        if st == stages - 1:
            gemm += model.logit_flops(b)
            params += model.vocab * h + 2 * h  # the output layer's copy of the word embedding, final LayerNorm
        p_gpu = params / t
        tp_fwd = per_stage_layers * tp_block_fwd
        if t > 1 and not q and st == 0:  # the vocabulary-parallel embedding sums its partial lookups
            tp_fwd += all_reduce(act, t, tp_bw, tp_lat)
        if t > 1 and not q and st == stages - 1:  # vocabulary-parallel cross-entropy: max, Σexp, target logit
            tp_fwd += 3 * all_reduce(4 * b * s, t, tp_bw, tp_lat)
        tp_bwd = per_stage_layers * tp_block_bwd
        gather = all_gather(PARAM_BYTES * p_gpu, layout.dp, dp_bw, dp_lat) if layout.zero >= 3 else 0.0
        # memory-bound kernels (LayerNorm, softmax, dropout, GeLU, residuals) stream the block's activations
        elementwise = per_stage_layers * model.layer_activation_bytes(b, t, False) * cluster.activation_passes
        fixed = per_stage_layers * cluster.layer_overhead / 3  # per pass of the blocks: F 1, B 2 (I 1 + W 1)
        fwd = (gemm + attn) / rate + elementwise / cluster.hbm_bandwidth + fixed
        recompute = (fwd + tp_fwd) if layout.recompute else 0.0
        op = cluster.op_overhead
        F.append(fwd + tp_fwd + gather + op)
        B.append(2 * fwd + tp_bwd + recompute + gather + op)
        split = (cluster.split_backward - 1) * 3 * fwd / 2  # a split backward's extra work, shared by I and W
        I.append((gemm + 2 * attn) / rate + fixed + split + tp_bwd + recompute + gather + op)
        W.append(gemm / rate + fixed + split + gather + op)
        grad_bytes = state_bytes("bf16", layout.grads).grad * p_gpu  # reduced in the dtype they accumulate in
        replica = all_reduce(grad_bytes, replicas, pp_bw, pp_lat)
        if layout.zero == 0:
            reduce.append(replica + all_reduce(grad_bytes, layout.dp, dp_bw, dp_lat))
            after.append(0.0)
        else:
            reduce.append(replica + all_gather(grad_bytes, layout.dp, dp_bw, dp_lat))
            after.append(all_gather(PARAM_BYTES * p_gpu, layout.dp, dp_bw, dp_lat) if layout.zero < 3 else 0.0)
        shard = p_gpu / (layout.dp if layout.zero >= 1 else 1)
        step.append(shard * ADAM_BYTES_PER_PARAM / cluster.hbm_bandwidth)
        psi.append(p_gpu)
        tpc.append(tp_fwd + tp_bwd + (tp_fwd if layout.recompute else 0.0))
        zg.append(2 * gather)
        back = tp_bwd + (tp_fwd if layout.recompute else 0.0) + gather
        waits.append({"F": tp_fwd + gather, "B": back, "I": back, "W": gather})
    return StageCosts(tuple(F), tuple(B), tuple(I), tuple(W), message, tuple(reduce), tuple(after), tuple(step),
                      tuple(psi), tuple(tpc), tuple(zg), tuple(waits))
