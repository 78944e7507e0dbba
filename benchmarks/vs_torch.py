"""pipedsl against torch.distributed.pipelining: same stages, data, processes and order, side by side.

For each schedule both runtimes have, one group of P local processes (gloo, one thread per
rank) builds the same stage modules twice — one copy driven by torch's schedule, one by
pipedsl running *the compute order torch runs* (for the looped schedules read from the torch
schedule's `pipeline_order` and lowered by pipedsl; for GPipe and 1F1B pipedsl's built-ins,
which are torch's loops), so only the runtimes differ.  Both warm up, then
repetitions alternate (pipedsl first on even repetitions, torch first on odd ones); each
repetition times `--steps` steps between two barriers.  Reported: median step time of each,
throughput (samples/s) and the pipedsl/torch throughput ratio, as the ratio of the medians and
as the median of the per-repetition ratios (paired, robust to load drifting during the run).

Workloads (`--P` sets the ranks of every workload; default 2 4 8 for `sleep`, 2 for the others):
`sleep` — the synthetic stage (benchmarks/_bench.py) sleeping F forward and B backward around a
small matmul; `mlp` — an 8-block MLP (Linear(64, 64) + GELU) per stage plus a synthetic stage
sleeping F/5 and B/5, CPU compute and a stand-in for accelerator time together; `tiny` — one
`Linear(8, 8)` per stage and nothing else, where the runtimes' own cost per op decides; `gpt` —
the small GPT (pipedsl.models.gpt.model).  One thread per rank.

    python benchmarks/vs_torch.py                   # both workloads, every schedule
    python benchmarks/vs_torch.py --quick           # P = 2, 4, fewer repetitions
    python benchmarks/vs_torch.py --workload sleep --P 4 --schedules 1f1b gpipe
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

SCHEDULE_NAMES = list(_bench.TORCH_SCHEDULES)
WORKLOADS = ("sleep", "mlp", "tiny", "gpt")


def _stage_modules(workload: str, S: int, cfg: dict) -> tuple[list, Any, Any, Any]:
    """(modules, inputs, targets, loss_fn) — identical on every rank and for both runtimes."""
    import torch

    M = cfg["M"]
    if workload == "sleep":
        x, y = _bench.sleep_batch(M)
        return _bench.sleep_stages(S, cfg["F"], cfg["B"]), x, y, _bench.sleep_loss
    if workload == "mlp":
        torch.manual_seed(0)
        x, y = _bench.sleep_batch(M)
        sleeps = _bench.sleep_stages(S, cfg["F"] / 5, cfg["B"] / 5)
        blocks = [[m for _ in range(8) for m in (torch.nn.Linear(_bench.WIDTH, _bench.WIDTH), torch.nn.GELU())]
                  for _ in range(S)]
        return [torch.nn.Sequential(*b, sl) for b, sl in zip(blocks, sleeps)], x, y, _bench.sleep_loss
    if workload == "tiny":
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(M * 2, 8, generator=g), torch.randn(M * 2, 8, generator=g)
        return [torch.nn.Linear(8, 8) for _ in range(S)], x, y, torch.nn.functional.mse_loss
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    torch.manual_seed(0)
    gcfg = GPTConfig(n_layer=max(4, S))
    model = GPT(gcfg)
    x, y = synthetic_batch(cfg["M"] * cfg["gpt_rows"], gcfg.block_size, gcfg.vocab_size,
                           torch.Generator().manual_seed(1))
    return model.stages(S), x, y, gpt_loss


def _rank_main(rank: int, workload: str, name: str, P: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import pipedsl

    M, S = cfg["M"], _bench.num_stages_for(name, P)
    device = torch.device(cfg.get("device", "cpu"))  # gpu_check.py: "cuda" (pipedsl picks it on NCCL itself)
    modules, x, y, loss_fn = _stage_modules(workload, S, cfg)
    torch_modules = copy.deepcopy(modules)
    sched = _bench.build_torch_schedule(name, torch_modules, P, rank, M, loss_fn, device)
    tx, ty = x.to(device), y.to(device)  # torch's runtime wants its inputs on the stage's device
    if _bench.TORCH_SCHEDULES[name][1] == "single":
        # torch's Schedule1F1B/ScheduleGPipe run a hand-written loop (their `pipeline_order` is only a
        # drawing, off by one on the last rank); pipedsl's built-ins are that loop's order (tests/pipedsl)
        program = pipedsl.load(name).compile(P=P, M=M)
    else:  # _PipelineScheduleRuntime executes exactly `pipeline_order`
        program = _bench.program_from_torch(sched, name, P, M)
    pipe = pipedsl.Pipeline(modules, program=program, loss_fn=loss_fn)
    torch_params = [p for s in _bench.torch_stage_indices(_bench.TORCH_SCHEDULES[name][1], P, rank)
                    for p in torch_modules[s].parameters()]

    def run_pipedsl() -> None:
        pipe.step(x, y)
        for p in pipe.parameters():
            p.grad = None

    def run_torch() -> None:
        sched.step(tx, target=ty, return_outputs=False)
        for p in torch_params:
            p.grad = None

    runners = {"pipedsl": run_pipedsl, "torch": run_torch}

    def timed(which: str, steps: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            runners[which]()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - t0) / steps

    for which in ("pipedsl", "torch"):
        if cfg["warmup"]:
            timed(which, cfg["warmup"])
    times: dict[str, list[float]] = {"pipedsl": [], "torch": []}
    for rep in range(cfg["reps"]):
        for which in (("pipedsl", "torch") if rep % 2 == 0 else ("torch", "pipedsl")):
            times[which].append(timed(which, cfg["steps"]))
    same = None  # does pipedsl's built-in .pipe compile to the order torch runs?
    if name in ("zb-v", "interleaved"):
        same = pipedsl.load(name).compile(P=P, M=M).compute_orders() == program.compute_orders()
    return {"times": times, "builtin_same_order": same, "instructions": program.num_instructions()}


def _row(workload: str, name: str, P: int, cfg: dict, out: dict) -> dict:
    t = out["times"]
    rows_per_step = cfg["M"] * {"gpt": cfg["gpt_rows"], "tiny": 2}.get(workload, _bench.ROWS_PER_MB)
    med = {k: _bench.median(v) for k, v in t.items()}
    paired = [tt / pp for pp, tt in zip(t["pipedsl"], t["torch"])]
    return {
        "workload": workload, "schedule": name, "torch_class": _bench.TORCH_SCHEDULES[name][0], "P": P,
        "M": cfg["M"], "step_s": {k: _bench.spread(v) for k, v in t.items()},
        "samples_per_s": {k: rows_per_step / v for k, v in med.items()},
        "ratio": med["torch"] / med["pipedsl"],  # pipedsl throughput / torch throughput
        "ratio_paired_median": _bench.median(paired), "ratio_paired_min": min(paired), "ratio_paired_max": max(paired),
        "builtin_same_order": out["builtin_same_order"], "raw": t,
    }


def main(argv: list[str] | None = None) -> dict:
    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", nargs="+", choices=[*WORKLOADS, "both"], default=["both"],
                    help="workloads (default: sleep and gpt; 'both' is those two)")
    ap.add_argument("--P", type=int, nargs="+", help="ranks for every workload (default: sleep 2 4 8, others 2; "
                                                     "--quick: sleep 2 4)")
    ap.add_argument("--M", type=int, help="microbatches (default 2P)")
    ap.add_argument("--F", type=float, default=0.010, help="synthetic forward sleep, s")
    ap.add_argument("--B", type=float, default=0.020, help="synthetic backward sleep (I + W), s")
    ap.add_argument("--gpt-rows", type=int, default=4, help="sequences per microbatch (GPT)")
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULE_NAMES, default=SCHEDULE_NAMES)
    ap.add_argument("--reps", type=int, help="repetitions per runtime (default 7; --quick 3)")
    ap.add_argument("--steps", type=int, default=2, help="steps per repetition (sleep workload)")
    ap.add_argument("--gpt-steps", type=int, default=10, help="steps per repetition (GPT: ~50 ms steps, more per rep)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="output file (default benchmarks/results/vs_torch.json)")
    ap.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    workloads = [w for w in WORKLOADS if w in args.workload or ("both" in args.workload and w in ("sleep", "gpt"))]
    default_P = {"sleep": [2, 4] if args.quick else [2, 4, 8]}
    jobs = [(w, P) for w in workloads for P in (args.P or default_P.get(w, [2]))]
    rows = []
    print(f"{'workload':>8} {'P':>2} {'M':>3} {'schedule':>15} {'pipedsl ms':>11} {'torch ms':>9} "
          f"{'ratio':>6} {'paired':>6}")
    for workload, P in jobs:
        M = args.M or 2 * P
        steps = args.gpt_steps if workload == "gpt" else args.steps
        cfg = {"M": M, "F": args.F, "B": args.B, "reps": reps, "steps": steps, "warmup": args.warmup,
               "gpt_rows": args.gpt_rows}
        for name in args.schedules:
            out = pipedsl.launch(_rank_main, P, workload, name, P, cfg, threads=1, timeout=120)[0]
            row = _row(workload, name, P, cfg, out)
            rows.append(row)
            print(f"{workload:>8} {P:>2} {M:>3} {name:>15} {row['step_s']['pipedsl']['median'] * 1e3:>11.1f} "
                  f"{row['step_s']['torch']['median'] * 1e3:>9.1f} {row['ratio']:>6.3f} "
                  f"{row['ratio_paired_median']:>6.3f}", flush=True)
    command = "python benchmarks/vs_torch.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    result = {"benchmark": "vs_torch", "command": command, "machine": _bench.machine(), "date": _bench.today(),
              "config": {"F": args.F, "B": args.B, "reps": reps, "steps": args.steps, "gpt_steps": args.gpt_steps,
                         "warmup": args.warmup,
                         "threads_per_rank": 1, "backend": "gloo"},
              "rows": rows}
    _bench.write_json("vs_torch", result, args.json)
    if not args.no_append:
        cells = "; ".join(f"{r['workload']} P={r['P']} {r['schedule']} {r['ratio']:.2f}×" for r in rows)
        _bench.append_results(_bench.results_row(
            command, f"pipedsl/torch throughput (median step times, alternating, {reps} reps): {cells}"))
    return result


if __name__ == "__main__":
    main()
