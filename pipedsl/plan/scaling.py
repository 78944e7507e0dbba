"""Where extra GPUs stop paying: predicted throughput against GPU count, for the planner's best
layout and for pure data parallelism (the best of ZeRO 0-3, tp = pp = 1: FSDP's layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipedsl.errors import PipeDSLError
from pipedsl.output import replacing
from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.model import ModelSpec
from pipedsl.plan.search import Estimate, search

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class ScalingPoint:
    gpus: int
    best: Estimate | None  # None: nothing fits
    data_parallel: Estimate | None

    def samples_per_second(self, which: str) -> float:
        e = getattr(self, which)
        return 0.0 if e is None else e.layout.dp * e.layout.microbatches * e.layout.microbatch / e.iteration


def scaling(model: ModelSpec, cluster: ClusterSpec, gpu_counts: tuple[int, ...] = GPU_COUNTS,
            schedules: list[str] | None = None) -> list[ScalingPoint]:
    """The best layout and the best pure data-parallel one at each GPU count (None where nothing fits)."""
    points = []
    for n in gpu_counts:
        c = cluster.with_gpus(n)
        best = search(model, c, top=1, schedules=schedules).ranked
        dp = search(model, c, top=1, tp=[1], pp=[1]).ranked
        points.append(ScalingPoint(n, best[0] if best else None, dp[0] if dp else None))
    return points


def plot_scaling(points: list[ScalingPoint], model: ModelSpec, cluster: ClusterSpec, path: str | Path) -> None:
    """Samples/s (left) and TFLOP/s per GPU (right) against GPUs, log-log, with ideal linear scaling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, per_gpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for which, label, style in (("best", "planner's best (dp × pp × tp, ZeRO, schedule)", "o-"),
                                ("data_parallel", "pure data parallel (best ZeRO stage)", "s--")):
        xs = [p.gpus for p in points if getattr(p, which) is not None]
        ax.plot(xs, [p.samples_per_second(which) for p in points if getattr(p, which) is not None], style, label=label)
        per_gpu.plot(xs, [getattr(p, which).tflops for p in points if getattr(p, which) is not None], style,
                     label=label)
    first = next((p for p in points if p.best is not None), None)
    if first is not None:
        xs = [p.gpus for p in points if p.gpus >= first.gpus]
        ax.plot(xs, [first.samples_per_second("best") * x / first.gpus for x in xs], ":", color="gray",
                label="linear from the first point")
    for a in (ax, per_gpu):
        a.set_xscale("log", base=2)
        a.set_xlabel("GPUs")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("samples / s (predicted)")
    per_gpu.set_ylabel("TFLOP/s per GPU (predicted)")
    ax.legend(fontsize=8)
    fig.suptitle(f"{model.name} ({model.params / 1e9:.0f}B, batch {model.global_batch}) on {cluster.name}: "
                 f"predicted throughput", fontsize=11)
    fig.tight_layout()
    try:
        with replacing(path) as tmp:
            fig.savefig(tmp)
    except OSError as err:
        raise PipeDSLError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
