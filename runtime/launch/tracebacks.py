"""The part of a failing rank's traceback that is the user's code.

A failure inside a stage runs through pipedsl's executor and stage wrappers, torch's module
call machinery and autograd before it reaches the line the user wrote; a report that shows
them all buries that line, one that shows none leaves the user guessing.  So a rank's report
keeps the frames of the user's files (their model's forward, their loss function, the loop
that called `step`), adds the innermost frame when the error was raised elsewhere (e.g. the
torch line a bad shape reached), and ends with the exception line; at most `MAX_FRAMES`
frames, each line at most `MAX_LINE` characters.  It travels between processes as text.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from types import TracebackType

MAX_FRAMES = 10
MAX_LINE = 160
MAX_MESSAGE = 400
_PACKAGES = ("pipedsl", "pipedsl.runtime", "pipedsl.parallel", "pipedsl.visualize", "torch")
# pipedsl's own model (what `pipedsl train` trains) plays the user's model there
_MODEL_FILES = (os.path.join(os.path.dirname(os.path.realpath(__file__)), "gpt.py"),)


@dataclass(frozen=True, slots=True)
class Frame:
    """One line of the call stack: where, in which function, and its source text."""

    file: str
    line: int
    function: str
    source: str
    user: bool

    def lines(self) -> list[str]:
        where = _shorten(f"{_display(self.file, self.user)}:{self.line} in {self.function}")
        return [where] + ([f"  {_shorten(self.source)}"] if self.source else [])


@dataclass(frozen=True, slots=True)
class Trace:
    """The user's frames of an exception's traceback (outermost first) and its exception line."""

    frames: tuple[Frame, ...]
    exception: str
    hidden: int = 0  # earlier user frames left out to keep the report short

    def under(self, outer: tuple[Frame, ...]) -> Trace:
        """This trace below the user's frames `outer` that led to it (e.g. their loop calling `step`)."""
        return _bounded(outer + self.frames, self.exception, self.hidden)

    def lines(self) -> list[str]:
        """The report: a header, two lines per frame, the exception line."""
        out = ["traceback, your code (most recent call last):"]
        if self.hidden:
            out.append(f"  … {self.hidden} earlier frame{'s' if self.hidden > 1 else ''}")
        for frame in self.frames:
            out += [f"  {line}" for line in frame.lines()]
        return out + [self.exception]


def trace_of(err: BaseException) -> Trace:
    """The user's part of `err`'s traceback (as far as it was unwound where this is called)."""
    return _bounded(frames_of(err.__traceback__), exception_line(err))


def frames_of(tb: TracebackType | None, innermost: bool = True) -> tuple[Frame, ...]:
    """The frames of `tb` in the user's files, and (`innermost`) the innermost frame if it is not one of them."""
    summary = traceback.extract_tb(tb)
    frames = [Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip(), _is_user(f.filename))
              for f in summary]
    kept = [f for f in frames if f.user]
    if innermost and frames and not frames[-1].user:
        kept.append(frames[-1])  # where it was raised: a torch (or pipedsl) line the user's call reached
    return tuple(kept)


def exception_line(err: BaseException) -> str:
    """`Type: message`, the message's first line, at most `MAX_MESSAGE` characters."""
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 1] + "…"


def _bounded(frames: tuple[Frame, ...], exception: str, hidden: int = 0) -> Trace:
    drop = max(0, len(frames) - MAX_FRAMES)
    return Trace(frames[drop:], exception, hidden + drop)


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 1] + "…"


@cache
def _is_user(path: str) -> bool:
    if path.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    real = os.path.realpath(path)
    if any(real.startswith(d + os.sep) for d in _library_dirs()):
        return real in _MODEL_FILES
    in_stdlib = any(real.startswith(d + os.sep) for d in _stdlib_dirs())
    return not in_stdlib or "site-packages" in real  # a package installed beside the stdlib is not the stdlib


def _display(path: str, user: bool) -> str:
    """A user's file relative to the working directory when inside it; a library's from its package."""
    real = os.path.realpath(path)
    if user:
        cwd = os.getcwd()
        return os.path.relpath(real, cwd) if real.startswith(cwd + os.sep) else path
    for d in _library_dirs():
        if real.startswith(d + os.sep):
            return os.path.join(os.path.basename(d), os.path.relpath(real, d))
    return path


@cache
def _library_dirs() -> tuple[str, ...]:
    """pipedsl's package directories and torch's."""
    dirs: list[str] = []
    for name in _PACKAGES:
        spec = find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += [os.path.realpath(d) for d in spec.submodule_search_locations]
    return tuple(dirs)


@cache
def _stdlib_dirs() -> tuple[str, ...]:
    return tuple({os.path.realpath(sysconfig.get_paths()["stdlib"]), os.path.realpath(os.path.dirname(os.__file__))})
