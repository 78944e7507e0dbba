"""How a rank's return value (or its error) reaches the launcher: one file per rank, written with
`torch.save`, read back with `torch.load` after the rank has exited.

Why files and not a `multiprocessing.Queue`: a queue pickles tensors as shared-memory file
descriptors that the receiver must fetch from the sender while it still runs, and a rank that
has already exited leaves `ConnectionResetError` / `BrokenPipeError` behind (issue 17).
`torch.save` copies the data itself (CUDA tensors included), keeps views of one storage
sharing it, and streams to disk, so a large state dict costs no extra pipe buffers; the file is
complete before the rank exits (written under a temporary name, then renamed).  The launcher
loads every tensor onto the CPU.  A value that cannot be pickled is reported as one line that
names the rank, where in the value it sits and its type.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

MESSAGE_LIMIT = 4000  # characters of an error message kept (a user's message could be huge)


def result_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.result"


def error_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.error"


class UnreturnableResult(Exception):  # noqa: N818 - a reason, raised and caught inside the rank
    """The rank's value cannot be pickled; the message says where in it and what type."""


def write_result(directory: str | os.PathLike, rank: int, value: Any) -> None:
    """Save `value` for the launcher (atomically), or raise `UnreturnableResult`."""
    path = result_path(directory, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(value, f)
    except Exception as err:  # noqa: BLE001 - pickling raises many types (TypeError, PicklingError, ...)
        tmp.unlink(missing_ok=True)
        where, culprit, reason = _culprit(value, "the result", err)
        kind = type(culprit)
        raise UnreturnableResult(
            f"cannot return {where} (a {kind.__module__}.{kind.__qualname__}) to the launcher: {reason}; "
            f"return tensors, numbers, strings, and lists, tuples or dicts of them") from None
    os.replace(tmp, path)


def write_error(directory: str | os.PathLike, rank: int, message: str, consequence: bool) -> None:
    """Record this rank's error for the launcher (best effort: the directory may be gone)."""
    path = error_path(directory, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT] + " …"
    try:
        tmp.write_text(json.dumps({"message": message, "consequence": consequence}))
        os.replace(tmp, path)
    except OSError:
        pass


def read_error(directory: str | os.PathLike, rank: int) -> tuple[str, bool] | None:
    """(message, consequence) the rank recorded, or None."""
    try:
        data = json.loads(error_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None
    return data["message"], bool(data["consequence"])


def has_result(directory: str | os.PathLike, rank: int) -> bool:
    return result_path(directory, rank).exists()


def read_result(directory: str | os.PathLike, rank: int) -> Any:
    """The rank's value, every tensor on the CPU; a `RuntimeError`/`Exception` if it cannot be read here."""
    with open(result_path(directory, rank), "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=False)


def _culprit(value: Any, where: str, err: Exception, depth: int = 0) -> tuple[str, Any, str]:
    """The innermost part of `value` that fails to pickle: (its path, the object, the reason)."""
    items: list[tuple[str, Any]] = []
    if depth < 20:
        if isinstance(value, dict):
            items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    for sub_where, sub in items:
        try:
            torch.save(sub, io.BytesIO())
        except Exception as sub_err:  # noqa: BLE001
            return _culprit(sub, sub_where, sub_err, depth + 1)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, pickle.PicklingError) or "pickle" in reason:
        return where, value, reason
    return where, value, f"{type(err).__name__}: {reason}"
