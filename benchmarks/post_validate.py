"""Synchronous against post-validated steps (runtime/post_validate.py): the steady-state step time, measured and
predicted.

Compute is emulated as in the other runtime benchmarks (a 2-core machine standing for accelerators): every stage
sleeps F forward and B = I + W backward around a small op (`_bench.SleepStage`), and the optimizer's step sleeps
`--opt-ms`.  P = 4, M = 8.  Per schedule — 1F1B, ZB-H1, ZB-H2, and zb-auto with `post=1` at mem = P and 2P — one
run of synchronous steps (each ends with the global checks, then the optimizer) and one of post-validated steps
(each rank steps when its part ends; the checks are read in the next step), in the same processes.  The step time
is the median interval between rank 0's consecutive step returns after warm-up.

Predicted, from costs fitted to a traced synchronous step of the same schedule (`Cost.fit`, the optimizer's sleep
as `Cost.step`): synchronous, the simulated makespan of one step; post-validated, the period of simulated
consecutive steps (`pipedsl.steps.period`: the longest rank span).

    python benchmarks/post_validate.py            # 10 timed steps a run
    python benchmarks/post_validate.py --quick    # 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402
import torch  # noqa: E402


class SleepSGD(torch.optim.SGD):
    """SGD whose step also sleeps `delay` seconds: an accelerator's optimizer step."""

    def __init__(self, params: Any, lr: float, delay: float) -> None:
        super().__init__(params, lr=lr)
        self.delay = delay

    def step(self, closure: Any = None) -> Any:
        time.sleep(self.delay)
        return super().step(closure)


def _rows(P: int) -> list[tuple[str, str, dict[str, Any]]]:
    return [("1f1b", "1f1b", {}), ("zb-h1", "zb-h1", {}), ("zb-h2", "zb-h2", {}),
            (f"zb-auto mem={P}", "zb-auto", {"mem": P, "post": 1}),
            (f"zb-auto mem={2 * P}", "zb-auto", {"mem": 2 * P, "post": 1})]


def _rank_main(rank: int, cfg: dict) -> list[dict[str, Any]]:
    import dataclasses

    import torch.distributed as dist

    import pipedsl
    from pipedsl.runtime.post_validate import TrainingSteps
    from pipedsl.steps import period

    P, M, F, B, opt_s = cfg["P"], cfg["M"], cfg["F"], cfg["B"], cfg["opt"]
    x, y = _bench.sleep_batch(M)
    nominal = pipedsl.Cost(F=F, B=B, I=B / 2, W=B / 2, step=opt_s)
    rows = []
    for label, name, params in _rows(P):
        extra = {"cost": nominal, **params} if name == "zb-auto" else {}
        program = pipedsl.load(name).compile(P=P, M=M, **extra)
        row: dict[str, Any] = {"schedule": label}
        for mode in ("synchronous", "post-validated"):
            pipe = pipedsl.Pipeline(_bench.sleep_stages(program.num_stages, F, B), program=program,
                                    loss_fn=_bench.sleep_loss)
            opt = pipe.optimizer(SleepSGD, lr=1e-4, delay=opt_s)
            if mode == "synchronous":  # the profile the predictions are fitted to
                _, timelines = _bench.run_steps(pipe, x, y, 2)
                for p in pipe.parameters():
                    p.grad = None
                if rank == 0:
                    cost = dataclasses.replace(pipedsl.Cost.fit(timelines[-1]), step=opt_s)
                    row["predicted_synchronous_s"] = pipedsl.simulate(program, cost).makespan
                    row["predicted_post_validated_s"] = period(pipedsl.simulate(program, cost, steps=4))
            steps = TrainingSteps(pipe, opt, post_validate=mode == "post-validated")
            for _ in range(cfg["warmup"]):
                steps.step(x, y)
            dist.barrier(group=pipe.group)
            stamps = [time.perf_counter()]
            for _ in range(cfg["steps"]):
                steps.step(x, y)
                stamps.append(time.perf_counter())
            steps.settle()
            row[f"{mode}_s"] = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
            pipe.close()
        rows.append(row)
    return rows


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'schedule':>16} {'sync ms':>8} {'predicted':>9} {'post ms':>8} {'predicted':>9} {'post/sync':>9} "
             f"{'meas/pred sync':>14} {'meas/pred post':>14}"]
    for r in result["rows"]:
        lines.append(f"{r['schedule']:>16} {r['synchronous_s'] * 1e3:>8.1f} {r['predicted_synchronous_s'] * 1e3:>9.1f} "
                     f"{r['post-validated_s'] * 1e3:>8.1f} {r['predicted_post_validated_s'] * 1e3:>9.1f} "
                     f"{r['post_over_sync']:>9.3f} {r['sync_over_predicted']:>14.3f} {r['post_over_predicted']:>14.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-P", type=int, default=4)
    ap.add_argument("-M", type=int, default=8)
    _bench.sleep_arguments(ap)
    ap.add_argument("--opt-ms", type=float, default=10.0, help="the optimizer step's ms (default 10)")
    ap.add_argument("--steps", type=int, help="timed steps a run (default 10; --quick 4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    cfg = {"P": args.P, "M": args.M, "F": args.F, "B": args.B, "opt": args.opt_ms / 1e3,
           "steps": args.steps or (4 if args.quick else 10), "warmup": args.warmup}
    rows = pipedsl.launch(_rank_main, args.P, cfg, threads=1, timeout=300)[0]
    for r in rows:
        r["post_over_sync"] = r["post-validated_s"] / r["synchronous_s"]
        r["sync_over_predicted"] = r["synchronous_s"] / r["predicted_synchronous_s"]
        r["post_over_predicted"] = r["post-validated_s"] / r["predicted_post_validated_s"]
    worst = max(abs(r[k] - 1) for r in rows for k in ("sync_over_predicted", "post_over_predicted"))
    checks = {"worst_prediction_error": worst, "best_post_over_sync": min(r["post_over_sync"] for r in rows)}
    summary = ("post-validated / synchronous step time: " + ", ".join(f"{r['schedule']} {r['post_over_sync']:.3f}"
                                                                    for r in rows)
               + f"; measured / predicted within {worst:.1%}")
    return _bench.publish("post_validate", argv, cfg, rows, checks, _table, summary, args.json, args.no_append)


if __name__ == "__main__":
    main()
