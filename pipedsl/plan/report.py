"""What `pipedsl plan` prints: one ranked table for every model kind, the rejections summarised once, an
encoder-decoder's stages and ranks, and `--mt5-table`'s Markdown.

A model kind changes only the header, the columns and what follows the table (an encoder-decoder's
stages, the runtime's own splits of its best layout), each kind's in one `_Kind` record (`_KINDS`, keyed by
`PlannedModel.kind`); the table and the rejections are printed alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pipedsl.plan.cluster import ClusterSpec
from pipedsl.plan.cost import SPLITS
from pipedsl.plan.model import EncDecSpec, PlannedModel, Unit
from pipedsl.plan.search import TIES, Estimate, LayoutError, PlanResult, evaluate
from pipedsl.plan.units import BYTES, COUNT, FLOPS, SECONDS, Units, add_columns, scaled

GB = 1e9

# (heading, "{}" where its unit goes; units, or None for text; a row's value)
Column = tuple[str, Units | None, Callable[[Any], Any]]


def train_split(layers: tuple[int, ...]) -> str:
    """`pipedsl train --split`'s value for stages of `layers` decoder layers each (the embedding on the first, the
    head on the last): "blocks" when they are even, else the cut points among [embedding, layers…, head]."""
    if len(set(layers)) <= 1:
        return "blocks"
    return ",".join(str(1 + sum(layers[:k])) for k in range(1, len(layers)))


class _Kind(NamedTuple):
    """What a model kind (`PlannedModel.kind`) changes in the printout: the console's width, the header (and whether
    it is Rich markup), the table's title, the columns `_columns` adds (`leading`: right after the layout; `live`:
    the peak's live count and the memory balance; `buffers`: ZeRO's step buffers on every table, not only where a
    row has them), what follows the table."""

    width: int
    header: Callable[[Any, ClusterSpec], str]
    markup: bool
    title: str
    leading: list[tuple[str, Callable[[Estimate], str]]]
    live: bool
    buffers: bool
    details: Callable[[PlanResult, Any], None]


def print_result(result: PlanResult, rejected_examples: int = 8) -> None:
    """The ranked table of a `search` result (any model kind), what the kind adds after it, and the rejections."""
    from rich.console import Console
    from rich.table import Table

    kind = _KINDS[result.model.kind]
    console = Console(width=kind.width)
    console.print(kind.header(result.model, result.cluster), markup=kind.markup)
    table = Table(title=f"ranked by predicted iteration time; {TIES} ({kind.title})")
    rows = result.ranked
    table.add_column("#", justify="right")
    table.add_column("layout")
    for head, _ in kind.leading:
        table.add_column(head)
    shown = add_columns(table, _columns(result.model, rows, kind.live, kind.buffers), rows)
    for i, e in enumerate(rows):
        table.add_row(str(i + 1), str(e.layout), *(value(e) for _, value in kind.leading), *(v[i] for v in shown))
    console.print(table)
    kind.details(result, console)
    print_rejections(result, rejected_examples, console)


def print_rejections(result: PlanResult, examples: int, console: Any) -> None:
    """The search's counts (simulated, pruned, rejected by kind of reason) and up to `examples` rejected layouts,
    shared among the kinds of reason."""
    kinds = Counter(r.reason.split(":")[0] for r in result.rejected)
    console.print(f"{result.simulated} simulated, {result.pruned} pruned (lower bound above the #{len(result.ranked)} "
                  f"time), {len(result.rejected)} rejected: "
                  + ", ".join(f"{n} {k}" for k, n in kinds.most_common()) + f"; {result.seconds:.1f} s")
    shown: Counter = Counter()
    for r in result.rejected:
        kind = r.reason.split(":")[0]
        if shown[kind] < max(1, examples // max(1, len(kinds))):
            shown[kind] += 1
            console.print(f"  rejected {r.layout}: {r.reason}", markup=False)


# ------------------------------------------------------------------ decoders (dense and MoE)


def _decoder_header(m: Any, c: ClusterSpec) -> str:
    moe = (f"{scaled(m.active_params, COUNT, '')} active, {m.experts} experts top-{m.top_k}"
           + (f" + {m.shared_experts} shared" if m.shared_experts else "") + ", ") if m.moe else ""
    return (f"[bold]{m.name}[/]: {scaled(m.params, COUNT, '')} parameters ({moe}{m.layout} layout), "
            f"{m.describe()}, batch {m.global_batch} — on "
            f"{c.gpus} × {c.name} ({c.gpus_per_node}/node, {scaled(c.peak_flops, FLOPS)}, "
            f"{scaled(c.memory, BYTES)})")


def _columns(m: PlannedModel, rows: Sequence[Estimate], live: bool, buffers: bool) -> list[Column]:
    """Every model kind's columns: time, throughput, the fullest GPU's memory, each communication its model has
    (`comm_kinds`; MoE all-to-alls with their share), where `pipedsl train --split` cuts an uneven split; `live`,
    `buffers`: `_Kind`'s."""
    columns: list[Column] = [
        ("iteration {}", SECONDS, lambda e: e.iteration),
        ("{}/GPU", FLOPS, lambda e: e.tflops * 1e12),
        ("MFU", None, lambda e: f"{e.mfu:.1%}"),
        ("memory {}", BYTES, lambda e: e.memory.total),  # the fullest GPU's: the tie-break
        ("params {}", BYTES, lambda e: e.memory.states.params),
        ("grads {}", BYTES, lambda e: e.memory.states.grads),
        ("optim {}", BYTES, lambda e: e.memory.states.optimizer),
        ("activ {}", BYTES, lambda e: e.memory.activations),
    ]
    if live:
        columns += [("peak live", None, lambda e: str(e.memory.peak_live)),
                    ("mem balance", None, lambda e: f"{e.memory_balance:.2f}")]  # the lightest rank's peak / fullest's
    columns += [(f"{kind} {{}}", SECONDS, lambda e, kind=kind: e.comm[kind]) for kind in m.comm_kinds if kind != "ep"]
    if buffers or any(e.layout.zero >= 2 for e in rows):  # ZeRO's buffers held during the step beyond the shards
        at = [header for header, *_ in columns].index("activ {}")
        columns[at:at] = [("grad buffer {}", BYTES, lambda e: e.memory.gradient_buffer),
                          ("gathered {}", BYTES, lambda e: e.memory.gathered)]
    if m.moe:  # the expert-parallel all-to-alls: seconds per iteration and their share of it
        columns += [("a2a {}", SECONDS, lambda e: e.comm["ep"]),
                    ("a2a %", None, lambda e: f"{e.comm['ep'] / e.iteration:.1%}")]
    if any(e.layout.split != "even" for e in rows):  # where `pipedsl train --split` cuts the layout's stages
        columns.append(("--split", None, lambda e: train_split(e.layers)))
    return columns


