"""`pipedsl show`, in process: every output path, and bad input as exit 2 with one clear line."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
from vis_support import ONE_F_ONE_B_3_PER_UNIT, simulated

import pipedsl
from pipedsl.cli import main
from pipedsl.visualize import graph as graph_module

SVG = "{http://www.w3.org/2000/svg}"


def _ids(path: Path) -> list[str]:
    return [g.get("id") for g in ET.parse(path).getroot().iter(f"{SVG}g") if g.get("id")]


def test_terminal_by_default(capsys):
    assert main(["show", "1f1b", "-P", "2", "-M", "2", "--width", "32"]) == 0
    assert capsys.readouterr().out == ONE_F_ONE_B_3_PER_UNIT


def test_terminal_comparison(capsys):
    assert main(["show", "gpipe", "1f1b", "-P", "2", "-M", "2", "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert out.index("GPipe  P=2 M=2") < out.index("1F1B  P=2 M=2")
    assert out.count("r0 |") == 2 and out.count("F forward") == 1


def test_svg_picture(tmp_path, capsys):
    out = tmp_path / "t.svg"
    assert main(["show", "1f1b", "-P", "4", "-M", "8", "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    ids = _ids(out)
    assert sum(i.startswith("rank-0-") for i in ids) == 4
    assert sum(i.startswith("op-0-") for i in ids) == 64


def test_png_picture(tmp_path):
    out = tmp_path / "t.png"
    assert main(["show", "gpipe", "-P", "2", "-M", "3", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def test_cost_and_parameters_reach_the_simulation(tmp_path, pipes):
    out = tmp_path / "t.json"
    assert main(["show", pipes["interleaved"], "-P", "2", "-M", "4", "-V", "3", "--cost", "F=2,B=5", "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert trace["otherData"]["pipedsl"]["params"] == {"P": 2, "M": 4, "V": 3}
    f = next(e for e in trace["traceEvents"] if e.get("name") == "F0.0")
    b = next(e for e in trace["traceEvents"] if e.get("name") == "B0.0")
    assert (f["dur"], b["dur"]) == (2000.0, 5000.0)
    assert max(e["args"]["stage"] for e in trace["traceEvents"] if e["ph"] == "X" and "stage" in e["args"]) == 5


def test_comparison_picture_gives_each_schedule_its_own_parameters(tmp_path, pipes):
    out = tmp_path / "cmp.svg"
    assert main(["show", pipes["interleaved"], "1f1b", "gpipe", "-P", "2", "-M", "2", "-V", "2", "-o", str(out)]) == 0
    ids = _ids(out)
    assert [sum(i.startswith(f"op-{k}-") for i in ids) for k in range(3)] == [16, 8, 8]


def test_chrome_trace_then_show_trace_draws_the_same_grid(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["show", "1f1b", "-P", "2", "-M", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", "--trace", str(out), "--width", "32"]) == 0
    assert capsys.readouterr().out == ONE_F_ONE_B_3_PER_UNIT


def test_timeline_json_trace_to_picture_and_predicted_vs_measured(tmp_path):
    measured = tmp_path / "measured.json"
    measured.write_text(simulated("1f1b", 2, 3).to_json())
    out = tmp_path / "one.svg"
    assert main(["show", "--trace", str(measured), "-o", str(out)]) == 0
    assert sum(i.startswith("op-0-") for i in _ids(out)) == 12
    out = tmp_path / "cmp.svg"
    assert main(["show", "1f1b", "-P", "2", "-M", "3", "--trace", str(measured), "-o", str(out)]) == 0
    ids = _ids(out)
    assert sum(i.startswith("op-0-") for i in ids) == sum(i.startswith("op-1-") for i in ids) == 12


def _measured(path: Path, name: str = "1f1b", P: int = 2, M: int = 3, **costs: float) -> None:
    """A "measured" trace in seconds: the schedule simulated with costs in seconds, marked measured."""
    cost = pipedsl.Cost(**(costs or {"F": 0.002, "B": 0.004, "comm": 0.0005}))
    timeline = pipedsl.simulate(pipedsl.load(name).compile(P=P, M=M), cost)
    path.write_text(replace(timeline, kind="measured").to_json())


def test_a_prediction_beside_a_measured_trace_is_in_seconds_fitted_to_it(tmp_path, capsys):
    """The prediction's costs are the measurement's mean op times, so the same schedule predicts the same
    26 ms (it was drawn in cost units labelled as ms: 'makespan 1.3e+04 ms'), and the legend says so."""
    measured = tmp_path / "measured.json"
    _measured(measured)
    assert main(["show", "1f1b", "-P", "2", "-M", "3", "--trace", str(measured), "--width", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("makespan")] == ["makespan 26 ms  bubble 30.8%  peak activations 2 1"] * 2
    assert out[-1] == "simulated with F 2 ms, B 4 ms, comm 0.5 ms (mean op times of measured.json)"
    picture = tmp_path / "cmp.svg"
    assert main(["show", "1f1b", "-P", "2", "-M", "3", "--trace", str(measured), "-o", str(picture)]) == 0
    texts = [" ".join(t.itertext()) for t in ET.parse(picture).getroot().iter(f"{SVG}text")]
    assert sum("makespan 26 ms" in t for t in texts) == 2, texts
    assert "simulated with F 2 ms, B 4 ms, comm 0.5 ms (mean op times of measured.json)" in texts


def test_a_cost_given_beside_a_measured_trace_is_read_as_seconds(tmp_path, capsys):
    measured = tmp_path / "measured.json"
    _measured(measured)
    argv = ["show", "gpipe", "-P", "2", "-M", "3", "--cost", "F=0.001,B=0.002", "--trace", str(measured)]
    assert main([*argv, "--width", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in out if line.startswith("makespan")] == ["makespan 12 ms", "makespan 26 ms"]
    assert out[-1] == "simulated with F 1 ms, B 2 ms (--cost in seconds)"
    assert main(["show", "gpipe", "-P", "2", "-M", "3", "--width", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "makespan 12  bubble" in out[-2] and not out[-1].startswith("simulated with"), "no trace: cost units"


def test_plain_text_file(tmp_path):
    out = tmp_path / "t.txt"
    assert main(["show", "1f1b", "-P", "2", "-M", "2", "--width", "32", "-o", str(out)]) == 0
    assert out.read_text() == ONE_F_ONE_B_3_PER_UNIT


def test_dependency_graph_source(tmp_path, capsys):
    out = tmp_path / "deps.dot"
    assert main(["show", "1f1b", "-P", "2", "-M", "3", "-o", str(out)]) == 0
    source = out.read_text()
    assert source.startswith("digraph") and source.count(" [label=") == 28  # 28 instructions
    assert capsys.readouterr().out.startswith(f"wrote {out}")


def test_graph_of_a_trace(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(simulated("gpipe", 2, 2).to_json())
    out = tmp_path / "deps.dot"
    assert main(["show", "--trace", str(trace), "-o", str(out)]) == 0
    assert out.read_text().count(" [label=") == 20


def test_graph_picture_without_dot_is_not_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(graph_module.shutil, "which", lambda name: None)
    out = tmp_path / "deps.svg"
    assert main(["show", "1f1b", "-P", "2", "-M", "2", "--graph", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and "not installed" in printed and "dot -Tsvg" in printed
    assert (tmp_path / "deps.dot").exists() and not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["show", "1f1b", "-P", "2", "-M", "2", "-o", "x.gif"], "unknown extension '.gif'"),
    (["show", "1f1b", "-P", "2", "-M", "2", "-o", "noext"], "unknown extension '(none)'"),
    (["show"], "show needs a SCHEDULE (with -P and -M) or --trace FILE"),
    (["show", "1f1b", "-P", "2"], "show 1f1b: needs -M"),
    (["show", "1f1b"], "needs -P and -M"),
    (["show", "--trace", "does-not-exist.json"], "cannot read trace does-not-exist.json: No such file"),
    (["show", "nonesuch", "-P", "2", "-M", "2"], "no schedule named 'nonesuch'"),
    (["show", "1f1b", "-P", "2", "-M", "2", "-p", "X=1"], "has no parameter 'X'"),
    (["show", "1f1b", "-P", "2", "-M", "2", "--cost", "F=oops"], "--cost"),
    (["show", "gpipe", "1f1b", "-P", "2", "-M", "2", "-o", "x.json"], "a Chrome trace shows one schedule or trace, got 2"),
    (["show", "gpipe", "1f1b", "-P", "2", "-M", "2", "-o", "x.dot"], "a dependency graph shows one"),
    (["show", "1f1b", "-P", "2", "-M", "2", "--graph"], "--graph draws the dependency graph: give -o"),
])
def test_bad_input_exits_2_with_one_clear_message(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "error: " in err.splitlines()[0]  # one headline (a .pipe error adds its source line and caret)


def test_bad_trace_contents_and_unwritable_output(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert main(["show", "--trace", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["show", "1f1b", "-P", "2", "-M", "2", "-o", str(tmp_path / "no" / "t.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_compile_and_simulate_still_take_one_schedule(capsys):
    assert main(["compile", "1f1b", "-P", "2", "-M", "2"]) == 0
    assert capsys.readouterr().out.startswith("# 1F1B P=2 M=2\n")
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "1f1b", "gpipe", "-P", "2", "-M", "2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["compile", "1f1b", "-P", "2"])  # -M is still required there


def test_docs_render_script(tmp_path, capsys):
    script = Path(__file__).resolve().parents[2] / "docs" / "render_images.py"
    spec = importlib.util.spec_from_file_location("render_images", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render(["gpipe", "1f1b"], tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1f1b.png", "gpipe.png"]
    assert (tmp_path / "1f1b.png").read_bytes().startswith(b"\x89PNG")
    assert "bubble 27.3%" in capsys.readouterr().out


def test_readme_visualise_commands_run(tmp_path, monkeypatch, capsys):
    """Every command of the README's "Visualise" block works (a simulated trace stands in for measured.json)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("### Visualise", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].replace("[-o …]", "").split() for line in block.strip().splitlines()]
    assert len(commands) >= 7 and all(c[:2] == ["pipedsl", "show"] for c in commands)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "measured.json").write_text(simulated("1f1b", 4, 8).to_json())
    for command in commands:
        assert main(command[1:]) == 0, command
    assert {"1f1b.svg", "cmp.png", "1f1b.json", "deps.dot"} <= {p.name for p in tmp_path.iterdir()}
