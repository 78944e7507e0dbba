"""`pipedsl train` / `pipedsl run`: train across local processes — a Hugging Face decoder on text, or the small GPT.

    pipedsl train --model DIR --data docs/ --schedule zb-h1 -P 2 --dp 2 --zero 3   # an HF model on text files
    pipedsl train --config run.toml [--steps 100 …]   # every option in a TOML file, flags on top
    pipedsl train --schedule 1f1b -P 4 -M 8 --steps 20  # the small GPT on synthetic tokens (the demo)
    pipedsl run --program prog.json --steps 20          # a compiled program file (JSON, CSV or text)
    pipedsl train … --checkpoint-dir ckpt --checkpoint-every 10 [--resume]
    pipedsl train --schedule zb-v -P 2 -M 4 --dp 2 --zero 1      # dp x P processes, ZeRO over dp
    pipedsl train --model DIR --data docs/ -P 2 --dp 2 --tp 2 --sequence-parallel   # dp x P x tp processes
    pipedsl train --precision bf16 --clip-grad 1.0 --lr-schedule cosine --warmup-steps 5
    pipedsl train --recompute full --loss-reduction token --pad-fraction 0.3

`--model DIR` takes a local Hugging Face model directory (weights: fine-tune; config only:
random init) and `--data` text files, folders, JSONL, Parquet or a saved `datasets` dataset,
tokenized once before any rank starts (trainer/data.py); `--eval-every N` reports held-out loss
and perplexity, `--tensorboard DIR` / `--wandb PROJECT` log beside `metrics.jsonl`, and
`pipedsl export CHECKPOINT --hf OUT` writes the trained model back as a Hugging Face directory
(models/hf/io.py).  The loop itself is trainer/train.py.

Rank 0 prints one progress line per step (loss, tokens/s, MFU, ETA); at the end the last step's
measured timeline is written as Timeline JSON (and as a PNG when pipedsl.visualize can draw
it), next to the simulator's prediction for the same program, and every step's exact loss
to `losses.json`.  `--steps` is the step to reach: a run resumed from step 20 with
`--steps 40` runs steps 21 … 40 and, on the same schedule, prints the same losses as a run
that never stopped.

Everything the user can get wrong (sizes, the program file, its rank count, a batch that does
not split into M, a checkpoint of another stage partition) is reported before any process
starts, as one line, exit status 2 — more local processes (dp x P), threads or model memory
than this machine can hold included, unless `--allow-oversubscribe` (runtime/launch/capacity.py).  A
failure while running (a rank that dies, a timeout) exits with status 1 and names the rank
that failed first.  SIGTERM, SIGINT or SIGHUP stop every rank, print `interrupted by SIGTERM:
stopped 4 ranks` and exit with status 128 + signal; no rank outlives the command, not even a
SIGKILL of it (runtime/launch/lifecycle.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from pipedsl.arguments import fraction, nonnegative_float, nonnegative_int, positive_float, positive_int
from pipedsl.output import write_text
from pipedsl.runtime.launch.capacity import check_local_ranks, total_memory, usable_cores
from pipedsl.runtime.launch.lifecycle import exit_on_signals

N_HEAD = 4
VOCAB = 64


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a Hugging Face decoder on text, or a small GPT on synthetic "
                                            "tokens, with a schedule (local processes)")
    p.add_argument("--config", metavar="TOML", help="read every option from a TOML file (flags given here win)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    p.add_argument("--model", metavar="DIR",
                   help="a local Hugging Face model directory (config.json; with safetensors weights: fine-tune "
                        "them, without: random init); default: the built-in GPT on synthetic tokens")
    p.add_argument("--schedule", default="1f1b", help="a built-in name or a .pipe file (default 1f1b)")
    p.add_argument("-P", "--ranks", type=positive_int, default=4, help="pipeline ranks = local processes (default 4)")
    p.add_argument("-M", "--microbatches", type=positive_int, default=8, help="microbatches per step (default 8)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE", help="a schedule parameter")
    _add_training_options(p, "out/train")
    p.set_defaults(_parser=p)
    return p


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="train the small GPT with a compiled program file (JSON, CSV or text)")
    p.add_argument("--program", required=True, metavar="FILE",
                   help="a program as written by `pipedsl compile --format json|csv|text`")
    p.add_argument("-P", "--ranks", type=positive_int, help="the ranks the program must have (default: its own)")
    p.add_argument("--config", metavar="TOML", help="read every option from a TOML file (flags given here win)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory (default: the built-in GPT)")
    _add_training_options(p, "out/run")
    p.set_defaults(_parser=p)
    return p


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a checkpoint of `pipedsl train --model` as a Hugging Face "
                                             "model directory")
    p.add_argument("checkpoint", help="a checkpoint directory (step-NNNNNNNN) or a directory of them (the latest)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR",
                   help="the directory to write (safetensors, config.json, tokenizer files)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the weights' dtype in the export (default fp32, as trained)")
    return p


def export(args: argparse.Namespace) -> int:
    """`pipedsl export CHECKPOINT --hf OUT`: from any dp × pp layout and ZeRO stage to `from_pretrained`."""
    from pipedsl.errors import PipeDSLError
    from pipedsl.models.hf.io import export_hf

    if os.path.exists(args.hf) and not os.path.isdir(args.hf):
        raise PipeDSLError(f"--hf {args.hf}: exists and is not a directory")
    try:
        out, step = export_hf(args.checkpoint, args.hf, args.dtype)
    except OSError as err:
        raise PipeDSLError(f"cannot write {args.hf}: {err.strerror or err}") from None
    files = sorted(p.name for p in out.iterdir())
    print(f"exported step {step} of {args.checkpoint} to {out}: {', '.join(files)}")
    return 0


def _add_training_options(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--steps", type=positive_int, default=20, help="train until this step (default 20)")
    p.add_argument("--batch", type=nonnegative_int, default=0, help="sequences per step (default 4·M)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--layers", type=nonnegative_int, default=0, help="transformer blocks (default: 2 per stage)")
    p.add_argument("--split", choices=("count", "blocks"), default="count",
                   help="how the GPT is cut into stages: count (the embedding and the head count as pieces like "
                        "the blocks; default) or blocks (every stage the same number of blocks, the embedding and "
                        "head on the end stages: Megatron-LM's split, the one `pipedsl plan` models)")
    p.add_argument("--embd", type=positive_int, default=64,
                   help=f"embedding width, a multiple of {N_HEAD} (default 64)")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW's weight decay (default 0.01)")
    p.add_argument("--dropout", type=fraction, default=0.0, help="dropout probability (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=positive_int, default=1,
                   help="data-parallel replicas of the pipeline: dp x P processes (default 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage over the dp replicas (default 0: an averaging all-reduce)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks per pipeline stage (Megatron's 1-D split: attention by heads, the MLP "
                        "column- then row-wise, vocabulary-parallel embedding, head and loss): dp x P x tp "
                        "processes (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: norms and residuals on 1/tp of the sequence, reduce-scatter and all-gather in "
                        "place of the all-reduces (Korthikanti et al. 2022); --seq must divide by --tp")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="compute dtype (autocast; fp16 scales the loss; default fp32)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the model's parameters: fp32 (default; autocast casts them per op) or the --precision dtype, "
                        "with fp32 main parameters in the optimizer, sharded by --zero (Megatron's distributed "
                        "optimizer: 6 + 12/dp bytes a parameter at --zero 1)")
    p.add_argument("--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="with --param-dtype bf16/fp16: gradients accumulate over microbatches and are reduced in fp32 "
                        "(default, Megatron's) or in the parameters' dtype (2 bytes a parameter less, the ZeRO "
                        "paper's; the sums round in bf16)")
    p.add_argument("--clip-grad", type=positive_float, metavar="MAX_NORM",
                   help="clip the whole model's gradient norm (over every rank) to MAX_NORM (default: no clipping)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="after --warmup-steps of linear warmup: constant, or a cosine decay to 0 at --steps")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=0, metavar="N",
                   help="linear learning-rate warmup over the first N steps (default 0)")
    p.add_argument("--recompute", choices=("none", "full", "selective"), default="none",
                   help="activation recomputation per stage: keep only the stage input (full) or recompute the "
                        "attention modules (selective); default none")
    p.add_argument("--loss-reduction", choices=("microbatch", "token"),
                   help="mean loss per microbatch, averaged, or the mean over every non-padding token of the global "
                        "batch (token); default: token with --model, microbatch for the GPT")
    p.add_argument("--pad-fraction", type=fraction, default=0.0, metavar="F",
                   help="about this fraction of the targets is padding (ignore_index -100), as a random tail per "
                        "sequence (default 0)")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="seconds before a silent rank counts as failed (process group; default 120)")
    p.add_argument("--checkpoint-timeout", type=positive_float, metavar="SECONDS",
                   help="seconds to wait for the other ranks' checkpoint parts (default: --timeout)")
    p.add_argument("--join-timeout", type=positive_float, default=3600.0,
                   help="seconds the whole run may take before its processes are killed (default 3600)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints under DIR/step-NNNNNNNN/")
    p.add_argument("--checkpoint-every", type=nonnegative_int, default=0, metavar="N",
                   help="checkpoint every N steps (default: only after the last step)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the latest complete checkpoint in --checkpoint-dir (none: start fresh), "
                        "or from the given checkpoint directory")
    d = p.add_argument_group("data and evaluation (with --model)")
    d.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files or folders, .jsonl (see --text-field), .parquet, or a `datasets` dataset saved "
                        "with save_to_disk; tokenized once with the model's tokenizer (bytes when it has none)")
    d.add_argument("--text-field", default="text", help="the JSONL / Parquet / dataset column holding the text")
    d.add_argument("--packing", choices=("pack", "pad"), default="pack",
                   help="pack: documents joined by end-of-text into fixed windows (default); pad: one document a "
                        "row, right-padded, masked")
    d.add_argument("--doc-mask", action="store_true",
                   help="packed rows: keep attention inside each document (position ids restart after end-of-text)")
    d.add_argument("--eval-fraction", type=fraction, default=0.05,
                   help="share of the samples held out for evaluation, at the end of the data (default 0.05)")
    d.add_argument("--eval-data", nargs="+", metavar="PATH",
                   help="a held-out set of its own (same formats as --data); then all of --data trains and "
                        "--eval-fraction is ignored")
    d.add_argument("--eval-every", type=nonnegative_int, default=0, metavar="N",
                   help="evaluate held-out loss and perplexity every N steps and after the last (default: only "
                        "after the last)")
    d.add_argument("--eval-batches", type=nonnegative_int, default=0, metavar="N",
                   help="held-out global batches per evaluation (default 0: all of them)")
    d.add_argument("--cache-dir", metavar="DIR", help="where tokenized data is cached (default OUT/token-cache)")
    d.add_argument("--attn", choices=("sdpa", "eager"),
                   help="the model's attention implementation (default sdpa, eager where transformers has no sdpa)")
    g = p.add_argument_group("logging")
    g.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard event files to DIR")
    g.add_argument("--wandb", metavar="PROJECT", help="also log to Weights & Biases (offline unless WANDB_MODE says)")
    g.add_argument("--peak-tflops", type=positive_float, metavar="X",
                   help="peak TFLOP/s of one device for MFU (default: a known GPU's datasheet, or measured on a CPU)")
    p.add_argument("-o", "--out", default=out,
                   help=f"directory for metrics.jsonl, timeline.json, losses.json (default {out})")
    p.add_argument("--allow-oversubscribe", action="store_true",
                   help="start more local processes, threads or model memory than this machine sensibly holds")


# ---------------------------------------------------------------- commands


def _stoppable(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """SIGTERM/SIGINT/SIGHUP end the command with status 128 + signal and one line, never a traceback."""
    @wraps(command)
    def wrapper(args: argparse.Namespace) -> int:
        with exit_on_signals():
            return command(args)
    return wrapper


def _resolve(args: argparse.Namespace) -> bool:
    """Apply `--config`; True when the command only prints the resolved configuration."""
    from pipedsl.trainer.config import apply_config, render

    parser = getattr(args, "_parser", None)
    if args.config and parser is not None:
        apply_config(parser, args, getattr(args, "_argv", sys.argv[1:]))
    if args.print_config:
        print(render(parser, args) if parser is not None else "", end="")
        return True
    return False


@_stoppable
def run(args: argparse.Namespace) -> int:
    """`pipedsl train`: compile the schedule, then train."""
    import pipedsl
    from pipedsl.errors import PipeDSLError

    started = time.time()
    if _resolve(args):
        return 0
    params: dict[str, int] = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().lstrip("-").isdigit():
            raise PipeDSLError(f"-p {item!r}: expected NAME=INTEGER")
        params[name.strip()] = int(value)
    _check_local(args.ranks, args)  # before compiling: a huge -P is refused, not compiled
    _start_fork_server(args)
    program = pipedsl.load(args.schedule).compile(P=args.ranks, M=args.microbatches, **params)
    return _execute(program, args, started)


@_stoppable
def run_program(args: argparse.Namespace) -> int:
    """`pipedsl run`: read and validate a program file, then train."""
    from pipedsl.runtime.program_file import read_program

    started = time.time()
    if _resolve(args):
        return 0
    _start_fork_server(args)
    return _execute(read_program(args.program, ranks=args.ranks), args, started)


def _start_fork_server(args: argparse.Namespace) -> None:
    """The ranks' fork server imports torch, the trainer and (for --model) transformers' model code while this
    process checks the data and the model and compiles: the two overlap (runtime/launch/fork_server.py)."""
    from pipedsl.runtime.launch.fork_server import TORCHRUN_ENV, start

    if all(k in os.environ for k in TORCHRUN_ENV):  # torchrun started this process: it starts no rank
        return
    start(["pipedsl.trainer.train", *(["transformers.modeling_utils"] if getattr(args, "model", None) else [])])


def _execute(program: Any, args: argparse.Namespace, started: float) -> int:
    import pipedsl
    from pipedsl.errors import PipeDSLError, PipeRuntimeError
    from pipedsl.timeline import Timeline

    out = Path(args.out)
    cfg = _config(program, args, out)
    cfg["started_at"] = started
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PipeDSLError(f"cannot create the output directory {out}: {err.strerror or err}") from None
    from pipedsl.runtime.launch.launcher import under_torchrun

    if under_torchrun() and os.environ.get("RANK") != "0":  # every process runs this command; one of them speaks
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    layout = _layout_text(program.num_ranks, cfg)
    what = cfg["hf"]["describe"] if cfg.get("hf") else \
        f"a {cfg['layers']}-block GPT (C={cfg['embd']}, T={cfg['seq']})"
    print(f"training {what} with {program.name} {' '.join(f'{k}={v}' for k, v in program.params.items())}: "
          f"{program.num_stages} stages on {layout}, batch {cfg['batch']}", flush=True)
    if cfg.get("hf"):
        print(f"data: {cfg['hf']['data_describe']}", flush=True)
    if cfg["resume"]:
        print(f"resuming from {cfg['resume']}", flush=True)
    nprocs = cfg["dp"] * program.num_ranks * cfg["tp"]
    from pipedsl.trainer.metrics import peak_flops

    cfg["peak_flops"], source = peak_flops(nprocs, min(nprocs * args.threads, usable_cores()), args.peak_tflops)
    print(f"MFU against {source}", flush=True)
    try:
        from pipedsl.trainer.train import train

        results = pipedsl.launch(train, nprocs, program.to_json(), cfg, timeout=args.timeout,
                                 join_timeout=args.join_timeout, threads=args.threads,
                                 max_local=nprocs if args.allow_oversubscribe else None)
    except PipeRuntimeError as err:
        print(err.render(), file=sys.stderr)
        return 1
    report = results[0]
    if report is None:  # torchrun: a process other than global rank 0 (it reports nothing)
        return 0
    write_text(out / "losses.json", json.dumps({"schedule": program.name, "params": program.params,
                                                  "losses": report["losses"]}, indent=1) + "\n")
    written = [str(out / "metrics.jsonl"), str(out / "losses.json")]
    if report["timeline"] is None:
        print(f"nothing to run: the checkpoint is at step {report['start']}, --steps is {cfg['steps']}")
        print("wrote " + ", ".join(written))
        return 0
    timeline = Timeline.from_dict(report["timeline"])
    write_text(out / "timeline.json", timeline.to_json())
    predicted = pipedsl.simulate(program, pipedsl.Cost(**report["cost"]))
    write_text(out / "predicted.json", predicted.to_json())
    written += [str(out / "timeline.json"), str(out / "predicted.json")]
    png = _plot([timeline, predicted], out / "timeline.png")
    if png:
        written.append(png)
    print(f"last step: {timeline.makespan * 1e3:.1f} ms measured, bubble {timeline.bubble_ratio:.3f} "
          f"(simulated with the measured mean op times: {predicted.makespan * 1e3:.1f} ms, "
          f"bubble {predicted.bubble_ratio:.3f}); peak activations per rank {[a for a, _ in report['peaks']]}, "
          f"saved-activation KiB per rank {[round(b / 1024, 1) for _, b in report['peaks']]}")
    print("wrote " + ", ".join(written))
    return 0


def _layout_text(ranks: int, cfg: dict[str, Any]) -> str:
    """"2 x 2 x 2 = 8 processes (dp x pp x tp, zero=1, sequence parallel)" — or "4 processes" for a pipeline."""
    dp, tp = cfg["dp"], cfg["tp"]
    if dp == 1 and tp == 1 and not cfg["zero"]:
        return f"{ranks} processes"
    dims = [("dp", dp), ("pp", ranks)] + ([("tp", tp)] if tp > 1 else [])
    notes = [f"zero={cfg['zero']}"] + (["sequence parallel"] if cfg.get("sequence_parallel") else [])
    return (f"{' x '.join(str(n) for _, n in dims)} = {dp * ranks * tp} processes "
            f"({' x '.join(d for d, _ in dims)}, {', '.join(notes)})")


def _config(program: Any, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The per-rank training configuration; every input error here, before any process starts."""
    from pipedsl.errors import PipeDSLError

    M, S, dp = program.num_microbatches, program.num_stages, args.dp
    _check_local(program.num_ranks, args)
    if args.sequence_parallel and args.tp == 1:
        raise PipeDSLError("--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp 2 "
                           "or more")
    if args.sequence_parallel and args.seq % args.tp:
        raise PipeDSLError(f"--sequence-parallel: --seq {args.seq} does not divide by --tp {args.tp} (each tp rank "
                           f"holds an equal part of the sequence)")
    batch = args.batch or 4 * M * dp
    if batch % (M * dp):
        what = f"dp*M = {dp}*{M} = {dp * M}" if dp > 1 else f"M={M}"
        raise PipeDSLError(f"--batch {batch} does not split into {what} equal microbatches "
                           f"(use a multiple of {dp * M})")
    for flag in ("checkpoint_dir", "cache_dir", "tensorboard"):
        path = getattr(args, flag, None)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise PipeDSLError(f"--{flag.replace('_', '-')} {path}: not a directory")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise PipeDSLError("--checkpoint-every needs --checkpoint-dir")
    if args.lr_schedule == "cosine" and args.warmup_steps >= args.steps:
        raise PipeDSLError(f"--warmup-steps {args.warmup_steps} must be less than --steps {args.steps} for the "
                           f"cosine schedule (it decays after the warmup, until --steps)")
    if args.resume == "latest" and not args.checkpoint_dir:
        raise PipeDSLError("--resume without a checkpoint needs --checkpoint-dir (or give --resume CHECKPOINT)")
    if args.param_dtype not in ("fp32", args.precision):
        raise PipeDSLError(f"--param-dtype {args.param_dtype} needs --precision {args.param_dtype} (parameters are "
                           f"held in fp32 or in the compute dtype)")
    if args.grad_dtype not in ("fp32", args.param_dtype):
        raise PipeDSLError(f"--grad-dtype {args.grad_dtype}: gradients accumulate in fp32 or in the parameters' dtype "
                           f"(--param-dtype {args.param_dtype})")
    hf = args.model is not None and args.model != "gpt"
    if not hf and (args.data or args.eval_data):
        raise PipeDSLError("--data needs --model DIR (a Hugging Face model directory; the built-in GPT trains on "
                           "synthetic tokens)")
    cfg = {"steps": args.steps, "batch": batch, "seq": args.seq, "lr": args.lr, "weight_decay": args.weight_decay,
           "dropout": args.dropout, "seed": args.seed, "timeout": args.checkpoint_timeout or args.timeout,
           "checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every, "resume": None,
           "dp": dp, "zero": args.zero, "tp": args.tp, "sequence_parallel": args.sequence_parallel,
           "precision": args.precision, "param_dtype": args.param_dtype,
           "grad_dtype": args.grad_dtype, "clip_grad": args.clip_grad,
           "lr_schedule": args.lr_schedule, "warmup": args.warmup_steps, "recompute": args.recompute,
           "loss_reduction": args.loss_reduction or ("token" if hf else "microbatch"),
           "pad_fraction": args.pad_fraction, "split": args.split, "out": str(out),
           "peak_flops": None,  # the hardware's, found in _execute (metrics.peak_flops)
           "logging": {"tensorboard": args.tensorboard, "wandb": args.wandb},
           "record": {k: v for k, v in vars(args).items() if not k.startswith("_") and _plain(v)}}
    if args.wandb:
        from pipedsl.trainer.metrics import _import_wandb

        _import_wandb()  # not installed: one line now, not a failed rank later
    if hf:
        _check_run_numbers(args, 0, batch, dp * program.num_ranks * args.tp)
        from pipedsl.trainer.hf_setup import hf_config

        cfg["hf"] = hf_config(args, program, batch, out)
        cfg["layers"] = cfg["hf"]["layers"]
    else:
        layers = args.layers or (2 * S if args.split == "blocks" else max(2 * S - 2, 1))
        if args.embd % N_HEAD:
            raise PipeDSLError(f"--embd {args.embd} must be a multiple of {N_HEAD} (the attention heads)")
        if args.split == "blocks" and layers < S:
            raise PipeDSLError(f"--layers {layers} --split blocks: every one of the program's {S} stages needs a "
                               f"block")
        if layers + 2 < S:
            raise PipeDSLError(f"--layers {layers}: an embedding, {layers} blocks and a head make {layers + 2} "
                               f"pieces, fewer than the program's {S} stages")
        _check_run_numbers(args, layers, batch, dp * program.num_ranks * args.tp)
        _check_gpt_tp(args)
        cfg.update(layers=layers, embd=args.embd, vocab=VOCAB, heads=N_HEAD)
    if args.resume:
        cfg["resume"] = _resume_point(program, cfg, args.resume, args.checkpoint_dir)
    return cfg


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value))


