"""Fidelity: measured makespan over simulated makespan for every built-in schedule, and the
runtime's own overhead per instruction.

The cost model is fitted from a *profile* — traced steps of 1F1B (F, B, the message latency
and the send cost) and of ZB-H1 (I and W) on pipelines of their own — and predicts every
schedule; the simulator is never fitted to the steps it is compared with.  Profile and
measured steps alternate in rounds (one traced step of each per round, the direction
reversed every round), so load that drifts during the run reaches both alike; the cost is
the mean of the per-round fits.  The fit takes
means (a path's expected length is the sum of mean costs); the prediction from medians
(`Cost.fit`'s default) is reported beside it.  Each schedule runs on
the synthetic stage (every stage sleeps F forward, I = W = B/2 backward) in one group of P
local processes; its measured makespan is the median over `--reps` traced steps.  As a
diagnostic (not a prediction) each row also shows the simulation with costs fitted to that
schedule's own trace: what the model cannot explain even with the right per-op numbers.

Overhead: steps with zero-sleep stages (1F1B, M microbatches) at P = 1 and at P, as time per
compute op; from the sleep traces, the median gap between instructions (dispatch), the median
send issue time and the message latency.

    python benchmarks/fidelity.py               # P=4, M=8, F=10 ms, B=20 ms, 7 reps
    python benchmarks/fidelity.py --quick       # 3 reps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

PROFILES = ("1f1b", "zb-h1")


def _program(name: str, P: int, M: int):
    import pipedsl
    from pipedsl.errors import PipeDSLError

    try:
        return pipedsl.load(name).compile(P=P, M=M), None
    except PipeDSLError as err:
        return None, err.message.splitlines()[0]


def _rank_main(rank: int, cfg: dict) -> dict:
    import pipedsl

    P, M, F, B = cfg["P"], cfg["M"], cfg["F"], cfg["B"]
    x, y = _bench.sleep_batch(M)

    def pipeline(program, F: float, B: float):
        pipe = pipedsl.Pipeline(_bench.sleep_stages(program.num_stages, F, B), program=program,
                                loss_fn=_bench.sleep_loss)
        _bench.run_steps(pipe, x, y, cfg["warmup"], trace=False)
        return pipe

    # profile pipelines and measured pipelines are separate; every round runs one traced step of each,
    # in alternating direction, so load that drifts during the run reaches profile and measurement alike
    runs: dict[str, object] = {f"profile:{n}": pipeline(_program(n, P, M)[0], F, B) for n in PROFILES}
    out: dict = {"rows": [], "profile": {}}
    for name in cfg["schedules"]:
        program, reason = _program(name, P, M)
        if program is None:
            out["rows"].append({"schedule": name, "skipped": reason})
        else:
            runs[name] = pipeline(program, F, B)
    got: dict[str, tuple[list, list]] = {k: ([], []) for k in runs}
    order = list(runs)
    for rnd in range(cfg["reps"]):
        for key in (order if rnd % 2 == 0 else order[::-1]):
            times, tls = _bench.run_steps(runs[key], x, y, 1)
            got[key][0].extend(times)
            got[key][1].extend(tls)
    if rank == 0:
        profiles = [[tls for tls in got[f"profile:{n}"][1]] for n in PROFILES]
        cost = _bench.average_cost([_bench.fit_profile(list(step), "mean") for step in zip(*profiles)])
        cost_median = _bench.average_cost([_bench.fit_profile(list(step), "median") for step in zip(*profiles)])
        out["profile"] = {"schedules": list(PROFILES), "steps": cfg["reps"], "statistic": "mean",
                          "cost": _bench.cost_dict(cost), "cost_median": _bench.cost_dict(cost_median)}
    gaps, sends = [], []
    for name in cfg["schedules"]:
        if name not in runs or rank != 0:
            continue
        program = runs[name].program
        times, tls = got[name]
        measured = [tl.makespan for tl in tls]
        predicted = pipedsl.simulate(program, cost).makespan
        predicted_median = pipedsl.simulate(program, cost_median).makespan
        nominal = pipedsl.simulate(program, pipedsl.Cost(F=F, B=B, I=B / 2, W=B / 2)).makespan
        self_fit = [pipedsl.simulate(program, pipedsl.Cost.fit(tl, "mean")).makespan for tl in tls]
        for tl in tls:
            gaps += _bench.dispatch_gaps(tl)
            sends += [e.duration for ev in tl.ranks for e in ev if e.instr.op.value.startswith("SEND")]
        med = _bench.median(measured)
        out["rows"].append({
            "schedule": name, "params": dict(program.params), "stages": program.num_stages,
            "measured_makespan_s": _bench.spread(measured), "step_wall_s": _bench.spread(times),
            "predicted_makespan_s": predicted, "ratio": med / predicted,
            "predicted_median_fit_s": predicted_median, "ratio_median_fit": med / predicted_median,
            "nominal_makespan_s": nominal, "ratio_to_nominal": med / nominal,
            "self_fit_ratio": med / _bench.median(self_fit),
        })
    order_of = {n: i for i, n in enumerate(cfg["schedules"])}
    out["rows"].sort(key=lambda r: order_of[r["schedule"]])

    def measure(program, F: float, B: float, steps: int) -> tuple[list[float], list]:
        return _bench.run_steps(pipeline(program, F, B), x, y, steps, trace=False)

    # zero compute at P: the runtime and the messages alone
    zero_program = _program("1f1b", P, cfg["zero_M"])[0]
    zero_times, _ = measure(zero_program, 0.0, 0.0, cfg["zero_steps"])
    if rank == 0:
        ops = 2 * cfg["zero_M"]  # compute ops per rank (one stage per rank)
        out["overhead"] = {
            f"zero_compute_P{P}_s_per_compute_op": _bench.median(zero_times) / ops,
            f"zero_compute_P{P}_step_s": _bench.spread(zero_times),
            "dispatch_gap_s": _bench.spread(gaps), "send_issue_s": _bench.spread(sends),
            "message_latency_s": cost.comm, "instructions_per_rank_zero": len(zero_program.ranks[0]),
        }
    return out


def _single_rank_overhead(rank: int, M: int, steps: int) -> dict:
    import pipedsl

    program = pipedsl.load("1f1b").compile(P=1, M=M)
    pipe = pipedsl.Pipeline(_bench.sleep_stages(1, 0.0, 0.0), program=program, loss_fn=_bench.sleep_loss)
    x, y = _bench.sleep_batch(M)
    _bench.run_steps(pipe, x, y, 3, trace=False)
    times, _ = _bench.run_steps(pipe, x, y, steps, trace=False)
    # the same work without the runtime: forward, loss and backward per microbatch, in a plain loop
    import time

    stage = _bench.sleep_stages(1, 0.0, 0.0)[0]
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (_bench.sleep_loss(stage(xm), ym) / M).backward()
        stage.weight.grad = None
        plain.append(time.perf_counter() - t0)
    return {"P1_s_per_compute_op": _bench.median(times) / (2 * M), "P1_step_s": _bench.spread(times),
            "P1_plain_loop_s_per_compute_op": _bench.median(plain) / (2 * M),
            "P1_runtime_s_per_compute_op": (_bench.median(times) - _bench.median(plain)) / (2 * M),
            "P1_instructions": len(program.ranks[0])}


def main(argv: list[str] | None = None) -> dict:
    import pipedsl
    from pipedsl.library import builtin_names

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--M", type=int, help="microbatches (default 2P)")
    _bench.sleep_arguments(ap)
    ap.add_argument("--reps", type=int, help="traced steps per schedule (default 7; --quick 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--schedules", nargs="+", default=builtin_names())
    ap.add_argument("--zero-M", type=int, default=16, help="microbatches of the zero-compute overhead run")
    ap.add_argument("--zero-steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    P, M = args.P, args.M or 2 * args.P
    cfg = {"P": P, "M": M, "F": args.F, "B": args.B, "reps": args.reps or (3 if args.quick else 7),
           "warmup": args.warmup, "schedules": args.schedules, "zero_M": args.zero_M, "zero_steps": args.zero_steps}
    out = pipedsl.launch(_rank_main, P, cfg, threads=1, timeout=120)[0]
    out["overhead"].update(pipedsl.launch(_single_rank_overhead, 1, args.zero_M, args.zero_steps, threads=1)[0])
    print(f"P={P} M={M} F={args.F * 1e3:g} ms B={args.B * 1e3:g} ms; cost fitted from {'+'.join(PROFILES)}: "
          + ", ".join(f"{k}={v * 1e3:.3f} ms" for k, v in out["profile"]["cost"].items()
                      if isinstance(v, float) and k not in ("message_bytes",)))
    print(f"{'schedule':>12} {'measured ms':>12} {'predicted':>10} {'meas/pred':>10} {'median-fit':>10} "
          f"{'nominal':>8} {'self-fit':>9}")
    for r in out["rows"]:
        if "skipped" in r:
            print(f"{r['schedule']:>12}  skipped: {r['skipped']}")
            continue
        print(f"{r['schedule']:>12} {r['measured_makespan_s']['median'] * 1e3:>12.1f} "
              f"{r['predicted_makespan_s'] * 1e3:>10.1f} {r['ratio']:>10.3f} {r['ratio_median_fit']:>10.3f} "
              f"{r['nominal_makespan_s'] * 1e3:>8.1f} "
              f"{r['self_fit_ratio']:>9.3f}")
    o = out["overhead"]
    print(f"overhead: P=1 {o['P1_s_per_compute_op'] * 1e6:.0f} µs/compute op (plain loop "
          f"{o['P1_plain_loop_s_per_compute_op'] * 1e6:.0f} µs, runtime "
          f"{o['P1_runtime_s_per_compute_op'] * 1e6:.0f} µs);"
          f" P={P} zero compute {o[f'zero_compute_P{P}_s_per_compute_op'] * 1e6:.0f} µs/compute op; dispatch gap "
          f"{o['dispatch_gap_s']['median'] * 1e6:.0f} µs, send issue {o['send_issue_s']['median'] * 1e6:.0f} µs, "
          f"message latency {o['message_latency_s'] * 1e6:.0f} µs")
    command = "python benchmarks/fidelity.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    result = {"benchmark": "fidelity", "command": command, "machine": _bench.machine(), "date": _bench.today(),
              "config": {k: v for k, v in cfg.items()}, **out}
    _bench.write_json("fidelity", result, args.json)
    if not args.no_append:
        rows = [r for r in out["rows"] if "ratio" in r]
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
        cells = ", ".join(f"{r['schedule']} {r['ratio']:.3f}" for r in rows)
        _bench.append_results(_bench.results_row(command, (
            f"measured/predicted makespan at P={P} M={M} (cost: means fitted from {'+'.join(PROFILES)}): {cells}; "
            f"worst {worst['schedule']} {(worst['ratio'] - 1) * 100:+.1f} %; overhead P=1 "
            f"{o['P1_runtime_s_per_compute_op'] * 1e6:.0f} µs/compute op above a plain loop, P={P} zero compute "
            f"{o[f'zero_compute_P{P}_s_per_compute_op'] * 1e3:.2f} ms/compute op, dispatch gap "
            f"{o['dispatch_gap_s']['median'] * 1e6:.0f} µs")))
    return result


if __name__ == "__main__":
    main()
