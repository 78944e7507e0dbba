"""The planner's units: a number prints in the unit that fits it, a column in the unit of its largest value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipedsl.plan.units import BYTES, COUNT, FLOPS, SECONDS, column, scaled


@pytest.mark.parametrize(("value", "units", "text"), [
    (18.4e9, COUNT, "18.4 B"), (1.2e6, COUNT, "1.20 M"), (350e3, COUNT, "350 k"), (42, COUNT, "42.0"),
    (80e9, BYTES, "80.0 GB"), (1.8e6, BYTES, "1.80 MB"), (999.6e6, BYTES, "1.00 GB"), (999.4e6, BYTES, "999 MB"),
    (312e12, FLOPS, "312 TFLOP/s"), (36e9, FLOPS, "36.0 GFLOP/s"),
    (9.52, SECONDS, "9.52 s"), (0.0123, SECONDS, "12.3 ms"), (2.37e-5, SECONDS, "23.7 µs"),
    (0, SECONDS, "0 s"), (0, BYTES, "0 B"), (3e-12, SECONDS, "0.00 ns"),
])
def test_a_value_takes_the_unit_that_fits_it(value, units, text):
    assert scaled(value, units) == text


@given(st.floats(1e-3, 1e18), st.sampled_from([COUNT, BYTES, FLOPS]))
def test_three_significant_digits_within_rounding(value, units):
    text = scaled(value, units)
    number, _, name = text.partition(" ")
    size = dict(units)[name]
    shown = float(number)
    assert math.isclose(shown * size, value, rel_tol=0.006) or value < units[-1][1]  # below the smallest unit
    if units[-1][1] <= value < units[0][1] * 999:
        assert 1 <= shown < 1000 and len(number.replace(".", "").lstrip("0")) == 3, text


def test_a_column_takes_the_unit_of_its_largest_value():
    assert column([2.37e-5, 2.6e-5, 0.0], SECONDS) == ("µs", ["23.7", "26.0", "0.0"])
    assert column([1.8e6, 400e3], BYTES) == ("MB", ["1.80", "0.40"])
    assert column([64e9, 9.39e9, 0.0587e9], BYTES) == ("GB", ["64.0", "9.4", "0.1"])  # decimals of the largest
    assert column([0.0, 0.0], SECONDS) == ("s", ["0", "0"])
