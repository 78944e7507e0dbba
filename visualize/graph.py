"""A program's dependency graph in graphviz: what waits for what, rank by rank.

Nodes are instructions (`r{rank}_{index}`), clustered by rank with time running left to
right.  Three kinds of edges:

- data dependencies (solid, coloured by the producing op): F → the next stage's F,
  F → its own B (or I), B / I → the previous stage's B / I, I → its W;
- same-rank order (light dashed): each instruction → the next one in its rank's stream;
- messages (bold red): the k-th SEND from rank a to rank b → the k-th RECV on b from a,
  which is how NCCL and gloo pair them.

The `.dot` source is always written; an SVG / PNG needs the graphviz `dot` program.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import graphviz

from pipedsl.ir import COMPUTE, RECVS, SENDS, Instr, Op, Program
from pipedsl.output import replacing, write_text

from . import style
from .errors import VisualizeError

RENDERED = (".svg", ".png", ".pdf")
ORDER_EDGE = {"style": "dashed", "color": "#bbbbbb", "arrowsize": "0.5", "weight": "10"}
MESSAGE_EDGE = {"style": "bold", "color": "#c0392b", "arrowsize": "0.7", "constraint": "false"}


def node_id(rank: int, index: int) -> str:
    return f"r{rank}_{index}"


def dependency_graph(program: Program) -> graphviz.Digraph:
    """The graph of `program`: one node per instruction, data / order / message edges."""
    g = graphviz.Digraph(name=program.name, graph_attr={
        "rankdir": "LR", "fontname": "Helvetica", "fontsize": "12", "nodesep": "0.12", "ranksep": "0.2",
        "newrank": "true", "label": f"{program.name}  " + " ".join(f"{k}={v}" for k, v in program.params.items()),
        "labelloc": "t"})
    g.attr("node", fontname="Helvetica", fontsize="10", height="0.3", margin="0.06,0.03")
    g.attr("edge", arrowsize="0.6")
    chunk_of = _chunks(program)
    chunks = max(chunk_of.values(), default=0) + 1
    where: dict[tuple[Op, int | None, int | None, int], str] = {}
    for rank, stream in enumerate(program.ranks):
        with g.subgraph(name=f"cluster_rank{rank}") as c:
            c.attr(label=f"rank {rank}", style="rounded", color="#999999", fontcolor="#333333")
            for index, instr in enumerate(stream):
                nid = node_id(rank, index)
                lead = instr.parts[0]  # an overlapped pair F&B is drawn in its forward's colour
                c.node(nid, str(instr), **_node_style(lead, chunk_of.get((lead.replica, lead.stage), 0), chunks))
                for part in instr.parts if instr.op in COMPUTE else ():
                    where[(part.op, part.mb, part.stage, part.replica)] = nid
            for index in range(1, len(stream)):
                c.edge(node_id(rank, index - 1), node_id(rank, index), **ORDER_EDGE)
    for src, dst, op in data_edges(program, where):
        g.edge(src, dst, color=style.BASE[op], penwidth="1.3")
    for src, dst in message_edges(program):
        g.edge(src, dst, **MESSAGE_EDGE)
    return g


def data_edges(program: Program, where: dict[tuple[Op, int | None, int | None, int], str] | None = None
               ) -> list[tuple[str, str, Op]]:
    """(producer node, consumer node, producer op) for every data dependency between compute ops."""
    if where is None:
        where = {(i.op, i.mb, i.stage, i.replica): node_id(r, k) for r, stream in enumerate(program.ranks)
                 for k, whole in enumerate(stream) if whole.op in COMPUTE for i in whole.parts}
    def find(kinds: tuple[Op, ...], mb: int | None, stage: int, replica: int) -> str | None:
        return next((where[(k, mb, stage, replica)] for k in kinds if (k, mb, stage, replica) in where), None)

    backward = (Op.B, Op.I)
    edges = []
    for (op, mb, stage, rep), nid in where.items():
        assert stage is not None
        if op is Op.F:
            targets = [find((Op.F,), mb, stage + 1, rep), find(backward, mb, stage, rep)]
        elif op in backward:
            targets = [find(backward, mb, stage - 1, rep)] + ([find((Op.W,), mb, stage, rep)] if op is Op.I else [])
        else:
            targets = []
        edges += [(nid, t, op) for t in targets if t is not None]
    return edges


def message_edges(program: Program) -> list[tuple[str, str]]:
    """(send node, receive node): per ordered pair of ranks, the k-th send meets the k-th receive."""
    sends: dict[tuple[int, int], list[str]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[str]] = defaultdict(list)
    for rank, stream in enumerate(program.ranks):
        for index, instr in enumerate(stream):
            if instr.op in SENDS:
                sends[(rank, instr.peer)].append(node_id(rank, index))
            elif instr.op in RECVS:
                recvs[(instr.peer, rank)].append(node_id(rank, index))
    return [pair for key, ids in sends.items() for pair in zip(ids, recvs.get(key, []))]


def write_graph(program: Program, path: str | Path) -> str:
    """Write `path` (`.dot` source, or `.svg` / `.png` / `.pdf` rendered beside its `.dot`); a one-line report."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix != ".dot" and suffix not in RENDERED:
        raise VisualizeError(f"cannot write a dependency graph to {str(path)!r}: unknown extension "
                             f"{suffix or '(none)'!r} (graphs: .dot, {', '.join(RENDERED)})")
    dot_path = path if suffix == ".dot" else path.with_suffix(".dot")
    try:
        write_text(dot_path, dependency_graph(program).source)
    except OSError as err:
        raise VisualizeError(f"cannot write {dot_path}: {err.strerror or err}") from None
    if suffix == ".dot":
        return f"wrote {dot_path} (render it with: dot -Tsvg {dot_path} -o {dot_path.with_suffix('.svg')})"
    how = f"dot -T{suffix[1:]} {dot_path} -o {path}"
    if shutil.which("dot") is None:
        return (f"wrote {dot_path}; the graphviz 'dot' program is not installed, so no {path}: "
                f"install graphviz (e.g. apt-get install graphviz) and run: {how}")
    try:
        with replacing(path) as tmp:
            graphviz.render("dot", suffix[1:], dot_path, outfile=tmp, quiet=True)
    except graphviz.ExecutableNotFound:
        return f"wrote {dot_path}; could not run the graphviz 'dot' program, so no {path}: run: {how}"
    except graphviz.CalledProcessError as err:
        raise VisualizeError(f"dot failed on {dot_path} (exit {err.returncode}); the .dot source is kept") from None
    return f"wrote {dot_path} and {path}"


