"""Starting local ranks: forked from the fork server against spawned, in the same run.

Each measurement is a fresh Python process (so nothing is imported or started beforehand), run
alternately with PIPEDSL_START_METHOD=forkserver and =spawn (runtime/launch/fork_server.py):

- *launch*: `pipedsl.launch` of a function that returns at once on N ranks — from the call until
  every rank's result is back (the fork server's own imports included: a first launch), and a
  second launch in the same process (the server already running);
- *train*: `pipedsl train` of a tiny GPT for 2 steps at P=2, end to end (command start to exit).

Reported: the median seconds of each, and forkserver / spawn (below 1 is faster).

    python benchmarks/startup.py                 # N = 2, 4; 3 rounds
    python benchmarks/startup.py --quick         # N = 2, no train; 1 round (structure only)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _bench  # noqa: E402

METHODS = ("forkserver", "spawn")
_LAUNCH = """
import json, sys, time
import pipedsl

def noop(rank):
    return rank

if __name__ == "__main__":
    n = int(sys.argv[1])
    t0 = time.perf_counter()
    pipedsl.launch(noop, n, threads=1)
    t1 = time.perf_counter()
    pipedsl.launch(noop, n, threads=1)
    print(json.dumps({"first": t1 - t0, "again": time.perf_counter() - t1}))
"""


def _env(method: str) -> dict[str, str]:
    return {**os.environ, "PIPEDSL_START_METHOD": method, "OMP_NUM_THREADS": "1"}


def launch_times(method: str, n: int, script: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(script), str(n)], capture_output=True, text=True, env=_env(method),
                         timeout=600)
    if out.returncode:  # what the launch said, not only its exit status
        raise SystemExit(f"{method} launch of {n} ranks failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_seconds(method: str, out: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipedsl.cli", "train", "-P", "2", "-M", "2", "--seq", "8", "--embd", "16",
                    "--steps", "2", "-o", str(out)], capture_output=True, text=True, env=_env(method), check=True,
                   timeout=600)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, nargs="+", default=[2, 4], help="ranks per launch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="N=2, no train run, one round")
    ap.add_argument("--json", help="output file (default benchmarks/results/startup.json)")
    ap.add_argument("--no-append", action="store_true", help="no row in RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.N, args.rounds = [2], 1
    import tempfile

    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "launch_noop.py"
        script.write_text(_LAUNCH)
        for _ in range(args.rounds):
            for method in METHODS:  # alternating: the machine's drifting load reaches both
                for n in args.N:
                    got = launch_times(method, n, script)
                    times.setdefault((method, f"launch N={n} first"), []).append(got["first"])
                    times.setdefault((method, f"launch N={n} again"), []).append(got["again"])
                if not args.quick:
                    times.setdefault((method, "pipedsl train P=2, 2 steps"), []).append(
                        train_seconds(method, Path(tmp) / f"train-{method}"))
    rows = []
    for what in dict.fromkeys(w for _, w in times):
        fork, spawn = (_bench.median(times[(m, what)]) for m in METHODS)
        rows.append({"what": what, "forkserver_s": fork, "spawn_s": spawn, "ratio": fork / spawn})
    print(f"{'what':<28} {'forkserver s':>12} {'spawn s':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['what']:<28} {r['forkserver_s']:12.2f} {r['spawn_s']:8.2f} {r['ratio']:6.2f}")
    command = ("python benchmarks/startup.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    result = {"benchmark": "startup", "command": command, "machine": _bench.machine(), "date": _bench.today(),
              "rounds": args.rounds, "rows": rows}
    _bench.write_json("startup", result, args.json)
    if not args.no_append:
        cells = "; ".join(f"{r['what']}: {r['forkserver_s']:.2f} s vs {r['spawn_s']:.2f} s ({r['ratio']:.2f}x)"
                          for r in rows)
        _bench.append_results(_bench.results_row(command, f"starting ranks, forkserver vs spawn: {cells}"))
    return result


if __name__ == "__main__":
    main()
