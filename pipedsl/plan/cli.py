"""`pipedsl plan`: the command-line face of the planner — one run for every model kind: the model, the cluster and
the space searched from the arguments, printed by `plan/report.py`."""

from __future__ import annotations

import argparse
from dataclasses import replace

from pipedsl.arguments import float_in, int_in
from pipedsl.errors import PipeDSLError
from pipedsl.library import load
from pipedsl.limits import MAX_PLAN_GPUS, MAX_PLAN_SIZE, MAX_PLAN_TOP, PLAN_RATE_RANGE, shorten
from pipedsl.plan.activations import LAYOUTS, RECOMPUTE_MODES
from pipedsl.plan.cluster import CLUSTERS, GB, ClusterSpec, cluster_preset
from pipedsl.plan.cost import SPLITS
from pipedsl.plan.encdec import ENCDEC_MODELS, MT5_BATCH, MT5_SOURCE, MT5_TARGET
from pipedsl.plan.model import ENCDEC_RECOMPUTE, MODELS, EncDecSpec, ModelSpec, PlannedModel, model_preset
from pipedsl.plan.report import assumptions, print_result, zero_table_markdown
from pipedsl.plan.search import search, zero_table
from pipedsl.plan.units import FLOPS, SECONDS, scaled


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="rank dp × pp × tp, ZeRO, schedule and microbatching for a model on a cluster")
    p.add_argument("--model", help=f"a preset ({', '.join(MODELS)}; encoder-decoders: {', '.join(ENCDEC_MODELS)}); "
                                   "explicit sizes below override a decoder preset's")
    size = int_in(1, MAX_PLAN_SIZE, "MAX_PLAN_SIZE")
    for name in ("layers", "hidden", "heads", "seq", "vocab", "global-batch", "ffn", "kv-heads"):
        p.add_argument(f"--{name}", type=size)
    p.add_argument("--source-len", type=size,
                   help=f"encoder-decoders: source tokens S (default {MT5_SOURCE}: T5's span corruption at 512 inputs)")
    p.add_argument("--target-len", type=size,
                   help=f"encoder-decoders: target tokens T (default {MT5_TARGET}, the targets of that corruption; "
                        f"mT5 itself: --source-len 1024 --target-len 229); --global-batch defaults to {MT5_BATCH}")
    p.add_argument("--split", choices=SPLITS, default="time",
                   help="how layers are spread over stages — time (default): decoders try Megatron's even split "
                        "and one balanced by FLOPs with the head counted, encoder-decoders the planner's balanced "
                        "DP; count: even only (encoder-decoders: by unit count); params: encoder-decoders by "
                        "parameters (seq2seq_stages' by=)")
    p.add_argument("--mt5-table", action="store_true",
                   help="instead of the ranked table: for mt5-small … mt5-xxl and each of --gpu-counts, the best "
                        "layout of each ZeRO stage or the memory it would need, as Markdown (docs/planner.md)")
    p.add_argument("--gpu-counts", default="8,16,32,64", help="GPU counts of --mt5-table (default 8,16,32,64)")
    p.add_argument("--model-layout", choices=LAYOUTS,
                   help="which runtime model the sizes describe: gpt (the built-in GPT: 1-D or 3-D tp, ZeRO with tp) "
                        "or hf (a Hugging Face decoder in the Llama layout: SwiGLU, RMSNorm, untied head; 1-D tp "
                        "only, no ZeRO with tp). Presets know theirs (llama-*: hf)")
    p.add_argument("--cluster", default="a100-80gb", help=f"a preset ({', '.join(CLUSTERS)}; default a100-80gb)")
    gpus = int_in(1, MAX_PLAN_GPUS, "MAX_PLAN_GPUS")
    rate = float_in(*PLAN_RATE_RANGE, "PLAN_RATE_RANGE")
    p.add_argument("--gpus", type=gpus, help="GPU count (default: the preset's 1024)")
    p.add_argument("--gpus-per-node", type=gpus)
    p.add_argument("--peak-tflops", type=rate, help="dense fp16/bf16 TFLOP/s per GPU")
    p.add_argument("--memory-gb", type=rate, help="memory per GPU")
    p.add_argument("--intra-gbps", type=rate, help="NVLink GB/s per GPU per direction")
    p.add_argument("--inter-gbps", type=rate, help="InfiniBand GB/s per GPU per direction")
    p.add_argument("--intra-latency-us", type=rate)
    p.add_argument("--inter-latency-us", type=rate)
    p.add_argument("--schedule", action="append", metavar="NAME_OR_PIPE",
                   help="only these schedules (repeatable; a built-in name or a .pipe file); default: every built-in "
                        "but zb-auto, whose order is searched from costs")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to try (default 0,1,2,3)")
    p.add_argument("--recompute", default="none,selective,full",
                   help="recomputation modes to try (default none,selective,full): selective recomputes attention "
                        "(Megatron: its s² core; an HF decoder under pipedsl: the attention module), full every "
                        "layer")
    p.add_argument("--sequence-parallel", choices=("on", "off", "both"), default="both",
                   help="sequence parallelism with 1-D tp > 1 (norms and dropout on 1/t of the sequence, "
                        "reduce-scatter + all-gather instead of all-reduce; default: try both)")
    p.add_argument("--attention", choices=("fused", "eager", "both"),
                   help="attention kernel: fused (FlashAttention-style: no s² activations stored) or eager; "
                        "default: the cluster's (fused on h100/h200, eager on a100-80gb)")
    p.add_argument("--grad-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 parameters with fp32 main parameters (pipedsl train --param-dtype bf16); gradients "
                        "accumulated in bf16 (default: 2+2+12 bytes a parameter, the ZeRO paper's) or fp32 "
                        "(2+4+12, Megatron's default)")
    p.add_argument("--ep", metavar="DEGREES",
                   help="Mixture-of-Experts models (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3): expert-parallel "
                        "degrees, comma-separated (default: every divisor of dp that divides the expert count)")
    p.add_argument("--top", type=int_in(1, MAX_PLAN_TOP, "MAX_PLAN_TOP"), default=10,
                   help=f"rows in the ranked table (default 10, at most {MAX_PLAN_TOP})")
    p.add_argument("--rejected", type=int_in(1, 1000, "1000 lines"), default=8,
                   help="rejected examples to print (default 8), shared among the kinds of reason; 'runtime: …' "
                        "names a rule of the runtime for this model and the module that enforces it")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (a GPT block's FLOP/s, gloo latency/bandwidth, AdamW) with --gpus "
                        "local processes (default 4) and plan on it; the model defaults to the small GPT")
    p.add_argument("--scaling", metavar="OUT.svg",
                   help="instead of the table: predicted throughput against GPU count (8..4096) for the best "
                        "layout and for pure data parallelism, drawn to OUT.svg")
    return p


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    explicit = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
                "vocab": args.vocab, "global_batch": args.global_batch, "ffn": args.ffn, "kv_heads": args.kv_heads,
                "layout": args.model_layout}
    if args.model_layout == "hf" and not args.model:
        explicit["gated"] = True  # the Llama layout's MLP is SwiGLU
    given = {k: v for k, v in explicit.items() if v is not None}
    if args.model:
        return replace(model_preset(args.model), **given)
    missing = [k for k in ("layers", "hidden", "heads", "seq", "vocab", "global_batch") if k not in given]
    if missing:
        raise PipeDSLError("plan: give --model PRESET or all of --layers --hidden --heads --seq --vocab "
                           f"--global-batch (missing: {', '.join('--' + m.replace('_', '-') for m in missing)})")
    return ModelSpec("custom", **given)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    cluster = cluster_preset(args.cluster)
    changes = {"gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
               "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
               "memory": args.memory_gb and args.memory_gb * GB,
               "intra_bandwidth": args.intra_gbps and args.intra_gbps * GB,
               "inter_bandwidth": args.inter_gbps and args.inter_gbps * GB,
               "intra_latency": args.intra_latency_us and args.intra_latency_us * 1e-6,
               "inter_latency": args.inter_latency_us and args.inter_latency_us * 1e-6}
    return replace(cluster, **{k: v for k, v in changes.items() if v is not None})


