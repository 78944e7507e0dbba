"""How compile + validate + simulate time and memory grow with program size, and how fast a program
near the file size limit loads back from a file.

Each size runs in a fresh process (so peak RSS is its own), timing the public API:
`schedule.plan` (bind + order), `lower`, `validate`, `simulate`.  Prints a table, writes
JSON, appends a row to benchmarks/RESULTS.md, and reports time per instruction and the
growth exponent (slope of log time over log instructions).

The program of 1.18·10^6 instructions (the largest whose JSON fits MAX_PROGRAM_BYTES; with
--quick the largest quick one) is also written as JSON, CSV, text and torch CSV, and each file
is loaded and validated (`read_program`, what `pipedsl run --program` and `Pipeline(program=path)` do)
in a fresh process, `--load-reps` times: instructions per second beside the compiler's own
(plan + lower + validate) speed in the same run.  `--baseline REV` compiles every size and loads
the same files with the code of git revision REV too, alternating with this tree (`--compile-reps`
times per size, medians), so a speed-up is measured in one run (this machine's speed moves 1.5-3x
between runs); each size prints both rows, phase by phase, and this tree's total and CPU time over
the baseline's (CPU time moves less with other users' load).

    python benchmarks/compiler_scale.py                      # 10^3 … 1.6·10^6 instructions
    python benchmarks/compiler_scale.py --quick              # up to ~2·10^5
    python benchmarks/compiler_scale.py --baseline HEAD~3 --load-reps 3   # before and after
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = {"json": "program.json", "csv": "program.csv", "text": "program.txt", "torch-csv": "program_torch.csv"}

# (P, M, V): interleaved 1F1B sizes from ~10^3 to ~1.6·10^6 instructions.
SIZES = [(4, 8, 2), (8, 32, 2), (16, 64, 4), (32, 256, 4), (64, 512, 4), (64, 768, 4), (64, 1024, 4)]
QUICK = SIZES[:4]
# The program written to files and loaded back: 1.18·10^6 instructions, the largest whose JSON (55 MB) stays
# under MAX_PROGRAM_BYTES; with --quick, the largest quick size.
FILES_AT, QUICK_FILES_AT = (64, 768, 4), QUICK[-1]
THIS = "this tree"


def measure(schedule: str, P: int, M: int, V: int, files: str | None = None) -> dict:
    """Run in the child process: time each phase once; with `files`, then write the program there
    in every format (after the peak RSS is read: writing is not compiling)."""
    import pipedsl
    from pipedsl.lowering import lower
    from pipedsl.perf import no_gc
    from pipedsl.validate import validate

    sched = pipedsl.load(schedule)
    t0, c0 = time.perf_counter(), time.process_time()
    with no_gc():
        plan = sched.plan(P=P, M=M, V=V)
        t1 = time.perf_counter()
        program = lower(plan)
        t2 = time.perf_counter()
        validate(program)
        t3 = time.perf_counter()
    timeline = pipedsl.simulate(program)
    t4, c4 = time.perf_counter(), time.process_time()
    n = program.num_instructions()
    row = {
        "P": P, "M": M, "V": V, "instructions": n,
        "plan_s": t1 - t0, "lower_s": t2 - t1, "validate_s": t3 - t2, "simulate_s": t4 - t3,
        "total_s": t4 - t0, "cpu_s": c4 - c0, "us_per_instruction": (t4 - t0) / n * 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bubble_ratio": timeline.bubble_ratio,
    }
    if files:
        write = {"json": program.to_json, "csv": program.to_csv, "text": program.to_text,
                 "torch-csv": lambda: pipedsl.to_torch_csv(program)}
        for fmt, name in FILES.items():
            if fmt != "torch-csv" or program.num_replicas == 1:
                Path(files, name).write_text(write[fmt]())
    return row


def load(path: str) -> dict:
    """Run in the child process: load and validate one program file, as `pipedsl run --program` does."""
    from pipedsl.runtime.program_file import read_program

    t0, c0 = time.perf_counter(), time.process_time()
    program = read_program(path)
    return {"load_s": time.perf_counter() - t0, "load_cpu_s": time.process_time() - c0,
            "instructions": program.num_instructions(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


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
    parser.add_argument("--load-reps", type=int, default=1, help="loads of each program file (median)")
    parser.add_argument("--formats", nargs="+", choices=list(FILES), default=list(FILES),
                        help="program file formats to load (default: all)")
    parser.add_argument("--baseline", metavar="REV", help="also compile every size and load the files with git "
                        "revision REV's code, alternating with this tree's")
    parser.add_argument("--compile-reps", type=int, default=1, help="runs of each size per variant (median)")
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.schedule, *args.child, files=args.files)))
        return
    if args.load:
        print(json.dumps(load(args.load)))
        return

    sizes, files_at = (QUICK, QUICK_FILES_AT) if args.quick else (SIZES, FILES_AT)
    files = tempfile.TemporaryDirectory(prefix="pipedsl-programs-")
    old = tempfile.TemporaryDirectory(prefix="pipedsl-baseline-") if args.baseline else None
    variants = {THIS: {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}}
    if old:
        variants[args.baseline] = {**os.environ, "PYTHONPATH": str(_tree_at(args.baseline, Path(old.name)))}
    rows, base_rows = compile_sizes(sizes, files_at, files.name, variants, args)
    big = [r for r in rows if r["instructions"] >= 10_000]
    exponent = growth_exponent(big)
    print(f"growth exponent (time ~ n^k, n ≥ 10^4): k = {exponent:.3f}")

    with files:
        loading = program_files(files.name, next(r for r in rows if (r["P"], r["M"], r["V"]) == files_at), variants,
                                args)
    if old:
        old.cleanup()
    result = {"benchmark": "compiler_scale", "schedule": args.schedule, "machine": _machine(),
              "date": datetime.date.today().isoformat(), "rows": rows, "growth_exponent": exponent,
              "program_files": loading, "compile_reps": args.compile_reps}
    if args.baseline:
        result["baseline"] = {"revision": args.baseline, "rows": base_rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    last = rows[-1]
    speeds = ", ".join(f"{fmt} {f['instructions_per_s'] / 1e3:.0f}k" for fmt, f in loading["formats"].items())
    before = loading.get("baseline")
    was = (f" (at {before['revision']}, same run: " + ", ".join(
        f"{fmt} {f['instructions_per_s'] / 1e3:.0f}k" for fmt, f in before["formats"].items()) + ")") if before else ""
    then = (f" ({args.baseline}'s code, same run: {base_rows[-1]['total_s']:.2f} s, this tree "
            f"{last['total_s'] / base_rows[-1]['total_s']:.2f}x its time, "
            f"{last['cpu_s'] / base_rows[-1]['cpu_s']:.2f}x its CPU time)") if base_rows else ""
    _append_results(
        f"| {result['date']} | `python benchmarks/compiler_scale.py{' --quick' if args.quick else ''}"
        f"{f' --baseline {args.baseline}' if args.baseline else ''}"
        f"{f' --compile-reps {args.compile_reps}' if args.compile_reps != 1 else ''}"
        f"{f' --load-reps {args.load_reps}' if args.load_reps != 1 else ''}` | "
        f"{result['machine']} | {last['instructions']:,} instructions ({args.schedule} P={last['P']} M={last['M']} "
        f"V={last['V']}): {last['total_s']:.2f} s end to end{then}, {last['us_per_instruction']:.2f} µs/instruction, "
        f"peak RSS {last['peak_rss_mb']:.0f} MB; growth exponent {exponent:.2f}; compiled at "
        f"{loading['compile_instructions_per_s'] / 1e3:.0f}k instructions/s (plan + lower + validate), "
        f"the {loading['instructions']:,}-instruction program loaded from files at {speeds} instructions/s{was} |")


def compile_sizes(sizes: list[tuple[int, int, int]], files_at: tuple[int, int, int], files: str,
                  variants: dict[str, dict[str, str]], args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Each size `--compile-reps` times per variant in fresh processes, the variants' order alternating;
    print a row of medians per variant (with a baseline, its time over this tree's) and return this tree's
    rows and the baseline's."""
    print(f"{'P':>4} {'M':>5} {'V':>2} {'instr':>9} {'code':>10} {'plan':>6} {'lower':>6} {'valid':>6} {'sim':>6} "
          f"{'total s':>8} {'cpu s':>6} {'µs/instr':>9} {'RSS MB':>7}"
          + ("  this/baseline (cpu)" if len(variants) > 1 else ""))
    rows, base_rows = [], []
    for k, (P, M, V) in enumerate(sizes):
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(args.compile_reps):
            for variant in (list(variants) if (k + rep) % 2 == 0 else list(variants)[::-1]):
                keep = ["--files", files] if (P, M, V) == files_at and variant == THIS and not runs[THIS] else []
                out = subprocess.run([sys.executable, __file__, "--schedule", args.schedule, "--child", str(P), str(M),
                                      str(V), *keep], capture_output=True, text=True, env=variants[variant], cwd=files)
                if out.returncode:
                    raise SystemExit(f"compiler_scale: compiling with {variant}'s code failed:\n{out.stderr[-2000:]}")
                runs[variant].append(json.loads(out.stdout))
        med = {v: _median_row(got) for v, got in runs.items()}
        rows.append(med[THIS])
        for variant, r in med.items():
            if r["instructions"] != med[THIS]["instructions"]:
                raise SystemExit(f"compiler_scale: {variant}'s code made {r['instructions']} instructions, this tree "
                                 f"{med[THIS]['instructions']}: not the same input")
            ratio = (f"  {med[THIS]['total_s'] / r['total_s']:>13.2f}x ({med[THIS]['cpu_s'] / r['cpu_s']:.2f}x)"
                     if variant != THIS else "")
            print(f"{P:>4} {M:>5} {V:>2} {r['instructions']:>9} {variant[:10]:>10} {r['plan_s']:>6.2f} "
                  f"{r['lower_s']:>6.2f} {r['validate_s']:>6.2f} {r['simulate_s']:>6.2f} {r['total_s']:>8.2f} "
                  f"{r['cpu_s']:>6.2f} "
                  f"{r['us_per_instruction']:>9.2f} {r['peak_rss_mb']:>7.0f}{ratio}", flush=True)
            if variant != THIS:
                base_rows.append({**r, "runs": [x["total_s"] for x in runs[variant]]})
        med[THIS]["runs"] = [x["total_s"] for x in runs[THIS]]
    return rows, base_rows


