"""Reading a timeline from a file: a pipedsl Timeline JSON (`Timeline.to_json`, what the runtime
tracer writes) or a Chrome trace written by `chrome_trace.write_chrome_trace`."""

from __future__ import annotations

from pathlib import Path

from pipedsl.errors import PipeDSLError
from pipedsl.limits import load_json
from pipedsl.timeline import Timeline

from .chrome_trace import from_chrome_trace
from .errors import VisualizeError


def read_timeline(path: str | Path) -> Timeline:
    """The timeline in `path`, whichever of the two formats it is; `VisualizeError` says why not."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise VisualizeError(f"cannot read trace {name}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise VisualizeError(f"cannot read trace {name}: not UTF-8 text") from None
    try:
        data = load_json(text)
    except PipeDSLError as err:
        raise VisualizeError(f"cannot read trace {name}: {err.message}") from None
    if isinstance(data, dict) and "ranks" in data:
        try:
            return Timeline.from_dict(data)
        except PipeDSLError as err:
            raise VisualizeError(f"cannot read trace {name}: {err.message}") from None
    if (isinstance(data, dict) and "traceEvents" in data) or isinstance(data, list):
        return from_chrome_trace(data, name)
    raise VisualizeError(f"cannot read trace {name}: neither a pipedsl timeline (an object with 'ranks', "
                         f"from Timeline.to_json) nor a Chrome trace (an object with 'traceEvents')")
