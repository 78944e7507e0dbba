"""Render docs/img/NAME.png for every built-in schedule at P=4, M=8 (default parameters), and
the VARIANTS below (a schedule at other sizes, shown in docs/schedules.md).

    python docs/render_images.py              # all of pipedsl.builtin_names()
    python docs/render_images.py 1f1b gpipe   # just these

Costs: F=1, B=2, and I=W=1 for split-backward schedules (pipedsl.Cost's defaults).  A schedule
that cannot be compiled at these sizes is reported and skipped (exit status 1).  Re-run it
whenever a schedule is added or changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pipedsl
from pipedsl.visualize import plot_timeline

IMG = Path(__file__).resolve().parent / "img"
P, M = 4, 8
COST = pipedsl.Cost(F=1, B=2, I=1, W=1)
# image name -> (schedule, compile arguments)
VARIANTS = {"interleaved-m6": ("interleaved", {"P": 4, "M": 6})}


def render(names: list[str] | None = None, folder: Path = IMG) -> list[str]:
    """Write folder/NAME.png for each schedule; return the names that failed."""
    folder.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names or [*pipedsl.builtin_names(), *VARIANTS]:
        schedule, sizes = VARIANTS.get(name, (name, {"P": P, "M": M}))
        try:
            timeline = pipedsl.simulate(pipedsl.load(schedule).compile(**sizes), COST)
            plot_timeline(timeline, folder / f"{name}.png")
        except pipedsl.PipeDSLError as err:
            print(f"{name}: skipped: {err.render().splitlines()[0]}", file=sys.stderr)
            failed.append(name)
            continue
        print(f"{folder / f'{name}.png'}  bubble {timeline.bubble_ratio:.1%}  makespan {timeline.makespan:g}")
    return failed


if __name__ == "__main__":
    raise SystemExit(1 if render(sys.argv[1:] or None) else 0)
