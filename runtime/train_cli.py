"""`pipedsl train`: train the small GPT on synthetic tokens across local processes.

    pipedsl train --schedule 1f1b -P 4 -M 8 --steps 20

Rank 0 prints one progress line per step (loss, samples/s); at the end the last step's
measured timeline is written as Timeline JSON (and as a PNG when pipedsl.visualize can draw
it), next to the simulator's prediction for the same program.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a small GPT on synthetic tokens with a schedule (local processes)")
    p.add_argument("--schedule", default="1f1b", help="a built-in name or a .pipe file (default 1f1b)")
    p.add_argument("-P", "--ranks", type=int, default=4, help="pipeline ranks = local processes (default 4)")
    p.add_argument("-M", "--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE", help="a schedule parameter")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=0, help="sequences per step (default 4·M)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--layers", type=int, default=0, help="transformer blocks (default: 2 per stage)")
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout in seconds")
    p.add_argument("-o", "--out", default="out/train", help="directory for timeline.json / timeline.png")
    return p


def run(args: argparse.Namespace) -> int:
    import pipedsl
    from pipedsl.errors import PipeDSLError
    from pipedsl.timeline import Timeline

    params: dict[str, int] = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise PipeDSLError(f"-p {item!r}: expected NAME=INTEGER")
        params[name.strip()] = int(value)
    program = pipedsl.load(args.schedule).compile(P=args.ranks, M=args.microbatches, **params)
    cfg = {"steps": args.steps, "batch": args.batch or 4 * args.microbatches, "seq": args.seq,
           "layers": args.layers or max(2 * program.num_stages - 2, 1), "embd": args.embd, "lr": args.lr,
           "seed": args.seed}
    print(f"training a {cfg['layers']}-block GPT (C={cfg['embd']}, T={cfg['seq']}) with {program.name} "
          f"{' '.join(f'{k}={v}' for k, v in program.params.items())}: {program.num_stages} stages on "
          f"{args.ranks} processes, batch {cfg['batch']}", flush=True)
    results = pipedsl.launch(_train, args.ranks, program.to_json(), cfg, timeout=args.timeout)
    report = results[0]
    timeline = Timeline.from_dict(report["timeline"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timeline.json").write_text(timeline.to_json())
    predicted = pipedsl.simulate(program, pipedsl.Cost(**report["cost"]))
    (out / "predicted.json").write_text(predicted.to_json())
    written = [str(out / "timeline.json"), str(out / "predicted.json")]
    png = _plot([timeline, predicted], out / "timeline.png")
    if png:
        written.append(png)
    print(f"last step: {timeline.makespan * 1e3:.1f} ms measured, bubble {timeline.bubble_ratio:.3f} "
          f"(simulated with the measured mean op times: {predicted.makespan * 1e3:.1f} ms, "
          f"bubble {predicted.bubble_ratio:.3f}); peak activations per rank {report['peaks']}")
    print("wrote " + ", ".join(written))
    return 0


def _plot(timelines: list, path: Path) -> str | None:
    try:
        from pipedsl import visualize
        plot = getattr(visualize, "plot_timelines", None)
    except ImportError:
        return None
    if plot is None:
        return None
    try:
        plot(timelines, path)
    except Exception as err:  # noqa: BLE001 - the picture is a bonus; the JSON is the record
        print(f"note: could not draw {path}: {err}", file=sys.stderr)
        return None
    return str(path)


def _train(rank: int, program_json: str, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import torch

    import pipedsl
    from pipedsl.ir import COMPUTE

    from .gpt import GPT, GPTConfig, gpt_loss, synthetic_batch

    program = pipedsl.Program.from_json(program_json)
    gcfg = GPTConfig(vocab_size=64, block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4, n_embd=cfg["embd"])
    torch.manual_seed(cfg["seed"])
    model = GPT(gcfg)  # the same weights on every rank; each keeps only its stages
    pipe = pipedsl.Pipeline(model.stages(program.num_stages), program=program, loss_fn=gpt_loss)
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    for step in range(1, cfg["steps"] + 1):
        x, y = synthetic_batch(cfg["batch"], cfg["seq"], gcfg.vocab_size, gen)
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step:>3}/{cfg['steps']}  loss {loss:.4f}  {cfg['batch'] / dt:8.1f} samples/s  "
                  f"{dt * 1e3:7.1f} ms/step", flush=True)
    peaks = [None] * dist_size()
    torch.distributed.all_gather_object(peaks, pipe.peak_activations)
    timeline = pipe.timeline()
    if timeline is None:
        return None
    # mean measured time per op kind: the cost the simulator is given for its prediction
    sums: dict[str, list[float]] = {}
    for events in timeline.ranks:
        for e in events:
            if e.instr.op in COMPUTE:
                sums.setdefault(e.instr.op.value, []).append(e.duration)
    cost = {k: sum(v) / len(v) for k, v in sums.items()}
    return {"timeline": timeline.to_dict(), "cost": cost, "peaks": peaks, "config": asdict(gcfg)}


def dist_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()
