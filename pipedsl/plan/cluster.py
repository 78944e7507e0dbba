"""GPU clusters as the planner sees them: compute, memory and the two link tiers.

Bandwidths are per GPU and per direction, as achieved (not the datasheet's bidirectional sum):
NVLink inside a node, one InfiniBand NIC per GPU between nodes (DGX/HGX layout).  Compute is
peak dense fp16/bf16 times an achievable GEMM efficiency; the memory-bound kernels between the
GEMMs (LayerNorm, softmax, dropout, GeLU, residual adds) are timed from HBM bandwidth, moving
`activation_passes` bytes per byte of the block's activations (Korthikanti et al.'s count).  That
second term is what makes small models (large 5·a·s/h, small h) reach a lower fraction of peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_PLAN_GPUS, shorten

GB = 1e9
MAX_OVERHEAD = 60.0  # seconds: a latency or per-op overhead beyond a minute is a unit mistake
MAX_SPLIT_BACKWARD = 10.0  # (F + I + W) / (F + B) beyond this is a measurement of a loaded machine, not a cost


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpus: int
    gpus_per_node: int
    peak_flops: float  # dense fp16/bf16 FLOP/s per GPU
    memory: float  # bytes per GPU
    intra_bandwidth: float  # bytes/s per GPU per direction (NVLink)
    intra_latency: float  # seconds per message hop
    inter_bandwidth: float  # bytes/s per GPU per direction (InfiniBand)
    inter_latency: float
    hbm_bandwidth: float  # bytes/s: the optimizer step is memory-bound
    gemm_efficiency: float = 0.71  # the one constant fitted to SC'21 Table 1 (docs/planner.md)
    activation_passes: float = 2.0  # each memory-bound kernel reads its input and writes its output
    reserved_memory: float = 2 * GB  # CUDA context, allocator fragmentation, workspace
    # A host whose ranks share processors (a CPU node, `plan --calibrate` here): 0 on GPU clusters.
    cores_per_node: int = 0  # processors a node's ranks share; 0: a device per rank
    sharing_efficiency: float = 1.0  # of those processors when oversubscribed (cache, scheduler losses)
    sync_latency: float = 0.0  # per ring step of a blocking collective: its peers' wait to be scheduled
    collective_busy: float = 0.0  # of a blocking collective's time, the share its rank keeps a core busy (gloo)
    split_backward: float = 1.0  # (F+I+W)/(F+B) of a block: a split backward's extra passes (1: none, as on GPUs)
    # Time that is not FLOP-proportional (measured by calibration; 0 on the GPU presets, whose fitted GEMM
    # efficiency absorbs it): per block forward + backward (op dispatch, small kernels), and per stage op
    # (F, B, I or W of one microbatch on one stage: the runtime's executor, messages, autograd bookkeeping).
    layer_overhead: float = 0.0
    op_overhead: float = 0.0
    # and per 1-D tensor-parallel block forward + backward, beyond its share of the block and its collectives (the
    # split layers' copies and extra autograd functions): (seconds, seconds per sample of the microbatch), without
    # and with sequence parallelism (its norms on shards, the sequence's layout copies)
    tp_own: tuple[float, float] = (0.0, 0.0)
    sp_own: tuple[float, float] = (0.0, 0.0)
    # The tensor-parallel collectives as timed inside a block's step (calibration; (0, 0): the link and the ring
    # formulas): (seconds per ring step, bytes/s) of its blocking all-reduces, and of sequence parallelism's
    # all-gathers and reduce-scatters.  Inside a step a collective also waits for its peer, and gloo's in-step
    # rate is far below a ping-pong's (0.1-0.7 against 3 GB/s here, docs/planner.md)
    tp_all_reduce: tuple[float, float] = (0.0, 0.0)
    tp_gather: tuple[float, float] = (0.0, 0.0)
    # The attention kernel the search assumes unless told: FlashAttention-style (no s² tensor stored, QKᵀ
    # recomputed in the backward) on the H100/H200 presets; eager on the A100 preset, as SC'21's Megatron ran.
    fused_attention: bool = False
    # gloo reduce-scatters through an all-reduce (timed alike here: 1.0-1.3 ms each for 128 KB on 2 ranks), so a
    # reduce-scatter costs an all-reduce's ring time; NCCL (the GPU presets) runs it at half that
    reduce_scatter_as_all_reduce: bool = False
    # and its all-gathers too, measured where sequence parallelism runs them (a GPT stage, 2 ranks, 512 KB
    # gathered: 1.6-1.9 ms each against 1.1-1.5 ms for the all-reduces of the same stage without SP), where the
    # ring formula gives half an all-reduce.  Both flags price ZeRO's and the tp pipeline hop's collectives; SP's
    # own are priced by `tp_gather` where calibration measured it
    all_gather_as_all_reduce: bool = False

    def __post_init__(self) -> None:
        for field_name in ("gpus", "gpus_per_node"):
            if not 1 <= getattr(self, field_name) <= MAX_PLAN_GPUS:
                raise PipeDSLError(f"cluster {self.name}: {field_name}={shorten(getattr(self, field_name))} is not in "
                                   f"1..{MAX_PLAN_GPUS:,} (MAX_PLAN_GPUS)")
        for field_name in ("peak_flops", "memory", "intra_bandwidth", "inter_bandwidth", "hbm_bandwidth",
                           "intra_latency", "inter_latency", "activation_passes", "reserved_memory"):
            value = getattr(self, field_name)
            zero_ok = field_name in ("intra_latency", "inter_latency", "activation_passes", "reserved_memory")
            if not (math.isfinite(value) and value >= 0 and (value > 0 or zero_ok)):
                kind = "a finite number >= 0" if zero_ok else "a positive, finite number"
                raise PipeDSLError(f"cluster {self.name}: {field_name} must be {kind}, got {shorten(value)}")
        for field_name in ("tp_own", "sp_own"):
            if not all(math.isfinite(v) and 0 <= v <= MAX_OVERHEAD for v in getattr(self, field_name)):
                raise PipeDSLError(f"cluster {self.name}: {field_name} must be (seconds, seconds per sample) in "
                                   f"[0, {MAX_OVERHEAD:g}], got {shorten(getattr(self, field_name))}")
        for field_name in ("tp_all_reduce", "tp_gather"):
            step, bandwidth = getattr(self, field_name)
            if not (math.isfinite(step) and math.isfinite(bandwidth) and 0 <= step <= MAX_OVERHEAD
                    and bandwidth >= 0):
                raise PipeDSLError(f"cluster {self.name}: {field_name} must be (seconds per step in "
                                   f"[0, {MAX_OVERHEAD:g}], bytes/s >= 0), got {shorten(getattr(self, field_name))}")
        if not 0 <= self.collective_busy <= 1:
            raise PipeDSLError(f"cluster {self.name}: collective_busy must be in [0, 1], got "
                               f"{shorten(self.collective_busy)}")
        for field_name in ("gemm_efficiency", "sharing_efficiency"):
            if not 0 < getattr(self, field_name) <= 1:
                raise PipeDSLError(f"cluster {self.name}: {field_name} must be in (0, 1], got "
                                   f"{shorten(getattr(self, field_name))}")
        if not (isinstance(self.cores_per_node, int) and 0 <= self.cores_per_node <= MAX_PLAN_GPUS):
            raise PipeDSLError(f"cluster {self.name}: cores_per_node={shorten(self.cores_per_node)} is not in "
                               f"0..{MAX_PLAN_GPUS:,}")
        if not (math.isfinite(self.split_backward) and 1 <= self.split_backward <= MAX_SPLIT_BACKWARD):
            raise PipeDSLError(f"cluster {self.name}: split_backward must be in [1, {MAX_SPLIT_BACKWARD:g}], got "
                               f"{shorten(self.split_backward)}")
        for field_name in ("sync_latency", "layer_overhead", "op_overhead"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and 0 <= value <= MAX_OVERHEAD):
                raise PipeDSLError(f"cluster {self.name}: {field_name} must be a number of seconds in "
                                   f"[0, {MAX_OVERHEAD:g}], got {shorten(value)}")

    def tp_link(self, t: int, gather: bool = False) -> tuple[float, float]:
        """(bandwidth, latency per step) of a tensor-parallel group's all-reduces (`gather`: SP's all-gathers and
        reduce-scatters): as calibrated inside a step, else the link's."""
        step, bandwidth = self.tp_gather if gather else self.tp_all_reduce
        return (bandwidth, step) if bandwidth > 0 else self.link(t)

    def link(self, group_span: int) -> tuple[float, float]:
        """(bandwidth, latency per step) of a ring collective over ranks `group_span` apart in the rank
        order at most: inside a node while the group fits in one, else InfiniBand."""
        if group_span <= self.gpus_per_node:
            return self.intra_bandwidth, self.intra_latency + self.sync_latency
        return self.inter_bandwidth, self.inter_latency + self.sync_latency

    def shared_ranks(self, gpus: int) -> int:
        """How many ranks of a `gpus`-rank layout share one node's `cores_per_node` processors (0: none share)."""
        on_node = min(gpus, self.gpus_per_node)
        return on_node if 0 < self.cores_per_node < on_node else 0

    def with_gpus(self, gpus: int) -> ClusterSpec:
        return replace(self, gpus=gpus)


