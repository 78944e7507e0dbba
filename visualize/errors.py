"""The one error type the renderers raise: a `PipeDSLError`, so the CLI prints it and exits 2."""

from __future__ import annotations

from pipedsl.errors import PipeDSLError


class VisualizeError(PipeDSLError):
    """A picture, trace or graph cannot be produced: unknown output type, unreadable input, …"""
