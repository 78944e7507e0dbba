"""Library warnings held back while the launcher checks a run (trainer/held_warnings.py): dropped on a refusal,
shown after the checks otherwise."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator

import pytest

from pipedsl.errors import PipeDSLError
from pipedsl.trainer.held_warnings import held


@contextlib.contextmanager
def _stderr(monkeypatch) -> Iterator[io.StringIO]:
    """One stream for what the block prints, Python's warnings and transformers' log, in the order they come."""
    tf_logging = pytest.importorskip("transformers.utils.logging")
    err = io.StringIO()
    tf_logging.get_logger()  # its handler set up, to write here
    library = logging.getLogger("transformers")
    # its own stream handler only: after other tests pytest's capture handlers sit on this logger too (they
    # would print each record again, in their own format)
    monkeypatch.setattr(library, "handlers", [h for h in library.handlers if type(h) is logging.StreamHandler])
    monkeypatch.setattr(library, "propagate", False)
    for handler in library.handlers:
        monkeypatch.setattr(handler, "stream", err)
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        sys.stderr.write(f"{category.__name__}: {message}\n"))
    with warnings.catch_warnings(), contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        yield err


def _checks(fail: BaseException | None = None) -> None:
    warnings.warn("deprecated", FutureWarning, stacklevel=1)
    logging.getLogger("transformers.configuration_utils").warning("a token id outside the vocabulary")
    print("checked", file=sys.stderr)
    if fail is not None:
        raise fail


def test_warnings_follow_checks_that_pass(monkeypatch) -> None:
    with _stderr(monkeypatch) as stderr, held(transformers=True):
        _checks()
    assert stderr.getvalue().splitlines() == ["checked", "FutureWarning: deprecated",
                                              "[transformers] a token id outside the vocabulary"]
    logging.getLogger("transformers.configuration_utils").warning("after")  # the handler is back
    assert stderr.getvalue().splitlines()[-1] == "[transformers] after"


def test_a_refusal_drops_them(monkeypatch) -> None:
    with _stderr(monkeypatch) as stderr, pytest.raises(PipeDSLError), held(transformers=True):
        _checks(PipeDSLError("refused"))
    assert stderr.getvalue().splitlines() == ["checked"]


def test_a_crash_shows_them(monkeypatch) -> None:
    """Not a refusal but a bug: what the libraries said may explain it."""
    with _stderr(monkeypatch) as stderr, pytest.raises(ZeroDivisionError), held(transformers=True):
        _checks(ZeroDivisionError("a bug"))
    assert "FutureWarning: deprecated" in stderr.getvalue().splitlines()
