"""`pipedsl plan --calibrate`: this machine's compute, link and memory speed, measured with the
real runtime's processes and gloo, as a `ClusterSpec` the planner predicts with.

- compute: forward + backward of one block of the small GPT (`pipedsl.runtime.gpt`), run as
  the runtime runs a stage (`runtime.stage.Stage`), at two microbatch sizes: a block costs a
  fixed `layer_overhead` (op dispatch, small kernels: a sixth of the block at microbatch 2 on a
  CPU core) plus time proportional to its FLOPs, whose rate is the cluster's peak.  Timed on one
  rank per core (a rank's own speed) and on every rank at once; with more ranks than cores the
  two give how well the shared cores are used (`sharing_efficiency`, for the planner's
  shared-processor replay, `plan/shared_host.py`).  The block's memory-bound kernels are inside
  that rate, so the cluster's elementwise term is off (`activation_passes` 0, `gemm_efficiency` 1).
  The split backward (I, then W) against the full one gives `split_backward`;
- the runtime's own work per stage op (`op_overhead`): a real 1F1B `Pipeline` of one block per
  rank at M = 4 and 8 microbatches; the CPU seconds a step adds per microbatch, less the block's
  own CPU, over its two ops (executor, messages, autograd bookkeeping).  CPU time, not wall time,
  so a rank waiting for a message or for a core does not count;
- blocking collectives: the same block tensor-parallel over pairs of ranks (`ParallelBlock`, t=2,
  four all-reduces of its activation), every rank at once.  What it costs beyond half the dense
  block is four all-reduces; beyond the link's ring cost, each all-reduce step waits for its peer
  to be scheduled — `sync_latency` (large where ranks outnumber cores, 0 on GPUs).  Its CPU time
  against its wall time gives the share of a collective that keeps the core busy
  (`collective_busy`: gloo's copies, reductions and wake-ups; the rest of the wait leaves the
  core to other ranks);
- link: gloo send/recv ping-pong between ranks 0 and 1 at two sizes: latency and bandwidth of
  `t = latency + bytes / bandwidth`;
- memory: an AdamW step on every rank at once, as the bytes per second `cost.py` charges it.

The runtime trains in fp32 while the planner counts fp16 values (2 bytes): the measured link
bandwidth is handed over per fp16 byte (halved), so a message of n values costs what it costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from pipedsl.plan.cluster import GB, ClusterSpec
from pipedsl.plan.cost import ADAM_BYTES_PER_PARAM
from pipedsl.plan.model import ModelSpec
from pipedsl.runtime.capacity import usable_cores

SIZES = (4 * 1024, 4 * 1024 * 1024)  # ping-pong message bytes: latency-bound, bandwidth-bound
LARGE = 4  # the block's second microbatch size, in multiples of the first
PIPELINE_MICROBATCHES = (4, 8)  # the two step sizes whose difference is one microbatch's cost (x4)
FP32_OVER_COUNTED = 2  # the runtime's fp32 bytes per value over the planner's fp16 bytes


@dataclass(frozen=True)
class SmallGPT:
    """The locally runnable model: `pipedsl.runtime.gpt.GPT` at these sizes."""

    layers: int = 8
    embd: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 256
    batch: int = 16
    microbatch: int = 2

    def spec(self) -> ModelSpec:
        return ModelSpec("small-gpt", self.layers, self.embd, self.heads, self.seq, self.vocab, self.batch)

    def gpt_config(self) -> Any:
        from pipedsl.runtime.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads,
                         n_embd=self.embd)


@dataclass(frozen=True)
class Calibration:
    ranks: int
    flops: float  # FLOP/s per rank while every rank computes
    latency: float  # seconds per message
    bandwidth: float  # bytes/s (fp32 bytes, as measured)
    memory_bandwidth: float  # bytes/s of an AdamW step (the planner's count of its bytes)
    cores: int = 0  # processors the ranks share (0: not measured; as many as ranks)
    flops_alone: float = 0.0  # FLOP/s of a rank with a core to itself (0: = flops)
    sync_latency: float = 0.0  # seconds per step of a blocking collective, beyond the link's cost
    split_backward: float = 1.0  # (F + I + W) / (F + B) of the runtime's Stage: what splitting the backward costs
    layer_overhead: float = 0.0  # seconds of a block's forward + backward that do not grow with the microbatch
    peak_flops: float = 0.0  # FLOP/s of the rest, with a core to itself (0: flops_alone or flops)
    op_overhead: float = 0.0  # CPU seconds of the runtime per stage op (F, B, I or W), beyond the stage's module
    collective_busy: float = 0.0  # CPU / wall time of a blocking collective (tp all-reduce), on its rank

    @property
    def shared(self) -> bool:
        return 0 < self.cores < self.ranks

    @property
    def sharing_efficiency(self) -> float:
        """Of the shared cores while every rank computes: rank rates summed / (cores · a rank's own rate)."""
        if not self.shared or not self.flops_alone:
            return 1.0
        return min(1.0, self.flops * self.ranks / (self.flops_alone * self.cores))

    def describe(self) -> str:
        shared = (f" ({self.flops_alone / 1e9:.2f} with a core each; {self.ranks} ranks on {self.cores} cores used "
                  f"at {self.sharing_efficiency:.0%})") if self.shared and self.flops_alone else ""
        return (f"{self.flops / 1e9:.2f} GFLOP/s per rank (GPT block, all {self.ranks} ranks computing){shared}, "
                f"link {self.latency * 1e6:.0f} us + {self.bandwidth / 1e9:.2f} GB/s (gloo), blocking collectives "
                f"+{self.sync_latency * 1e6:.0f} us a step ({self.collective_busy:.0%} of it busy), "
                f"split backward x{self.split_backward:.2f}, "
                f"AdamW {self.memory_bandwidth / 1e9:.2f} GB/s; not FLOP-proportional: "
                f"{self.layer_overhead * 1e3:.2f} ms a block (F+B), {self.op_overhead * 1e3:.2f} ms a stage op")

    def cluster(self) -> ClusterSpec:
        """This machine as the planner's cluster: one node of `ranks` processes on `cores` processors."""
        link = self.bandwidth / FP32_OVER_COUNTED
        flops = self.peak_flops or (self.flops_alone if self.shared and self.flops_alone else self.flops)
        return ClusterSpec("local", self.ranks, self.ranks, flops, 64 * GB, link, self.latency, link,
                           self.latency, self.memory_bandwidth, gemm_efficiency=1.0, activation_passes=0.0,
                           reserved_memory=0.0, cores_per_node=self.cores if self.shared else 0,
                           sharing_efficiency=max(self.sharing_efficiency, 1e-3), sync_latency=self.sync_latency,
                           split_backward=self.split_backward, layer_overhead=self.layer_overhead,
                           op_overhead=self.op_overhead, collective_busy=self.collective_busy,
                           reduce_scatter_as_all_reduce=True,  # gloo's reduce-scatters and all-gathers
                           all_gather_as_all_reduce=True)  # cost what its all-reduces do (cluster.py)


def _median_time(fn, reps: int, clock=time.perf_counter) -> float:
    fn()  # warm up (allocations, autograd graph caches)
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def measure_rank(rank: int, model: SmallGPT, reps: int, sizes: tuple[int, int] = SIZES,
                 cores: int = 0) -> dict[str, float]:
    """This rank's measurements (every rank of the process group must call it).  With `cores`
    fewer than the ranks, the block is also timed on ranks 0..cores-1 alone."""
    import torch
    import torch.distributed as dist

    from pipedsl.runtime.gpt import Block

    torch.manual_seed(rank)
    cfg = model.gpt_config()
    block = Block(cfg)
    x = torch.randn(model.microbatch, model.seq, model.embd, requires_grad=True)  # [b, T, C]
    x_large = torch.randn(LARGE * model.microbatch, model.seq, model.embd, requires_grad=True)

    full, split = _stage_steps(block, x)
    full_large, _ = _stage_steps(block, x_large)
    world = dist.get_world_size()
    dist.barrier()
    out = {"block": _median_time(full, reps), "split_block": _median_time(split, reps),
           "block_large": _median_time(full_large, reps)}
    if 0 < cores < world:
        dist.barrier()
        if rank < cores:  # the others wait in the barrier
            out["block_alone"] = _median_time(full, reps)
            out["block_large_alone"] = _median_time(full_large, reps)
        dist.barrier()
    out.update(_pipeline_cpu(model, block, full, reps))
    if world % 2 == 0:
        out["tp_block"], out["tp_block_cpu"] = _tp_block_time(model, block, x, reps)

    params = [torch.zeros(1 << 20, requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    dist.barrier()
    out["adam"] = _median_time(opt.step, reps)
    out["adam_params"] = float(sum(p.numel() for p in params))

    dist.barrier()
    for size in sizes:  # ping-pong: half a round trip is one message
        buf = torch.zeros(size // 4)
        if rank in (0, 1):
            peer = 1 - rank

            def ping(buf=buf, peer=peer) -> None:
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)

            out[f"msg{size}"] = _median_time(ping, reps * 4) / 2
        dist.barrier()
    return out


def _stage_steps(block: Any, x: Any) -> tuple[Any, Any]:
    """The block as the runtime's middle `Stage`: forward + full backward (F, B), and forward + the
    split backward the zero-bubble schedules run (F, I, W)."""
    import torch

    from pipedsl.runtime.stage import ActivationCounter, Stage

    stage = Stage(block, 1, 3, None, 1, ActivationCounter())
    grad = [torch.ones_like(x)]

    def full() -> None:
        act, _ = stage.forward([x])
        stage.backward(act, grad)

    def split() -> None:
        act, _ = stage.forward([x])
        stage.backward_input(act, grad)
        stage.backward_weight(act)

    return full, split


def _pipeline_cpu(model: SmallGPT, block: Any, full: Any, reps: int) -> dict[str, float]:
    """This rank's CPU seconds a step of a 1F1B pipeline of one block per rank, at each of
    PIPELINE_MICROBATCHES, and of the block's own forward + backward (every rank calls it)."""
    import torch
    import torch.distributed as dist

    from pipedsl.runtime.pipeline import Pipeline

    out = {"block_cpu": _median_time(full, reps, time.process_time)}
    for M in PIPELINE_MICROBATCHES:
        x = torch.randn(M * model.microbatch, model.seq, model.embd)
        with Pipeline(lambda stage: block, "1f1b", M, loss_fn=_mean_square) as pipe:
            dist.barrier()
            out[f"pipeline{M}_cpu"] = _median_time(lambda pipe=pipe, x=x: pipe.step(x, x), reps, time.process_time)
    return out


def _mean_square(out: Any, target: Any) -> Any:
    return (out - target).pow(2).mean()


def _tp_block_time(model: SmallGPT, block: Any, x: Any, reps: int) -> tuple[float, float]:
    """Wall and CPU seconds of the block tensor-parallel over pairs of ranks (1-D, t=2), every rank at once."""
    import torch.distributed as dist

    from pipedsl.parallel import ParallelConfig, ParallelMesh
    from pipedsl.parallel.tp1d import ParallelBlock
    from pipedsl.parallel.tp_gpt import dense_block

    mesh = ParallelMesh(ParallelConfig(dp=dist.get_world_size() // 2, pp=1, tp=2))
    tp_block = ParallelBlock.from_dense(dense_block(block), mesh.tp_group)

    def step() -> None:
        tp_block(x).sum().backward()

    dist.barrier()
    took = _median_time(step, reps)
    dist.barrier()
    cpu = _median_time(step, reps, time.process_time)
    dist.barrier()
    return took, cpu


def _measure_in_pool(model: SmallGPT, reps: int, sizes: tuple[int, int], cores: int) -> dict[str, float]:
    import torch.distributed as dist

    return measure_rank(dist.get_rank(), model, reps, sizes, cores)


def calibrate(ranks: int = 4, model: SmallGPT | None = None, reps: int = 7, timeout: float = 300.0,
              pool: Any = None) -> Calibration:
    """Measure this machine with `ranks` local processes (gloo, one torch thread each), started by
    `pipedsl.launch` or run on an existing `pipedsl.parallel.pool.LocalPool`."""
    from pipedsl.runtime import launch

    model = model or SmallGPT()
    if ranks < 2:
        from pipedsl.errors import PipeDSLError

        raise PipeDSLError(f"--calibrate needs at least 2 ranks (a link to measure), got {ranks}")
    n = usable_cores()
    if pool is None:
        results = launch(measure_rank, ranks, model, reps, SIZES, n, timeout=timeout, threads=1)
    else:
        results = pool.run(_measure_in_pool, ranks, model, reps, SIZES, n, timeout=timeout)
    return summarize([results], model, n)


def summarize(runs: list[list[dict[str, float]]], model: SmallGPT, cores: int = 0) -> Calibration:
    """One calibration from the per-rank measurements of one or more runs (medians over all)."""
    spec = model.spec()
    every = [r for results in runs for r in results]
    block = statistics.median(r["block"] for r in every)
    block_flops = 3 * spec.layer_flops(model.microbatch)
    alone = [r["block_alone"] for r in every if "block_alone" in r]
    adam = statistics.median(r["adam"] / r["adam_params"] for r in every)
    small, large = (statistics.median(r[f"msg{s}"] for r in every if f"msg{s}" in r) for s in SIZES)
    bandwidth = (SIZES[1] - SIZES[0]) / max(large - small, 1e-9)
    latency = max(small - SIZES[0] / bandwidth, 1e-7)
    fixed, peak = _block_fit(every, model, "_alone" if alone else "")
    block_cpu = statistics.median(r["block_cpu"] for r in every)
    sync = busy = 0.0
    tp = [r for r in every if "tp_block" in r]
    if tp:  # four all-reduces of the fp32 [b, T, C] activation over 2 ranks: bytes/bw + 2 steps each
        activation = 4 * model.microbatch * model.seq * model.embd
        # t = 2 halves the block's FLOPs, not its fixed part
        kept = (1 + fixed / (fixed + 3 * spec.layer_flops(model.microbatch) / peak)) / 2 if peak else 0.5
        collectives = statistics.median(r["tp_block"] for r in tp) - block * kept
        sync = max(0.0, (collectives / 4 - activation / bandwidth) / 2 - latency)
        collectives_cpu = statistics.median(r["tp_block_cpu"] for r in tp) - block_cpu * kept
        busy = min(1.0, max(0.0, collectives_cpu / collectives)) if collectives > 0 else 0.0
    split = statistics.median(r["split_block"] / r["block"] for r in every)
    m4, m8 = PIPELINE_MICROBATCHES
    per_microbatch = [(r[f"pipeline{m8}_cpu"] - r[f"pipeline{m4}_cpu"]) / (m8 - m4) for r in every]
    op = max(0.0, (statistics.median(per_microbatch) - block_cpu) / 2)
    return Calibration(len(runs[0]), block_flops / block, latency, bandwidth, ADAM_BYTES_PER_PARAM / adam,
                       cores, block_flops / statistics.median(alone) if alone else 0.0, sync, max(split, 1.0),
                       fixed, peak, op, busy)


def _block_fit(every: list[dict[str, float]], model: SmallGPT, suffix: str) -> tuple[float, float]:
    """(seconds of a block's F+B that do not grow with the microbatch, FLOP/s of the rest) from the
    block timed at two microbatch sizes ("_alone": on one rank per core); (0, 0) if noise makes the
    larger one no slower per sample."""
    b = model.microbatch
    small, large = (statistics.median(r[key + suffix] for r in every if key + suffix in r)
                    for key in ("block", "block_large"))
    per_sample = (large - small) / ((LARGE - 1) * b)
    fixed = small - b * per_sample
    if per_sample <= 0 or fixed < 0:
        return 0.0, 0.0
    return fixed, 3 * model.spec().layer_flops(1) / per_sample
