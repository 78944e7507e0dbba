"""Reading a timeline from a file: Timeline JSON or our Chrome trace, and clear errors otherwise."""

from __future__ import annotations

import json

import pytest
from vis_support import simulated

from pipedsl.visualize import VisualizeError, read_timeline, write_chrome_trace


def test_reads_a_pipedsl_timeline(tmp_path):
    timeline = simulated("1f1b", 3, 4)
    (tmp_path / "t.json").write_text(timeline.to_json())
    back = read_timeline(tmp_path / "t.json")
    assert back.ranks == timeline.ranks and back.name == "1F1B" and back.params == {"P": 3, "M": 4}


def test_reads_a_chrome_trace(tmp_path):
    timeline = simulated("gpipe", 2, 3)
    write_chrome_trace(timeline, tmp_path / "t.json")
    back = read_timeline(tmp_path / "t.json")
    assert [[e.instr for e in ev] for ev in back.ranks] == [[e.instr for e in ev] for ev in timeline.ranks]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read trace .*: No such file"),
    ("{not json", "not JSON"),
    (json.dumps({"hello": 1}), "neither a pipedsl timeline"),
    (json.dumps({"ranks": [[{"op": "F"}]]}), "cannot read trace .*F needs 'mb'"),
    (json.dumps({"traceEvents": [{"ph": "X", "name": "foreign"}]}), "no pipedsl events"),
])
def test_unreadable_files(tmp_path, content, message):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(VisualizeError, match=message):
        read_timeline(path)
