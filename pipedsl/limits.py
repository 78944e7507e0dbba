"""Every size limit of the language, its loaders and the cost model, in one place.

Each limit is checked *before* the work it bounds (a bounded read, a depth count on the
parse tree before any recursion, an expansion count on the AST before lambdas are built),
and the error names the limit and its value.  docs/language.md ("Limits") says why each
value was chosen; keep that table in step with this file.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from pipedsl.errors import PipeDSLError

# ---- what a schedule may compile to
MAX_COMPUTE_OPS = 500_000  # forwards per step: ~2.5M instructions, ~12 s and ~1 GB to compile
MAX_RANKS = 1_024  # pipeline ranks of one program (P ranks hold >= P stages, so P*P <= MAX_COMPUTE_OPS anyway)
MAX_MICROBATCHES = MAX_COMPUTE_OPS  # one stage, one replica: M forwards
MAX_STAGES = MAX_COMPUTE_OPS  # stages x replicas: each holds at least one forward
MAX_INSTRUCTIONS = 8 * MAX_COMPUTE_OPS  # per program file: F, B (or I + W), two messages each way, reduces
MAX_COMPUTE_STEPS = 4 * MAX_COMPUTE_OPS  # items a `compute` block may run, over all ranks together

# ---- what a .pipe source may contain
MAX_SOURCE_BYTES = 32 * 1024  # 14x the largest built-in (dualpipe.pipe, 2.3 KB); the densest 32 KiB parses in < 1 s
MAX_NESTING = 100  # levels of the syntax tree (operators, if/then/else, blocks), also with every `let` inlined
MAX_NUMBER_DIGITS = 18  # every literal < 10**18 < 2**63
MAX_VALUE_BITS = 128  # |value| < 2**128 for every value an expression computes
MAX_EXPANSION = 100_000  # syntax nodes of all expressions with every `let` inlined where it is used

# ---- loaded programs, costs, drawings
MAX_PROGRAM_BYTES = 64 * 1024 * 1024  # JSON at ~47 bytes an instruction: ~1.4M instructions, ~0.5 GB to load
MAX_COST = 1e15  # a cost (time, bytes, bandwidth) is a finite number in [0, MAX_COST]
MAX_DRAWING_COLUMNS = 10_000  # `show --width`: P rows of this many characters

# ---- the planner (`pipedsl plan`)
MAX_PLAN_GPUS = 1 << 20  # ~1M GPUs, 10x the largest cluster built; divisors are found by trial (~0.2 s)
MAX_PLAN_SIZE = 1 << 30  # layers, hidden, heads, seq, vocab, ffn, global batch: ~1e9, floats stay exact
MAX_BALANCED_LAYERS = 512  # `split="balanced"`: its exact DP is quadratic in layers (~0.3 s a stage count at 512)
MAX_PLAN_TOP = 100  # ranked rows: each one is a simulated pipeline (pruning stops at the top-th)
PLAN_RATE_RANGE = (1e-3, 1e6)  # TFLOP/s, GB, GB/s and microseconds on the command line: far beyond any GPU


def shorten(value: object, width: int = 40) -> str:
    """A caller's value for an error message, cut short: an int of a million digits, or a
    line of a megabyte, is no message (and `str` of a huge int is quadratic)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a number of {'-' if value < 0 else ''}about {int(value.bit_length() * 0.30103):,} digits"
    text = str(value) if isinstance(value, int | BaseException) else repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes; otherwise a `PipeDSLError`.

    Devices, FIFOs and directories are refused from `stat` alone, before opening (opening a
    FIFO blocks; /dev/zero never ends), and at most `limit + 1` bytes are ever read.
    """
    name = os.fspath(path)
    try:
        info = os.stat(name)
        if not stat.S_ISREG(info.st_mode):
            raise PipeDSLError(f"cannot read {name}: not a regular file")
        if info.st_size > limit:
            raise PipeDSLError(f"{name} is {info.st_size:,} bytes, over the limit of {limit:,} for {what}")
        with open(name, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise PipeDSLError(f"cannot read {name}: {err.strerror or err}") from None
    if len(data) > limit:  # it grew after stat
        raise PipeDSLError(f"{name} is over the limit of {limit:,} bytes for {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PipeDSLError(f"{name} is not UTF-8 text") from None


_DIGIT_BYTES = bytes(49 if 48 <= b <= 57 else 48 for b in range(256))  # ASCII digit -> "1", any other byte -> "0"


def _long_digit_run(text: str) -> bool:
    """Whether `text` has more than MAX_NUMBER_DIGITS ASCII digits in a row, which every integer too long
    for `load_json` has (JSON numbers are ASCII; UTF-8 never puts an ASCII byte inside another character)."""
    mask = text.encode("utf-8", "surrogatepass").translate(_DIGIT_BYTES)
    return b"1" * (MAX_NUMBER_DIGITS + 1) in mask


def load_json(text: str, what: str = "", error: type[PipeDSLError] = PipeDSLError) -> Any:
    """`json.loads` for files from anywhere: integers of at most MAX_NUMBER_DIGITS digits (Python's
    own 4,300-digit refusal would escape as a ValueError), and nesting that exhausts the decoder's
    recursion (ten thousand '[') refused.  Any failure is one `error`."""
    where = f"{what}: " if what else ""

    def bounded_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_NUMBER_DIGITS:
            raise error(f"{where}the number {shorten(digits, 24)} has more than {MAX_NUMBER_DIGITS} digits "
                        f"(MAX_NUMBER_DIGITS)")
        return int(digits)

    try:  # checking every integer costs a call each: only when some run of digits is long enough to need it
        return json.loads(text, parse_int=bounded_int if _long_digit_run(text) else None)
    except json.JSONDecodeError as err:
        raise error(f"{where}not JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except (ValueError, RecursionError) as err:
        deep = isinstance(err, RecursionError)
        raise error(f"{where}JSON nested too deep to read" if deep else f"{where}not readable JSON: "
                    f"{shorten(err, 80)}") from None