# DGX A100 80GB (Selene, SC'21's machine): 312 TFLOP/s, NVLink3 300 GB/s per direction (~240 achieved
# by NCCL rings), 8× HDR InfiniBand 200 Gb/s (25 GB/s) per node, one per GPU; HBM2e 2.0 TB/s.
# gemm_efficiency is fitted to SC'21 Table 1 (one value for all ten rows, see docs/planner.md) and kept for
# H100/H200; activation_passes = 2 is counted, not fitted.
CLUSTERS: dict[str, ClusterSpec] = {c.name: c for c in (
    ClusterSpec("a100-80gb", 1024, 8, 312e12, 80 * GB, 240 * GB, 5e-6, 23 * GB, 8e-6, 1.6e12),
    # DGX H100: 989 TFLOP/s dense bf16, NVLink4 450 GB/s per direction, NDR 400 Gb/s per GPU, HBM3 3.35 TB/s.
    ClusterSpec("h100", 1024, 8, 989e12, 80 * GB, 360 * GB, 4e-6, 45 * GB, 6e-6, 2.8e12, fused_attention=True),
    # H200: the H100's compute and links with 141 GB HBM3e at 4.8 TB/s.
    ClusterSpec("h200", 1024, 8, 989e12, 141 * GB, 360 * GB, 4e-6, 45 * GB, 6e-6, 4.0e12, fused_attention=True),
)}


def cluster_preset(name: str) -> ClusterSpec:
    try:
        return CLUSTERS[name]
    except KeyError:
        raise PipeDSLError(f"unknown cluster {name!r} (presets: {', '.join(CLUSTERS)})") from None
