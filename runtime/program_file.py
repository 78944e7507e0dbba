"""`read_program(path)`: a compiled program from a file (JSON, CSV or text), validated before anything runs.

The format follows the suffix (`.json`, `.csv`, `.txt`); otherwise the content decides (`{` is
JSON, a `rank,index,…` header is CSV, anything else the text form).  A `.csv` whose first cell
is a torch action (`0F0`) is torch.distributed.pipelining's CSV schedule (pipedsl.torch_csv).  Every problem — an
unreadable file, malformed content, an unsafe program, the wrong number of ranks — is one
`PipeDSLError` whose message starts with the file name.  Torch-free (the CLI uses it before
starting processes).
"""

from __future__ import annotations

import os
from pathlib import Path

from pipedsl.errors import PipeDSLError, ValidationError
from pipedsl.ir import Program
from pipedsl.limits import MAX_PROGRAM_BYTES, read_bounded
from pipedsl.torch_csv import from_torch_csv
from pipedsl.validate import validate

FORMATS = {".json": "json", ".csv": "csv", ".txt": "text", ".text": "text"}


def read_program(path: str | os.PathLike, ranks: int | None = None) -> Program:
    """The validated program in `path`; with `ranks`, it must have exactly that many ranks."""
    name = str(path)
    p = Path(path)
    if p.suffix == ".pipe":
        raise PipeDSLError(f"{name} is a schedule source, not a compiled program: use it with "
                           f"--schedule (or compile it: pipedsl compile {name} -P … -M … --format json)")
    # never a FIFO or /dev/zero (it may not end), never more than MAX_PROGRAM_BYTES
    text = read_bounded(p, MAX_PROGRAM_BYTES, "a program file (MAX_PROGRAM_BYTES)")
    fmt = FORMATS.get(p.suffix.lower()) or _sniff(text)
    try:
        if fmt == "json":
            program = Program.from_json(text)
        elif fmt == "csv" and _is_torch_csv(text):
            program = from_torch_csv(text, name=p.stem)
        elif fmt == "csv":
            program = Program.from_csv(text, name=p.stem)
        else:
            program = Program.from_text(text, name=p.stem)
        validate(program)
    except ValidationError as err:
        raise type(err)(f"{name}: {err.message}", notes=err.notes) from None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as err:  # belt, braces
        raise ValidationError(f"{name}: malformed {fmt} program: {type(err).__name__}: {err}") from None
    if ranks is not None and ranks != program.num_ranks:
        raise PipeDSLError(f"{name}: the program has {program.num_ranks} rank(s), but {ranks} were asked for "
                           f"(it must run on exactly {program.num_ranks} processes)")
    return program


def _is_torch_csv(text: str) -> bool:
    first = text.lstrip().split("\n", 1)[0].split(",", 1)[0].strip()
    return bool(first) and (first[0].isdigit() or first.startswith("(")) and not first.isdigit()


def _sniff(text: str) -> str:
    head = text.lstrip()
    if head.startswith(("{", "[")):
        return "json"
    if head.split("\n", 1)[0].replace(" ", "").startswith("rank,index,"):
        return "csv"
    return "text"
