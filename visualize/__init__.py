"""pipedsl.visualize: look at timelines and programs.

- `plot_timeline` / `plot_timelines` — SVG / PNG / PDF pictures (matplotlib, headless)
- `render_text` / `print_timelines` — the terminal grid (plain text or rich colours)
- `to_chrome_trace` / `write_chrome_trace` / `from_chrome_trace` — Perfetto / chrome://tracing
- `read_timeline` — a Timeline JSON or a Chrome trace from a file
- `dependency_graph` / `write_graph` — the graphviz dependency graph of a program

The CLI front end is `pipedsl show` (`pipedsl.visualize.show`).  Names are imported on first
use, so importing this package does not pull in matplotlib.
"""

from __future__ import annotations

from pipedsl.registry import lazy_attributes

_EXPORTS = {
    "plot_timeline": "timeline_plot",
    "plot_timelines": "timeline_plot",
    "render_text": "terminal",
    "render_rich": "terminal",
    "print_timelines": "terminal",
    "to_chrome_trace": "chrome_trace",
    "write_chrome_trace": "chrome_trace",
    "from_chrome_trace": "chrome_trace",
    "read_timeline": "trace_file",
    "dependency_graph": "graph",
    "write_graph": "graph",
    "VisualizeError": "errors",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
