"""The training configuration: one typed, frozen `TrainConfig`, from flags and TOML to every rank.

    [model]
    model = "examples/llama-tiny"
    [data]
    data = ["docs/"]
    seq = 128
    [training]
    steps = 200
    precision = "bf16"

`TrainConfig` is a frozen dataclass of one frozen dataclass per TOML section (`ModelConfig`,
`DataConfig`, … — torchtitan's job config), and the single home of every option: a field holds its
default, the rules its value must pass and its command-line flag (`Flag`: spellings, type, help), and
the parsers of `pipedsl train` and `pipedsl run` are built from the fields (trainer/cli.py), each
flag defaulting to None so that the dataclass supplies the value.  Each section checks its own values
where it is built and `TrainConfig` checks how they combine (`--checkpoint-every` needs
`--checkpoint-dir`, …): a `ConfigError`, one line naming the option, exit status 2.  The
launcher (trainer/cli.py) then makes it concrete for the compiled program (`for_program`: the
batch, the GPT's layers) and adds what it found out (`hf`: the Hugging Face model's facts,
`peak_flops`), and that one object is what every rank receives (trainer/train.py).

`pipedsl train --config run.toml`: each key is a command-line option's name (`clip-grad` or
`clip_grad`), in the section that groups it (`SECTIONS`: a section's keys are its dataclass's
fields) or at the top level.  The file is checked as strictly as the flags: an unknown key names
its section and the keys that section takes, a value of the wrong type or out of range names the
key and what it expected — one line, exit status 2, before anything starts.  A flag given on the
command line wins over the file (torchtitan's rule); `--print-config` checks the configuration as a
run would before it reads the model or the data (trainer/cli.py), prints it as TOML and exits, so
`pipedsl train … --print-config > run.toml` writes a file that reproduces the run (`render`: the
options of the model source it trains, GPT or Hugging Face; read back, it prints the same text).
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from collections.abc import Callable, Collection, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from pipedsl.arguments import (
    NO_DECAY_KINDS,
    fraction,
    no_decay_kinds,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from pipedsl.errors import PipeDSLError
from pipedsl.models.hf import StageCut

if TYPE_CHECKING:  # pragma: no cover - annotations only (it imports numpy and the data layer)
    from pipedsl.models.hf.io import ExportMetadata
    from pipedsl.trainer.seq2seq_data import Seq2SeqObjective

GPT_HEADS = 4  # the built-in GPT's attention heads and synthetic vocabulary: fixed, so not options
GPT_VOCAB = 64
MAX_SECONDS = 365 * 86400.0  # a timeout beyond a year is a typo (and overflows torch's timedelta near 1e14 s)
MAX_SEED = 2**63 - 2  # torch.manual_seed takes 64-bit seeds; the data generator uses seed + 1

DTYPES = ("fp32", "bf16", "fp16")
SPLITS = ("count", "blocks", "flops")
ATTENTIONS = ("sdpa", "eager")
PACKINGS = ("pack", "pad")
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
RECOMPUTES = ("none", "full", "selective")
LOSS_REDUCTIONS = ("microbatch", "token")
ZERO_STAGES = (0, 1, 2, 3)
ZERO_RESHARDS = ("auto", "unit", "step")  # parallel/config.py's RESHARD_CHOICES (no torch-side import here)

# What differs between the two commands.  The dataclasses' defaults are those of a bare rank function
# (`train(rank, program_json, cfg)`): the program decides the ranks and `logging.out=None` writes no files.
# `pipedsl train` compiles its schedule for 4 ranks unless -P says otherwise; each command writes under its own
# folder unless -o says otherwise.
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {"train": {"ranks": 4, "out": "out/train"}, "run": {"out": "out/run"}}
NOT_IN_FILE = ("config", "print_config", "help")


class ConfigError(PipeDSLError):
    """An option's value, or a combination of them, that cannot run: one line naming the option."""


class ConfigFileError(ConfigError):
    """A TOML file that does not read as options: not TOML, an unknown section or key, a value's type."""

    kind = "config error"


# ---------------------------------------------------------------- what a value must be

Rule = tuple[str, Callable[[Any], bool]]  # (the requirement, said in the error; the test)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _at_least(low: int) -> Rule:
    return f"must be an integer of at least {low}", lambda v: _is_int(v) and v >= low


def _one_of(*choices: Any) -> Rule:
    return f"is not one of {', '.join(map(str, choices))}", lambda v: v in choices and type(v) is type(choices[0])


