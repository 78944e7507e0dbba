"""Finding schedules: a built-in name (`schedules/NAME.pipe`, shipped as package data) or a path."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from pipedsl.compiler import Schedule
from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_SOURCE_BYTES, read_bounded, shorten


def _builtin_dir():
    return resources.files("pipedsl.schedules")


def builtin_names() -> list[str]:
    """Names of the shipped schedules, sorted."""
    return sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".pipe"))


def load(name_or_path: str | Path) -> Schedule:
    """A built-in schedule by name (`"1f1b"`), or a `.pipe` file by path."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if text_name in builtin_names():
        res = _builtin_dir() / f"{text_name}.pipe"
        return Schedule.from_text(res.read_text(encoding="utf-8"), f"schedules/{text_name}.pipe")
    if path.suffix == ".pipe" or os.path.exists(path):  # False, not OSError, for a name too long to be a path
        return Schedule.from_text(read_bounded(path, MAX_SOURCE_BYTES, "a .pipe source (MAX_SOURCE_BYTES)"), text_name)
    raise PipeDSLError(f"no schedule named {shorten(text_name)} and no such file "
                       f"(built-in: {', '.join(builtin_names())})")
