"""Soak: train the small GPT for 200 steps, restarting every 20 from a checkpoint under another schedule.

    python benchmarks/soak.py                      # 200 steps, P=2, M=4, a restart every 20 steps
    python benchmarks/soak.py --faults             # also SIGKILL rank 1 in the middle of every other segment

Every segment is a fresh set of processes (`pipedsl.launch`): it loads the latest complete
checkpoint, trains until the next multiple of `--every` under the next schedule of the
rotation, and checkpoints.  The schedules all cut the model into the same 4 stages but place
them differently on the 2 ranks (interleaved {0,2}|{1,3}, ZB-V and Hanayo {0,3}|{1,2}, looped
BFS {0,2}|{1,3}) and ZB-V splits the backward (I/W), so a rank often loads stages from
the other rank's part.  With `--faults`, a killed segment is restarted from the last complete
checkpoint (the lost steps run again).  The per-step losses are compared with one
uninterrupted run of the first schedule and must be identical bit-for-bit (exit status 0):
a resume restores the state exactly, and these schedules run the same per-stage arithmetic,
each stage accumulating its microbatch gradients in microbatch order.  Looped BFS
(`--schedules interleaved,zb-v,hanayo,looped-bfs`) runs each stage's backwards in reverse
microbatch order, so its gradient sums round differently in the last bits; at this learning
rate such differences grow over the run (chaotically, not from the checkpoints: compare
`--schedules looped-bfs --every 200 --reference interleaved`, a run with no restart at all).
The report gives the count of bit-identical steps, the largest absolute difference, the wall
time of both runs, and the save/load times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime import checkpoint

ROTATION = ("interleaved", "zb-v", "hanayo")


def segment(rank: int, program_json: str, cfg: dict[str, Any], first: int, last: int) -> dict[str, Any]:
    """Train steps first … last (resuming from the latest checkpoint when first > 1); rank 0 reports."""
    import torch

    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.trainer.train import _arm_step_fault

    program = pipedsl.Program.from_json(program_json)
    gcfg = GPTConfig(vocab_size=64, block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4, n_embd=cfg["embd"])
    torch.manual_seed(cfg["seed"])
    model = GPT(gcfg)
    pipe = pipedsl.Pipeline(model.stages(program.num_stages), program=program, loss_fn=gpt_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    load_s, restored = 0.0, None
    if first > 1:
        t0 = time.perf_counter()
        restored = checkpoint.load(pipe, cfg["dir"], opt)
        load_s = time.perf_counter() - t0
        gen.set_state(restored.extra["data"])
        assert restored.step == first - 1, (restored.step, first)
    _arm_step_fault(pipe, rank)  # --faults: PIPEDSL_FAULT=step:1:N kills rank 1 inside step N
    losses, saves = {}, []
    t_train = time.perf_counter()
    for step in range(first, last + 1):
        x, y = synthetic_batch(cfg["batch"], cfg["seq"], gcfg.vocab_size, gen)
        losses[step] = pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg["dir"] and step % cfg["every"] == 0:
            t0 = time.perf_counter()
            checkpoint.save(pipe, cfg["dir"], step, opt, extra={"data": gen.get_state()}, timeout=cfg["timeout"])
            saves.append(time.perf_counter() - t0)
    train_s = time.perf_counter() - t_train - sum(saves)
    if rank != 0:
        return {}
    return {"losses": losses, "load_s": load_s, "save_s": saves, "train_s": train_s,
            "changed": restored.schedule_changed if restored else None}


def launch(program: pipedsl.Program, cfg: dict[str, Any], first: int, last: int, fault: str | None = None):
    if fault:
        os.environ["PIPEDSL_FAULT"] = fault
    try:
        return pipedsl.launch(segment, program.num_ranks, program.to_json(), cfg, first, last,
                              timeout=cfg["timeout"], join_timeout=1800.0, threads=1)[0]
    finally:
        os.environ.pop("PIPEDSL_FAULT", None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="checkpoint and switch schedule every N steps")
    ap.add_argument("--schedules", default=",".join(ROTATION))
    ap.add_argument("--reference", help="schedule of the uninterrupted run (default: the first of --schedules)")
    ap.add_argument("-P", "--ranks", type=int, default=2)
    ap.add_argument("-M", "--microbatches", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--faults", action="store_true", help="SIGKILL rank 1 mid-step in every other segment")
    ap.add_argument("-o", "--out", default="out/soak")
    args = ap.parse_args(argv)

    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    programs = [pipedsl.load(n).compile(P=args.ranks, M=args.microbatches) for n in names]
    if len({p.num_stages for p in programs}) != 1:
        print("error: the schedules must cut the model into the same number of stages", file=sys.stderr)
        return 2
    out = Path(args.out)
    ckpt = out / "ckpt"
    if ckpt.exists():
        for info in checkpoint.checkpoints(ckpt):  # a fresh soak: old checkpoints would be resumed
            for f in info.path.iterdir():
                f.unlink()
            info.path.rmdir()
    ckpt.mkdir(parents=True, exist_ok=True)
    cfg = {"seq": args.seq, "embd": args.embd, "layers": args.layers, "batch": 4 * args.microbatches, "lr": 3e-3,
           "seed": 0, "every": args.every, "timeout": args.timeout, "dir": None}
    print(f"soak: {args.steps} steps of a {args.layers}-block GPT (C={args.embd}, T={args.seq}), "
          f"{programs[0].num_stages} stages on {args.ranks} processes, M={args.microbatches}; "
          f"restart + checkpoint + schedule switch every {args.every} steps: {' → '.join(names)}", flush=True)

    ref_name = args.reference or names[0]
    t0 = time.perf_counter()
    base = launch(pipedsl.load(ref_name).compile(P=args.ranks, M=args.microbatches), cfg, 1, args.steps)
    base_wall = time.perf_counter() - t0
    reference = base["losses"]
    print(f"uninterrupted ({ref_name}): {base_wall:.1f} s wall, {base['train_s']:.1f} s training, "
          f"final loss {reference[args.steps]:.4f}", flush=True)

    cfg["dir"] = str(ckpt)
    losses: dict[int, float] = {}
    rows = []
    t0 = time.perf_counter()
    first, k, kills = 1, 0, 0
    while first <= args.steps:
        last = min(first + args.every - 1, args.steps)
        program, name = programs[k % len(programs)], names[k % len(names)]
        fault = f"step:1:{first + args.every // 2}" if args.faults and k % 2 == 1 and not rows[-1].get("killed") \
            else None
        ts = time.perf_counter()
        try:
            rep = launch(program, cfg, first, last, fault)
        except PipeRuntimeError as err:
            kills += 1
            latest = checkpoint.latest(ckpt)
            rows.append({"schedule": name, "steps": f"{first}-{last}", "killed": True,
                         "wall_s": time.perf_counter() - ts, "error": err.message.splitlines()[0]})
            print(f"  {name:<12} steps {first:>3}-{last:<3} KILLED ({err.message.splitlines()[0]}); "
                  f"latest complete checkpoint: step {latest.step if latest else None}", flush=True)
            first = (latest.step if latest else 0) + 1
            continue
        wall = time.perf_counter() - ts
        losses.update(rep["losses"])
        rows.append({"schedule": name, "steps": f"{first}-{last}", "wall_s": wall, "train_s": rep["train_s"],
                     "load_ms": rep["load_s"] * 1e3, "save_ms": [s * 1e3 for s in rep["save_s"]]})
        same = sum(rep["losses"][s] == reference[s] for s in rep["losses"])
        print(f"  {name:<12} steps {first:>3}-{last:<3} {wall:5.1f} s wall (train {rep['train_s']:.1f} s, "
              f"load {rep['load_s'] * 1e3:5.1f} ms, save {sum(rep['save_s']) * 1e3:5.1f} ms)  "
              f"{same}/{len(rep['losses'])} losses identical", flush=True)
        first, k = last + 1, k + 1
    soak_wall = time.perf_counter() - t0

    diffs = [abs(losses[s] - reference[s]) for s in range(1, args.steps + 1)]
    identical = sum(d == 0.0 for d in diffs)
    parts = [f.stat().st_size for f in sorted((ckpt / f"step-{args.steps:08d}").glob("rank-*.pt"))]
    report = {"steps": args.steps, "every": args.every, "schedules": names, "reference": ref_name, "ranks": args.ranks,
              "microbatches": args.microbatches, "faults": args.faults, "kills": kills,
              "identical_steps": identical, "max_abs_diff": max(diffs), "final_loss": losses[args.steps],
              "uninterrupted_wall_s": base_wall, "soak_wall_s": soak_wall,
              "checkpoints": [c.step for c in checkpoint.checkpoints(ckpt)], "part_bytes": parts,
              "segments": rows, "losses": losses, "reference_losses": reference}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"losses identical at {identical}/{args.steps} steps; max |difference| {max(diffs):.3g}; "
          f"final loss {losses[args.steps]:.6f} vs {reference[args.steps]:.6f}")
    print(f"wall time: uninterrupted {base_wall:.1f} s, soak {soak_wall:.1f} s ({len(rows)} launches, {kills} killed); "
          f"checkpoint parts {parts} bytes; wrote {out / 'report.json'}")
    return 0 if identical == args.steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
