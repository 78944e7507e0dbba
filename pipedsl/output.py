"""Output files written so that a stopped or failing command never leaves a half-written one.

Each file is written beside its destination under a temporary name and renamed into place once
complete (`os.replace` is atomic on POSIX): a SIGTERM, a crash or a full disk mid-write leaves the
previous file as it was.  The temporary name keeps the real suffix, for writers that choose the
format by it (matplotlib, graphviz).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields the temporary path to write; on success it becomes `path`, on any failure it is removed."""
    path = Path(path)
    if not path.name:  # '', '.', '/': a directory, as the plain write would say (callers report OSErrors)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """`Path(path).write_text(text)`, all or nothing."""
    with replacing(path) as tmp:
        tmp.write_text(text)
