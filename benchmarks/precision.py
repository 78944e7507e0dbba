"""Mixed precision and global clipping on the small GPT: step time and point-to-point bytes, vs fp32.

One group of P local processes (gloo, one thread per rank) builds the same GPT stages once per
variant — fp32, bf16, fp16 (dynamic loss scaling), fp32 + `clip_grad_norm_(1.0)`, bf16 + clip, and
bf16 parameters with fp32 main parameters (gradients accumulated in fp32 or in bf16) — each a
`Pipeline` with `pipe.optimizer(AdamW)`.  After a warmup, repetitions run every variant
in turn (the order rotates each repetition, so load drifting during the run hits all alike);
each repetition times `--steps` full training steps (pipe.step, clip, opt.step, zero_grad)
between two barriers.  Reported per variant: median step time, its ratio to fp32 (ratio of the
medians and median of the per-repetition ratios, measured in the same run), and the bytes every
rank sent point to point per step (activations forward, gradients back), summed over the ranks.

    python benchmarks/precision.py                 # P=2, 1F1B, M=4
    python benchmarks/precision.py --schedule zb-v --P 2 --M 8 --reps 9
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

# name: ((compute dtype, parameters' dtype, gradients' dtype), clip); "bf16-main": bf16 parameters with fp32
# main parameters and fp32 gradients (Megatron's), "bf16-main-g16": gradients accumulated in bf16 (the ZeRO paper's)
VARIANTS = {"fp32": (("fp32", "fp32", None), None), "bf16": (("bf16", "fp32", None), None),
            "fp16": (("fp16", "fp32", None), None), "fp32+clip": (("fp32", "fp32", None), 1.0),
            "bf16+clip": (("bf16", "fp32", None), 1.0), "bf16-main": (("bf16", "bf16", "fp32"), None),
            "bf16-main-g16": (("bf16", "bf16", "bf16"), None)}


def _rank_main(rank: int, schedule: str, P: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    gcfg = GPTConfig(n_layer=cfg["layers"], n_embd=cfg["embd"], block_size=cfg["seq"])
    torch.manual_seed(0)
    model = GPT(gcfg)
    x, y = synthetic_batch(cfg["M"] * cfg["rows"], gcfg.block_size, gcfg.vocab_size, torch.Generator().manual_seed(1))
    prog = pipedsl.load(schedule).compile(P=P, M=cfg["M"], **cfg["params"])
    runs = {}
    from pipedsl.runtime.precision import MixedPrecision

    for name, ((compute, params, grads), clip) in VARIANTS.items():
        import copy

        pipe = pipedsl.Pipeline(copy.deepcopy(model).stages(prog.num_stages), program=prog, loss_fn=gpt_loss,
                                precision=MixedPrecision(compute, params=params, grads=grads))
        opt = pipe.optimizer(torch.optim.AdamW, lr=1e-4)

        def step(pipe=pipe, opt=opt, clip=clip) -> None:
            pipe.step(x, y)
            if clip is not None:
                pipe.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
        runs[name] = (pipe, step)

    def timed(name: str, steps: int) -> tuple[float, int]:
        pipe, step = runs[name]
        sent = pipe.channels.sent_bytes
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        return (time.perf_counter() - t0) / steps, (pipe.channels.sent_bytes - sent) // steps

    names = list(VARIANTS)
    for name in names:
        timed(name, max(1, cfg["warmup"]))  # the first step learns shapes: never timed
    times: dict[str, list[float]] = {n: [] for n in names}
    sent: dict[str, int] = {}
    for rep in range(cfg["reps"]):
        for k in range(len(names)):
            name = names[(k + rep) % len(names)]
            t, b = timed(name, cfg["steps"])
            times[name].append(t)
            sent[name] = b
    total = torch.tensor([sent[n] for n in names], dtype=torch.int64)
    dist.all_reduce(total)
    return {"times": times, "p2p_bytes": dict(zip(names, total.tolist()))}


def main(argv: list[str] | None = None) -> dict:
    import pipedsl

    args = _bench.small_gpt_parser(__doc__.splitlines()[0], "precision").parse_args(argv)
    cfg = _bench.small_gpt_config(args)
    out = pipedsl.launch(_rank_main, args.P, args.schedule, args.P, cfg, threads=1, timeout=300)[0]
    t = out["times"]
    med = {k: _bench.median(v) for k, v in t.items()}
    rows = []
    for name in VARIANTS:
        paired = [a / b for a, b in zip(t[name], t["fp32"])]
        rows.append({"variant": name, "step_s": _bench.spread(t[name]), "vs_fp32": med[name] / med["fp32"],
                     "vs_fp32_paired_median": _bench.median(paired), "p2p_bytes_per_step": out["p2p_bytes"][name],
                     "p2p_vs_fp32": out["p2p_bytes"][name] / out["p2p_bytes"]["fp32"], "raw": t[name]})
    command = "python benchmarks/precision.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": "precision", "command": command.strip(), "machine": _bench.machine(),
              "date": _bench.today(), "schedule": args.schedule, "P": args.P, "config": cfg, "rows": rows}
    print(f"{'variant':<14} {'step ms':>8} {'vs fp32':>8} {'paired':>8} {'P2P bytes/step':>15} {'vs fp32':>8}")
    for r in rows:
        print(f"{r['variant']:<14} {r['step_s']['median'] * 1e3:8.2f} {r['vs_fp32']:8.3f} "
              f"{r['vs_fp32_paired_median']:8.3f} {r['p2p_bytes_per_step']:15d} {r['p2p_vs_fp32']:8.3f}")
    _bench.write_json("precision", result, args.json)
    summary = ", ".join(f"{r['variant']} {r['vs_fp32_paired_median']:.2f}x" for r in rows[1:])
    _bench.append_results(_bench.results_row(
        result["command"], f"{args.schedule} P={args.P} M={args.M}, step time vs fp32 (paired median): {summary}; "
                           f"P2P bytes bf16/fp32 {rows[1]['p2p_vs_fp32']:.3f}"))
    return result


if __name__ == "__main__":
    main()
