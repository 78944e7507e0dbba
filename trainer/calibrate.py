"""`pipedsl plan --calibrate`: this machine's compute, link and memory speed, measured with the
real runtime's processes and gloo, as a `ClusterSpec` the planner predicts with.

- compute: forward + backward of one block of the small GPT (`pipedsl.models.gpt.model`), run as
  the runtime runs a stage (`runtime.stage.Stage`), at two microbatch sizes: a block costs a
  fixed `layer_overhead` (op dispatch, small kernels: a sixth of the block at microbatch 2 on a
  CPU core) plus time proportional to its FLOPs, whose rate is the cluster's peak.  Timed on one
  rank per core (a rank's own speed) and on every rank at once; with more ranks than cores the
  two give how well the shared cores are used (`sharing_efficiency`, for the planner's
  shared-processor replay, `plan/shared_host.py`).  The block's memory-bound kernels are inside
  that rate, so the cluster's elementwise term is off (`activation_passes` 0, `gemm_efficiency` 1).
  The split backward (I, then W) against the full one, timed back to back, gives `split_backward` (at most
  `MAX_SPLIT_BACKWARD`);
- the runtime's own work per stage op (`op_overhead`): a real 1F1B `Pipeline` of one block per
  rank at M = 4 and 8 microbatches; the CPU seconds a step adds per microbatch, less the block's
  own CPU, over its two ops (executor, messages, autograd bookkeeping).  CPU time, not wall time,
  so a rank waiting for a message or for a core does not count;
- blocking collectives: the same block tensor-parallel over pairs of ranks (`ParallelBlock`, t=2,
  four all-reduces of its activation), every rank at once, with the seconds spent inside its
  all-reduces counted (`parallel.comm.count_comm`): inside a step, a collective also waits for
  its peer to arrive, which an isolated loop of all-reduces never does.  Beyond the link's ring
  cost, each all-reduce step's wait is `sync_latency` (large where ranks outnumber cores, 0 on
  GPUs).  The rest of what the block costs beyond half the dense one is tensor parallelism's own
  work (the split layers' copies and extra autograd functions): `tp_own`, per block, and the SP
  block's the same way (`sp_own`: its norms on shards, the sequence's layout copies).
  The collectives' CPU time against their wall time gives the share that keeps the core busy
  (`collective_busy`: gloo's copies, reductions and wake-ups; the rest of the wait leaves the
  core to other ranks);
- link: gloo send/recv ping-pong between ranks 0 and 1 at two sizes: latency and bandwidth of
  `t = latency + bytes / bandwidth` (where noise hides the bytes' time, the larger message's bytes over its time);
- memory: an AdamW step on every rank at once, as the bytes per second `cost.py` charges it.

The runtime trains in fp32 while the planner counts fp16 values (2 bytes): the measured link
bandwidth is handed over per fp16 byte (halved), so a message of n values costs what it costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from pipedsl.plan.cluster import GB, MAX_SPLIT_BACKWARD, ClusterSpec
from pipedsl.plan.cost import ADAM_BYTES_PER_PARAM
from pipedsl.plan.model import BYTES_FP16, ModelSpec
from pipedsl.runtime.launch.capacity import usable_cores

SIZES = (4 * 1024, 4 * 1024 * 1024)  # ping-pong message bytes: latency-bound, bandwidth-bound
LARGE = 4  # the block's second microbatch size, in multiples of the first
PIPELINE_MICROBATCHES = (4, 8)  # the two step sizes whose difference is one microbatch's cost (x4)
FP32_OVER_COUNTED = 2  # the runtime's fp32 bytes per value over the planner's fp16 bytes
MAX_BANDWIDTH = 1e15  # bytes/s of a collective whose time did not grow with its size (the fit's noise)


@dataclass(frozen=True)
class SmallGPT:
    """The locally runnable model: `pipedsl.models.gpt.model.GPT` at these sizes."""

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
        from pipedsl.models.gpt.model import GPTConfig

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
    tp_own: tuple[float, float] = (0.0, 0.0)  # t=2 block F+B beyond half the dense one and its collectives: s, s/sample
    sp_own: tuple[float, float] = (0.0, 0.0)  # the same with sequence parallelism
    tp_all_reduce: tuple[float, float] = (0.0, 0.0)  # in-step all-reduce over 2 ranks: (s per ring step, fp16 B/s)
    tp_gather: tuple[float, float] = (0.0, 0.0)  # in-step SP all-gather / reduce-scatter over 2 ranks: the same

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
                f"{self.layer_overhead * 1e3:.2f} ms a block (F+B), tensor-parallel "
                f"+{self.tp_own[0] * 1e3:.2f} ms + {self.tp_own[1] * 1e3:.2f} ms a sample (SP "
                f"+{self.sp_own[0] * 1e3:.2f} ms + {self.sp_own[1] * 1e3:.2f} ms), "
                f"{self.op_overhead * 1e3:.2f} ms a stage op; "
                f"in a step, tp all-reduces {self.tp_all_reduce[0] * 1e3:.2f} ms a ring step + "
                f"{self.tp_all_reduce[1] / 1e9:.2f} GB/s, SP gathers {self.tp_gather[0] * 1e3:.2f} ms + "
                f"{self.tp_gather[1] / 1e9:.2f} GB/s")

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
                           tp_own=self.tp_own, sp_own=self.sp_own,
                           tp_all_reduce=self.tp_all_reduce, tp_gather=self.tp_gather,
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


def _paired_median(base, other, reps: int) -> tuple[float, float]:
    """(`base`'s median time, the median over repetitions of `other`'s time / `base`'s, the two run back to back):
    a ratio from two medians taken apart follows the load between them (a split backward once measured 10.5×
    with the test suite running beside it)."""
    base(), other()  # warm up
    times, ratios = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        other()
        t2 = time.perf_counter()
        times.append(t1 - t0)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(times), statistics.median(ratios)


def measure_rank(rank: int, model: SmallGPT, reps: int, sizes: tuple[int, int] = SIZES,
                 cores: int = 0) -> dict[str, float]:
    """This rank's measurements (every rank of the process group must call it).  With `cores`
    fewer than the ranks, the block is also timed on ranks 0..cores-1 alone."""
    import torch
    import torch.distributed as dist

    from pipedsl.models.gpt.model import Block

    torch.manual_seed(rank)
    cfg = model.gpt_config()
    block = Block(cfg)
    x = torch.randn(model.microbatch, model.seq, model.embd, requires_grad=True)  # [b, T, C]
    x_large = torch.randn(LARGE * model.microbatch, model.seq, model.embd, requires_grad=True)

    full, split = _stage_steps(block, x)
    full_large, _ = _stage_steps(block, x_large)
    world = dist.get_world_size()
    dist.barrier()
    block_s, split_ratio = _paired_median(full, split, reps)
    out = {"block": block_s, "split_block": block_s * split_ratio, "block_large": _median_time(full_large, reps)}
    if 0 < cores < world:
        dist.barrier()
        if rank < cores:  # the others wait in the barrier
            out["block_alone"] = _median_time(full, reps)
            out["block_large_alone"] = _median_time(full_large, reps)
        dist.barrier()
    out.update(_pipeline_cpu(model, block, full, reps))
    if world % 2 == 0:
        out.update(_tp_block_times(model, block, reps))

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


def _tp_block_times(model: SmallGPT, block: Any, reps: int) -> dict[str, float]:
    """The block tensor-parallel over pairs of ranks (1-D, t=2), every rank at once, at the two microbatch
    sizes, without and with sequence parallelism: wall seconds of F+B, and the seconds of one of its collectives
    inside that step (the all-reduces; with SP the all-gathers and reduce-scatters of the sequence), medians of
    the timed steps; CPU seconds of the tp block at the first size."""
    import torch
    import torch.distributed as dist

    from pipedsl.parallel import ParallelConfig, ParallelMesh, count_comm
    from pipedsl.parallel.tp1d import ParallelBlock

    mesh = ParallelMesh(ParallelConfig(dp=dist.get_world_size() // 2, pp=1, tp=2))
    tp_block = ParallelBlock.from_dense(block, mesh.tp_group)
    sp_block = ParallelBlock.from_dense(block, mesh.tp_group, sequence_parallel=True)
    out: dict[str, float] = {}
    for suffix, b in (("", model.microbatch), ("_large", LARGE * model.microbatch)):
        for name, layer, seq, kinds in (("tp", tp_block, model.seq, ("all_reduce",)),
                                        ("sp", sp_block, model.seq // 2, ("all_gather", "reduce_scatter"))):
            x = torch.randn(b, seq, model.embd, requires_grad=True)
            per_call: list[float] = []
            every: list[float] = []

            def step(layer: Any = layer, x: Any = x, kinds: tuple[str, ...] = kinds, per_call: list[float] = per_call,
                     every: list[float] = every) -> None:
                with count_comm() as counter:
                    layer(x).sum().backward()
                timed = [(counter.seconds[k], counter.calls[k]) for k in counter.calls if k[0] in kinds]
                per_call.append(sum(t for t, _ in timed) / max(1, sum(n for _, n in timed)))
                every.append(counter.total_seconds)

            dist.barrier()
            out[f"{name}_block{suffix}"] = _median_time(step, reps)
            out[f"{name}_block_collective{suffix}"] = statistics.median(per_call[1:])  # not the warm-up step
            out[f"{name}_block_comm{suffix}"] = statistics.median(every[1:])  # all its collectives
            dist.barrier()
    x = torch.randn(model.microbatch, model.seq, model.embd, requires_grad=True)
    out["tp_block_cpu"] = _median_time(lambda: tp_block(x).sum().backward(), reps, time.process_time)
    dist.barrier()
    return out


def _measure_in_pool(model: SmallGPT, reps: int, sizes: tuple[int, int], cores: int) -> dict[str, float]:
    import torch.distributed as dist

    return measure_rank(dist.get_rank(), model, reps, sizes, cores)


def calibrate(ranks: int = 4, model: SmallGPT | None = None, reps: int = 7, timeout: float = 300.0,
              pool: Any = None) -> Calibration:
    """Measure this machine with `ranks` local processes (gloo, one torch thread each), started by
    `pipedsl.launch` or run on an existing `pipedsl.runtime.launch.pool.LocalPool`."""
    from pipedsl.runtime.launch.launcher import launch

    model = model or SmallGPT()
    if ranks < 2:
        from pipedsl.errors import PipeDSLError

        raise PipeDSLError(f"--calibrate needs at least 2 ranks (a link to measure), got {ranks}")
    n = usable_cores()
    if pool is None:
        # gloo whatever the machine holds: the measurements are the CPU's and its host tensors' (with as many GPUs
        # as ranks the launcher's default would be NCCL, which refuses host tensors)
        results = launch(measure_rank, ranks, model, reps, SIZES, n, backend="gloo", timeout=timeout, threads=1)
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
    bandwidth = _link_bandwidth(small, large)
    latency = max(small - SIZES[0] / bandwidth, 1e-7)
    fixed, peak = _block_fit(every, model, "_alone" if alone else "")
    block_cpu = statistics.median(r["block_cpu"] for r in every)
    sync = busy = 0.0
    tp_own = sp_own = all_reduce = gather = (0.0, 0.0)
    tp = [r for r in every if "tp_block" in r]
    if tp:
        def med(key: str) -> float:
            return statistics.median(r[key] for r in tp)

        b = model.microbatch
        act = BYTES_FP16 * b * model.seq * model.embd  # one [b, T, C] activation, as the planner counts it
        # over 2 ranks an all-reduce is 2 ring steps + bytes / bandwidth; a gather or scatter 1 step + half that
        all_reduce = _fit_collective(med("tp_block_collective"), med("tp_block_collective_large"), act, 2, 1.0)
        gather = _fit_collective(med("sp_block_collective"), med("sp_block_collective_large"), act, 1, 0.5)
        sync = max(0.0, all_reduce[0] - latency)

        def kept(samples: int) -> float:  # t = 2 halves the block's FLOPs, not its fixed part
            flops = 3 * spec.layer_flops(samples)
            return (1 + fixed / (fixed + flops / peak)) / 2 if peak else 0.5

        def own_work(name: str) -> tuple[float, float]:
            """The block's time beyond half the dense block and every collective in it, fixed and per sample."""
            small, large = (med(f"{name}_block{s}") - statistics.median(r[f"block{s}"] for r in every) * kept(n)
                            - med(f"{name}_block_comm{s}") for s, n in (("", b), ("_large", LARGE * b)))
            per_sample = max(0.0, (large - small) / ((LARGE - 1) * b))
            return max(0.0, small - b * per_sample), per_sample

        tp_own, sp_own = own_work("tp"), own_work("sp")
        collectives = med("tp_block_comm")  # two all-reduces forward, two backward
        collectives_cpu = med("tp_block_cpu") - block_cpu * kept(b) - (tp_own[0] + b * tp_own[1])
        busy = min(1.0, max(0.0, collectives_cpu / collectives)) if collectives > 0 else 0.0
    split = statistics.median(r["split_block"] / r["block"] for r in every)
    m4, m8 = PIPELINE_MICROBATCHES
    per_microbatch = [(r[f"pipeline{m8}_cpu"] - r[f"pipeline{m4}_cpu"]) / (m8 - m4) for r in every]
    op = max(0.0, (statistics.median(per_microbatch) - block_cpu) / 2)
    return Calibration(len(runs[0]), block_flops / block, latency, bandwidth, ADAM_BYTES_PER_PARAM / adam,
                       cores, block_flops / statistics.median(alone) if alone else 0.0, sync,
                       min(max(split, 1.0), MAX_SPLIT_BACKWARD),
                       fixed, peak, op, busy, tp_own, sp_own, all_reduce, gather)


def _link_bandwidth(small: float, large: float) -> float:
    """Bytes/s of the link from the ping-pong's two sizes.  Where the larger message (1,024× the bytes) took less
    than twice the smaller's time, the difference is noise (a loaded machine's smaller message waited): the fit would
    say the bytes are free (4·10^15 B/s on a loaded CI run), so the link is credited with the least the larger message
    shows, its bytes over its whole time."""
    if large < 2 * small:
        return SIZES[1] / large
    return (SIZES[1] - SIZES[0]) / (large - small)


def _fit_collective(small: float, large: float, act: float, steps: int, share: float) -> tuple[float, float]:
    """(seconds per ring step, bytes/s) of a collective over 2 ranks timed at `act` and LARGE·`act` bytes, as
    `steps` ring steps plus `share` of the bytes over the bandwidth; a flat time (noise) is all steps."""
    slope = (large - small) / ((LARGE - 1) * act)
    if slope <= 0:
        return statistics.mean([small, large]) / steps, MAX_BANDWIDTH
    bandwidth = min(share / slope, MAX_BANDWIDTH)
    return max(0.0, (small - share * act / bandwidth) / steps), bandwidth


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