def _median_row(runs: list[dict]) -> dict:
    """The repetition of median total time (the lower one of an even count): its phases add up to its total."""
    return dict(sorted(runs, key=lambda r: r["total_s"])[(len(runs) - 1) // 2])


def program_files(directory: str, row: dict, variants: dict[str, dict[str, str]], args: argparse.Namespace) -> dict:
    """Load each file of the program `--load-reps` times in fresh processes (with `--baseline`, alternately
    with that revision's code, which may predate a format: then that cell is empty); print and return the
    median speed per format."""
    n = row["instructions"]
    old = len(variants) > 1
    formats = [f for f in args.formats if Path(directory, FILES[f]).exists()]
    times: dict[str, dict[str, list[float]]] = {v: {f: [] for f in formats} for v in variants}
    unreadable: set[tuple[str, str]] = set()  # (baseline, format) its code cannot read
    for rep in range(args.load_reps):
        for variant in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            for fmt in formats:
                if (variant, fmt) in unreadable:
                    continue
                out = subprocess.run([sys.executable, __file__, "--load", str(Path(directory, FILES[fmt]))],
                                     capture_output=True, text=True, env=variants[variant], cwd=directory)
                if out.returncode and variant != THIS and "ValidationError" in out.stderr:
                    unreadable.add((variant, fmt))
                    continue
                if out.returncode:
                    raise SystemExit(f"compiler_scale: loading {fmt} with {variant}'s code failed:\n"
                                     f"{out.stderr[-2000:]}")
                got = json.loads(out.stdout)
                if got["instructions"] != n:
                    raise SystemExit(f"compiler_scale: {variant} loaded {got['instructions']} instructions, not {n}")
                times[variant][fmt].append(got["load_s"])
    compile_speed = n / (row["plan_s"] + row["lower_s"] + row["validate_s"])
    print(f"\nprogram files of {n:,} instructions ({args.schedule} P={row['P']} M={row['M']} V={row['V']}): load + "
          f"validate, median of {args.load_reps}; compiled at {compile_speed:,.0f} instructions/s in this run")
    print(f"{'format':>10} {'MB':>6} " + " ".join(f"{v[:12] + ' s':>14} {'instr/s':>10}" for v in variants)
          + (f" {'speed-up':>9}" if old else ""))
    summary: dict = {"instructions": n, "compile_instructions_per_s": compile_speed, "formats": {}}
    for fmt in formats:
        size = Path(directory, FILES[fmt]).stat().st_size / 2 ** 20
        med = {v: statistics.median(times[v][fmt]) if times[v][fmt] else None for v in variants}
        cells = " ".join(f"{med[v]:>14.2f} {n / med[v]:>10,.0f}" if med[v] else f"{'unreadable':>25}" for v in variants)
        gain = (f" {med[args.baseline] / med[THIS]:>8.2f}x" if med[args.baseline] else f" {'-':>9}") if old else ""
        print(f"{fmt:>10} {size:>6.1f} {cells}{gain}")
        summary["formats"][fmt] = {"megabytes": size, "load_s": med[THIS], "runs": times[THIS][fmt],
                                   "instructions_per_s": n / med[THIS]}
    if old:
        summary["baseline"] = {"revision": args.baseline, "formats": {
            fmt: {"load_s": statistics.median(times[args.baseline][fmt]), "runs": times[args.baseline][fmt],
                  "instructions_per_s": n / statistics.median(times[args.baseline][fmt])}
            for fmt in formats if times[args.baseline][fmt]}, "unreadable": sorted(f for _, f in unreadable)}
    return summary


def _tree_at(revision: str, into: Path) -> Path:
    """`pipedsl` as of a git revision, importable from `into` (schedules and runtime where the install maps them)."""
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", revision, "pipedsl", "schedules", "runtime"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for name in ("schedules", "runtime"):
        (into / name).rename(into / "pipedsl" / name)
    (into / "pipedsl" / "schedules" / "__init__.py").touch()
    return into


def _machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _append_results(row: str) -> None:
    sys.path.insert(0, str(HERE))
    import _bench  # here, not at the top: the measuring children must not import torch (their RSS)

    _bench.append_results(row)


if __name__ == "__main__":
    main()
