"""Command-line arguments shared by every `pipedsl` command that names schedules and sizes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pipedsl.errors import PipeDSLError


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return v


def add_sizes(p: argparse.ArgumentParser, many: bool = False) -> None:
    """SCHEDULE -P -M [-V] [-p]; `many`: any number of schedules, sizes checked by the command (`show`)."""
    p.add_argument("schedule", nargs="*" if many else None, help="a built-in name (see `pipedsl list`) or a .pipe file")
    p.add_argument("-P", "--ranks", type=positive_int, required=not many, help="pipeline ranks")
    p.add_argument("-M", "--microbatches", type=positive_int, required=not many, help="microbatches per step")
    p.add_argument("-V", "--chunks", type=positive_int, help="shorthand for -p V=N (chunks per rank)")
    add_param(p)


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
            raise PipeDSLError(f"-p {item!r}: expected NAME=INTEGER")
        params[name] = number
    if chunks is not None:
        params["V"] = chunks
    return params


def params_of(args: argparse.Namespace) -> dict[str, int]:
    """The schedule parameters of parsed arguments: every -p, and -V when given."""
    return parse_params(args.param, getattr(args, "chunks", None))
