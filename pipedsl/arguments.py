"""Command-line arguments shared by every `pipedsl` command that names schedules and sizes."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_MICROBATCHES, MAX_NUMBER_DIGITS, MAX_RANKS, shorten

NO_DECAY_KINDS = ("biases", "norms", "embeddings")  # what weight decay may spare (parallel/weight_decay.py)


def no_decay_kinds(text: str) -> tuple[str, ...]:
    """`--no-decay`'s value: kinds of NO_DECAY_KINDS separated by commas, or "none" (decay every parameter)."""
    if text.strip() == "none":
        return ()
    kinds = tuple(k.strip() for k in text.split(","))
    if not all(k in NO_DECAY_KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not 'none' or some of {', '.join(NO_DECAY_KINDS)} "
                                         f"separated by commas")
    return tuple(dict.fromkeys(kinds))


def _number(text: str, convert: type, ok, requirement: str) -> int | float:
    """Parse `text` with `convert` and check `ok(value)`; an argparse error names `requirement`."""
    digits = text.strip().lstrip("+-").replace("_", "")
    if convert is int and len(digits) > MAX_NUMBER_DIGITS:
        raise argparse.ArgumentTypeError(f"{shorten(text, 24)} has more than {MAX_NUMBER_DIGITS} digits "
                                         f"(MAX_NUMBER_DIGITS)")
    try:
        v = convert(text)
    except ValueError:
        kind = "an integer" if convert is int else "a number"
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not {kind}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"{shorten(v)} {requirement}")
    return v


def int_in(low: int, high: int, limit: str):
    """argparse type: an integer in [low, high]; `limit` names the bound in the error (limits.py)."""
    def parse(text: str) -> int:
        return _number(text, int, lambda v: low <= v <= high, f"is not in {low:,}..{high:,} ({limit})")
    parse.__name__ = f"integer in {low:,}..{high:,}"  # what argparse calls the type in its messages
    return parse


def float_in(low: float, high: float, limit: str):
    """argparse type: a finite number in [low, high]; `limit` names the bound in the error."""
    def parse(text: str) -> float:
        return _number(text, float, lambda v: math.isfinite(v) and low <= v <= high,
                       f"is not a number in [{low:g}, {high:g}] ({limit})")
    parse.__name__ = f"number in [{low:g}, {high:g}]"
    return parse


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    return _number(text, int, lambda v: v >= 1, "must be at least 1")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer ≥ 0."""
    return _number(text, int, lambda v: v >= 0, "must not be negative")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, rates)."""
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "must be a positive, finite number")


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number ≥ 0 (weight decay)."""
    return _number(text, float, lambda v: math.isfinite(v) and v >= 0, "must be a non-negative, finite number")


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    return _number(text, float, lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")


def add_sizes(p: argparse.ArgumentParser, many: bool = False) -> None:
    """SCHEDULE -P -M [-V] [-p]; `many`: any number of schedules, sizes checked by the command (`show`)."""
    p.add_argument("schedule", nargs="*" if many else None, help="a built-in name (see `pipedsl list`) or a .pipe file")
    p.add_argument("-P", "--ranks", type=int_in(1, MAX_RANKS, "MAX_RANKS"), required=not many,
                   help=f"pipeline ranks (at most {MAX_RANKS:,})")
    p.add_argument("-M", "--microbatches", type=int_in(1, MAX_MICROBATCHES, "MAX_MICROBATCHES"), required=not many,
                   help="microbatches per step")
    p.add_argument("-V", "--chunks", type=positive_int, help="shorthand for -p V=N (chunks per rank)")
    add_param(p)


def add_steps(p: argparse.ArgumentParser) -> None:
    """--steps N: consecutive steps without a barrier between them (pipedsl/steps.py)."""
    from pipedsl.steps import MAX_STEPS

    p.add_argument("--steps", type=int_in(1, MAX_STEPS, "MAX_STEPS"), default=1,
                   help="consecutive steps of each schedule that overlap (the optimizer's checks post-validated, no "
                        "barrier between steps), proven hang-free together (default 1; a --trace is drawn as "
                        "recorded)")


def add_param(p: argparse.ArgumentParser, help: str = "a schedule parameter (repeatable)") -> None:  # noqa: A002
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE", help=help)


def parse_params(items: Sequence[str], chunks: int | None = None) -> dict[str, int]:
    """`["V=2", "W=1"]` -> `{"V": 2, "W": 1}` (`chunks`, from -V, sets V); else a `PipeDSLError`."""
    params: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            number = int(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise PipeDSLError(f"-p {shorten(item)}: expected NAME=INTEGER")
        params[name] = number
    if chunks is not None:
        params["V"] = chunks
    return params


def params_of(args: argparse.Namespace) -> dict[str, int]:
    """The schedule parameters of parsed arguments: every -p, and -V when given."""
    return parse_params(args.param, getattr(args, "chunks", None))
