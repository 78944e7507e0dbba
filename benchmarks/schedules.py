"""Schedules against each other: Hanayo (W = 1, 2) against 1F1B, interleaved 1F1B and Chimera,
measured on the runtime and predicted by the simulator, at P = 4 and 8 with M from P to 4P.

The *model* is fixed: a microbatch costs F forward and B backward per rank's share of the
model, whatever the schedule cuts it into — a schedule with S stages gets stages that sleep
F·P/S and B·P/S (the synthetic stage, benchmarks/_bench.py).  Each (P, M) runs in one group of
P local processes; the schedules alternate over `--reps` rounds, and the measured makespan is
the median over the traced steps.

Two predictions per row: `ideal` — the simulator with the nominal sleeps and free messages
(what the schedule promises); `predicted` — the same plus the runtime's costs, fitted from a
1F1B profile at M = 2P run on a pipeline of its own, one traced step per round beside the
measured schedules (so load that drifts reaches both): the per-op overshoot of each kind (measured minus
nominal, added to every op), the message latency and the send issue time (means: see
fidelity.py).  Never fitted to the runs it predicts.

Writes benchmarks/results/schedules.json and a stacked picture of the measured timelines at
the first (P, M) of the run with M = 2P (benchmarks/results/schedules_P4_M8.png by default).

    python benchmarks/schedules.py              # P = 4, 8; M = P, 2P, 4P; 3 rounds
    python benchmarks/schedules.py --quick      # P = 4; M = 4, 8; 2 rounds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

# label -> (schedule, parameters)
SCHEDULES = {
    "1f1b": ("1f1b", {}),
    "interleaved": ("interleaved", {"V": 2}),
    "chimera": ("chimera", {}),
    "hanayo-W1": ("hanayo", {"W": 1}),
    "hanayo-W2": ("hanayo", {"W": 2}),
}


def _compile(label: str, P: int, M: int):
    import pipedsl
    from pipedsl.errors import PipeDSLError

    name, params = SCHEDULES[label]
    try:
        return pipedsl.load(name).compile(P=P, M=M, **params), None
    except PipeDSLError as err:
        return None, err.message.splitlines()[0]


def _nominal(program, P: int, F: float, B: float):
    import pipedsl

    k = P / program.num_stages
    return pipedsl.Cost(F=F * k, B=B * k, I=B * k / 2, W=B * k / 2)


def _rank_main(rank: int, cfg: dict) -> dict:
    import pipedsl

    P, F, B = cfg["P"], cfg["F"], cfg["B"]
    # the profile: 1F1B at M = 2P on a pipeline of its own, one traced step per round beside the measured ones
    prof = pipedsl.load("1f1b").compile(P=P, M=2 * P)
    px, py = _bench.sleep_batch(2 * P)
    profile = pipedsl.Pipeline(_bench.sleep_stages(P, F, B), program=prof, loss_fn=_bench.sleep_loss)
    _bench.run_steps(profile, px, py, cfg["warmup"], trace=False)
    out: dict = {"P": P, "rows": [], "timelines": {}, "profiles": []}
    for M in cfg["Ms"](P):
        x, y = _bench.sleep_batch(M)
        pipes, skipped = {}, {}
        for label in SCHEDULES:
            program, reason = _compile(label, P, M)
            if program is None:
                skipped[label] = reason
                continue
            c = _nominal(program, P, F, B)
            pipes[label] = pipedsl.Pipeline(_bench.sleep_stages(program.num_stages, c.F, c.B), program=program,
                                            loss_fn=_bench.sleep_loss)
            _bench.run_steps(pipes[label], x, y, cfg["warmup"], trace=False)
        got: dict[str, tuple[list, list]] = {label: ([], []) for label in pipes}
        order = [*pipes, "profile"]
        prof_tls = []
        for rnd in range(cfg["reps"]):
            for label in (order if rnd % 2 == 0 else order[::-1]):
                if label == "profile":
                    prof_tls += _bench.run_steps(profile, px, py, 1)[1]
                    continue
                times, tls = _bench.run_steps(pipes[label], x, y, 1)
                got[label][0].extend(times)
                got[label][1].extend(tls)
        if rank != 0:
            continue
        fit = _bench.average_cost([_bench.fit_profile([tl]) for tl in prof_tls])
        out["profiles"].append({"M": M, "schedule": "1f1b", "profile_M": 2 * P, "steps": len(prof_tls),
                                "cost": _bench.cost_dict(fit), "overshoot_F_s": fit.F - F,
                                "overshoot_B_s": fit.B - B})
        for label, (times, tls) in got.items():
            program = pipes[label].program
            nominal = _nominal(program, P, F, B)
            from dataclasses import replace
            predicted_cost = replace(nominal, F=nominal.F + fit.F - F, B=nominal.B + fit.B - B,
                                     I=nominal.I + (fit.B - B) / 2, W=nominal.W + (fit.B - B) / 2,
                                     comm=fit.comm, send=fit.send)
            measured = [tl.makespan for tl in tls]
            ideal = pipedsl.simulate(program, nominal)
            predicted = pipedsl.simulate(program, predicted_cost)
            med = _bench.median(measured)
            out["rows"].append({
                "schedule": label, "P": P, "M": M, "stages": program.num_stages,
                "measured_makespan_s": _bench.spread(measured), "step_wall_s": _bench.spread(times),
                "ideal_makespan_s": ideal.makespan, "predicted_makespan_s": predicted.makespan,
                "measured_over_predicted": med / predicted.makespan,
                "ideal_bubble": ideal.bubble_ratio, "peak_activations": ideal.peak_activations,
                "samples_per_s": M * _bench.ROWS_PER_MB / med,
            })
            if M == 2 * P:
                best = min(tls, key=lambda t: abs(t.makespan - med))
                out["timelines"][label] = best.to_json()
        for label, reason in skipped.items():
            out["rows"].append({"schedule": label, "P": P, "M": M, "skipped": reason})
    return out


def main(argv: list[str] | None = None) -> dict:
    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, nargs="+", help="ranks (default 4 8; --quick 4)")
    ap.add_argument("--M-factors", type=int, nargs="+", help="M as multiples of P (default 1 2 4; --quick 1 2)")
    _bench.sleep_arguments(ap)
    ap.add_argument("--reps", type=int, help="rounds (default 3; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--png", help="picture of the measured timelines "
                                  "(default benchmarks/results/schedules_P{P}_M{2P}.png)")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    Ps = args.P or ([4] if args.quick else [4, 8])
    factors = args.M_factors or ([1, 2] if args.quick else [1, 2, 4])
    reps = args.reps or (2 if args.quick else 3)
    rows, pictures = [], {}
    print(f"{'P':>2} {'M':>3} {'schedule':>12} {'measured ms':>12} {'predicted':>10} {'meas/pred':>9} {'ideal':>8} "
          f"{'vs 1F1B':>8}")
    for P in Ps:
        cfg = {"P": P, "F": args.F, "B": args.B, "reps": reps, "warmup": args.warmup,
               "Ms": _Ms(factors)}
        out = pipedsl.launch(_rank_main, P, cfg, threads=1, timeout=180)[0]
        rows += out["rows"]
        if out["timelines"]:
            pictures[P] = out["timelines"]
        base = {r["M"]: r["measured_makespan_s"]["median"] for r in out["rows"] if r["schedule"] == "1f1b"}
        for r in out["rows"]:
            if "skipped" in r:
                print(f"{P:>2} {r['M']:>3} {r['schedule']:>12}  skipped: {r['skipped']}")
                continue
            med = r["measured_makespan_s"]["median"]
            r["speedup_vs_1f1b"] = base[r["M"]] / med if r["M"] in base else None
            print(f"{P:>2} {r['M']:>3} {r['schedule']:>12} {med * 1e3:>12.1f} {r['predicted_makespan_s'] * 1e3:>10.1f} "
                  f"{r['measured_over_predicted']:>9.3f} {r['ideal_makespan_s'] * 1e3:>8.1f} "
                  f"{r['speedup_vs_1f1b'] or float('nan'):>8.3f}", flush=True)
    png = None
    if pictures:
        from pipedsl.visualize import plot_timelines

        P = min(pictures)
        tls = {label: pipedsl.Timeline.from_json(s) for label, s in pictures[P].items()}
        png = Path(args.png) if args.png else _bench.RESULTS_DIR / f"schedules_P{P}_M{2 * P}.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_timelines(list(tls.values()), png,
                       titles=[f"{label} (measured, P={P} M={2 * P}): {t.makespan * 1e3:.0f} ms"
                               for label, t in tls.items()])
    command = "python benchmarks/schedules.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    result = {"benchmark": "schedules", "command": command, "machine": _bench.machine(), "date": _bench.today(),
              "config": {"P": Ps, "M_factors": factors, "F": args.F, "B": args.B, "reps": reps,
                         "model": "each schedule's stages sleep F*P/S and B*P/S (the same model cut differently)"},
              "rows": rows, "picture": str(png) if png else None}
    _bench.write_json("schedules", result, args.json)
    if not args.no_append:
        measured = [r for r in rows if "measured_over_predicted" in r]
        cells = "; ".join(f"P={r['P']} M={r['M']} {r['schedule']} {r['measured_makespan_s']['median'] * 1e3:.0f} ms "
                          f"({r['speedup_vs_1f1b']:.2f}× 1F1B, meas/pred {r['measured_over_predicted']:.3f})"
                          for r in measured if r["schedule"].startswith("hanayo"))
        worst = max(measured, key=lambda r: abs(r["measured_over_predicted"] - 1))
        _bench.append_results(_bench.results_row(command, (
            f"Hanayo vs 1F1B/interleaved/Chimera (measured): {cells}; worst measured/predicted over all "
            f"{len(measured)} rows: {worst['schedule']} P={worst['P']} M={worst['M']} "
            f"{(worst['measured_over_predicted'] - 1) * 100:+.1f} %")))
    return result


class _Ms:
    """M = factor·P for each factor (picklable for the ranks)."""

    def __init__(self, factors: list[int]) -> None:
        self.factors = factors

    def __call__(self, P: int) -> list[int]:
        return [f * P for f in self.factors]


if __name__ == "__main__":
    main()
