"""Timeline pictures: parse the SVG and check what is drawn where (ids set by timeline_plot)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from vis_support import simulated

from pipedsl.ir import COMMS, COMPUTE
from pipedsl.timeline import Timeline
from pipedsl.visualize import VisualizeError
from pipedsl.visualize.timeline_plot import plot_timeline, plot_timelines

SVG = "{http://www.w3.org/2000/svg}"


def _ids(path: Path) -> dict[str, ET.Element]:
    root = ET.parse(path).getroot()
    return {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("id")}


def _with(ids: dict[str, ET.Element], prefix: str) -> list[str]:
    return [i for i in ids if i.startswith(prefix)]


def _x_range(group: ET.Element) -> tuple[float, float]:
    """Left and right edge of the rectangle path inside a group."""
    xs = [float(x) for x in re.findall(r"[ML] ([-\d.]+) [-\d.]+", group.find(f"{SVG}path").get("d"))]
    return min(xs), max(xs)


def _y_top(group: ET.Element) -> float:
    return min(float(y) for y in re.findall(r"[ML] [-\d.]+ ([-\d.]+)", group.find(f"{SVG}path").get("d")))


def _texts(path: Path) -> list[str]:
    return ["".join(t.itertext()) for t in ET.parse(path).getroot().iter(f"{SVG}text")]


@pytest.mark.parametrize("name, P, M, params", [
    ("1f1b", 4, 8, {}), ("gpipe", 3, 5, {}), ("split", 4, 6, {}), ("interleaved", 4, 8, {"V": 2}),
    ("replicas", 4, 4, {}),
])
def test_one_row_per_rank_and_one_box_per_compute_op(tmp_path, pipes, name, P, M, params):
    timeline = simulated(pipes.get(name, name), P, M, **params)
    plot_timeline(timeline, tmp_path / "t.svg")
    ids = _ids(tmp_path / "t.svg")
    assert sorted(_with(ids, "rank-0-")) == sorted(f"rank-0-{r}" for r in range(P))
    expected_boxes = {f"op-0-{r}-{e.instr}" for r, ev in enumerate(timeline.ranks) for e in ev if e.instr.op in COMPUTE}
    boxes = _with(ids, "op-")
    program_ops = sum(1 for ev in timeline.ranks for e in ev if e.instr.op in COMPUTE)
    assert len(boxes) == program_ops == len(expected_boxes)
    assert set(boxes) == expected_boxes
    messages = sum(1 for ev in timeline.ranks for e in ev if e.instr.op in COMMS)
    assert len(_with(ids, "msg-0-")) == messages


def test_boxes_sit_where_and_when_their_ops_ran(tmp_path):
    timeline = simulated("1f1b", 3, 4)
    plot_timeline(timeline, tmp_path / "t.svg")
    ids = _ids(tmp_path / "t.svg")
    # x is an affine function of time: the same scale for every box on every rank.
    first = timeline.ranks[0][0]
    x0, x1 = _x_range(ids[f"op-0-0-{first.instr}"])
    scale = (x1 - x0) / first.duration
    for r, events in enumerate(timeline.ranks):
        for e in events:
            if e.instr.op in COMPUTE:
                left, right = _x_range(ids[f"op-0-{r}-{e.instr}"])
                assert left == pytest.approx(x0 + (e.start - first.start) * scale, abs=0.01)
                assert right - left == pytest.approx(e.duration * scale, abs=0.01)
    # Rank rows go down the page in rank order, and a rank's boxes lie inside its row.
    tops = [_y_top(ids[f"rank-0-{r}"]) for r in range(3)]
    assert tops == sorted(tops)
    for r in range(3):
        box = ids[f"op-0-{r}-B3.{r}"]  # the last backward
        assert tops[r] <= _y_top(box) < (tops[r + 1] if r < 2 else float("inf"))


def test_idle_time_is_empty(tmp_path):
    # GPipe P=2 M=1: rank 0 runs F [0,1], then waits for rank 1's F and B (1..4), then B [4,6].
    timeline = simulated("gpipe", 2, 1)
    plot_timeline(timeline, tmp_path / "t.svg")
    ids = _ids(tmp_path / "t.svg")
    f_right = _x_range(ids["op-0-0-F0.0"])[1]
    b_left = _x_range(ids["op-0-0-B0.0"])[0]
    row_left, row_right = _x_range(ids["rank-0-0"])
    unit = (row_right - row_left) / 6
    assert b_left - f_right == pytest.approx(3 * unit, abs=0.01)
    boxes = [_x_range(ids[i]) for i in _with(ids, "op-0-0-")]
    assert not [b for b in boxes if b[0] < b_left - 0.01 and b[1] > f_right + 0.01]


def test_title_names_schedule_sizes_bubble_and_makespan(tmp_path, pipes):
    plot_timeline(simulated(pipes["interleaved"], 4, 8), tmp_path / "t.svg")
    texts = _texts(tmp_path / "t.svg")
    assert "Interleaved   P=4 M=8 V=2" in texts
    timeline = simulated(pipes["interleaved"], 4, 8)
    assert f"bubble {timeline.bubble_ratio:.1%}    makespan {timeline.makespan:g}" in texts
    for entry in ("F  forward", "B  backward", "chunk 0", "chunk 1", "send", "receive wait", "idle"):
        assert entry in texts


def test_legend_lists_only_kinds_present(tmp_path, pipes):
    plot_timeline(simulated(pipes["split"], 3, 3), tmp_path / "split.svg")
    texts = _texts(tmp_path / "split.svg")
    assert {"F  forward", "I  input grad", "W  weight grad"} <= set(texts)
    assert "B  backward" not in texts
    plot_timeline(simulated(pipes["replicas"], 2, 2), tmp_path / "rep.svg")
    assert "replica 1" in _texts(tmp_path / "rep.svg")


def test_readable_at_p8_m32(tmp_path):
    """Every box of 1F1B at P=8, M=32 is wide enough to carry its microbatch number."""
    timeline = simulated("1f1b", 8, 32)
    plot_timeline(timeline, tmp_path / "big.svg")
    ids = _ids(tmp_path / "big.svg")
    assert len(_with(ids, "op-0-")) == 8 * 64
    labels = _with(ids, "label-0-")
    assert len(labels) == 8 * 64
    assert "".join(ids["label-0-7-F31.7"].itertext()).strip() == "31"


def test_labels_are_dropped_when_boxes_are_too_narrow(tmp_path):
    # A 1000-unit-long step makes a forward of 1 unit a sliver: no number inside it.
    from pipedsl import Cost, load, simulate
    timeline = simulate(load("1f1b").compile(P=2, M=2), Cost(F=1, B=1000))
    plot_timeline(timeline, tmp_path / "t.svg")
    ids = _ids(tmp_path / "t.svg")
    assert "label-0-0-B0.0" in ids and "label-0-0-F0.0" not in ids


def test_comparison_stacks_panels_on_one_time_axis(tmp_path):
    a, b = simulated("gpipe", 4, 8), simulated("1f1b", 2, 3)
    plot_timelines([a, b], tmp_path / "cmp.svg")
    ids = _ids(tmp_path / "cmp.svg")
    assert len(_with(ids, "rank-0-")) == 4 and len(_with(ids, "rank-1-")) == 2
    assert len(_with(ids, "op-0-")) == 64 and len(_with(ids, "op-1-")) == 12
    # The same time unit is the same width in both panels, and both start at the same x.
    fa, fb = _x_range(ids["op-0-0-F0.0"]), _x_range(ids["op-1-0-F0.0"])
    assert fa == pytest.approx(fb, abs=0.01)
    # Each panel's idle band ends where its own timeline ends.
    assert _x_range(ids["rank-1-0"])[1] - fb[0] == pytest.approx(b.makespan * (fa[1] - fa[0]), abs=0.01)


def test_predicted_and_measured_are_labelled(tmp_path):
    predicted = simulated("1f1b", 2, 2)
    measured = Timeline(predicted.name, predicted.params, predicted.ranks, "measured")
    plot_timelines([predicted, measured], tmp_path / "cmp.svg")
    texts = _texts(tmp_path / "cmp.svg")
    assert "1F1B (simulated)   P=2 M=2" in texts and "1F1B (measured)   P=2 M=2" in texts
    assert "simulated with F 1 s, B 2 s" in texts, "the legend says what the prediction assumed (in its unit)"


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_format_follows_the_extension(tmp_path, suffix, magic):
    path = tmp_path / f"t{suffix.upper()}"
    plot_timeline(simulated("1f1b", 2, 2), path)
    assert path.read_bytes().startswith(magic)


def test_unknown_extension_and_unwritable_path_are_clear_errors(tmp_path):
    with pytest.raises(VisualizeError, match=r"unknown extension '\.gif'.*\.png, \.svg, \.pdf"):
        plot_timeline(simulated("1f1b", 2, 2), tmp_path / "t.gif")
    with pytest.raises(VisualizeError, match="cannot write"):
        plot_timeline(simulated("1f1b", 2, 2), tmp_path / "missing" / "t.png")


def test_measured_time_axis_is_in_milliseconds(tmp_path):
    predicted = simulated("1f1b", 2, 2)
    scaled = tuple(tuple(e._replace(start=e.start / 1000 + 7.0, end=e.end / 1000 + 7.0) for e in ev)
                   for ev in predicted.ranks)  # 9 ms on a clock that reads 7 s at the start
    plot_timeline(Timeline("1F1B", predicted.params, scaled, "measured"), tmp_path / "t.svg")
    texts = [t.strip() for t in _texts(tmp_path / "t.svg")]
    assert "time (ms)" in texts and "8" in texts  # a tick at 8 ms
    assert "bubble 33.3%    makespan 9 ms" in texts


def test_prediction_beside_a_measurement_is_shown_in_the_same_unit(tmp_path):
    # A prediction from measured op costs is in seconds: drawn beside the measurement, both read in ms.
    base = simulated("1f1b", 2, 2)
    seconds = tuple(tuple(e._replace(start=e.start / 1000, end=e.end / 1000) for e in ev) for ev in base.ranks)
    predicted = Timeline("1F1B", base.params, seconds, "simulated")
    measured = Timeline("1F1B", base.params, seconds, "measured")
    plot_timelines([measured, predicted], tmp_path / "t.svg")
    texts = [t.strip() for t in _texts(tmp_path / "t.svg")]
    assert texts.count("bubble 33.3%    makespan 9 ms") == 2
