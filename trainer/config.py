"""`pipedsl train --config run.toml`: every option of the command in one TOML file, flags on top.

    [model]
    model = "examples/llama-tiny"
    [data]
    data = ["docs/"]
    seq = 128
    [training]
    steps = 200
    precision = "bf16"

Each key is a command-line option's name (`clip-grad` or `clip_grad`), in the section that
groups it (`SECTIONS`) or at the top level.  The file is checked as strictly as the flags: an
unknown key names its section and the keys that section takes, a value of the wrong type or
out of range names the key and what it expected — one line, exit status 2, before anything
starts.  A flag given on the command line wins over the file (torchtitan's rule); `--print-config`
prints the resolved configuration as TOML and exits, so `pipedsl train … --print-config >
run.toml` writes a file that reproduces the run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import tomllib

from pipedsl.errors import PipeDSLError

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "attn", "layers", "embd", "split", "dropout", "seed"),
    "data": ("data", "eval_data", "text_field", "seq", "packing", "doc_mask", "eval_fraction", "cache_dir",
             "pad_fraction"),
    "schedule": ("schedule", "ranks", "microbatches", "param"),
    "parallel": ("dp", "zero", "tp", "sequence_parallel"),
    "training": ("steps", "batch", "lr", "weight_decay", "precision", "param_dtype", "grad_dtype", "clip_grad",
                 "lr_schedule", "warmup_steps", "recompute", "loss_reduction", "threads"),
    "eval": ("eval_every", "eval_batches"),
    "checkpoint": ("checkpoint_dir", "checkpoint_every", "resume"),
    "logging": ("out", "tensorboard", "wandb", "peak_tflops", "log_every"),
    "run": ("timeout", "checkpoint_timeout", "join_timeout", "allow_oversubscribe"),
}
NOT_IN_FILE = ("config", "print_config", "help")


class ConfigError(PipeDSLError):
    kind = "config error"


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILE and a.option_strings}


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The options given on the command line (they win over the file)."""
    given: set[str] = set()
    for action in _actions(parser).values():
        for opt in action.option_strings:
            for arg in argv:
                if arg == opt or (opt.startswith("--") and arg.startswith(opt + "=")) or \
                        (not opt.startswith("--") and arg.startswith(opt) and len(arg) > len(opt)):
                    given.add(action.dest)
    return given


def apply_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Fill `args` from `args.config` (a TOML file) wherever the command line gave no flag."""
    path = args.config
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    actions = _actions(parser)
    given = explicit_dests(parser, argv)
    for section, key, value in _entries(path, data, actions):
        dest = key.replace("-", "_")
        if dest not in given:
            setattr(args, dest, _convert(path, section, key, value, actions[dest]))


def _entries(path: str, data: dict[str, Any], actions: dict[str, argparse.Action]):
    for key, value in data.items():
        if isinstance(value, dict) and key in SECTIONS:
            for k, v in value.items():
                dest = k.replace("-", "_")
                if dest not in SECTIONS[key] or dest not in actions:
                    known = ", ".join(d.replace("_", "-") for d in SECTIONS[key] if d in actions)
                    raise ConfigError(f"{path}: unknown key {k!r} in [{key}] (it takes: {known})")
                yield key, k, v
        elif isinstance(value, dict):
            raise ConfigError(f"{path}: unknown section [{key}] (sections: {', '.join(SECTIONS)})")
        else:
            dest = key.replace("-", "_")
            if dest not in actions:
                raise ConfigError(f"{path}: unknown key {key!r} (not an option of pipedsl train)")
            yield None, key, value


def _convert(path: str, section: str | None, key: str, value: Any, action: argparse.Action) -> Any:
    where = f"{path}: {'[' + section + '] ' if section else ''}{key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_show(value)}")
        return value
    if isinstance(action, argparse._AppendAction):  # -p NAME=VALUE: a table or a list of strings
        if isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a table {{NAME = INTEGER}} or a list of \"NAME=VALUE\" strings")
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
        raise ConfigError(f"{where}: expected {_expected(action)}, got {_show(value)}")
    if kind is None or kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_show(value)}")
        converted: Any = value
    else:
        if isinstance(value, str) and _numeric(action):
            raise ConfigError(f"{where}: expected {_expected(action)}, got the string {value!r}")
        try:
            converted = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError) as err:
            raise ConfigError(f"{where}: {value!r}: {err}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _numeric(action: argparse.Action) -> bool:
    return action.type in (int, float) or getattr(action.type, "__name__", "").startswith(
        ("positive", "nonnegative", "fraction"))


def _expected(action: argparse.Action) -> str:
    name = getattr(action.type, "__name__", "a value")
    return {"int": "an integer", "float": "a number"}.get(name, name.replace("_", " "))


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, bool) else str(value).lower()


def render(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The resolved configuration as TOML, by section (what `--print-config` prints)."""
    actions = _actions(parser)
    lines: list[str] = []
    for section, dests in SECTIONS.items():
        body = [f"{d.replace('_', '-')} = {_toml(getattr(args, d))}" for d in dests
                if d in actions and getattr(args, d, None) is not None]
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
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
