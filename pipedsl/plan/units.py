"""Numbers with the unit that fits their size, for the planner's output.

The same table shows a 1T-parameter model on 3,072 GPUs and a 100k-parameter GPT calibrated on
a laptop: fixed units (GB, TFLOP/s, seconds) print the small one as rows of zeros.  A column
takes the unit of its largest value, so its rows still compare at a glance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Units = tuple[tuple[str, float], ...]  # (name, size), largest first; the last one is the smallest shown

COUNT: Units = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0))
BYTES: Units = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0))
FLOPS: Units = (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("kFLOP/s", 1e3))
SECONDS: Units = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def unit_for(value: float, units: Units) -> tuple[str, float]:
    """The largest unit in which `value` shows as at least 1 (999.7 MB is 1.00 GB); zero takes the
    unit nearest to 1 (0 s, 0 B), anything below the smallest unit that one."""
    if value == 0:
        return min(units, key=lambda unit: abs(math.log10(unit[1])))
    for name, size in units:
        if abs(value) >= size * 0.9995:
            return name, size
    return units[-1]


def _decimals(largest: float) -> int:
    """Three significant digits for the largest number shown (none for zero)."""
    return 0 if largest == 0 else 2 if largest < 9.995 else 1 if largest < 99.95 else 0


def scaled(value: float, units: Units, sep: str = " ") -> str:
    """`value` in the unit that fits it, with three significant digits: 1.23 MB, 18.4B, 350 µs."""
    name, size = unit_for(value, units)
    return f"{value / size:.{_decimals(abs(value) / size)}f}{sep}{name}".rstrip()


def column(values: Sequence[float], units: Units) -> tuple[str, list[str]]:
    """One unit for a whole column (the one its largest value needs) and the values in it."""
    name, size = unit_for(max((abs(v) for v in values), default=0.0), units)
    places = _decimals(max((abs(v) / size for v in values), default=0.0))
    return name, [f"{v / size:.{places}f}" for v in values]


def add_columns(table: Any, columns: Sequence[tuple[str, Units | None, Callable[[Any], Any]]],
                rows: Sequence[Any]) -> list[list[str]]:
    """One right-aligned column of `table` (a rich Table) per (heading, units or None, value of a row): a column
    with units takes the one its largest value needs, in its heading's `{}`; returns the columns' cells."""
    shown = []
    for head, units, value in columns:
        values = [value(r) for r in rows]
        if units is not None:
            unit, values = column(values, units)
            head = head.format(unit)
        table.add_column(head, justify="right")
        shown.append(values)
    return shown
