"""DualPipe, DualPipeV, V-Half and V-Min against 1F1B, ZB-H1 and ZB-V at one size (issue 15).

Per schedule, in one group of P local processes (the schedules alternate over `--reps` rounds,
reversed every other round, so load that drifts reaches all of them):

- simulated bubble fraction (F = 1, B = 2, I = W = 1 per op of a stage, F&B = F + B) and peak
  activations per rank, in stage activations and relative to 1F1B's (a 2P-stage schedule's
  chunk activation is half a stage's, so its counts are halved);
- measured on the runtime with a small GPT (4P - 2 blocks, so that the embedding, the blocks and
  the head cut evenly into P and 2P stages by count; the same weights for every schedule):
  the peak live activations the runtime counted and the peak saved-activation bytes per rank
  (pipedsl's ActivationCounter: stage inputs and every tensor autograd saved), and the step time;
- the step time again with the synthetic accelerator stage (benchmarks/_bench.py: each op sleeps
  F·P/S, B·P/S for S stages), where a waiting rank leaves the CPU to the others as a GPU would —
  on a 2-core machine the GPT's bubbles are filled by the other ranks' compute.

Step times are medians over the rounds, as ratios to 1F1B's measured in the same run.
Writes benchmarks/results/schedules_v.json and appends a row to benchmarks/RESULTS.md.

    python benchmarks/schedules_v.py              # P = 4, M = 8, 5 rounds (~4 min)
    python benchmarks/schedules_v.py --quick      # 2 rounds
    python benchmarks/schedules_v.py --M 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "dualpipev", "dualpipe", "v-half", "v-min"]
SIM_COST = {"F": 1, "B": 2, "I": 1, "W": 1}
SEQ, ROWS = 32, 2  # GPT tokens per sequence, sequences per microbatch


def _programs(P: int, M: int, names: list[str]) -> dict:
    import pipedsl

    return {n: pipedsl.load(n).compile(P=P, M=M) for n in names}


def _rank_main(rank: int, cfg: dict) -> dict:
    import torch

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    P, M, F, B = cfg["P"], cfg["M"], cfg["F"], cfg["B"]
    programs = _programs(P, M, cfg["schedules"])
    gcfg = GPTConfig(n_layer=4 * P - 2, n_embd=cfg["width"], n_head=4, block_size=SEQ)
    x, y = synthetic_batch(M * ROWS, SEQ, gcfg.vocab_size, torch.Generator().manual_seed(1))
    sx, sy = _bench.sleep_batch(M)
    gpt, sleep = {}, {}
    for name, program in programs.items():
        torch.manual_seed(0)  # the same weights for every schedule
        gpt[name] = pipedsl.Pipeline(GPT(gcfg).stages(program.num_stages), program=program, loss_fn=gpt_loss,
                                     activation_bytes=True)
        k = P / program.num_stages
        sleep[name] = pipedsl.Pipeline(_bench.sleep_stages(program.num_stages, F * k, B * k), program=program,
                                       loss_fn=_bench.sleep_loss)
        _bench.run_steps(gpt[name], x, y, cfg["warmup"], trace=False)
        _bench.run_steps(sleep[name], sx, sy, cfg["warmup"], trace=False)
    out = {name: {"gpt_s": [], "sleep_s": [], "peak_activations": [], "peak_bytes": []} for name in programs}
    names = list(programs)
    for rnd in range(cfg["reps"]):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            out[name]["gpt_s"] += _bench.run_steps(gpt[name], x, y, 1, trace=False)[0]
            out[name]["peak_activations"].append(gpt[name].peak_activations)
            out[name]["peak_bytes"].append(gpt[name].counter.peak_bytes)
            out[name]["sleep_s"] += _bench.run_steps(sleep[name], sx, sy, 1, trace=False)[0]
    return out


def main(argv: list[str] | None = None) -> dict:
    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES, help="1f1b first: the baseline")
    _bench.sleep_arguments(ap)
    ap.add_argument("--width", type=int, default=64, help="GPT embedding width")
    ap.add_argument("--reps", type=int, help="rounds (default 5; --quick 2)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    P, M = args.P, args.M
    args.reps = args.reps or (2 if args.quick else 5)
    if args.schedules[0] != "1f1b":
        ap.error("the first schedule is the baseline and must be 1f1b")
    cfg = {"P": P, "M": M, "F": args.F, "B": args.B, "width": args.width, "reps": args.reps,
           "warmup": args.warmup, "schedules": args.schedules}
    per_rank = pipedsl.launch(_rank_main, P, cfg, threads=1, timeout=300)
    programs = _programs(P, M, args.schedules)
    cost = pipedsl.Cost(**SIM_COST)
    rows = []
    for name, program in programs.items():
        t = pipedsl.simulate(program, cost)
        half = P / program.num_stages  # a chunk of a 2P-stage schedule holds half a stage
        # the synthetic stage's nominal sleeps, messages free: what the schedule promises
        nominal = pipedsl.simulate(program, pipedsl.Cost(F=args.F * half, B=args.B * half, I=args.B * half / 2,
                                                         W=args.B * half / 2))
        measured = [r[name] for r in per_rank]
        rows.append({
            "schedule": name, "stages": program.num_stages, "weight_copies": program.num_replicas,
            "sim_bubble": t.bubble_ratio, "sim_peak_activations": list(t.peak_activations),
            "sim_peak_stage_activations": max(t.peak_activations) * half,
            "measured_peak_activations": [max(m["peak_activations"]) for m in measured],
            "measured_peak_bytes": [max(m["peak_bytes"]) for m in measured],
            "gpt_step_s": _bench.spread(measured[0]["gpt_s"]),
            "sleep_step_s": _bench.spread(measured[0]["sleep_s"]),
            "sim_sleep_makespan_s": nominal.makespan,
        })
    base = rows[0]
    for r in rows:
        r["sim_memory_vs_1f1b"] = r["sim_peak_stage_activations"] / base["sim_peak_stage_activations"]
        r["measured_bytes_vs_1f1b"] = max(r["measured_peak_bytes"]) / max(base["measured_peak_bytes"])
        r["gpt_step_vs_1f1b"] = r["gpt_step_s"]["median"] / base["gpt_step_s"]["median"]
        r["sleep_step_vs_1f1b"] = r["sleep_step_s"]["median"] / base["sleep_step_s"]["median"]
        r["sim_step_vs_1f1b"] = r["sim_sleep_makespan_s"] / base["sim_sleep_makespan_s"]
    print(table(rows, P, M))
    command = "python benchmarks/schedules_v.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    result = {"benchmark": "schedules_v", "command": command, "machine": _bench.machine(), "date": _bench.today(),
              "config": {**{k: v for k, v in cfg.items() if k != "schedules"}, "sim_cost": SIM_COST,
                         "gpt": f"{4 * P - 2} blocks, width {args.width}, {ROWS} x {SEQ} tokens a microbatch"},
              "rows": rows}
    _bench.write_json("schedules_v", result, args.json)
    if not args.no_append:
        cells = "; ".join(f"{r['schedule']} bubble {r['sim_bubble']:.3f}, bytes {r['measured_bytes_vs_1f1b']:.2f}x, "
                          f"step {r['sleep_step_vs_1f1b']:.2f}x (sleep) {r['gpt_step_vs_1f1b']:.2f}x (GPT)"
                          for r in rows[1:])
        _bench.append_results(_bench.results_row(command, f"P={P} M={M} vs 1F1B: {cells}"))
    return result


def table(rows: list[dict], P: int, M: int) -> str:
    """The markdown table docs/schedules.md shows."""
    lines = [f"P = {P}, M = {M}; simulated at F = 1, B = 2, I = W = 1; measured: small GPT and synthetic stage",
             "",
             "| schedule | sim. bubble | sim. peak activations per rank (stage units) | memory vs 1F1B (sim.) "
             "| measured peak saved KiB per rank | bytes vs 1F1B | step vs 1F1B: sim. | synthetic | GPT |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        half = P / r["stages"]
        peaks = " ".join(f"{a * half:g}" for a in r["sim_peak_activations"])
        kib = " ".join(f"{b / 1024:.0f}" for b in r["measured_peak_bytes"])
        ratios = " | ".join(f"{r[k]:.2f}" for k in ("measured_bytes_vs_1f1b", "sim_step_vs_1f1b", "sleep_step_vs_1f1b",
                                                     "gpt_step_vs_1f1b"))
        lines.append(f"| {r['schedule']} | {r['sim_bubble']:.3f} | {peaks} | {r['sim_memory_vs_1f1b']:.2f} | {kib} | "
                     f"{ratios} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