def split_points(split: str) -> list[int] | None:
    """`--split`'s explicit cut points ("3,7": stages 1 and 2 begin at units 3 and 7 of [embedding, blocks…,
    head]), None for a named rule (`SPLITS`) or anything else."""
    parts = split.split(",")
    if split in SPLITS or not all(p.strip().isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def split_keywords(split: str) -> dict[str, Any]:
    """`--split` as `GPT.stages` / `split_gpt` keywords: {"by": rule} or {"points": cut points}."""
    points = split_points(split)
    return {"points": points} if points is not None else {"by": split}


def check_points(points: list[int], units: int, stages: int, what: str) -> None:
    """Refuse `--split` points that do not cut `units` units into `stages` non-empty stages, in one line."""
    if len(points) != stages - 1:
        raise ConfigError(f"--split {','.join(map(str, points))}: {len(points)} cut points make {len(points) + 1} "
                          f"stages, the program has {stages}")
    if any(a >= b for a, b in zip([0, *points], [*points, units])):
        raise ConfigError(f"--split {','.join(map(str, points))}: cut points must increase within 1..{units - 1} "
                          f"({what}: {units} units, the embedding, the blocks and the head)")


def _parses(parse: Callable[[str], Any], text: str) -> bool:
    """Whether a command-line parser (pipedsl/arguments.py) takes `text`: one rule for a flag and its TOML key."""
    try:
        parse(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def _optional(rule: Rule) -> Rule:
    return rule[0], lambda v: v is None or rule[1](v)


POSITIVE: Rule = ("must be a positive, finite number", lambda v: _is_number(v) and v > 0)
NONNEGATIVE: Rule = ("must be a non-negative, finite number", lambda v: _is_number(v) and v >= 0)
FRACTION: Rule = ("must be in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1)
TEXT: Rule = ("must be a string", lambda v: isinstance(v, str))
FLAG: Rule = ("must be true or false", lambda v: isinstance(v, bool))
PATHS: Rule = ("must be a list of paths", lambda v: isinstance(v, tuple) and bool(v) and
               all(isinstance(p, str) for p in v))
SEED: Rule = ("must be in [0, 2**63 - 2]", lambda v: _is_int(v) and 0 <= v <= MAX_SEED)
NO_DECAY: Rule = (f"must be 'none' or some of {', '.join(NO_DECAY_KINDS)} separated by commas",
                  lambda v: isinstance(v, str) and _parses(no_decay_kinds, v))
WITHIN_A_YEAR: Rule = (f"more than a year ({MAX_SECONDS:g} s)", lambda v: v is None or v <= MAX_SECONDS)


def _open_fraction() -> Rule:
    return ("must be in (0, 1)", lambda v: _is_number(v) and 0 < v < 1)


def _at_least_number(low: float) -> Rule:
    return (f"must be a number of at least {low:g}", lambda v: _is_number(v) and v >= low)


def _split_arg(value: str) -> str:
    """`--split`'s flag type: a named rule or cut points."""
    if value in SPLITS or split_points(value) is not None:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(SPLITS)} or cut points such as 3,7")


def _no_decay(text: str) -> str:
    """`--no-decay` checked and written as the configuration keeps it ("none" for no kind)."""
    return ",".join(no_decay_kinds(text)) or "none"


SPLIT: Rule = (f"is not one of {', '.join(SPLITS)} or cut points (\"3,7\": where stages 1 … S-1 begin among the units "
               f"embedding, blocks…, head)", lambda v: isinstance(v, str) and _parses(_split_arg, v))
TIMEOUT: tuple[Rule, ...] = (POSITIVE, WITHIN_A_YEAR)


# ---------------------------------------------------------------- how an option is spelled on the command line


@dataclass(frozen=True)
class Flag:
    """An option's command-line flag, kept in its field's metadata beside its default and rules: the parsers of
    `pipedsl train` and `pipedsl run` are built from the fields (trainer/cli.py), so an option is declared once.
    There an option's flag defaults to None ("not given": the field supplies the value), and a bool option is a
    switch (store_true)."""

    help: str | Mapping[str, str]  # "{default}" quotes the (command's) default; a mapping: the text by command
    short: str | None = None  # "-P", before the long flag (--ranks)
    type: Callable[[str], Any] | None = None  # argparse's; the TOML value goes through it too (read_file)
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None
    const: Any = None
    action: str | None = None  # "append"
    required: bool = False

    def spellings(self, name: str) -> list[str]:
        """The flag of the option `name`: `["-P", "--ranks"]`."""
        return [*([self.short] if self.short else []), "--" + name.replace("_", "-")]

    def keywords(self, command: str, default: Any = None) -> dict[str, Any]:
        """`add_argument`'s keywords for the flag in `command`, its help quoting `default`."""
        text = self.help if isinstance(self.help, str) else self.help[command]
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        given = {"type": self.type, "choices": self.choices, "metavar": self.metavar, "nargs": self.nargs,
                 "const": self.const, "action": self.action, "required": self.required or None}
        return {"help": text.replace("{default}", shown), **{k: v for k, v in given.items() if v is not None}}


def _option(default: Any, *rules: Rule, choices: tuple[Any, ...] | None = None, **flag: Any) -> Any:
    """A field with its default, the rules its value must pass (checked in `_Section.__post_init__`) and its
    flag (`Flag`'s keywords).  `choices` are both a rule and the flag's choices."""
    if choices is not None:
        rules = (*rules, _one_of(*choices) if default is not None else _optional(_one_of(*choices)))
    return field(default=default, metadata={"rules": rules, "flag": Flag(choices=choices, **flag)})


def _flag(f: Field) -> str:
    """The flag an error names: the short one where there is one (-P)."""
    return f.metadata["flag"].spellings(f.name)[0]


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if _is_int(value) else repr(value)


class _Section:
    """A TOML section: every field checked by its rules when built; lists become tuples (frozen means frozen)."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, list):  # TOML and argparse give lists
                value = tuple(value)
                object.__setattr__(self, f.name, value)
            for requirement, ok in f.metadata.get("rules", ()):
                if not ok(value):
                    raise ConfigError(f"{_flag(f)} {_shown(value)}: {requirement}")


# ---------------------------------------------------------------- the sections


@dataclass(frozen=True)
class ModelConfig(_Section):
    """[model]: which model, and how it is cut into stages."""

    model: str | None = _option(  # a Hugging Face directory; None or "gpt": the built-in GPT
        None, _optional(TEXT), metavar="DIR",
        help={"train": "a local Hugging Face model directory (config.json; with safetensors weights: fine-tune them, "
                       "without: random init); default: the built-in GPT on synthetic tokens",
              "run": "a local Hugging Face model directory (default: the built-in GPT)"})
    attn: str | None = _option(  # None: sdpa where transformers has it
        None, choices=ATTENTIONS,
        help="the model's attention implementation (default sdpa, eager where transformers has no sdpa)")
    layers: int = _option(  # the GPT's blocks; 0: 2 a stage (`for_program`)
        0, _at_least(0), type=nonnegative_int, help="transformer blocks (default: 2 per stage)")
    embd: int = _option(64, _at_least(1), type=positive_int,
                        help=f"embedding width, a multiple of {GPT_HEADS} (default {{default}})")
    split: str = _option(
        "count", SPLIT, type=_split_arg, metavar="{count,blocks,flops,POINTS}",
        help="how the model is cut into stages: count (the embedding and the head count as pieces like the blocks; "
             "default), blocks (every stage the same number of blocks, the embedding and head on the end stages: "
             "Megatron-LM's split, the one `pipedsl plan` models), flops (balanced by the FLOPs a token costs in each "
             "piece: a large-vocabulary head gets a stage with fewer blocks) or cut points, e.g. 3,7 (stages 1 and 2 "
             "begin at pieces 3 and 7 of [embedding, blocks…, head])")
    dropout: float = _option(0.0, FRACTION, type=fraction, help="dropout probability (default {default})")
    seed: int = _option(0, SEED, type=int, help="the seed of the weights and the data order (default {default})")
    experts: int = _option(  # the GPT's experts per block (models/gpt/moe.py); 0: a dense MLP
        0, _at_least(0), type=nonnegative_int,
        help="the built-in GPT with a mixture of experts in every block (a top-k router with its load-balancing "
             "loss, models/gpt/moe.py; default {default}: a dense MLP)")
    top_k: int = _option(2, _at_least(1), type=positive_int,  # experts a token goes to
                         help="experts a token is routed to (default {default})")
    capacity_factor: float = _option(  # slots an expert takes, × its even share; 0: dropless
        0.0, NONNEGATIVE, type=nonnegative_float,
        help="an expert takes at most this times its even share of the routings, the rest dropped (default 0: "
             "dropless)")

    @property
    def is_hf(self) -> bool:
        return self.model is not None and self.model != "gpt"


@dataclass(frozen=True)
class DataConfig(_Section):
    """[data]: the text a Hugging Face model trains on (the GPT draws synthetic tokens) and its shape."""

    data: tuple[str, ...] | None = _option(
        None, _optional(PATHS), nargs="+", metavar="PATH",
        help="text files or folders, .jsonl (see --text-field), .parquet, or a `datasets` dataset saved with "
             "save_to_disk; tokenized once with the model's tokenizer (bytes when it has none)")
    eval_data: tuple[str, ...] | None = _option(
        None, _optional(PATHS), nargs="+", metavar="PATH",
        help="a held-out set of its own (same formats as --data); then all of --data trains and --eval-fraction is "
             "ignored")
    text_field: str = _option(
        "text", TEXT, help="the JSONL / Parquet / dataset column holding the text (default {default})")
    source_field: str | None = _option(  # encoder-decoders: (source, target) pairs …
        None, _optional(TEXT), metavar="FIELD",
        help="encoder-decoders: train on (source, target) pairs, the encoder's text in this JSONL / Parquet field "
             "(default: T5's span corruption of --text-field)")
    target_field: str | None = _option(  # … else span corruption of --text-field
        None, _optional(TEXT), metavar="FIELD", help="encoder-decoders: the field holding each target")
    seq: int = _option(32, _at_least(1), type=positive_int, help="tokens per sequence (default {default})")
    target_seq: int = _option(  # pairs: the targets' length; 0: --seq
        0, _at_least(0), type=nonnegative_int, metavar="N",
        help="encoder-decoders on pairs: target tokens a row (default: --seq); span corruption derives it")
    noise_density: float = _option(  # span corruption: the share of tokens masked
        0.15, _open_fraction(), type=float,
        help="span corruption: the share of tokens masked (default {default}, T5's)")
    mean_noise_span: float = _option(  # … and their spans' mean length
        3.0, _at_least_number(1.0), type=float, help="span corruption: the masked spans' mean length (default "
                                                     "{default})")
    packing: str = _option(
        "pack", choices=PACKINGS,
        help="pack: documents joined by end-of-text into fixed windows (default); pad: one document a row, "
             "right-padded, masked")
    doc_mask: bool = _option(
        False, FLAG,
        help="packed rows: keep attention inside each document (position ids restart after end-of-text)")
    eval_fraction: float = _option(
        0.05, FRACTION, type=fraction,
        help="share of the samples held out for evaluation, in blocks spread over the data (default {default})")
    cache_dir: str | None = _option(
        None, _optional(TEXT), metavar="DIR", help="where tokenized data is cached (default OUT/token-cache)")
    pad_fraction: float = _option(
        0.0, FRACTION, type=fraction, metavar="F",
        help="about this fraction of the targets is padding (ignore_index -100), as a random tail per sequence "
             "(default {default})")

    @property
    def heldout_fraction(self) -> float:
        """The share of --data held out: none when --eval-data is a held-out set of its own."""
        return 0.0 if self.eval_data else self.eval_fraction


@dataclass(frozen=True)
class ScheduleConfig(_Section):
    """[schedule]: the schedule and its sizes (`pipedsl train`), or a compiled program file (`pipedsl run`)."""

    schedule: str = _option(
        "1f1b", TEXT,
        help="a built-in name or a .pipe file (default {default}); auto: profile a few steps under ZB-H1, then "
             "continue under ZB-auto searched from the measured op and message times (-p mem=N: its memory cap, "
             "default 2P)")
    ranks: int | None = _option(  # None: the program's own (COMMAND_DEFAULTS)
        None, _optional(_at_least(1)), short="-P", type=positive_int,
        help={"train": "pipeline ranks = local processes (default {default})",
              "run": "the ranks the program must have (default: its own)"})
    microbatches: int = _option(8, _at_least(1), short="-M", type=positive_int,
                                help="microbatches per step (default {default})")
    param: tuple[str, ...] = _option(
        (), ("must be a list of NAME=VALUE strings", lambda v: isinstance(v, tuple) and all(isinstance(p, str)
                                                                                             for p in v)),
        short="-p", action="append", metavar="NAME=VALUE", help="a schedule parameter")
    program: str | None = _option(None, _optional(TEXT), required=True, metavar="FILE",
                                  help="a program as written by `pipedsl compile --format json|csv|text`")
    auto_memory: float | None = _option(  # GB for activations under auto; None: free now
        None, _optional(POSITIVE), type=positive_float, metavar="GB",
        help="with --schedule auto and no -p mem: the memory a rank gives activations, which sets ZB-auto's cap "
             "from one activation's bytes measured in the profile steps (default: the device's free memory then, "
             "less a tenth; the cap is at most 2P)")

    def __post_init__(self) -> None:
        _Section.__post_init__(self)
        for item in self.param:
            name, sep, value = item.partition("=")
            if not sep or not name.strip() or _integer(value) is None:
                raise ConfigError(f"-p {item!r}: expected NAME=INTEGER")
        if self.auto_memory is not None and self.schedule != "auto":
            raise ConfigError(f"--auto-memory {self.auto_memory:g} sizes --schedule auto's memory cap; the schedule "
                              f"is {self.schedule!r}")

    @property
    def params(self) -> dict[str, int]:
        """The schedule parameters, `{"V": 2}` for `-p V=2`."""
        return {name.strip(): int(value) for name, _, value in (p.partition("=") for p in self.param)}


def _integer(text: str) -> int | None:
    try:
        return int(text) if text.strip().lstrip("+-").isdigit() else None
    except ValueError:  # digits int() does not read ("²")
        return None


@dataclass(frozen=True)
class ParallelismConfig(_Section):
    """[parallel]: data-, tensor- and sequence-parallel ranks around the pipeline, and the ZeRO stage."""

    dp: int = _option(1, _at_least(1), type=positive_int,
                      help="data-parallel replicas of the pipeline: dp x P processes (default {default})")
    zero: int = _option(0, choices=ZERO_STAGES, type=int,
                        help="ZeRO stage over the dp replicas (default {default}: an averaging all-reduce)")
    tp: int = _option(
        1, _at_least(1), type=positive_int,
        help="tensor-parallel ranks per pipeline stage (Megatron's 1-D split: attention by heads, the MLP column- "
             "then row-wise, vocabulary-parallel embedding, head and loss): dp x P x tp processes (default "
             "{default})")
    sequence_parallel: bool = _option(
        False, FLAG,
        help="with --tp: norms and residuals on 1/tp of the sequence, reduce-scatter and all-gather in place of the "
             "all-reduces (Korthikanti et al. 2022); --seq must divide by --tp")
    ep: int = _option(  # expert parallelism: each MoE layer's experts over ep of the dp ranks
        1, _at_least(1), type=positive_int,
        help="expert parallelism: each MoE layer's experts sharded over groups of ep data-parallel replicas, "
             "tokens exchanged with all-to-alls (parallel/expert.py); ep divides --dp (default {default})")
    zero_reshard: str = _option(  # ZeRO-3 frees a unit after each use, or the step
        "auto", choices=ZERO_RESHARDS,
        help="ZeRO-3: free a layer's gathered parameters after each forward and backward (unit: one layer whole at "
             "a time, 2M all-gathers a layer a step) or after the stage's last backward (step: one all-gather a "
             "layer a step, the stage whole during the step); auto: step with -P 2 or more, unit with one stage "
             "(default {default})")


@dataclass(frozen=True)
class TrainingConfig(_Section):
    """[training]: steps, batch, optimizer, precision, recomputation and the loss."""

    steps: int = _option(20, _at_least(1), type=positive_int, help="train until this step (default {default})")
    batch: int = _option(  # 0: 4 sequences a microbatch and replica (`for_program`)
        0, _at_least(0), type=nonnegative_int, help="sequences per step (default 4·M)")
    lr: float = _option(  # 0: the steps run, the weights stay (an evaluation of the data)
        3e-3, NONNEGATIVE, type=nonnegative_float,
        help="AdamW's learning rate (default {default}; 0: the steps run, the weights stay)")
    weight_decay: float = _option(0.01, NONNEGATIVE, type=nonnegative_float,
                                  help="AdamW's weight decay (default {default})")
    no_decay: str = _option(  # what weight decay spares, or "none"
        ",".join(NO_DECAY_KINDS), NO_DECAY, type=_no_decay,
        help=f"what weight decay spares: some of {', '.join(NO_DECAY_KINDS)} separated by commas, or none "
             f"(default {{default}}: HF Trainer's and torchtitan's choice)")
    precision: str = _option("fp32", choices=DTYPES,
                             help="compute dtype (autocast; fp16 scales the loss; default {default})")
    param_dtype: str = _option(
        "fp32", choices=DTYPES,
        help="the model's parameters: {default} (default; autocast casts them per op) or the --precision dtype, "
             "with fp32 main parameters in the optimizer, sharded by --zero (Megatron's distributed optimizer: 6 + "
             "12/dp bytes a parameter at --zero 1)")
    grad_dtype: str = _option(
        "fp32", choices=DTYPES,
        help="with --param-dtype bf16/fp16: gradients accumulate over microbatches and are reduced in {default} "
             "(default, Megatron's) or in the parameters' dtype (2 bytes a parameter less, the ZeRO paper's; the "
             "sums round in bf16)")
    clip_grad: float | None = _option(
        None, _optional(POSITIVE), type=positive_float, metavar="MAX_NORM",
        help="clip the whole model's gradient norm (over every rank) to MAX_NORM (default: no clipping)")
    post_validate: bool = _option(  # steps overlap: the checks after the optimizer step (post_validate.py)
        False, FLAG,
        help="steps overlap: each rank steps its optimizer when its part of the step ends and the global checks "
             "(gradient norm, inf/NaN) complete in the next step, which redoes the step when they fail (the "
             "weights equal synchronous steps'); the loss is logged one step late")
    lr_schedule: str = _option(
        "constant", choices=LR_SCHEDULES,
        help="after --warmup-steps of linear warmup: constant (default {default}), a cosine or a linear decay to "
             "--min-lr at --steps, or wsd (warmup-stable-decay: constant, then linear to --min-lr over the last "
             "--decay-steps)")
    warmup_steps: int = _option(0, _at_least(0), type=nonnegative_int, metavar="N",
                                help="linear learning-rate warmup over the first N steps (default {default})")
    min_lr: float = _option(0.0, NONNEGATIVE, type=nonnegative_float,  # where cosine, linear and wsd decay to
                            help="the learning rate cosine, linear and wsd decay to (default {default})")
    decay_steps: int = _option(  # wsd's final decay; 0: a tenth of the steps after the warmup
        0, _at_least(0), type=nonnegative_int, metavar="N",
        help="wsd: the final decay's steps (default: a tenth of those after the warmup)")
    recompute: str = _option(
        "none", choices=RECOMPUTES,
        help="activation recomputation per stage: keep only the stage input (full) or recompute the attention "
             "modules (selective); default {default}")
    loss_reduction: str | None = _option(  # see TrainConfig's
        None, choices=LOSS_REDUCTIONS,
        help="mean loss per microbatch, averaged, or the mean over every non-padding token of the global batch "
             "(token); default: token with --model, microbatch for the GPT")
    threads: int = _option(1, _at_least(1), type=positive_int, help="torch threads per rank (default {default})")

    @property
    def state_bytes(self) -> Any:
        """The bytes a parameter's model states take in this run (its dtypes, AdamW): `plan.memory.StateBytes`,
        what the launcher's memory checks and `--schedule auto`'s room count with."""
        from pipedsl.plan.memory import state_bytes

        return state_bytes(self.param_dtype, self.grad_dtype, "adamw")


@dataclass(frozen=True)
class EvalConfig(_Section):
    """[eval]: when and how much held-out data is evaluated (a Hugging Face model's)."""

    eval_every: int = _option(  # 0: only after the last step
        0, _at_least(0), type=nonnegative_int, metavar="N",
        help="evaluate held-out loss and perplexity every N steps and after the last (default: only after the last)")
    eval_batches: int = _option(  # spread over the held-out set; 0: all of them
        20, _at_least(0), type=nonnegative_int, metavar="N",
        help="held-out global batches an evaluation runs, spread over the held-out set (default {default}; 0: all "
             "of them)")


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    """[checkpoint]: where and how often to save, and what to resume from."""

    checkpoint_dir: str | None = _option(None, _optional(TEXT), metavar="DIR",
                                         help="write checkpoints under DIR/step-NNNNNNNN/")
    checkpoint_every: int = _option(  # 0: only after the last step
        0, _at_least(0), type=nonnegative_int, metavar="N",
        help="checkpoint every N steps (default: only after the last step)")
    resume: str | None = _option(  # "latest" in checkpoint_dir, or a checkpoint
        None, _optional(TEXT), nargs="?", const="latest", metavar="CHECKPOINT",
        help="continue from the latest complete checkpoint in --checkpoint-dir (none: start fresh), or from the "
             "given checkpoint directory")
    overwrite: bool = _option(  # a new run may remove another run's checkpoints from checkpoint_dir
        False, FLAG,
        help="without --resume: remove another run's checkpoints from --checkpoint-dir and start over (a run into a "
             "directory holding them is refused otherwise)")
    keep_checkpoints: int = _option(  # the newest N complete checkpoints stay; 0: every one
        0, _at_least(0), type=nonnegative_int, metavar="N",
        help="keep the newest N complete checkpoints, removing older ones after each save (default 0: keep every "
             "one)")


@dataclass(frozen=True)
class LoggingConfig(_Section):
    """[logging]: the output folder and the loggers beside metrics.jsonl."""

    out: str | None = _option(  # None: no files, the console only
        None, _optional(TEXT), short="-o",
        help="directory for metrics.jsonl, timeline.json, losses.json (default {default})")
    tensorboard: str | None = _option(
        None, _optional(TEXT), metavar="DIR",
        help="also write TensorBoard event files, to DIR/NAME with NAME the output directory's (-o) name: runs "
             "sharing DIR show side by side")
    wandb: str | None = _option(None, _optional(TEXT), metavar="PROJECT",
                                help="also log to Weights & Biases (offline unless WANDB_MODE says)")
    peak_tflops: float | None = _option(  # None: a datasheet's, or measured
        None, _optional(POSITIVE), type=positive_float, metavar="X",
        help="peak TFLOP/s of one device for MFU (default: a known GPU's datasheet, or measured on a CPU)")
    log_every: int = _option(  # steps between metric records (the first and the last always)
        1, _at_least(1), type=positive_int, metavar="N",
        help="record the metrics every N steps (and the first and the last; default {default})")


@dataclass(frozen=True)
class RunConfig(_Section):
    """[run]: how long the processes may take, and whether to start more than the machine holds."""

    timeout: float = _option(
        120.0, *TIMEOUT, type=positive_float,
        help="seconds before a silent rank counts as failed (process group; default {default})")
    checkpoint_timeout: float | None = _option(
        None, _optional(POSITIVE), WITHIN_A_YEAR, type=positive_float, metavar="SECONDS",
        help="seconds to wait for the other ranks' checkpoint parts (default: --timeout)")
    join_timeout: float = _option(
        3600.0, *TIMEOUT, type=positive_float,
        help="seconds the whole run may take before its processes are killed (default {default})")
    allow_oversubscribe: bool = _option(
        False, FLAG, help="start more local processes, threads or model memory than this machine sensibly holds")
    max_time: float | None = _option(  # stop (and save) before this
        None, _optional(POSITIVE), WITHIN_A_YEAR, type=positive_float, metavar="SECONDS",
        help="stop before the run has taken SECONDS (from the command's start), saving a checkpoint with "
             "--checkpoint-dir; --resume continues it")
    stop_timeout: float = _option(  # after a stop signal: to end the step and save
        120.0, *TIMEOUT, type=positive_float, metavar="SECONDS",
        help="after SIGTERM, SIGINT or SIGHUP the ranks finish their step and save a checkpoint (with "
             "--checkpoint-dir); killed if that takes longer than SECONDS (default {default}; a second signal "
             "kills at once)")

    @property
    def save_timeout(self) -> float:
        """Seconds a checkpoint save waits for the other ranks' parts."""
        return self.checkpoint_timeout or self.timeout


SECTION_TYPES: dict[str, type[_Section]] = {
    "model": ModelConfig, "data": DataConfig, "schedule": ScheduleConfig, "parallel": ParallelismConfig,
    "training": TrainingConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
    "run": RunConfig}
SECTIONS: dict[str, tuple[str, ...]] = {name: tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
                                        for name, cls in SECTION_TYPES.items()}
SECTION_OF: dict[str, str] = {key: section for section, keys in SECTIONS.items() for key in keys}
FIELDS: dict[str, Field] = {f.name: f for cls in SECTION_TYPES.values() for f in fields(cls)}  # type: ignore[arg-type]
# the options only one model source reads (`render` prints the chosen one's): the built-in GPT's shape and
# synthetic padding; a Hugging Face model's attention, its data (all of [data] but seq and pad_fraction) and [eval]
GPT_ONLY: tuple[str, ...] = ("layers", "embd", "dropout", "experts", "top_k", "capacity_factor", "pad_fraction")
HF_ONLY: tuple[str, ...] = ("attn", *(k for k in SECTIONS["data"] if k not in ("seq", "pad_fraction")),
                            *SECTIONS["eval"])


@dataclass(frozen=True)
class HFModelConfig:
    """What the launcher found out about a Hugging Face model and its data (trainer/hf_setup.py), so that no
    rank looks again: the model directory, how the ranks build their stages, the tokenized caches, and the
    metadata every checkpoint carries for `pipedsl export`."""

    path: str  # the model directory, absolute
    local: bool  # each rank builds only its stages (hf_io.LocalStages); False: the whole model, then its stages
    attn: str  # the attention implementation
    split: StageCut  # where the stages are cut and what they take besides the tokens (attention mask, position ids)
    cache: str  # the token cache of --data
    eval_cache: str | None  # the token cache of --eval-data
    eval_at_end: bool  # there is a held-out batch to evaluate after the last step
    export: ExportMetadata  # what `pipedsl export` needs: saved in every checkpoint (as a plain dict)
    describe: str  # one line on the model, for the launcher's banner
    data_describe: str  # one line on the data
    seq2seq: Seq2SeqObjective | None = None  # an encoder-decoder's objective and target caches
    router_loss: bool = False  # an MoE decoder adds its router's auxiliary loss per microbatch (RouterLoss)
    experts_seen: bool = False  # its experts are modules parallel/expert.py can shard and count (is_experts)


@dataclass(frozen=True)
class TrainConfig:
    """Every option of a training run, by section, and the facts the launcher resolved before any rank starts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # resolved by the launcher: not options, not in the TOML
    hf: HFModelConfig | None = None  # with --model
    peak_flops: float | None = None  # the hardware's FLOP/s for MFU (metrics.peak_flops)
    started_at: float | None = None  # when the command started (time to the first step)

    def __post_init__(self) -> None:
        """How the options combine, checked in the order a user meets them."""
        m, d, par, t, c = self.model, self.data, self.parallel, self.training, self.checkpoint
        for name, cls in SECTION_TYPES.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"[{name}]: expected a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if par.sequence_parallel and par.tp == 1:
            raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs "
                              "--tp 2 or more")
        if par.sequence_parallel and d.seq % par.tp:
            raise ConfigError(f"--sequence-parallel: --seq {d.seq} does not divide by --tp {par.tp} (each tp rank "
                              f"holds an equal part of the sequence)")
        if par.zero_reshard == "step" and par.zero != 3:
            raise ConfigError(f"--zero-reshard {par.zero_reshard} sets when ZeRO-3 frees gathered parameters: it needs "
                              f"--zero 3 (--zero {par.zero} keeps them whole)")
        if par.dp % par.ep:
            raise ConfigError(f"--ep {par.ep} must divide --dp {par.dp}: the experts are sharded over groups of ep "
                              f"data-parallel replicas")
        if c.checkpoint_every and not c.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        if t.lr_schedule != "constant" and t.warmup_steps >= t.steps:
            raise ConfigError(f"--warmup-steps {t.warmup_steps} must be less than --steps {t.steps} for the "
                              f"{t.lr_schedule} schedule (it decays after the warmup, until --steps)")
        if t.min_lr > t.lr:
            raise ConfigError(f"--min-lr {t.min_lr:g} is above --lr {t.lr:g}: the schedule decays from --lr to it")
        if t.decay_steps and t.lr_schedule != "wsd":
            raise ConfigError(f"--decay-steps {t.decay_steps} sets the wsd schedule's final decay; this run's "
                              f"--lr-schedule is {t.lr_schedule}")
        if t.lr_schedule == "wsd" and t.decay_steps > t.steps - t.warmup_steps:
            raise ConfigError(f"--decay-steps {t.decay_steps} is more than the {t.steps - t.warmup_steps} steps after "
                              f"the warmup")
        if c.resume == "latest" and not c.checkpoint_dir:
            raise ConfigError("--resume without a checkpoint needs --checkpoint-dir (or give --resume CHECKPOINT)")
        if t.param_dtype not in ("fp32", t.precision):
            raise ConfigError(f"--param-dtype {t.param_dtype} needs --precision {t.param_dtype} (parameters are "
                              f"held in fp32 or in the compute dtype)")
        if t.grad_dtype not in ("fp32", t.param_dtype):
            raise ConfigError(f"--grad-dtype {t.grad_dtype}: gradients accumulate in fp32 or in the parameters' "
                              f"dtype (--param-dtype {t.param_dtype})")
        if m.is_hf:
            if not d.data:
                raise ConfigError("--model needs --data: text files or folders, .jsonl, .parquet or a saved dataset")
            if d.doc_mask and d.packing != "pack":
                raise ConfigError("--doc-mask keeps documents apart inside packed rows; with --packing pad every row "
                                  "is one document already")
            if (d.source_field is None) != (d.target_field is None):
                raise ConfigError("--source-field and --target-field come together: an encoder-decoder trains on "
                                  "(source, target) pairs of two fields of each record")
            if m.experts:
                raise ConfigError(f"--experts {m.experts} builds the built-in GPT's experts; a Hugging Face model "
                                  f"brings its own (its config's)")
        else:
            self._check_gpt()
        if self.hf is not None and not isinstance(self.hf, HFModelConfig):
            raise ConfigError(f"hf: expected an HFModelConfig, got {type(self.hf).__name__}")
        if self.peak_flops is not None and not (_is_number(self.peak_flops) and self.peak_flops >= 0):
            raise ConfigError(f"peak_flops {self.peak_flops!r}: must be a non-negative number of FLOP/s")

    def _check_gpt(self) -> None:
        """The built-in GPT: synthetic tokens (no --data), its heads over --embd, and Megatron's tensor-parallel
        split of its heads, width, MLP and vocabulary (models/gpt/tp.py's rule)."""
        m, d, tp = self.model, self.data, self.parallel.tp
        if d.data or d.eval_data:
            raise ConfigError("--data needs --model DIR (a Hugging Face model directory; the built-in GPT trains on "
                              "synthetic tokens)")
        if m.embd % GPT_HEADS:
            raise ConfigError(f"--embd {m.embd} must be a multiple of {GPT_HEADS} (the attention heads)")
        ep = self.parallel.ep
        if ep > 1 and not m.experts:
            raise ConfigError(f"--ep {ep} shards experts, and the GPT has none: give --experts N (a multiple of "
                              f"{ep})")
        if m.experts and m.experts % ep:
            raise ConfigError(f"--experts {m.experts} cannot be shared evenly by --ep {ep} ranks")
        if m.experts and m.top_k > m.experts:
            raise ConfigError(f"--top-k {m.top_k} is more than the {m.experts} experts")
        if m.experts and m.capacity_factor and tp > 1:
            raise ConfigError(f"--capacity-factor {m.capacity_factor:g} with --tp {tp}: each tp rank routes its share "
                              f"of the tokens, and would fill the experts' capacity with it alone; tensor "
                              f"parallelism of the GPT's experts takes a dropless router (--capacity-factor 0)")
        if tp == 1:
            return
        for what, n in (("attention heads", GPT_HEADS), ("--embd", m.embd), ("vocabulary", GPT_VOCAB)):
            if n % tp:
                raise ConfigError(f"--tp {tp}: the GPT's {what} ({n}) does not divide by {tp}")
        if m.dropout:
            raise ConfigError(f"--tp {tp} with --dropout {m.dropout}: tensor-parallel dropout needs a random stream "
                              f"per tp rank, which the layers do not keep; use --dropout 0")

    @property
    def loss_reduction(self) -> str:
        """The loss reduction the run uses: the option when given, else the model's own default.  A Hugging Face
        model on real text has padding and uneven documents, where only the mean over every token of the global
        batch is the loss of the batch (the per-microbatch mean weighs short microbatches up), except with an MoE
        router's auxiliary loss, which the model adds to each forward's mean loss; the GPT on
        synthetic tokens keeps its historical per-microbatch mean, so that its losses (and checkpoints resumed
        bit for bit) do not change.  The one place this default is decided."""
        if self.training.loss_reduction:
            return self.training.loss_reduction
        if self.hf is not None and self.hf.router_loss:  # an MoE's auxiliary loss is per microbatch, as HF's
            return "microbatch"
        return "token" if self.model.is_hf else "microbatch"

    @classmethod
    def from_options(cls, options: Mapping[str, Any], **facts: Any) -> TrainConfig:
        """From `{option: value}` (the flags' names, `clip_grad`): None or absent means the default."""
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
        for key, value in options.items():
            section = SECTION_OF.get(key.replace("-", "_"))
            if section is None:
                raise ConfigError(f"unknown option {key!r} (the options: {', '.join(SECTION_OF)})")
            if value is not None:
                by_section[section][key.replace("-", "_")] = value
        return cls(**{name: SECTION_TYPES[name](**values) for name, values in by_section.items()}, **facts)

    def for_program(self, program: Any) -> TrainConfig:
        """This configuration made concrete for `program` (a `pipedsl.Program`): its ranks and microbatches, the
        global batch (`batch = 0`: 4 sequences a microbatch and replica) and the GPT's blocks (`layers = 0`: 2 a
        stage), checked against its stages.  The launcher and every rank call it; it is idempotent."""
        M, S, dp = program.num_microbatches, program.num_stages, self.parallel.dp
        batch = self.training.batch or 4 * M * dp
        if batch % (M * dp):
            what = f"dp*M = {dp}*{M} = {dp * M}" if dp > 1 else f"M={M}"
            raise ConfigError(f"--batch {batch} does not split into {what} equal microbatches "
                              f"(use a multiple of {dp * M})")
        from pipedsl.plan.runnable import moe_tokens_refusal

        model = self.model
        tokens = moe_tokens_refusal(batch // (M * dp), self.data.seq, self.parallel.tp,
                                    self.parallel.sequence_parallel) if model.experts else None
        if tokens is not None:
            raise ConfigError(f"--experts with --tp {self.parallel.tp}: {tokens}; change --batch or --seq, or add "
                              f"--sequence-parallel")
        if not model.is_hf:
            layers = model.layers or (2 * S if model.split == "blocks" else max(2 * S - 2, 1))
            if model.split == "blocks" and layers < S:
                raise ConfigError(f"--layers {layers} --split blocks: every one of the program's {S} stages needs a "
                                  f"block")
            if layers + 2 < S:
                raise ConfigError(f"--layers {layers}: an embedding, {layers} blocks and a head make {layers + 2} "
                                  f"pieces, fewer than the program's {S} stages")
            points = split_points(model.split)
            if points is not None:
                check_points(points, layers + 2, S, f"the {layers}-block GPT")
            model = replace(model, layers=layers)
        return replace(self, model=model, training=replace(self.training, batch=batch),
                       schedule=replace(self.schedule, ranks=program.num_ranks, microbatches=M))

    def options(self) -> dict[str, Any]:
        """Every option by its name, `{"steps": 20, …}` (lists for tuples): the run's record for W&B."""
        return {key: list(v) if isinstance(v := getattr(getattr(self, section), key), tuple) else v
                for key, section in SECTION_OF.items()}


# ---------------------------------------------------------------- flags and TOML


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILE and a.option_strings}


def option_names(parser: argparse.ArgumentParser) -> set[str]:
    """The options a command takes (`pipedsl run` has no --schedule): the keys its TOML files may hold."""
    return set(_actions(parser))


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's configuration: the dataclasses' defaults (the command's own, `COMMAND_DEFAULTS`), under the
    TOML file of `--config`, under the flags given (each flag defaults to None: not given)."""
    parser: argparse.ArgumentParser | None = getattr(args, "_parser", None)
    options: dict[str, Any] = dict(COMMAND_DEFAULTS.get(getattr(args, "command", None) or "train", {}))
    chosen: dict[str, Any] = {}  # what the file and the flags set
    if getattr(args, "config", None) and parser is not None:
        chosen.update(read_file(args.config, _actions(parser)))
    chosen.update({k: v for k, v in vars(args).items() if k in SECTION_OF and v is not None})
    _check_model_source(chosen)
    return TrainConfig.from_options({**options, **chosen})


def _check_model_source(chosen: Mapping[str, Any]) -> None:
    """Options of the other model source refused by name: a run would ignore them (`--layers` under --model
    trained the directory's own number of layers without a word)."""
    hf = chosen.get("model") not in (None, "gpt")
    other = [k for k in (GPT_ONLY if hf else HF_ONLY) if k in chosen and k not in ("data", "eval_data")]
    if not other:
        return  # --data without --model has its own message (TrainConfig._check_gpt)
    flags = ", ".join(f"--{k.replace('_', '-')}" for k in other)
    if hf:
        raise ConfigError(f"{flags}: the built-in GPT's; --model {chosen['model']} brings its own (its config.json "
                          f"sets its shape): leave {'them' if len(other) > 1 else 'it'} out")
    raise ConfigError(f"{flags}: {'options' if len(other) > 1 else 'an option'} of a Hugging Face model, its data "
                      f"or its evaluation: give --model DIR (the built-in GPT trains on synthetic tokens, without "
                      f"held-out data)")


def read_file(path: str, actions: dict[str, argparse.Action]) -> dict[str, Any]:
    """A TOML file's options, `{dest: value}`, each converted and checked as its flag would be."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ConfigFileError(f"--config {path}: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigFileError(f"{path}: not valid TOML: {err}") from None
    out: dict[str, Any] = {}
    for section, key, value in _entries(path, data, actions):
        dest = key.replace("-", "_")
        out[dest] = _convert(path, section, key, value, actions[dest])
    return out


def _entries(path: str, data: dict[str, Any], actions: dict[str, argparse.Action]):
    for key, value in data.items():
        if isinstance(value, dict) and key in SECTIONS:
            for k, v in value.items():
                dest = k.replace("-", "_")
                if dest not in SECTIONS[key] or dest not in actions:
                    known = ", ".join(d.replace("_", "-") for d in SECTIONS[key] if d in actions)
                    raise ConfigFileError(f"{path}: unknown key {k!r} in [{key}] (it takes: {known})")
                yield key, k, v
        elif isinstance(value, dict):
            raise ConfigFileError(f"{path}: unknown section [{key}] (sections: {', '.join(SECTIONS)})")
        else:
            dest = key.replace("-", "_")
            if dest not in actions:
                raise ConfigFileError(f"{path}: unknown key {key!r} (not an option of pipedsl train)")
            yield None, key, value


def _convert(path: str, section: str | None, key: str, value: Any, action: argparse.Action) -> Any:
    where = f"{path}: {'[' + section + '] ' if section else ''}{key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {_show(value)}")
        return value
    if isinstance(action, argparse._AppendAction):  # -p NAME=VALUE: a table or a list of strings
        if isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigFileError(f"{where}: expected a table {{NAME = INTEGER}} or a list of \"NAME=VALUE\" strings")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_scalar(where, v, action) for v in items]
    if value is None:
        return None
    return _scalar(where, value, action)


def _scalar(where: str, value: Any, action: argparse.Action) -> Any:
    kind = action.type
    if isinstance(value, (dict, list, bool)):
        raise ConfigFileError(f"{where}: expected {_expected(action)}, got {_show(value)}")
    if kind is None or kind is str:
        if not isinstance(value, str):
            raise ConfigFileError(f"{where}: expected a string, got {_show(value)}")
        converted: Any = value
    else:
        if isinstance(value, str) and _numeric(action):
            raise ConfigFileError(f"{where}: expected {_expected(action)}, got the string {value!r}")
        try:
            converted = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError) as err:
            raise ConfigFileError(f"{where}: {value!r}: {err}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigFileError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _numeric(action: argparse.Action) -> bool:
    return action.type in (int, float) or getattr(action.type, "__name__", "").startswith(
        ("positive", "nonnegative", "fraction"))


def _expected(action: argparse.Action) -> str:
    name = getattr(action.type, "__name__", "a value")
    return {"int": "an integer", "float": "a number"}.get(name, name.replace("_", " "))


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, bool) else str(value).lower()


def render(cfg: TrainConfig, keys: Collection[str] | None = None) -> str:
    """The configuration's options as TOML, by section (what `--print-config` prints); `keys`: only these
    (the command's options).  Unset options (None) and those of the other model source (`GPT_ONLY` under
    --model, `HF_ONLY` for the GPT: the run ignores them) are left out: reading the text back gives `cfg`
    again, those at their defaults, and renders the same text."""
    other = GPT_ONLY if cfg.model.is_hf else HF_ONLY
    lines: list[str] = []
    for section, names in SECTIONS.items():
        part = getattr(cfg, section)
        body = [f"{n.replace('_', '-')} = {_toml(getattr(part, n))}" for n in names
                if (keys is None or n in keys) and n not in other and getattr(part, n) is not None]
        if body:
            lines += [f"[{section}]", *body, ""]
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    # a TOML basic string: JSON's escapes are TOML's, but TOML also wants DEL escaped
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
