"""A GPT whose last stage carries a large-vocabulary head: the searched schedule on an uneven partition
against 1F1B, ZB-H1 and ZB-V on an even one, at the same activation memory.

The built-in GPT (8 blocks, C = 64, a `--vocab`-token head: about `--vocab`·C / (12·C²) blocks' worth of
FLOPs) on P = 4 local processes, M = 8.  Compute is emulated as in the other runtime benchmarks (a 2-core
machine standing for accelerators), here in proportion to FLOPs: each piece (embedding, block, head) sleeps
`--us-per-mweight` µs per million matmul weights (`models/split.py`'s `matmul_weights`) in its forward, as
long in its input gradient I and in its weight gradient W (so B = 2F, I = W = F).  Rows, side by side in one
run:

    1f1b, zb-h1 (split by count: the embedding and the head count as pieces like the blocks),
    zb-v (2P chunks by count),
    auto: from the split by count, profiled 3 steps under ZB-H1 with each piece's forward timed, the pieces
          re-cut from the measured times and ZB-auto searched from the costs of the new cut at mem = P (1F1B's
          activation memory on rank 0), as `pipedsl train --schedule auto` does (plan/recut.py)

with the step time (median of `--steps` timed steps after warm-up), the traced step's bubble and peak
activations, and the simulator's makespan for the traced step: "predicted" for auto (from the profile's
costs, before it ran), "self-fit" for every row (`Cost.fit` of its own trace).

    python benchmarks/auto_schedule.py            # 5 timed steps
    python benchmarks/auto_schedule.py --quick    # 2
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

P, M, BLOCKS = 4, 8, 8
ROWS = (("1f1b", "count"), ("zb-h1", "count"), ("zb-v", "count"), ("auto", "count"))


def _rank_main(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    from torch import nn

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.models.split import matmul_weights
    from pipedsl.plan.recut import choose_cut
    from pipedsl.runtime.unit_clock import UnitClock

    class Timed(nn.Module):
        """`inner` with emulated compute in proportion to its matmul weights: F after its forward, I in the
        gradient of its output, W in the gradient of a weight of its own."""

        def __init__(self, inner: nn.Module, seconds: float) -> None:
            super().__init__()
            self.inner, self.seconds = inner, seconds
            self.clock = nn.Parameter(torch.zeros(()))

        def forward(self, *xs: Any) -> Any:
            out = self.inner(*xs)
            w = _bench._Sleep.apply(self.clock, 0.0, self.seconds)
            first = out[0] if isinstance(out, tuple) else out
            first = _bench._Sleep.apply(first, self.seconds, self.seconds) + 0 * w
            return (first, *out[1:]) if isinstance(out, tuple) else first

    torch.set_num_threads(1)
    per = cfg["us_per_mweight"] * 1e-6 / 1e6
    gcfg = GPTConfig(vocab_size=cfg["vocab"], block_size=32, n_layer=BLOCKS, n_head=4, n_embd=64)

    def model() -> GPT:
        torch.manual_seed(0)
        m = GPT(gcfg)
        m.embed = Timed(m.embed, per * 64 * 64)  # a lookup: a token's worth of work, not a matmul
        m.blocks = nn.ModuleList(Timed(b, per * matmul_weights(b)) for b in m.blocks)
        m.head = Timed(m.head, per * matmul_weights(m.head.inner if hasattr(m.head, "inner") else m.head))
        return m

    def run(program: Any, by: str, steps: int, warmup: int, points: list[int] | None = None,
            clock: list[Any] | None = None) -> tuple[Any, list[float], Any]:
        pipe = pipedsl.Pipeline(model().stages(program.num_stages, by=by, points=points), program=program,
                                loss_fn=gpt_loss)
        if clock is not None:  # the profile: each unit's forward timed, as `pipedsl train --schedule auto` does
            clock.append(UnitClock(pipe.local_stages()))
        gen = torch.Generator().manual_seed(1)
        batches = [synthetic_batch(4 * M, 32, cfg["vocab"], gen) for _ in range(3)]
        times = []
        for k in range(warmup + steps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            pipe.step(*batches[k % 3])
            if k >= warmup:
                times.append(time.perf_counter() - t0)
            for p in pipe.parameters():
                p.grad = None
        timeline = pipe.timeline()
        pipe.close()
        if clock is not None:
            clock[0].close()
        return pipe, times, timeline

    rows = []
    for name, by in ROWS:
        predicted, points, kept = None, None, None
        if name == "auto":  # trainer/train.py's `_switch`: profile, re-cut, search
            clock: list[Any] = []
            profiled = pipedsl.load("zb-h1").compile(P=P, M=M)
            _, _, profile = run(profiled, by, 1, 2, clock=clock)
            units: list[Any] = [None] * P
            torch.distributed.all_gather_object(units, clock[0].report())
            plan = [choose_cut(profile, units, profiled, {"mem": P}) if profile is not None else None]
            torch.distributed.broadcast_object_list(plan, src=0)
            points, kept, predicted = plan[0].points, plan[0].kept_ms / 1e3, plan[0].predicted_ms / 1e3
            program = pipedsl.Program.from_json(plan[0].program)
        else:
            program = pipedsl.load(name).compile(P=P, M=M)
        _, times, timeline = run(program, by, cfg["steps"], cfg["warmup"], points=points)
        rows.append({"schedule": name, "split": ",".join(map(str, points)) if points else by,
                     "program": program.to_json(), "step_s": statistics.median(times), "predicted_s": predicted,
                     "kept_s": kept, "timeline": timeline.to_json() if timeline is not None else None})
    return rows


def table(result: dict[str, Any]) -> str:
    lines = ["| schedule | split | step ms | traced ms | bubble | peak activations | predicted ms | self-fit ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] is not None else ""
        lines.append(f"| {r['schedule']} | {r['split']} | {r['step_ms']:.1f} | {r['makespan_ms']:.1f} | "
                     f"{r['bubble']:.3f} | {' '.join(map(str, r['peaks']))} | {pred} | {r['self_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 timed steps")
    ap.add_argument("--vocab", type=int, default=4096,
                    help="the head's vocabulary (default 4096: the head costs about 5 blocks)")
    ap.add_argument("--us-per-mweight", type=float, default=20000.0,
                    help="emulated µs of forward per million matmul weights (default 20000: a block 1 ms, so the "
                         "emulated compute, which sleeps, outweighs the real one and 4 ranks on 2 cores barely "
                         "contend)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="output file (default benchmarks/results/auto_schedule.json)")
    ap.add_argument("--no-append", action="store_true", help="do not append a row to RESULTS.md")
    args = ap.parse_args(argv)
    cfg = {"vocab": args.vocab, "us_per_mweight": args.us_per_mweight, "steps": 2 if args.quick else args.steps,
           "warmup": 1 if args.quick else 2}
    rows = pipedsl.launch(_rank_main, P, cfg, threads=1, timeout=1200)[0]
    summary = []
    for r in rows:
        timeline = pipedsl.Timeline.from_json(r["timeline"])
        program = pipedsl.Program.from_json(r["program"])
        summary.append({"schedule": r["schedule"], "split": r["split"], "step_ms": r["step_s"] * 1e3,
                        "makespan_ms": timeline.makespan * 1e3, "bubble": timeline.bubble_ratio,
                        "peaks": timeline.peak_activations,
                        "predicted_ms": r["predicted_s"] * 1e3 if r["predicted_s"] is not None else None,
                        "self_ms": pipedsl.simulate(program, pipedsl.Cost.fit(timeline)).makespan * 1e3})
    auto = summary[-1]
    best_other = min(s["step_ms"] for s in summary[:-1])
    checks = {"auto_over_best_even": auto["step_ms"] / best_other,
              "predicted_over_measured": auto["predicted_ms"] / auto["makespan_ms"]}
    _bench.publish("auto_schedule", argv, cfg, summary, checks, table,
                   f"auto / best even-split schedule {checks['auto_over_best_even']:.3f}, predicted / measured (auto) "
                   f"{checks['predicted_over_measured']:.3f}", args.json, args.no_append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