# ------------------------------------------------------------------ encoder-decoders


def encdec_header(spec: EncDecSpec, cluster: ClusterSpec) -> str:
    return (f"{spec.name}: {scaled(spec.params, COUNT, '')} parameters (encoder-decoder: {spec.describe()}), batch "
            f"{spec.global_batch} — on {cluster.gpus} × {cluster.name} ({cluster.gpus_per_node}/node, "
            f"{scaled(cluster.peak_flops, FLOPS)}, {scaled(cluster.memory, BYTES)}); bf16 parameters, fp32 main "
            f"parameters and Adam, tp 1, eager attention")


def _print_encdec_details(result: PlanResult, console: Any) -> None:
    """After the table: the best layout's stages, ranks and other splits, or the least memory nothing fitted in."""
    spec, cluster = result.model, result.cluster
    if result.ranked:
        print_stages(result.ranked[0], spec, console)
        print_other_splits(result.ranked[0], spec, cluster, console)
    elif result.least_memory < float("inf"):
        console.print(f"nothing fits: the least memory any layout needs is {result.least_memory / GB:.1f} GB "
                      f"(usable {(cluster.memory - cluster.reserved_memory) / GB:.0f} GB)")


def stage_labels(spec: EncDecSpec, bounds: Sequence[int]) -> list[str]:
    """Per stage, its units in short: 'emb E0-E5', 'E23 dec-emb D0-D3', 'D20-D23 head'."""
    units = spec.units()
    out = []
    for a, b in zip(bounds, bounds[1:]):
        groups: list[list[Unit]] = []
        for u in units[a:b]:
            if groups and u.layer and groups[-1][-1].kind == u.kind:
                groups[-1].append(u)
            else:
                groups.append([u])
        out.append(" ".join(g[0].label if len(g) == 1 else f"{g[0].label}-{g[-1].label}" for g in groups))
    return out


def print_stages(e: Any, spec: EncDecSpec, console: Any) -> None:
    """The best layout's stages (units, time per microbatch) and its ranks' memory: the balance."""
    from rich.table import Table

    labels = stage_labels(spec, e.bounds)
    params = [sum(u.params for u in spec.units()[a:b]) for a, b in zip(e.bounds, e.bounds[1:])]
    slowest = max(e.stage_seconds)
    stages = Table(title=f"#1's program stages: slowest {scaled(slowest, SECONDS)} per microbatch (F+B), "
                         f"mean {scaled(sum(e.stage_seconds) / len(e.stage_seconds), SECONDS)}")
    for head in ("stage", "units", "F+B / microbatch", "of slowest", "parameters"):
        stages.add_column(head, justify="left" if head == "units" else "right")
    for s, (label, sec, p) in enumerate(zip(labels, e.stage_seconds, params)):
        stages.add_row(str(s), label, scaled(sec, SECONDS), f"{sec / slowest:.0%}", scaled(p, COUNT, ""))
    console.print(stages)
    ranks = Table(title="#1's ranks at their peak (states between steps + the step's gradient buffer and ZeRO-3 "
                        "gathers + activations)")
    for head in ("rank", "stages", "total GB", "params", "grads", "optim", "grad buffer", "gathered", "activations",
                 "peak live"):
        ranks.add_column(head, justify="right")
    for m in e.ranks:
        st = m.states
        ranks.add_row(str(m.rank), ",".join(map(str, m.stages)), f"{m.total / GB:.1f}", f"{st.params / GB:.1f}",
                      f"{st.grads / GB:.1f}", f"{st.optimizer / GB:.1f}", f"{m.gradient_buffer / GB:.1f}",
                      f"{m.gathered / GB:.1f}", f"{m.activations / GB:.1f}", f"{m.peak_live:g}")
    console.print(ranks)
    console.print(f"train it so: stages = seq2seq_stages(model, {len(e.bounds) - 1}, points={list(e.points)})",
                  markup=False)


