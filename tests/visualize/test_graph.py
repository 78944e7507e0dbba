"""The dependency graph: one node per instruction, and exactly the expected edges of each kind."""

from __future__ import annotations

import re
from pathlib import Path

import graphviz
import pytest

import pipedsl
from pipedsl.ir import COMPUTE, SENDS
from pipedsl.visualize import VisualizeError, dependency_graph, write_graph
from pipedsl.visualize import graph as graph_module

NODE = re.compile(r"^\s*(r\d+_\d+) \[label=(\"[^\"]+\"|[^ \]]+)", re.M)
EDGE = re.compile(r"^\s*(r\d+_\d+) -> (r\d+_\d+) \[(.*)\]$", re.M)


def _parse(source: str):
    nodes = {nid: label.strip('"') for nid, label in NODE.findall(source)}
    edges = [(a, b, attrs) for a, b, attrs in EDGE.findall(source)]
    order = [(a, b) for a, b, attrs in edges if "dashed" in attrs]
    messages = [(a, b) for a, b, attrs in edges if "bold" in attrs]
    data = [(a, b) for a, b, attrs in edges if "dashed" not in attrs and "bold" not in attrs]
    return nodes, order, messages, data


@pytest.mark.parametrize("P, M", [(2, 3), (4, 8)])
def test_1f1b_nodes_and_edges(P, M):
    program = pipedsl.load("1f1b").compile(P=P, M=M)
    nodes, order, messages, data = _parse(dependency_graph(program).source)
    # One node per instruction, labelled with its text.
    assert len(nodes) == program.num_instructions()
    assert nodes == {f"r{r}_{i}": str(ins) for r, s in enumerate(program.ranks) for i, ins in enumerate(s)}
    # Same-rank order: each instruction to the next one on its rank.
    assert sorted(order) == sorted((f"r{r}_{i - 1}", f"r{r}_{i}") for r, s in enumerate(program.ranks)
                                   for i in range(1, len(s)))
    # Data: F -> next stage's F (M(P-1)), F -> own B (MP), B -> previous stage's B (M(P-1)).
    assert len(data) == 3 * M * P - 2 * M
    labels = [(nodes[a], nodes[b]) for a, b in data]
    assert ("F0.0", "F0.1") in labels and ("F0.0", "B0.0") in labels and ("B0.1", "B0.0") in labels
    # Messages: one edge per send, to a receive of the same microbatch on the peer.
    assert len(messages) == sum(i.op in SENDS for s in program.ranks for i in s)
    for a, b in messages:
        send, recv = pipedsl.Instr.parse(nodes[a]), pipedsl.Instr.parse(nodes[b])
        assert send.op.value[-1] == recv.op.value[-1] and send.mb == recv.mb
        assert int(a[1:a.index("_")]) == recv.peer and int(b[1:b.index("_")]) == send.peer


def test_split_backward_adds_input_to_weight_edges(pipes):
    P, M = 3, 4
    program = pipedsl.load(pipes["split"]).compile(P=P, M=M)
    nodes, _, _, data = _parse(dependency_graph(program).source)
    labels = [(nodes[a], nodes[b]) for a, b in data]
    assert sum(a.startswith("I") and b.startswith("W") for a, b in labels) == M * P
    assert sum(a.startswith("I") and b.startswith("I") for a, b in labels) == M * (P - 1)
    assert len(data) == 4 * M * P - 2 * M


def test_replicas_link_stages_of_the_same_replica_only(pipes):
    program = pipedsl.load(pipes["replicas"]).compile(P=2, M=2)
    nodes, _, _, data = _parse(dependency_graph(program).source)
    labels = {(nodes[a], nodes[b]) for a, b in data}
    assert ("F1.0r1", "F1.1r1") in labels and ("B1.1r1", "B1.0r1") in labels
    assert not any(a.endswith("r1") != b.endswith("r1") for a, b in labels)


def test_ranks_are_clusters():
    program = pipedsl.load("1f1b").compile(P=3, M=2)
    source = dependency_graph(program).source
    assert re.findall(r"subgraph (cluster_rank\d+)", source) == ["cluster_rank0", "cluster_rank1", "cluster_rank2"]
    assert source.count('label="rank ') == 3
    # Compute nodes are filled boxes in the op colours; messages are small grey shapes.
    compute = [ins for s in program.ranks for ins in s if ins.op in COMPUTE]
    assert source.count("fillcolor=\"#4e79a7\"") == sum(i.op.value == "F" for i in compute)


def test_dot_source_is_written_with_a_hint(tmp_path):
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    message = write_graph(program, tmp_path / "deps.dot")
    assert (tmp_path / "deps.dot").read_text() == dependency_graph(program).source
    assert message.startswith(f"wrote {tmp_path / 'deps.dot'}") and "dot -Tsvg" in message


def test_without_dot_the_source_is_written_and_the_message_says_how_to_render(tmp_path, monkeypatch):
    monkeypatch.setattr(graph_module.shutil, "which", lambda name: None)
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    message = write_graph(program, tmp_path / "deps.svg")
    assert (tmp_path / "deps.dot").exists() and not (tmp_path / "deps.svg").exists()
    assert "\n" not in message
    assert "'dot' program is not installed" in message
    assert f"dot -Tsvg {tmp_path / 'deps.dot'} -o {tmp_path / 'deps.svg'}" in message


def test_with_dot_the_picture_is_rendered_beside_the_source(tmp_path, monkeypatch):
    calls = []

    def fake_render(engine, fmt, filepath, outfile=None, quiet=False):
        calls.append((engine, fmt, Path(filepath), Path(outfile)))
        Path(outfile).write_text("<svg/>")
        return str(outfile)

    monkeypatch.setattr(graph_module.shutil, "which", lambda name: "/usr/bin/dot")
    monkeypatch.setattr(graphviz, "render", fake_render)
    message = write_graph(pipedsl.load("1f1b").compile(P=2, M=2), tmp_path / "deps.png")
    [(engine, fmt, source, rendered)] = calls  # rendered beside it under a temporary name, then renamed
    assert (engine, fmt, source, rendered.parent, rendered.suffix) == ("dot", "png", tmp_path / "deps.dot", tmp_path,
                                                                      ".png")
    assert (tmp_path / "deps.png").read_text() == "<svg/>" and not rendered.exists()
    assert message == f"wrote {tmp_path / 'deps.dot'} and {tmp_path / 'deps.png'}"


def test_unknown_graph_extension(tmp_path):
    with pytest.raises(VisualizeError, match=r"unknown extension '\.gif'"):
        write_graph(pipedsl.load("1f1b").compile(P=2, M=2), tmp_path / "deps.gif")