MAX_SECONDS = 365 * 86400.0  # a timeout beyond a year is a typo (and overflows torch's timedelta near 1e14 s)
MAX_SEED = 2**63 - 2  # torch.manual_seed takes 64-bit seeds; the data generator uses seed + 1


def _check_local(ranks: int, args: argparse.Namespace) -> None:
    """dp x ranks x tp local processes: within what this machine runs (capacity.py) unless --allow-oversubscribe."""
    dp, tp = args.dp, args.tp
    what = " x ".join([*([f"--dp {dp}"] if dp > 1 else []), f"{ranks} pipeline ranks", *([f"--tp {tp}"] if tp > 1
                                                                                          else [])])
    check_local_ranks(dp * ranks * tp, limit=10**9 if args.allow_oversubscribe else None, what=what,
                      override="--allow-oversubscribe")


def _check_gpt_tp(args: argparse.Namespace) -> None:
    """The GPT's heads, width, MLP and vocabulary split evenly over --tp (models/gpt/tp.py's rule)."""
    from pipedsl.errors import PipeDSLError

    t = args.tp
    if t == 1:
        return
    for what, n in (("attention heads", N_HEAD), ("--embd", args.embd), ("vocabulary", VOCAB)):
        if n % t:
            raise PipeDSLError(f"--tp {t}: the GPT's {what} ({n}) does not divide by {t}")
    if args.dropout:
        raise PipeDSLError(f"--tp {t} with --dropout {args.dropout}: tensor-parallel dropout needs a random stream "
                           f"per tp rank, which the layers do not keep; use --dropout 0")


