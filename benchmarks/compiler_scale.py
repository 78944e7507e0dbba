"""How compile + validate + simulate time and memory grow with program size.

Each size runs in a fresh process (so peak RSS is its own), timing the public API:
`schedule.plan` (bind + order), `lower`, `validate`, `simulate`.  Prints a table, writes
JSON, appends a row to benchmarks/RESULTS.md, and reports time per instruction and the
growth exponent (slope of log time over log instructions).

    python benchmarks/compiler_scale.py                      # 10^3 … 1.6·10^6 instructions
    python benchmarks/compiler_scale.py --quick              # up to ~10^5
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (P, M, V): interleaved 1F1B sizes from ~10^3 to ~1.6·10^6 instructions.
SIZES = [(4, 8, 2), (8, 32, 2), (16, 64, 4), (32, 256, 4), (64, 512, 4), (64, 1024, 4)]
QUICK = SIZES[:4]


def measure(schedule: str, P: int, M: int, V: int) -> dict:
    """Run in the child process: time each phase once."""
    import pipedsl
    from pipedsl.lowering import lower
    from pipedsl.perf import no_gc
    from pipedsl.validate import validate

    sched = pipedsl.load(schedule)
    t0 = time.perf_counter()
    with no_gc():
        plan = sched.plan(P=P, M=M, V=V)
        t1 = time.perf_counter()
        program = lower(plan)
        t2 = time.perf_counter()
        validate(program)
        t3 = time.perf_counter()
    timeline = pipedsl.simulate(program)
    t4 = time.perf_counter()
    n = program.num_instructions()
    return {
        "P": P, "M": M, "V": V, "instructions": n,
        "plan_s": t1 - t0, "lower_s": t2 - t1, "validate_s": t3 - t2, "simulate_s": t4 - t3,
        "total_s": t4 - t0, "us_per_instruction": (t4 - t0) / n * 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bubble_ratio": timeline.bubble_ratio,
    }


def growth_exponent(rows: list[dict]) -> float:
    """Least-squares slope of log(total time) against log(instructions)."""
    xs = [math.log(r["instructions"]) for r in rows]
    ys = [math.log(r["total_s"]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved")
    parser.add_argument("--quick", action="store_true", help="sizes up to ~10^5 instructions")
    parser.add_argument("--json", default=str(HERE / "results" / "compiler_scale.json"))
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.schedule, *args.child)))
        return

    rows = []
    print(f"{'P':>4} {'M':>5} {'V':>2} {'instr':>9} {'plan':>6} {'lower':>6} {'valid':>6} {'sim':>6} "
          f"{'total s':>8} {'µs/instr':>9} {'RSS MB':>7}")
    for P, M, V in QUICK if args.quick else SIZES:
        out = subprocess.run([sys.executable, __file__, "--schedule", args.schedule, "--child", str(P), str(M), str(V)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        rows.append(r)
        print(f"{P:>4} {M:>5} {V:>2} {r['instructions']:>9} {r['plan_s']:>6.2f} {r['lower_s']:>6.2f} "
              f"{r['validate_s']:>6.2f} {r['simulate_s']:>6.2f} {r['total_s']:>8.2f} "
              f"{r['us_per_instruction']:>9.2f} {r['peak_rss_mb']:>7.0f}", flush=True)
    big = [r for r in rows if r["instructions"] >= 10_000]
    exponent = growth_exponent(big)
    print(f"growth exponent (time ~ n^k, n ≥ 10^4): k = {exponent:.3f}")

    result = {"benchmark": "compiler_scale", "schedule": args.schedule, "machine": _machine(),
              "date": datetime.date.today().isoformat(), "rows": rows, "growth_exponent": exponent}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    last = rows[-1]
    _append_results(
        f"| {result['date']} | `python benchmarks/compiler_scale.py{' --quick' if args.quick else ''}` | "
        f"{result['machine']} | {last['instructions']:,} instructions ({args.schedule} P={last['P']} M={last['M']} "
        f"V={last['V']}): {last['total_s']:.2f} s end to end, {last['us_per_instruction']:.2f} µs/instruction, "
        f"peak RSS {last['peak_rss_mb']:.0f} MB; growth exponent {exponent:.2f} |")


def _machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _append_results(row: str) -> None:
    sys.path.insert(0, str(HERE))
    import _bench  # here, not at the top: the measuring children must not import torch (their RSS)

    _bench.append_results(row)


if __name__ == "__main__":
    main()
