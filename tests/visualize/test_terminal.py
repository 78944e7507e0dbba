"""The terminal grid.  Expected texts are written by hand from each schedule's definition
(orders, warmup, F=1, B=2, I=W=1), not copied from the renderer's output."""

from __future__ import annotations

import io

import pytest
from vis_support import ONE_F_ONE_B_3_PER_UNIT, simulated

from pipedsl.ir import Instr, Op
from pipedsl.timeline import Event, Timeline
from pipedsl.visualize.terminal import layout, print_timelines, render_text


def test_1f1b_golden():
    assert render_text(simulated("1f1b", 2, 2), width=32) == ONE_F_ONE_B_3_PER_UNIT


def test_gpipe_golden():
    # All forwards then all backwards.  r0: F0 [0,1] F1 [1,2] B0 [5,7] B1 [7,9];
    # r1: F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7].  Both ranks hold 2 activations.
    assert render_text(simulated("gpipe", 2, 2), width=32) == """\
GPipe  P=2 M=2
r0 |F0-F1-.........B0----B1----|
r1 |...F0-F1-B0----B1----......|
    0                         9
makespan 9  bubble 33.3%  peak activations 2 2
F forward  B backward  (number = microbatch)  . idle
"""


def test_narrow_boxes_keep_the_op_letter_and_drop_the_number():
    # One column per time unit: a forward is one cell ("F"), a backward two ("B0").
    assert render_text(simulated("1f1b", 2, 2), width=14).splitlines()[1:4] == [
        "r0 |FF..B0.B1|",
        "r1 |.FB0FB1..|",
        "    0       9",
    ]


def test_split_backward_golden(pipes):
    # Rank 0 (wlag 0): F0 F1 I0 W0 I1 W1; rank 1 (wlag 1): F0 I0 F1 I1 W0 W1.
    # r1: F0 [1,2] I0 [2,3] F1 [3,4] I1 [4,5] W0 [5,6] W1 [6,7]
    # r0: F0 [0,1] F1 [1,2] I0 [3,4] W0 [4,5] I1 [5,6] W1 [6,7]      makespan 7, busy 6 + 6 of 14.
    # Activations live from F to W: both ranks hold two.
    assert render_text(simulated(pipes["split"], 2, 2), width=26) == """\
Split  P=2 M=2
r0 |F0-F1-...I0-W0-I1-W1-|
r1 |...F0-I0-F1-I1-W0-W1-|
    0                   7
makespan 7  bubble 14.3%  peak activations 2 2
F forward  I input grad  W weight grad  (number = microbatch)  . idle
"""


def test_interleaved_chunks_fill_differently(pipes):
    # P=2, M=2, V=2: rank 0 holds stages 0 (chunk 0) and 2 (chunk 1), rank 1 stages 1 and 3.
    # Forward order (m/P, v, m%P): F0 F1 of chunk 0, then of chunk 1.  Backward order puts chunk 1
    # first.  Warmup: rank 0 min(2 + 2, 4) = 4, rank 1 min(2 + 0, 4) = 2.
    # r0: F0.0 [0,1] F1.0 [1,2] F0.2 [2,3] F1.2 [3,4] B0.2 [6,8] B1.2 [9,11] B0.0 [11,13] B1.0 [13,15]
    # r1: F0.1 [1,2] F1.1 [2,3] F0.3 [3,4] B0.3 [4,6] F1.3 [6,7] B1.3 [7,9] B0.1 [9,11] B1.1 [11,13]
    assert render_text(simulated(pipes["interleaved"], 2, 2), width=50) == """\
Interleaved  P=2 M=2 V=2
r0 |F0-F1-F0=F1=......B0====...B1====B0----B1----|
r1 |...F0-F1-F0=B0====F1=B1====B0----B1----......|
    0                                          15
makespan 15  bubble 20.0%  peak activations 4 3
F forward  B backward  (number = microbatch; - chunk 0, = chunk 1)  . idle
"""


def test_replica_one_is_lowercase(pipes):
    # Microbatch 0 runs down (stage s on rank s), microbatch 1 up (stage s on rank 1 - s).
    # r0: F0.0 [0,1]  F1.1r1 [3,4] (after r1's F1.0r1 [2,3])  B0.0 [5,7] (after r1's B0.1 [3,5])  B1.1r1 [7,9]
    # r1: F0.1 [1,2]  F1.0r1 [2,3]  B0.1 [3,5]  B1.0r1 [9,11]                makespan 11, busy 6 + 6 of 22.
    assert render_text(simulated(pipes["replicas"], 2, 2), width=27) == """\
Bidirectional  P=2 M=2
r0 |F0....f1..B0--b1--....|
r1 |..F0f1B0--........b1--|
    0                   11
makespan 11  bubble 45.5%  peak activations 2 2
F forward  B backward  (number = microbatch; lowercase = replica 1)  . idle
"""