def _check_run_numbers(args: argparse.Namespace, layers: int, batch: int, nprocs: int) -> None:
    """Seconds, seeds, threads and model memory a local run can actually use; one line each."""
    from pipedsl.errors import PipeDSLError

    for flag, value in (("--timeout", args.timeout), ("--checkpoint-timeout", args.checkpoint_timeout),
                        ("--join-timeout", args.join_timeout)):
        if value is not None and value > MAX_SECONDS:
            raise PipeDSLError(f"{flag} {value:g}: more than a year ({MAX_SECONDS:g} s)")
    if not 0 <= args.seed <= MAX_SEED:
        raise PipeDSLError(f"--seed {args.seed}: must be in [0, 2**63 - 2]")
    if args.allow_oversubscribe:
        return
    cores = usable_cores()
    if args.threads > cores:
        raise PipeDSLError(f"--threads {args.threads}: more threads per rank than this machine's {cores} cores "
                           f"(--allow-oversubscribe to run anyway)")
    if not layers:  # a Hugging Face model: its memory is checked with its config (hf_setup.py)
        return
    need, memory = _memory_estimate(args, layers, batch, nprocs), total_memory()
    if memory and need > memory:
        raise PipeDSLError(f"the model and batch need about {need / 2**30:.3g} GiB (--layers {layers}, "
                           f"--embd {args.embd}, --seq {args.seq}, --batch {batch}, {nprocs} processes), more than "
                           f"this machine's {memory / 2**30:.3g} GiB (--allow-oversubscribe to run anyway)")


