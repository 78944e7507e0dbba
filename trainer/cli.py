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
not split into M, a checkpoint of another model) is reported before any process
starts, as one line, exit status 2 — more local processes (dp x P), threads or model memory
than this machine can hold included, unless `--allow-oversubscribe` (runtime/launch/capacity.py);
library warnings met on the way are held until the checks pass (trainer/held_warnings.py), so a refusal is
the first line.  `--print-config` makes the same checks, short of reading the model, the data and a
checkpoint, before it prints.  A failure while running (a rank that dies, a timeout) exits with status 1
and names the rank that failed first.  SIGTERM, SIGINT or SIGHUP stop every rank, print `interrupted by SIGTERM:
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
from dataclasses import replace
from functools import wraps
from pathlib import Path
from typing import Any

from pipedsl.output import write_text
from pipedsl.runtime.launch.capacity import check_local_ranks, total_memory, usable_cores
from pipedsl.runtime.launch.lifecycle import exit_on_signals
from pipedsl.steps import period
from pipedsl.trainer import config
from pipedsl.trainer.config import GPT_HEADS, GPT_VOCAB, TrainConfig, split_keywords

# The help pages of `pipedsl train` and `pipedsl run`: their argument groups in order (None: argparse's own
# "options"), each naming its options in order.  An option's flag itself (spellings, type, choices, help) is its
# `TrainConfig` field's `config.Flag`, declared there once; "config" and "print_config" are the commands' own.
_SHARED = ("steps", "batch", "seq", "layers", "split", "embd", "lr", "weight_decay", "no_decay", "dropout", "seed",
           "dp", "zero", "zero_reshard", "tp", "ep", "experts", "top_k", "capacity_factor", "sequence_parallel",
           "precision", "param_dtype", "grad_dtype", "clip_grad", "post_validate", "lr_schedule", "min_lr",
           "decay_steps", "warmup_steps", "recompute", "loss_reduction", "pad_fraction",
           "timeout", "checkpoint_timeout", "join_timeout", "max_time", "stop_timeout", "threads", "checkpoint_dir",
           "checkpoint_every", "keep_checkpoints", "resume", "overwrite")
_GROUPS = (("data and evaluation (with --model)",
            ("data", "text_field", "source_field", "target_field", "target_seq", "noise_density", "mean_noise_span",
             "packing", "doc_mask", "eval_fraction", "eval_data", "eval_every", "eval_batches", "cache_dir", "attn")),
           ("logging", ("tensorboard", "wandb", "log_every", "peak_tflops")),
           (None, ("out", "allow_oversubscribe")))
LAYOUTS: dict[str, tuple[tuple[str | None, tuple[str, ...]], ...]] = {
    "train": ((None, ("config", "print_config", "model", "schedule", "auto_memory", "ranks", "microbatches", "param",
                      *_SHARED)), *_GROUPS),
    "run": ((None, ("program", "ranks", "config", "print_config", "model", *_SHARED)), *_GROUPS),
}
FILE_FLAGS: dict[str, config.Flag] = {  # not options of a run: never in a TOML file (config.NOT_IN_FILE)
    "config": config.Flag("read every option from a TOML file (flags given here win)", metavar="TOML"),
    "print_config": config.Flag("print the resolved configuration as TOML and exit", action="store_true"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a Hugging Face decoder on text, or a small GPT on synthetic "
                                            "tokens, with a schedule (local processes)")
    _add_options(p, "train")
    return p


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="train the small GPT with a compiled program file (JSON, CSV or text)")
    _add_options(p, "run")
    return p


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a checkpoint of `pipedsl train --model` as a Hugging Face "
                                             "model directory")
    p.add_argument("checkpoint", help="a checkpoint directory (step-NNNNNNNN) or a directory of them (the latest)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR",
                   help="the directory to write (safetensors, config.json, tokenizer files)")
    p.add_argument("--dtype", choices=config.DTYPES, default="fp32",
                   help="the weights' dtype in the export (default fp32, as trained)")
    return p


def export(args: argparse.Namespace) -> int:
    """`pipedsl export CHECKPOINT --hf OUT`: from any dp × pp × tp layout and ZeRO stage to `from_pretrained`."""
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


def _add_options(p: argparse.ArgumentParser, command: str) -> None:
    """The command's flags in its help page's order (`LAYOUTS`).  No default here: None means "not given", and
    `TrainConfig` supplies the value (the help quotes it), so a TOML file fills exactly what the flags leave out.
    Every option is on some help page: tests/trainer/test_train_config.py."""
    for title, names in LAYOUTS[command]:
        group = p if title is None else p.add_argument_group(title)
        for name in names:
            _add_flag(group, name, command)
    p.set_defaults(_parser=p)


def _add_flag(group: argparse._ActionsContainer, name: str, command: str) -> None:
    """One flag, as its `config.Flag` says; an option's (a field's) flag defaults to None, a bool option's is a
    switch, and its help quotes the command's default."""
    if name in FILE_FLAGS:
        group.add_argument(*FILE_FLAGS[name].spellings(name), **FILE_FLAGS[name].keywords(command))
        return
    option = config.FIELDS[name]
    flag: config.Flag = option.metadata["flag"]
    keywords = flag.keywords(command, config.COMMAND_DEFAULTS[command].get(name, option.default))
    switch = {"action": "store_true"} if isinstance(option.default, bool) else {}
    group.add_argument(*flag.spellings(name), **keywords, default=None, **switch)


# ---------------------------------------------------------------- commands


def _stoppable(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """SIGTERM/SIGINT/SIGHUP end the command with status 128 + signal and one line, never a traceback."""
    @wraps(command)
    def wrapper(args: argparse.Namespace) -> int:
        with exit_on_signals():
            return command(args)
    return wrapper


def _print_config(args: argparse.Namespace, program: Any, cfg: TrainConfig) -> int:
    """`--print-config`: the configuration as TOML, once it has passed what a run checks before it reads the
    model, the data or a checkpoint (`_checked`), so that a file it prints is not refused for its options; the
    keys of the other model source are left out (`config.render`).  Not this machine's capacity: the file may be
    for torchrun on a cluster.  Starts nothing, writes nothing."""
    _checked(program, cfg, here=False)
    parser = getattr(args, "_parser", None)
    print(config.render(cfg, config.option_names(parser) if parser is not None else None), end="")
    return 0


@_stoppable
def run(args: argparse.Namespace) -> int:
    """`pipedsl train`: compile the schedule, then train."""
    import pipedsl

    started = time.time()
    cfg = config.from_args(args)
    s = cfg.schedule
    if not args.print_config:  # a printed file may be for a cluster (torchrun): not this machine's capacity
        _check_local(s.ranks, cfg)  # before compiling: a huge -P is refused, not compiled
    _check_paths(cfg)  # before the fork server's imports: a wrong path fails in a moment
    if not args.print_config:
        _start_fork_server(cfg)
    if s.schedule == "auto":  # profile under ZB-H1, then search ZB-auto from its costs (trainer/train.py: _switch)
        pipedsl.load("zb-auto").compile(P=s.ranks, M=s.microbatches, **s.params)  # its parameters, checked now
        program = pipedsl.load("zb-h1").compile(P=s.ranks, M=s.microbatches)
    else:
        program = pipedsl.load(s.schedule).compile(P=s.ranks, M=s.microbatches, **s.params)
    if args.print_config:
        return _print_config(args, program, cfg)
    return _execute(program, cfg, started)


@_stoppable
def run_program(args: argparse.Namespace) -> int:
    """`pipedsl run`: read and validate a program file, then train."""
    from pipedsl.runtime.program_file import read_program

    started = time.time()
    cfg = config.from_args(args)
    _check_paths(cfg)
    if not args.print_config:
        _start_fork_server(cfg)
    program = read_program(cfg.schedule.program, ranks=cfg.schedule.ranks)
    if args.print_config:
        return _print_config(args, program, cfg)
    return _execute(program, cfg, started)


def _check_paths(cfg: TrainConfig) -> None:
    """The model directory's config.json and the data paths, checked before anything imports torch or
    transformers (the fork server, the model's config): a wrong path fails in a moment, not after the imports."""
    from pipedsl.trainer import data

    if cfg.model.is_hf:
        from pipedsl.models.hf import read_config_file

        read_config_file(cfg.model.model)
    for paths in (cfg.data.data, cfg.data.eval_data):
        if paths:
            data.check_data_paths(paths)


def _start_fork_server(cfg: TrainConfig) -> None:
    """The ranks' fork server imports torch, the trainer and (for --model) transformers' model code while this
    process checks the data and the model and compiles: the two overlap (runtime/launch/fork_server.py).  The
    ranks' rendezvous store starts now too."""
    from pipedsl.runtime.launch.fork_server import TORCHRUN_ENV, start

    if all(k in os.environ for k in TORCHRUN_ENV):  # torchrun started this process: it starts no rank
        return
    start(["pipedsl.trainer.train", *(["transformers.modeling_utils"] if cfg.model.is_hf else []),
           "pipedsl.trainer.rank_modules"])  # last: what the ranks import on first use (trainer/rank_modules.py)
    from pipedsl.runtime.launch import world_store

    world_store.warm(cfg.run.timeout)  # the ranks' store, old enough when they connect (world_store.py)


def _execute(program: Any, cfg: TrainConfig, started: float) -> int:
    import pipedsl
    from pipedsl.errors import PipeDSLError, PipeRuntimeError
    from pipedsl.timeline import Timeline
    from pipedsl.trainer.held_warnings import held

    with held(transformers=cfg.model.is_hf):  # library warnings never above a refusal: shown after the checks pass
        cfg = replace(_config(program, cfg), started_at=started)
    out = Path(cfg.logging.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PipeDSLError(f"cannot create the output directory {out}: {err.strerror or err}") from None
    from pipedsl.runtime.launch.launcher import under_torchrun

    if under_torchrun() and os.environ.get("RANK") != "0":  # every process runs this command; one of them speaks
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    layout = _layout_text(program.num_ranks, cfg)
    m = cfg.model
    experts = f", {m.experts} experts top-{m.top_k}" if m.experts else ""
    what = cfg.hf.describe if cfg.hf else f"a {m.layers}-block GPT (C={m.embd}, T={cfg.data.seq}{experts})"
    print(f"training {what} with {program.name} {' '.join(f'{k}={v}' for k, v in program.params.items())}: "
          f"{program.num_stages} stages on {layout}, batch {cfg.training.batch}", flush=True)
    if cfg.hf:
        print(f"data: {cfg.hf.data_describe}", flush=True)
    if cfg.checkpoint.resume:
        print(f"resuming from {cfg.checkpoint.resume}", flush=True)
    nprocs = cfg.parallel.dp * program.num_ranks * cfg.parallel.tp
    from pipedsl.trainer.metrics import peak_flops

    peak, source = peak_flops(nprocs, min(nprocs * cfg.training.threads, usable_cores()), cfg.logging.peak_tflops)
    cfg = replace(cfg, peak_flops=peak)
    print(f"MFU against {source}", flush=True)
    try:
        from pipedsl.trainer.train import train

        results = pipedsl.launch(train, nprocs, program.to_json(), cfg, timeout=cfg.run.timeout,
                                 join_timeout=cfg.run.join_timeout, stop_grace=cfg.run.stop_timeout,
                                 threads=cfg.training.threads,
                                 max_local=nprocs if cfg.run.allow_oversubscribe else None)
    except PipeRuntimeError as err:
        print(err.render(), file=sys.stderr)
        return 1
    report = results[0]
    if report is None:  # torchrun: a process other than global rank 0 (it reports nothing)
        return 0
    if "program" in report:  # the program that ran last (--schedule auto: the searched one)
        program = pipedsl.Program.from_json(report["program"])
    write_text(out / "losses.json", json.dumps({"schedule": program.name, "params": program.params,
                                                  "losses": report["losses"]}, indent=1) + "\n")
    written = [str(out / "metrics.jsonl"), str(out / "losses.json")]
    if report["timeline"] is None:
        print(f"nothing to run: the checkpoint is at step {report['start']}, --steps is {cfg.training.steps}")
        print("wrote " + ", ".join(written))
        return 0
    timeline = Timeline.from_dict(report["timeline"])
    write_text(out / "timeline.json", timeline.to_json())
    steps = int(timeline.meta.get("steps", 1))  # 2: the last two post-validated steps, which overlap
    predicted = pipedsl.simulate(program, pipedsl.Cost(**report["cost"]), steps=steps)
    write_text(out / "predicted.json", predicted.to_json())
    written += [str(out / "timeline.json"), str(out / "predicted.json")]
    png = _plot([timeline, predicted], out / "timeline.png")
    if png:
        written.append(png)
    memory = (f"peak activations per rank {[a for a, _ in report['peaks']]}, "
              f"saved-activation KiB per rank {[round(b / 1024, 1) for _, b in report['peaks']]}")
    if steps > 1:
        print(f"last {steps} steps (post-validated, overlapping): {period(timeline) * 1e3:.1f} ms a step measured "
              f"(simulated with the measured mean op times and gap between steps: {period(predicted) * 1e3:.1f} "
              f"ms); {memory}")
    else:
        print(f"last step: {timeline.makespan * 1e3:.1f} ms measured, bubble {timeline.bubble_ratio:.3f} "
              f"(simulated with the measured mean op times: {predicted.makespan * 1e3:.1f} ms, "
              f"bubble {predicted.bubble_ratio:.3f}); {memory}")
    print("wrote " + ", ".join(written))
    return 0


def _layout_text(ranks: int, cfg: TrainConfig) -> str:
    """"2 x 2 x 2 = 8 processes (dp x pp x tp, zero=1, sequence parallel)" — or "4 processes" for a pipeline."""
    dp, tp, zero = cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.zero
    if dp == 1 and tp == 1 and not zero:
        return f"{ranks} processes"
    dims = [("dp", dp), ("pp", ranks)] + ([("tp", tp)] if tp > 1 else [])
    notes = ([f"zero={zero}"] + (["sequence parallel"] if cfg.parallel.sequence_parallel else [])
             + ([f"experts over ep={cfg.parallel.ep}"] if cfg.parallel.ep > 1 else []))
    return (f"{' x '.join(str(n) for _, n in dims)} = {dp * ranks * tp} processes "
            f"({' x '.join(d for d, _ in dims)}, {', '.join(notes)})")


def _config(program: Any, cfg: TrainConfig) -> TrainConfig:
    """`cfg` made concrete for `program` and for this machine — the output folder, the batch and the GPT's
    layers, the Hugging Face model's facts, the checkpoint to resume — with every input error that needs the
    program, the files or the machine, before any process starts.  What the ranks receive."""
    cfg = _checked(program, cfg)
    if cfg.model.is_hf:
        from pipedsl.trainer.hf_setup import hf_config

        cfg = replace(cfg, hf=hf_config(cfg, program, Path(cfg.logging.out)))
    if cfg.checkpoint.resume:
        resume = _resume_point(program, cfg)
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=resume))
    elif cfg.checkpoint.checkpoint_dir:
        _own_checkpoint_dir(cfg)
    return cfg


def _checked(program: Any, cfg: TrainConfig, here: bool = True) -> TrainConfig:
    """`cfg` made concrete for `program` (the batch, the GPT's layers, the output folder) and checked against the
    paths it names and (`here`) this machine's processes, threads, memory and packages: what a run checks before
    it reads the model, the data or a checkpoint, and all that `--print-config` checks."""
    from pipedsl.errors import PipeDSLError

    if here:  # the process count first (for `pipedsl run`, its first check; `pipedsl train` checked it to compile)
        _check_local(program.num_ranks, cfg)
    cfg = cfg.for_program(program)
    if cfg.logging.out is None:  # a configuration not built by from_args: the command's folder
        command = "run" if cfg.schedule.program else "train"
        cfg = replace(cfg, logging=replace(cfg.logging, out=config.COMMAND_DEFAULTS[command]["out"]))
    for flag, path in (("checkpoint_dir", cfg.checkpoint.checkpoint_dir), ("cache_dir", cfg.data.cache_dir),
                       ("tensorboard", cfg.logging.tensorboard)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise PipeDSLError(f"--{flag.replace('_', '-')} {path}: not a directory")
    if here:  # this machine's packages, threads and memory
        if cfg.logging.wandb:
            from pipedsl.trainer.metrics import _import_wandb

            _import_wandb()  # not installed: one line now, not a failed rank later
        _check_machine(cfg, cfg.parallel.dp * program.num_ranks * cfg.parallel.tp)
    return cfg


def _own_checkpoint_dir(cfg: TrainConfig) -> None:
    """A run without --resume owns its checkpoint directory: one holding another run's checkpoints is refused (its
    latest would be exported or resumed as this run's), or emptied of them with --overwrite."""
    import shutil

    from pipedsl.errors import PipeDSLError
    from pipedsl.runtime import checkpoint

    directory = cfg.checkpoint.checkpoint_dir
    saved = checkpoint.checkpoints(directory) if directory and os.path.isdir(directory) else []
    if not saved:
        return
    last = saved[-1]
    if not cfg.checkpoint.overwrite:
        raise PipeDSLError(f"--checkpoint-dir {directory} holds another run's checkpoints (the latest: step "
                           f"{last.step}, {checkpoint.schedule_name(last.manifest)}): continue it with --resume, or "
                           f"pass --overwrite to remove them and start over")
    for info in saved:
        shutil.rmtree(info.path)
    print(f"note: --overwrite: removed {len(saved)} checkpoint(s) of another run from {directory}", flush=True)


def _check_local(ranks: int, cfg: TrainConfig) -> None:
    """dp x ranks x tp local processes: within what this machine runs (capacity.py) unless --allow-oversubscribe."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    what = " x ".join([*([f"--dp {dp}"] if dp > 1 else []), f"{ranks} pipeline ranks", *([f"--tp {tp}"] if tp > 1
                                                                                          else [])])
    check_local_ranks(dp * ranks * tp, limit=10**9 if cfg.run.allow_oversubscribe else None, what=what,
                      override="--allow-oversubscribe")


def _check_machine(cfg: TrainConfig, nprocs: int) -> None:
    """Threads and model memory this machine can actually give the ranks; one line each."""
    from pipedsl.errors import PipeDSLError

    if cfg.run.allow_oversubscribe:
        return
    cores = usable_cores()
    if cfg.training.threads > cores:
        raise PipeDSLError(f"--threads {cfg.training.threads}: more threads per rank than this machine's {cores} "
                           f"cores (--allow-oversubscribe to run anyway)")
    if cfg.model.is_hf:  # a Hugging Face model: its memory is checked with its config (hf_setup.py)
        return
    need, memory = _memory_estimate(cfg, nprocs), total_memory()
    if memory and need > memory:
        m = cfg.model
        raise PipeDSLError(f"the model and batch need about {need / 2**30:.3g} GiB (--layers {m.layers}, "
                           f"--embd {m.embd}, --seq {cfg.data.seq}, --batch {cfg.training.batch}, {nprocs} "
                           f"processes), more than this machine's {memory / 2**30:.3g} GiB (--allow-oversubscribe to "
                           f"run anyway)")


def _memory_estimate(cfg: TrainConfig, nprocs: int) -> int:
    """Bytes a run needs at least: every process builds the whole GPT in fp32 before keeping its stages;
    each dp replica's model states under the run's precision and ZeRO stage (`pipedsl.plan.memory`);
    activations of the whole batch (Korthikanti et al. 2022: 34·s·b·h + 5·a·s²·b bytes per layer in fp16,
    doubled for fp32)."""
    from pipedsl.plan.memory import model_states

    C, T, L, B = cfg.model.embd, cfg.data.seq, cfg.model.layers, cfg.training.batch
    params = 2 * GPT_VOCAB * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    activations = L * (68 * T * B * C + 10 * GPT_HEADS * T * T * B) + 16 * B * T
    dp = cfg.parallel.dp
    states = dp * model_states(params, dp, cfg.parallel.zero, cfg.training.state_bytes).total
    return int(4 * params * nprocs + states + activations)


def _resume_point(program: Any, cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from (None: start fresh), checked against the model: its configuration, and its
    tensors in this run's stage partition (the same, or another one that loads by name)."""
    import torch

    from pipedsl.runtime import checkpoint

    resume, directory, tp = cfg.checkpoint.resume, cfg.checkpoint.checkpoint_dir, cfg.parallel.tp
    if resume == "latest":
        found = checkpoint.latest(directory)
        if found is None:
            print(f"note: no complete checkpoint in {directory}; starting from step 0", flush=True)
            return None
    else:
        found = checkpoint.resolve(resume)
    from pipedsl.trainer.train import model_record

    differ = checkpoint.model_differences(found.manifest, model_record(cfg))
    if differ:
        shown = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, a, b in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise checkpoint.CheckpointError(f"{found.path} is of another model than this run's: {shown}{more}")
    saved_tp = checkpoint.saved_parallel(found.manifest)["tp"]
    if saved_tp != tp and not cfg.hf:  # a Hugging Face model's DTensor shards are cut again on load
        raise checkpoint.CheckpointError(f"{found.path} was saved with --tp {saved_tp}, this run has --tp {tp}: "
                                         f"the built-in GPT's tensor-parallel slices load only under the same tp")
    if tp > 1 and not cfg.hf:  # the GPT's tp layers have names of their own: ranks compare shards
        return str(found.path)
    with torch.device("meta"):  # shapes only: compare the partition before any process starts
        if cfg.hf:
            from pipedsl.trainer.hf_setup import meta_stages

            stages, what = meta_stages(cfg, program.num_stages)
        else:
            from pipedsl.models.gpt.model import GPT
            from pipedsl.trainer.train import gpt_config

            stages = GPT(gpt_config(cfg)).stages(program.num_stages, **split_keywords(cfg.model.split))
            what = f"the {cfg.model.layers}-block GPT cut into {program.num_stages} stages"
    if checkpoint.loads_into(found.manifest, dict(enumerate(stages)), program.num_stages, where=what):
        saved = found.manifest["partition"]["num_stages"]
        print(f"note: {found.path} was cut into {saved} stages otherwise; its tensors load by name into {what}",
              flush=True)
    if found.step >= cfg.training.steps:
        print(f"note: the checkpoint is at step {found.step}, not before --steps {cfg.training.steps}", flush=True)
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