def test_comparison_shares_one_time_scale():
    # 1F1B with M=1: r0 F0 [0,1] B0 [4,6]; r1 F0 [1,2] B0 [2,4]; drawn on the 9-unit scale of M=2.
    text = render_text([simulated("1f1b", 2, 2), simulated("1f1b", 2, 1)], width=14)
    assert text == """\
1F1B  P=2 M=2
r0 |FF..B0.B1|
r1 |.FB0FB1..|
    0       9
makespan 9  bubble 33.3%  peak activations 2 1
1F1B  P=2 M=1
r0 |F...B0...|
r1 |.FB0.....|
    0       9
makespan 6  bubble 50.0%  peak activations 1 1
F forward  B backward  (number = microbatch)  . idle
"""


def _measured() -> Timeline:
    """A hand-made measured trace (seconds on a monotonic clock that does not start at 0)."""
    t0 = 1000.0
    r0 = (Event(Instr(Op.F, 0, 0), t0, t0 + 0.002), Event(Instr(Op.SEND_F, 0, 0, 1), t0 + 0.002, t0 + 0.002),
          Event(Instr(Op.RECV_B, 0, 0, 1), t0 + 0.002, t0 + 0.006), Event(Instr(Op.B, 0, 0), t0 + 0.006, t0 + 0.010))
    r1 = (Event(Instr(Op.RECV_F, 0, 1, 0), t0, t0 + 0.002), Event(Instr(Op.F, 0, 1), t0 + 0.002, t0 + 0.004),
          Event(Instr(Op.B, 0, 1), t0 + 0.004, t0 + 0.006), Event(Instr(Op.SEND_B, 0, 1, 0), t0 + 0.006, t0 + 0.006))
    return Timeline("run", {"P": 2, "M": 1}, (r0, r1), "measured")


def test_measured_timeline_in_milliseconds_from_its_own_start():
    # 10 ms on 10 columns: one column per millisecond.
    assert render_text(_measured(), width=15).splitlines()[1:5] == [
        "r0 |F0....B0--|",
        "r1 |..F0B0....|",
        "    0    10 ms",
        "makespan 10 ms  bubble 50.0%  peak activations 1 1"  # busy 6 + 4 of 20 ms,
    ]


def test_layout_never_overlaps_and_keeps_short_boxes():
    timeline = simulated("1f1b", 8, 32)
    for columns in (10, 37, 80, 351):
        for segments in layout(timeline, columns):
            assert all(0 <= s.start < s.end <= columns for s in segments)
            assert all(a.end <= b.start for a, b in zip(segments, segments[1:]))
    # With room to spare, every compute op gets its own box.
    assert [len(s) for s in layout(timeline, 351)] == [64] * 8


def test_plain_text_when_not_a_terminal():
    out = io.StringIO()
    print_timelines(simulated("1f1b", 2, 2), stream=out, width=32)
    assert out.getvalue() == ONE_F_ONE_B_3_PER_UNIT


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLORTERM", "truecolor")
    out = _Terminal()
    print_timelines(simulated("1f1b", 2, 2), stream=out, width=32)
    text = out.getvalue()
    assert "\x1b[" in text  # ANSI colours
    assert "48;2;78;121;167" in text  # the forward blue as a background
    lines = [line for line in text.splitlines() if line.startswith("\x1b[2mr")]
    assert len(lines) == 2  # one line per rank


@pytest.mark.parametrize("value", ["1", "yes"])
def test_no_color_gives_plain_text_on_a_terminal(monkeypatch, value):
    monkeypatch.setenv("NO_COLOR", value)
    out = _Terminal()
    print_timelines(simulated("1f1b", 2, 2), stream=out, width=32)
    assert out.getvalue() == ONE_F_ONE_B_3_PER_UNIT


def test_sixteen_colour_terminals_get_distinct_standard_colours(monkeypatch):
    # Downsampled, the picture's blue and green would both turn grey: use named ANSI colours instead.
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("COLORTERM", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    out = _Terminal()
    print_timelines(simulated("gpipe", 2, 2), stream=out, width=32)
    text = out.getvalue()
    assert "\x1b[37;44mF0" in text and "\x1b[37;42mB0" in text  # white on blue, white on green
    assert "48;2;" not in text