def _memory_estimate(args: argparse.Namespace, layers: int, batch: int, nprocs: int) -> int:
    """Bytes a run needs at least: every process builds the whole GPT in fp32 before keeping its stages;
    each dp replica's model states under the run's precision and ZeRO stage (`pipedsl.plan.memory`);
    activations of the whole batch (Korthikanti et al. 2022: 34·s·b·h + 5·a·s²·b bytes per layer in fp16,
    doubled for fp32)."""
    from pipedsl.plan.memory import model_states, state_bytes

    C, T, L, B = args.embd, args.seq, layers, batch
    params = 2 * VOCAB * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    activations = L * (68 * T * B * C + 10 * N_HEAD * T * T * B) + 16 * B * T
    mode = state_bytes(args.param_dtype, args.grad_dtype, "adamw")
    states = args.dp * model_states(params, args.dp, args.zero, mode).total
    return int(4 * params * nprocs + states + activations)


def _resume_point(program: Any, cfg: dict[str, Any], resume: str, directory: str | None) -> str | None:
    """The checkpoint to resume from (None: start fresh), checked against the model's stage partition."""
    import torch

    from pipedsl.runtime import checkpoint

    if resume == "latest":
        found = checkpoint.latest(directory)
        if found is None:
            print(f"note: no complete checkpoint in {directory}; starting from step 0", flush=True)
            return None
    else:
        found = checkpoint.resolve(resume)
    saved_tp = checkpoint.saved_parallel(found.manifest)["tp"]
    if saved_tp != cfg["tp"] and not cfg.get("hf"):  # a Hugging Face model's DTensor shards are cut again on load
        raise checkpoint.CheckpointError(f"{found.path} was saved with --tp {saved_tp}, this run has --tp {cfg['tp']}: "
                                         f"the built-in GPT's tensor-parallel slices load only under the same tp")
    if cfg["tp"] > 1 and not cfg.get("hf"):  # the GPT's tp layers have names of their own: ranks compare shards
        return str(found.path)
    with torch.device("meta"):  # shapes only: compare the partition before any process starts
        if cfg.get("hf"):
            from pipedsl.trainer.hf_setup import meta_stages

            stages, what = meta_stages(cfg, program.num_stages)
        else:
            from pipedsl.models.gpt.model import GPT
            from pipedsl.trainer.train import gpt_config

            stages = GPT(gpt_config(cfg)).stages(program.num_stages, by=cfg.get("split", "count"))
            what = f"the {cfg['layers']}-block GPT cut into {program.num_stages} stages"
    checkpoint.check_partition(found.manifest, dict(enumerate(stages)), program.num_stages, where=what)
    if found.step >= cfg["steps"]:
        print(f"note: the checkpoint is at step {found.step}, not before --steps {cfg['steps']}", flush=True)
    return str(found.path)


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