def print_other_splits(e: Any, spec: EncDecSpec, cluster: ClusterSpec, console: Any) -> None:
    """The same layout with the runtime's own splits, `by="count"` (its default) and `by="params"`."""
    parts = []
    for how in SPLITS:
        if how == e.split:
            continue
        try:
            other = evaluate(spec, cluster, e.layout, how)
        except LayoutError as err:
            parts.append(f'by="{how}": {err.message}')
            continue
        parts.append(f'by="{how}" {scaled(other.iteration, SECONDS)} ({other.iteration / e.iteration - 1:+.1%}, '
                     f"slowest stage {scaled(max(other.stage_seconds), SECONDS)}, fullest GPU "
                     f"{other.memory.total / GB:.1f} GB)")
    console.print("the same layout split as the runtime would: " + "; ".join(parts), markup=False)


_KINDS = {
    "decoder": _Kind(240, _decoder_header, True, "pipeline simulated on each schedule's compiled program", [],
                     live=True, buffers=False, details=lambda result, console: None),
    "encoder-decoder": _Kind(200, encdec_header, False,
                             "units split by the planner's balanced DP: seq2seq_stages(points=…)",
                             [("points", lambda e: ",".join(map(str, e.points)) or "-")], live=False, buffers=True,
                             details=_print_encdec_details),
}


# ------------------------------------------------------------------ --mt5-table


def assumptions(spec: EncDecSpec, cluster: ClusterSpec, space: dict) -> str:
    """What `--mt5-table` assumed, in one paragraph above its table."""
    schedules = ", ".join(space.get("schedules") or ["every built-in schedule"])
    return (f"Assumed: S = {spec.source} source and T = {spec.target} target tokens, global batch "
            f"{spec.global_batch} sequences; bf16 parameters with fp32 main parameters and Adam "
            f"({space.get('grads', 'bf16')} gradients); tp 1, eager attention; {cluster.name} "
            f"({cluster.gpus_per_node} GPUs a node, {scaled(cluster.peak_flops, FLOPS)}, "
            f"{scaled(cluster.memory, BYTES)}, "
            f"{scaled(cluster.reserved_memory, BYTES)} reserved); {schedules}; microbatch 1, 2, 4, 8; recomputation "
            f"{' or '.join(space.get('recompute', ('none', 'full')))}; units split by "
            f"{'the planner' if space.get('split', 'time') == 'time' else space['split']}. Each ZeRO column: the best "
            f"iteration with that stage (ZeRO 1-3 need dp > 1), or the least memory any of its layouts needs.")


def _cell(e: Any, least: float) -> str:
    if e is not None:
        return f"{e.iteration:.3g} s"
    if least == float("inf"):
        return "—"
    return f"OOM (≥ {least / GB:.0f} GB)"


def zero_table_markdown(rows: Sequence[Any], cluster: ClusterSpec) -> str:
    """The table of `pipedsl plan --mt5-table` (rows of `zero_table`), in Markdown (docs/planner.md)."""
    usable = (cluster.memory - cluster.reserved_memory) / GB
    lines = [f"| model | params | GPUs | best layout ({cluster.name}, {usable:.0f} GB usable) | split points | "
             f"iteration | MFU | fullest GPU | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 | pure data parallel (pp 1) |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        best = row.best
        zeros = [_cell(row.per_zero[z], row.least_memory[z]) if z in row.per_zero else "not searched"
                 for z in range(4)]
        flat = row.data_parallel
        if flat is None:
            zeros.append(_cell(None, row.data_parallel_least))
        else:
            recompute = " recompute" if flat.layout.recompute == "full" else ""
            zeros.append(f"{flat.iteration:.3g} s: zero{flat.layout.zero}{recompute} b{flat.layout.microbatch}, "
                         f"{flat.memory.total / GB:.0f} GB")
        if best is None:
            lines.append(f"| {row.model.name} | {scaled(row.model.params, COUNT, '')} | {row.gpus} | nothing fits | | "
                         f"| | | " + " | ".join(zeros) + " |")
            continue
        lines.append(f"| {row.model.name} | {scaled(row.model.params, COUNT, '')} | {row.gpus} | `{best.layout}` | "
                     f"{','.join(map(str, best.points)) or '-'} | {best.iteration:.3g} s | {best.mfu:.1%} | "
                     f"{best.memory.total / GB:.1f} GB | " + " | ".join(zeros) + " |")
    return "\n".join(lines)