def _zero_stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        stages = ()
    if not stages or any(z not in (0, 1, 2, 3) for z in stages):
        raise PipeDSLError(f"--zero {shorten(text)}: expected comma-separated stages among 0,1,2,3")
    return tuple(sorted(set(stages)))  # each stage once: a repeated one would multiply the search


def _recompute_modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not modes or any(m not in RECOMPUTE_MODES for m in modes):
        raise PipeDSLError(f"--recompute {shorten(text)}: expected comma-separated modes among "
                           f"{','.join(RECOMPUTE_MODES)}")
    return modes


def _ep_degrees(text: str | None, model: ModelSpec) -> tuple[int, ...] | None:
    if text is None:
        return None
    if not model.moe:
        raise PipeDSLError(f"plan: --ep applies to Mixture-of-Experts models; {model.name} is dense")
    try:
        degrees = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        degrees = ()
    if not degrees or any(not 1 <= e <= MAX_PLAN_GPUS for e in degrees):
        raise PipeDSLError(f"--ep {shorten(text)}: expected comma-separated expert-parallel degrees in "
                           f"1..{MAX_PLAN_GPUS:,}")
    return degrees


def run(args: argparse.Namespace) -> int:
    """One search for every model kind: the model and the space it is searched over from the arguments, then the
    ranked table (`--scaling`, `--mt5-table`: their own outputs instead)."""
    if args.mt5_table or (args.model in ENCDEC_MODELS):
        cluster, space = _encdec_space(args)
        if args.mt5_table:
            return _print_zero_table(args, cluster, space)
        model: PlannedModel = encdec_from_args(args, args.model)
    else:
        model, cluster = _decoder(args)
        if args.scaling:
            return _run_scaling(model, cluster, args.scaling)
        space = _decoder_space(args, model)
    result = search(model, cluster, top=args.top, **space)
    print_result(result, args.rejected)
    return 0 if result.ranked else 1


