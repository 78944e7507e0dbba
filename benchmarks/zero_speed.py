"""ZeRO and bf16 parameters against the same step without them, on the small GPT: `pipe.step` time ratios.

One group of P × dp local processes (gloo, one thread a rank) builds the same stages — the small GPT, or a
Hugging Face Llama of the same sizes (`--model llama`) — once per variant, each a `Pipeline` with
`pipe.optimizer(AdamW)`: fp32 without ZeRO (the baseline), ZeRO-1, -2 and -3 (`ParallelConfig(dp, pp=P,
zero=k)`: the parameters live in the flat buffers ZeRO shards; the baseline is the same dp without ZeRO), bf16
autocast over fp32 parameters (the bf16 baseline) and bf16 parameters over fp32 main parameters (Megatron's;
flat buffers).  Repetitions time `--steps` calls of `pipe.step` between barriers (then the optimizer's step,
untimed), every variant in turn, the order rotating each repetition.  Reported: each variant's median and its
paired ratio to its baseline (fp32, or bf16 autocast for bf16-main).

    python benchmarks/zero_speed.py                       # P=2, 1F1B, M=8, hidden 384 (the issue's GPT)
    python benchmarks/zero_speed.py --schedules 1f1b zb-h1 --variants zero1 bf16-main
    python benchmarks/zero_speed.py --model llama --dp 2 --embd 256
    python benchmarks/zero_speed.py --dp 2 --with-optimizer   # the optimizer's step timed too
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

# name: (zero level or None, compute dtype, parameters' dtype, baseline)
VARIANTS = {"fp32": (None, "fp32", "fp32", None), "zero1": (1, "fp32", "fp32", "fp32"),
            "zero2": (2, "fp32", "fp32", "fp32"), "zero3": (3, "fp32", "fp32", "fp32"),
            "zero3-unit": (3, "fp32", "fp32", "fp32"),  # ZeRO-3 gathering each unit on every use
            "bf16": (None, "bf16", "fp32", None), "bf16-main": (None, "bf16", "bf16", "bf16")}
RESHARD = {"zero3-unit": "unit"}  # ParallelConfig.zero_reshard of a variant ("auto" otherwise: "step" when P > 1)


def layout(name: str, dp: int, P: int) -> Any:
    """Variant `name`'s ParallelConfig over dp x P ranks; None for one pipeline without ZeRO."""
    from pipedsl.parallel import ParallelConfig

    zero = VARIANTS[name][0]
    if zero is None and dp == 1:
        return None
    return ParallelConfig(dp=dp, pp=P, zero=zero or 0, zero_reshard=RESHARD.get(name, "auto"))


def _rank_main(rank: int, schedules: list[str], P: int, cfg: dict, names: list[str]) -> dict:
    """{(schedule, variant): [seconds a pipe.step, per repetition]}, every pipeline built in these processes."""
    import torch
    import torch.distributed as dist

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.runtime.precision import MixedPrecision

    torch.manual_seed(0)
    dp = cfg.get("dp", 1)
    if cfg.get("model", "gpt") == "gpt":
        gcfg = GPTConfig(n_layer=cfg["layers"], n_embd=cfg["embd"], block_size=cfg["seq"])
        model = GPT(gcfg)
        x, y = synthetic_batch(dp * cfg["M"] * cfg["rows"], gcfg.block_size, gcfg.vocab_size,
                               torch.Generator().manual_seed(1))

        def stages(S: int) -> list:
            return copy.deepcopy(model).stages(S)
        loss_fn = gpt_loss
    else:  # a Hugging Face Llama, cut by models/hf/stages.py
        import transformers

        from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

        lcfg = transformers.LlamaConfig(vocab_size=512, hidden_size=cfg["embd"], num_hidden_layers=cfg["layers"],
                                        num_attention_heads=4, num_key_value_heads=4,
                                        intermediate_size=cfg["embd"] * 8 // 3, max_position_embeddings=cfg["seq"])
        model = transformers.LlamaForCausalLM._from_config(lcfg, attn_implementation="sdpa")
        x = torch.randint(512, (dp * cfg["M"] * cfg["rows"], cfg["seq"]), generator=torch.Generator().manual_seed(1))
        y = shift_labels(x)

        def stages(S: int) -> list:
            return causal_lm_stages(copy.deepcopy(model), S, check=False)
        loss_fn = causal_lm_loss
    runs = {}
    for schedule in schedules:
        prog = pipedsl.load(schedule).compile(P=P, M=cfg["M"], **cfg["params"])
        for name in names:
            _, compute, params, _ = VARIANTS[name]
            pipe = pipedsl.Pipeline(stages(prog.num_stages), program=prog, loss_fn=loss_fn,
                                    parallel=layout(name, dp, P), precision=MixedPrecision(compute, params=params))
            runs[(schedule, name)] = (pipe, pipe.optimizer(torch.optim.AdamW, lr=1e-4))

    with_optimizer = cfg.get("optimizer", False)  # the optimizer's step (ZeRO 1-2's gathers after it) timed too

    def timed(key: tuple[str, str], steps: int) -> float:
        pipe, opt = runs[key]
        total = 0.0
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, y)
            if with_optimizer:
                opt.step()
                opt.zero_grad()
            dist.barrier()
            total += time.perf_counter() - t0
            if not with_optimizer:
                opt.step()
                opt.zero_grad()
        return total / steps

    keys = list(runs)
    for key in keys:
        timed(key, max(1, cfg["warmup"]))  # the first step learns shapes: never timed
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for rep in range(cfg["reps"]):
        for k in range(len(keys)):
            key = keys[(k + rep) % len(keys)]
            times[key].append(timed(key, cfg["steps"]))
    for pipe, _ in runs.values():
        pipe.close()
    return times


