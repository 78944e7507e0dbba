"""The planner calibrated on this machine against the runtime's measured step times.

`pipedsl plan --calibrate`'s measurements (trainer/calibrate.py: a GPT block's FLOP/s
alone and with every rank computing, the split backward, blocking collectives, gloo ping-pong
latency/bandwidth, AdamW's bytes/s) become a
`ClusterSpec`; the planner then predicts the step time of each locally runnable layout of the
small GPT, and the same layouts are trained for real (pipedsl.launch, gloo, one torch thread a
rank: forward, backward, gradient reduction and the AdamW step, as `pipedsl train`).  The table
is measured vs predicted per layout, the ratio, and whether the two orders agree (Spearman's
rho of the step times, and the pairs measured more than 15 % apart — closer ones are within
the run-to-run noise).  Calibration and measurement run in the same invocation.

    python benchmarks/planner_calibration.py            # 4 ranks, 5 timed steps per layout
    python benchmarks/planner_calibration.py --quick    # 4 layouts, 3 steps
    python benchmarks/planner_calibration.py --ranks 2  # a core per rank: bubbles cost as on GPUs
    python benchmarks/planner_calibration.py --ranks 8  # the layouts with dp doubled (slow on 2 cores)
    python benchmarks/planner_calibration.py --repeat 3 # each layout 3 times (interleaved), medians
    python benchmarks/planner_calibration.py --tp-only  # only the tensor-parallel rows (with and without SP)

One launch of a layout measures within about ±10 % of another on this 2-core VM (which ranks
the OS puts together on a core changes from launch to launch); `--repeat` takes the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

from pipedsl.plan import Layout, evaluate  # noqa: E402
from pipedsl.runtime.launch.capacity import usable_cores  # noqa: E402
from pipedsl.trainer.calibrate import SmallGPT, measure_rank, summarize  # noqa: E402

# (dp, pp, tp, schedule, params, microbatch size[, sequence parallel]) at 4 ranks; 8 ranks doubles dp
LAYOUTS_4 = [(1, 4, 1, "1f1b", (), 2), (1, 4, 1, "gpipe", (), 2), (1, 4, 1, "zb-h1", (), 2),
             (1, 4, 1, "interleaved", (("V", 2),), 2), (2, 2, 1, "1f1b", (), 2), (2, 2, 1, "zb-h1", (), 2),
             (1, 2, 2, "1f1b", (), 2), (4, 1, 1, "1f1b", (), 2), (1, 2, 2, "1f1b", (), 2, True),
             (2, 1, 2, "1f1b", (), 2, True)]
# 2 ranks on 2 cores: no core is shared, so bubbles cost what they cost on GPUs (M=2 vs M=8)
LAYOUTS_2 = [(1, 2, 1, "1f1b", (), 2), (1, 2, 1, "1f1b", (), 8), (1, 2, 1, "gpipe", (), 2),
             (1, 2, 1, "zb-h1", (), 2), (1, 2, 1, "zb-h1", (), 8), (1, 2, 1, "interleaved", (("V", 2),), 2),
             (2, 1, 1, "1f1b", (), 2), (1, 1, 2, "1f1b", (), 2), (1, 1, 2, "1f1b", (), 2, True),
             (1, 1, 2, "1f1b", (), 8, True)]


def _train_rank(rank: int, model: SmallGPT, layout: Layout, steps: int, warmup: int) -> tuple[dict, list[float]]:
    import torch

    import pipedsl
    from pipedsl.models.gpt.model import GPT, gpt_loss, synthetic_batch
    from pipedsl.parallel import ParallelConfig, ParallelMesh

    program = pipedsl.load(layout.schedule).compile(P=layout.pp, M=layout.microbatches, **dict(layout.params))
    torch.manual_seed(0)
    gpt = GPT(model.gpt_config())
    mesh = None
    if layout.dp > 1 or layout.tp > 1:
        mesh = ParallelMesh(ParallelConfig(dp=layout.dp, pp=layout.pp, tp=layout.tp, zero=layout.zero))
    if layout.tp > 1:
        from pipedsl.models.gpt.parallelize import tp_gpt_loss

        stages = gpt.tp_stages(program.num_stages, mesh, by="blocks", sequence_parallel=layout.sequence_parallel)
        loss = tp_gpt_loss(mesh)
    else:
        stages, loss = gpt.stages(program.num_stages, by="blocks"), gpt_loss
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=loss, parallel=mesh)
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(warmup + steps):
        x, y = synthetic_batch(model.batch, model.seq, model.vocab, gen)
        torch.distributed.barrier()  # every rank starts the step together: the step ends at the last rank
        t0 = time.perf_counter()
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return measure_rank(rank, model, reps=3, cores=usable_cores()), times


def measure(model: SmallGPT, layout: Layout, steps: int, warmup: int) -> tuple[list[dict], float]:
    """The calibration measurements taken right after the steps (same processes, same load), and
    the median over steps of the slowest rank's step time."""
    from pipedsl.runtime.launch.launcher import launch

    per_rank = launch(_train_rank, layout.gpus, model, layout, steps, warmup, timeout=600, threads=1)
    return [m for m, _ in per_rank], statistics.median(max(ts) for ts in zip(*(t for _, t in per_rank)))


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0] * len(xs)
        for r, i in enumerate(order):
            out[i] = r
        return out

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 layouts (pp4 1F1B and GPipe, dp2xpp2, dp4), 3 steps")
    parser.add_argument("--repeat", type=int, default=1, help="launches of each layout (in turn); their median")
    parser.add_argument("--tp-only", action="store_true", help="only the tensor-parallel layouts (tp, tp + SP)")
    args = parser.parse_args()
    table = LAYOUTS_2 if args.ranks == 2 else LAYOUTS_4
    chosen = [table[i] for i in (0, 1, 4, 7)] if args.quick else table
    if args.tp_only:
        chosen = [row for row in chosen if row[2] > 1]
    if args.quick:
        args.steps, args.warmup = 3, 1
    model = SmallGPT()
    spec = model.spec()
    began = time.perf_counter()
    scale = max(1, args.ranks // 4)
    layouts = [Layout(dp * scale, pp, tp, schedule, b, model.batch // (dp * scale * b), zero=0, recompute=False,
                      params=params, sequence_parallel=bool(sp and sp[0]))
               for dp, pp, tp, schedule, params, b, *sp in chosen]
    launches: list[list[float]] = [[] for _ in layouts]
    runs = []
    for _ in range(max(1, args.repeat)):
        for layout, times in zip(layouts, launches):
            calibration_run, step = measure(model, layout, args.steps, args.warmup)
            times.append(step)
            runs.append(calibration_run)
            print(f"  {layout}: measured {step * 1e3:.0f} ms", flush=True)
    measured = [statistics.median(times) for times in launches]
    # one calibration for every row: the medians over all the runs' measurements
    cal = summarize(runs, model, usable_cores())
    cluster = cal.cluster()
    print(f"calibration ({args.ranks} ranks, {len(runs)} runs): {cal.describe()}")
    rows = [(layout, m, evaluate(spec, cluster, layout).iteration) for layout, m in zip(layouts, measured)]
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    same = sorted(rows, key=lambda r: r[1]) == sorted(rows, key=lambda r: r[2])
    errors = [abs(p / m - 1) for _, m, p in rows]
    # layouts whose measured times differ by less than the run-to-run noise (~15 % here) have no order to agree on
    apart = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:] if max(a[1], b[1]) > 1.15 * min(a[1], b[1])]
    alike = sum((a[1] < b[1]) == (a[2] < b[2]) for a, b in apart)
    print("\n| layout | measured ms | launches ms | predicted ms | predicted / measured |")
    print("|---|---:|---|---:|---:|")
    for (layout, m, p), times in zip(rows, launches):
        each = ", ".join(f"{t * 1e3:.0f}" for t in times)
        print(f"| {layout} | {m * 1e3:.0f} | {each} | {p * 1e3:.0f} | {p / m:.2f} |")
    print(f"\nSpearman rho {rho:.2f}, identical order: {same}; |error| median {statistics.median(errors):.1%}, "
          f"max {max(errors):.1%}; within 15 %: {sum(e <= 0.15 for e in errors)}/{len(errors)}; "
          f"pairs measured >15 % apart: {alike}/{len(apart)} ordered alike; {time.perf_counter() - began:.0f} s")
    _bench.write_json("planner_calibration", {
        "machine": _bench.machine(), "ranks": args.ranks, "calibration": cal.__dict__,
        "rows": [{"layout": str(lay), "measured": m, "launches": times, "predicted": p}
                 for (lay, m, p), times in zip(rows, launches)],
        "spearman": rho, "identical_order": same,
        "pairs_apart": len(apart), "pairs_apart_ordered_alike": alike})
    ratios = [p / m for _, m, p in rows]
    _bench.append_results(_bench.results_row(f"python benchmarks/planner_calibration.py --ranks {args.ranks} "
                                             f"--repeat {args.repeat}{' --tp-only' if args.tp_only else ''}",
                                             f"predicted/measured {min(ratios):.2f}-{max(ratios):.2f}, "
                                             f"Spearman {rho:.2f}, pairs >15 % apart ordered alike "
                                                                f"{alike}/{len(apart)}"))


if __name__ == "__main__":
    main()