def _chunks(program: Program) -> dict[tuple[int, int], int]:
    """(replica, stage) → its chunk index on its rank."""
    out = {}
    for rank in range(program.num_ranks):
        counters: dict[int, int] = defaultdict(int)
        for replica, stage in program.stages_of(rank):
            out[(replica, stage)] = counters[replica]
            counters[replica] += 1
    return out


def _node_style(instr: Instr, chunk: int, chunks: int) -> dict[str, str]:
    if instr.op in COMPUTE:
        face = style.fill(instr.op, chunk, chunks)
        attrs = {"shape": "box", "style": "filled,rounded", "fillcolor": face, "color": style.edge(face),
                 "fontcolor": style.text_on(face)}
        if instr.replica % 2:
            attrs["peripheries"] = "2"
        return attrs
    if instr.op in SENDS or instr.op in RECVS:
        return {"shape": "cds" if instr.op in SENDS else "invhouse", "style": "filled", "fontsize": "8",
                "fillcolor": "#f4f4f4", "color": "#999999", "fontcolor": "#444444", "height": "0.2"}
    return {"shape": "octagon", "style": "filled", "fontsize": "8", "fillcolor": style.mix(style.BASE[instr.op],
            "#ffffff", 0.6), "color": style.BASE[instr.op]}
