"""One error hierarchy for everything pipedsl reports, each error saying *where*.

Source errors carry a `Span` and render as ``file:line:col: error: …`` followed by the
offending line and a caret; program errors name the rank and instruction index.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a `.pipe` source: 1-based line and column of its start (and end)."""

    file: str
    line: int
    column: int
    end_line: int = 0
    end_column: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class PipeDSLError(Exception):
    """Base of every error pipedsl raises on purpose."""

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, source: str | None = None,
                 notes: tuple[str, ...] = ()) -> None:
        self.message = message
        self.span = span
        self.source = source
        self.notes = tuple(notes)
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.span}: {self.kind}: {self.message}" if self.span else f"{self.kind}: {self.message}"
        lines = [head]
        if self.span is not None and self.source is not None:
            lines += _excerpt(self.source, self.span)
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def with_source(self, source: str) -> PipeDSLError:
        """Attach the text the span points into (for the caret excerpt)."""
        if self.source is None:
            self.source = source
            self.args = (self.render(),)
        return self


class PipeSyntaxError(PipeDSLError):
    """The text of a `.pipe` file does not follow the grammar."""

    kind = "syntax error"


class PipeSemanticError(PipeDSLError):
    """A well-formed schedule that means something impossible (types, ranges, requirements)."""


class ValidationError(PipeDSLError):
    """A lowered program breaks an invariant: completeness, placement, dependencies, order."""

    kind = "invalid program"


class DeadlockError(ValidationError):
    """The ranks of a program wait on each other in a cycle."""

    kind = "deadlock"


class PipeRuntimeError(PipeDSLError):
    """A failure while executing a program on real processes."""

    kind = "runtime error"


def _excerpt(source: str, span: Span) -> list[str]:
    text_lines = source.splitlines()
    if not 1 <= span.line <= len(text_lines):
        return []
    text = text_lines[span.line - 1].expandtabs(1)
    gutter = f"{span.line:>4} | "
    width = 1
    if span.end_line == span.line and span.end_column > span.column:
        width = span.end_column - span.column
    column = span.column
    if len(text) > _EXCERPT:  # a window of a very long line around the column
        first = max(0, min(column - 1 - _EXCERPT // 2, len(text) - _EXCERPT))
        text = ("…" if first else "") + text[first:first + _EXCERPT] + ("…" if first + _EXCERPT < len(text) else "")
        column -= first - (1 if first else 0)
    width = max(1, min(width, len(text) - column + 1))
    caret = " " * (len(gutter) - 2) + "| " + " " * (column - 1) + "^" * width
    return [gutter + text, caret]


_EXCERPT = 100  # characters of a source line shown


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message as one line of at most `limit` characters (its type's name if it has none), for
    refusals that quote what a library raised."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
