"""Library warnings held back while the launcher checks a run, so that a refusal is the first line a user reads.

transformers and torch warn while the launcher reads a model (a token id outside the vocabulary, a deprecated
argument): printed as they come, they stood above the one-line refusal that followed.  `held()` records
Python warnings and transformers' log records (it logs what it does not warn) for the length of the
checks; a refusal (`PipeDSLError`) drops them — the refusal is what matters, and fixing it
changes them — and anything else, success or a crash, shows them afterwards, as they would have been shown.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from pipedsl.errors import PipeDSLError


class _Recorder(logging.Handler):
    def __init__(self, logger: logging.Logger, records: list[tuple[logging.Logger, logging.LogRecord]]) -> None:
        super().__init__()
        self.logger, self.records = logger, records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.logger, record))


@contextmanager
def held(transformers: bool = False) -> Iterator[None]:
    """Hold Python warnings, and with `transformers` the records of its loggers, until the block ends; drop
    them if it raises a `PipeDSLError` (a refusal), else show them then."""
    records: list[tuple[logging.Logger, logging.LogRecord]] = []
    swapped: list[tuple[logging.Logger, list[logging.Handler], bool, logging.Handler]] = []
    if transformers:
        from transformers.utils import logging as tf_logging

        root = tf_logging.get_logger()  # its handler set up now, so that the one swapped out is the one it keeps
        recorder = _Recorder(root, records)
        swapped.append((root, root.handlers, root.propagate, recorder))
        root.handlers, root.propagate = [recorder], False
    refused = False
    try:
        with warnings.catch_warnings(record=True) as seen:  # the filters as they are: only what would show is held
            try:
                yield
            except PipeDSLError:
                refused = True
                raise
    finally:
        for logger, handlers, propagate, recorder in swapped:
            added = [h for h in logger.handlers if h is not recorder and h not in handlers]
            logger.handlers, logger.propagate = [*handlers, *added], propagate
        if not refused:
            for w in seen:  # through the hook, as the warnings module shows them (they passed the filters)
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
            for logger, record in records:
                logger.handle(record)