def main(argv: list[str] | None = None) -> dict:
    import pipedsl

    ap = _bench.small_gpt_parser(__doc__.splitlines()[0], "zero_speed")
    ap.set_defaults(M=8, embd=384, reps=5, steps=2)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt", help="the small GPT, or a Hugging Face "
                    "Llama of the same sizes (the hf extra)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (P x dp ranks; default 1)")
    ap.add_argument("--no-append", action="store_true", help="do not add a row to RESULTS.md")
    ap.add_argument("--with-optimizer", action="store_true", help="time pipe.step and the optimizer's step together "
                    "(ZeRO 1-2 gather the updated parameters in the optimizer's step, ZeRO-3 in the next forward: "
                    "pipe.step alone counts ZeRO-3's gathers and not theirs)")
    ap.add_argument("--schedules", nargs="+", help="schedules to time (default --schedule); with several, each "
                    "variant's step under every schedule over its step under the first, against the same ratio "
                    "of its baseline (zero bubble's gain kept under ZeRO?)")
    args = ap.parse_args(argv)
    cfg = {**_bench.small_gpt_config(args), "model": args.model, "dp": args.dp, "optimizer": args.with_optimizer}
    schedules = args.schedules or [args.schedule]
    names = [n for n in VARIANTS if n in args.variants or any(VARIANTS[v][3] == n for v in args.variants)]
    t = pipedsl.launch(_rank_main, args.P * args.dp, schedules, args.P, cfg, names, threads=1, timeout=900)[0]
    rows = []
    for schedule in schedules:
        for name in names:
            base, mine = VARIANTS[name][3], t[(schedule, name)]
            ratio = _bench.paired_median(mine, t[(schedule, base)]) if base else None
            row = {"schedule": schedule, "variant": name, "baseline": base, "step_s": _bench.spread(mine),
                   "raw": mine, "ratio_paired_median": ratio}
            if schedule != schedules[0]:
                row[f"vs_{schedules[0]}"] = _bench.paired_median(mine, t[(schedules[0], name)])
            rows.append(row)
    first = schedules[0]

    def table(result: dict) -> str:
        timed = "step+opt ms" if args.with_optimizer else "pipe.step ms"
        lines = [f"{'schedule':<10} {'variant':<10} {timed:>12} {'vs':>6} {'ratio':>7} {'vs ' + first:>12}"]
        for r in result["rows"]:
            ratio = f"{r['ratio_paired_median']:7.3f}" if r["baseline"] else " " * 7
            across = f"{r['vs_' + first]:12.3f}" if f"vs_{first}" in r else ""
            lines.append(f"{r['schedule']:<10} {r['variant']:<10} {r['step_s']['median'] * 1e3:12.1f} "
                         f"{r['baseline'] or '':>6} {ratio} {across}")
        return "\n".join(lines)

    cells = "; ".join(f"{r['schedule']} {r['variant']} {r['ratio_paired_median']:.3f}"
                      for r in rows if r["baseline"])
    what = "pipe.step and the optimizer's step" if args.with_optimizer else "pipe.step"
    summary = (f"{args.model} P={args.P} dp={args.dp} M={args.M}, {what} over the same without ZeRO / bf16 "
               f"parameters: {cells}")
    return _bench.publish("zero_speed", argv, {**cfg, "schedules": schedules, "P": args.P}, rows, {}, table, summary,
                          args.json, args.no_append)


if __name__ == "__main__":
    main()
