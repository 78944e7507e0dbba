"""`pipedsl plan --calibrate`: this machine's compute, link and memory speed, measured with the
real runtime's processes and gloo, as a `ClusterSpec` the planner predicts with.

- compute: forward + backward of one block of the small GPT (`pipedsl.runtime.gpt`) on every
  rank at once (the rate a rank gets while the others compute too: on a CPU the ranks share
  cores), as FLOP/s of the planner's count; the block's memory-bound kernels are inside that
  rate, so the cluster's elementwise term is off (`activation_passes` 0, `gemm_efficiency` 1);
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

SIZES = (4 * 1024, 4 * 1024 * 1024)  # ping-pong message bytes: latency-bound, bandwidth-bound
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

    def cluster(self) -> ClusterSpec:
        """This machine as the planner's cluster: one node of `ranks` processes."""
        link = self.bandwidth / FP32_OVER_COUNTED
        return ClusterSpec("local", self.ranks, self.ranks, self.flops, 64 * GB, link, self.latency, link,
                           self.latency, self.memory_bandwidth, gemm_efficiency=1.0, activation_passes=0.0,
                           reserved_memory=0.0)


def _median_time(fn, reps: int) -> float:
    fn()  # warm up (allocations, autograd graph caches)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rank(rank: int, model: SmallGPT, reps: int, sizes: tuple[int, int] = SIZES) -> dict[str, float]:
    """This rank's measurements (every rank of the process group must call it)."""
    import torch
    import torch.distributed as dist

    from pipedsl.runtime.gpt import Block

    torch.manual_seed(rank)
    cfg = model.gpt_config()
    block = Block(cfg)
    x = torch.randn(model.microbatch, model.seq, model.embd, requires_grad=True)  # [b, T, C]

    def block_step() -> None:
        block(x).sum().backward()

    dist.barrier()
    out = {"block": _median_time(block_step, reps)}

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


def _measure_in_pool(model: SmallGPT, reps: int, sizes: tuple[int, int]) -> dict[str, float]:
    import torch.distributed as dist

    return measure_rank(dist.get_rank(), model, reps, sizes)


def calibrate(ranks: int = 4, model: SmallGPT | None = None, reps: int = 7, timeout: float = 300.0,
              pool: Any = None) -> Calibration:
    """Measure this machine with `ranks` local processes (gloo, one torch thread each), started by
    `pipedsl.launch` or run on an existing `pipedsl.parallel.pool.LocalPool`."""
    from pipedsl.runtime import launch

    model = model or SmallGPT()
    if ranks < 2:
        from pipedsl.errors import PipeDSLError

        raise PipeDSLError(f"--calibrate needs at least 2 ranks (a link to measure), got {ranks}")
    if pool is None:
        results = launch(measure_rank, ranks, model, reps, SIZES, timeout=timeout, threads=1)
    else:
        results = pool.run(_measure_in_pool, ranks, model, reps, SIZES, timeout=timeout)
    return summarize([results], model)


def summarize(runs: list[list[dict[str, float]]], model: SmallGPT) -> Calibration:
    """One calibration from the per-rank measurements of one or more runs (medians over all)."""
    spec = model.spec()
    every = [r for results in runs for r in results]
    block = statistics.median(r["block"] for r in every)
    flops = 3 * spec.layer_flops(model.microbatch) / block
    adam = statistics.median(r["adam"] / r["adam_params"] for r in every)
    small, large = (statistics.median(r[f"msg{s}"] for r in every if f"msg{s}" in r) for s in SIZES)
    bandwidth = (SIZES[1] - SIZES[0]) / max(large - small, 1e-9)
    latency = max(small - SIZES[0] / bandwidth, 1e-7)
    return Calibration(len(runs[0]), flops, latency, bandwidth, ADAM_BYTES_PER_PARAM / adam)