def _schedules(args: argparse.Namespace) -> list[str] | None:
    """--schedule's names, each once; an unknown name or a broken .pipe is one error up front, not every layout
    rejected."""
    schedules = list(dict.fromkeys(args.schedule)) if args.schedule else None
    for name in schedules or ():
        load(name)
    return schedules


def _decoder(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec]:
    """A decoder (dense or MoE) and the cluster, from a preset, sizes or a calibration of this machine."""
    encdec_only = [flag for flag, given in (("--source-len", args.source_len), ("--target-len", args.target_len),
                                            ("--split params", args.split == "params")) if given]
    if args.ep is not None and (args.scaling or args.calibrate):
        raise PipeDSLError("plan: --ep narrows the ranked search (not --scaling or --calibrate)")
    if encdec_only:
        raise PipeDSLError(f"plan: {', '.join(encdec_only)} apply to the encoder-decoder presets "
                           f"({', '.join(ENCDEC_MODELS)})")
    if args.calibrate:
        return _calibrated(args)
    return model_from_args(args), cluster_from_args(args)


def _decoder_space(args: argparse.Namespace, model: ModelSpec) -> dict:
    """`search`'s space for a decoder: every option narrows it."""
    schedules = _schedules(args)
    sp = {"on": (True,), "off": (False,), "both": (False, True)}[args.sequence_parallel]
    attention = {None: None, "fused": ("fused",), "eager": ("eager",), "both": ("eager", "fused")}[args.attention]
    return {"schedules": schedules, "zero": _zero_stages(args.zero), "grads": args.grad_dtype,
            "recompute": _recompute_modes(args.recompute), "sequence_parallel": sp, "attention": attention,
            "ep": _ep_degrees(args.ep, model), "splits": ("even", "balanced") if args.split == "time" else ("even",)}


def _run_scaling(model: ModelSpec, cluster: ClusterSpec, path: str) -> int:
    from pipedsl.plan.scaling import GPU_COUNTS, plot_scaling, scaling

    points = scaling(model, cluster)
    plot_scaling(points, model, cluster, path)
    for p in points:
        print(f"{p.gpus:>5} GPUs: best {_short(p.best)}; data parallel {_short(p.data_parallel)}")
    print(f"wrote {path} ({GPU_COUNTS[0]}..{GPU_COUNTS[-1]} GPUs)")
    return 0


def _short(e) -> str:
    if e is None:
        return "nothing fits"
    return f"{scaled(e.iteration, SECONDS)}/iteration, {scaled(e.tflops * 1e12, FLOPS)}/GPU ({e.layout})"


def _calibrated(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec]:
    from pipedsl.registry import lend  # the calibration runs the runtime: a layer above the planner

    small = lend("SmallGPT")()
    cal = lend("calibrate")(args.gpus or 4, small)
    print(f"calibrated on {cal.ranks} local processes: {cal.describe()}")
    print("every stage is planned with the same number of blocks, the embedding and head on the end stages "
          "(train a layout so with `pipedsl train --split blocks`)")
    given = args.model or any(getattr(args, k) is not None for k in ("layers", "hidden", "heads", "seq", "vocab"))
    return (model_from_args(args) if given else small.spec()), cal.cluster()


# ------------------------------------------------------------------ encoder-decoders


_DECODER_ONLY = ("layers", "hidden", "heads", "seq", "vocab", "ffn", "kv_heads", "model_layout", "scaling", "calibrate",
                 "ep")


def encdec_from_args(args: argparse.Namespace, name: str) -> EncDecSpec:
    given = [f"--{k.replace('_', '-')}" for k in _DECODER_ONLY if getattr(args, k, None) not in (None, False)]
    if given:
        raise PipeDSLError(f"plan: {', '.join(given)} describe decoder models; an encoder-decoder preset takes "
                           f"--source-len, --target-len and --global-batch")
    spec = ENCDEC_MODELS[name].with_lengths(args.source_len, args.target_len)
    return spec.with_batch(args.global_batch) if args.global_batch else spec


def _gpu_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        counts = ()
    if not counts or any(not 1 <= n <= MAX_PLAN_GPUS for n in counts):
        raise PipeDSLError(f"--gpu-counts {shorten(text)}: expected comma-separated GPU counts in 1..{MAX_PLAN_GPUS:,}")
    return counts


def _encdec_space(args: argparse.Namespace) -> tuple[ClusterSpec, dict]:
    """The cluster and `search`'s space for an encoder-decoder (or `--mt5-table`'s): what the runtime runs for one
    (`EncDecSpec.space`), narrowed by the options; the options it cannot run are one error."""
    if args.attention in ("fused", "both"):
        raise PipeDSLError("plan: encoder-decoders are planned with eager attention (T5's relative position bias is "
                           "added to the stored scores)")
    modes = tuple(m for m in _recompute_modes(args.recompute) if m in ENCDEC_RECOMPUTE)
    if not modes:
        raise PipeDSLError(f"plan: encoder-decoders are planned with --recompute {' or '.join(ENCDEC_RECOMPUTE)}")
    if args.model and args.model not in ENCDEC_MODELS:
        raise PipeDSLError(f"plan: --mt5-table plans the encoder-decoder presets ({', '.join(ENCDEC_MODELS)}), "
                           f"not {args.model!r}")
    schedules = _schedules(args)
    cluster = cluster_from_args(args)
    return cluster, {"schedules": schedules, "zero": _zero_stages(args.zero), "recompute": modes,
                     "grads": args.grad_dtype, "split": args.split}


def _print_zero_table(args: argparse.Namespace, cluster: ClusterSpec, space: dict) -> int:
    """`--mt5-table`: every mT5 size (or --model's) on each of --gpu-counts, the best layout of each ZeRO stage."""
    specs = [encdec_from_args(args, n) for n in ([args.model] if args.model else ENCDEC_MODELS)]
    rows = zero_table(specs, cluster, _gpu_counts(args.gpu_counts), **space)
    print(assumptions(specs[0], cluster, space))
    print()
    print(zero_table_markdown(rows, cluster))
    return 0 if any(r.best is not None for r in rows) else 1
