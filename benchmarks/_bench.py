"""Shared pieces of the runtime benchmarks: the synthetic sleep stage, timing, results files.

The synthetic stage emulates an accelerator on a 2-core machine: its forward and backward
*sleep* fixed times around a real (small) tensor op, so a rank that waits for compute leaves
the CPU to the others and schedule bubbles show as they would on GPUs.  The sleeps sit on
the autograd graph so that a split backward splits them too:

    out = Sleep(x @ Sleep(weight, 0, W), F, I)      # forward sleeps F
    full backward B = I + W; input gradient (I) = I; weight gradient (W) = W

(the output's node sleeps I when any gradient passes through it; the weight's node sleeps W
only when the weight gradient is computed).  The first stage has no input gradient: its I
is empty and its W does all the work, in pipedsl and torch alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
WIDTH = 64  # feature width of the synthetic stage's tensors
ROWS_PER_MB = 4  # rows per microbatch


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `fwd` seconds in forward and `bwd` seconds in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        if fwd > 0:
            time.sleep(fwd)
        ctx.bwd = bwd
        return x.clone()  # not a view: torch detaches stage outputs in place

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd > 0:
            time.sleep(ctx.bwd)
        return g, None, None


class SleepStage(nn.Module):
    """One synthetic stage: forward sleeps `F`, input gradient `I`, weight gradient `W` seconds."""

    def __init__(self, F: float, I: float, W: float, width: int = WIDTH, seed: int = 0) -> None:  # noqa: E741
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.eye(width) + 0.01 * torch.randn(width, width, generator=g))
        self.F, self.I, self.W = F, I, W

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, width]
        w = _Sleep.apply(self.weight, 0.0, self.W)
        return _Sleep.apply(torch.tanh(x @ w), self.F, self.I)  # [rows, width]


def sleep_stages(num_stages: int, F: float, B: float) -> list[SleepStage]:
    """`num_stages` stages with forward `F` and full backward `B` = I + W, split evenly."""
    return [SleepStage(F, B / 2, B / 2, seed=s) for s in range(num_stages)]


def sleep_batch(M: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = M * ROWS_PER_MB
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def sleep_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


# ---------------------------------------------------------------- A/B against another checkout, in one run

_PACKAGES = {"pipedsl": "pipedsl", "pipedsl.runtime": "runtime", "pipedsl.parallel": "parallel",
             "pipedsl.models": "models", "pipedsl.trainer": "trainer", "pipedsl.visualize": "visualize",
             "pipedsl.schedules": "schedules"}  # pyproject.toml's package-dir (models, trainer: from 2026-11-25)


class _TreeFinder:
    """Imports pipedsl's packages from another checkout (`PIPEDSL_TREE`), ahead of the installed one."""

    def __init__(self, tree: str) -> None:
        self.tree = Path(tree)

    def find_spec(self, name: str, path: object = None, target: object = None):  # noqa: ANN201
        if name not in _PACKAGES:
            return None
        import importlib.util

        where = self.tree / _PACKAGES[name]
        if not (where / "__init__.py").is_file():  # a checkout from before that package existed
            return None
        return importlib.util.spec_from_file_location(name, where / "__init__.py", submodule_search_locations=[
            str(where)])


if os.environ.get("PIPEDSL_TREE"):  # in a benchmark's child process and in the ranks it spawns (they import us)
    import sys

    sys.meta_path.insert(0, _TreeFinder(os.environ["PIPEDSL_TREE"]))


@contextlib.contextmanager
def trees(against: str | None, paths: Sequence[str] | None = None) -> Iterator[dict[str, str]]:
    """{name: checkout} to measure: this one (or `paths`), and with `against` that commit in a temporary git
    worktree, removed afterwards.  Run each tree's measurement with `in_tree`."""
    root = HERE.parent
    resolved = [str(Path(t).resolve()) for t in (paths or [root])]
    out = {("this" if p == str(root) else Path(p).name): p for p in resolved}
    if against is None:
        yield out
        return
    worktree = tempfile.mkdtemp(prefix="pipedsl-ab-")
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", worktree, against], check=True,
                   capture_output=True)
    try:
        yield {against: worktree, **out}
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", worktree], check=False)


def in_tree(script: str, tree: str, args: Sequence[str]) -> Any:
    """Run `script args --json F` in a fresh process importing pipedsl from `tree`; returns F's JSON."""
    import sys

    # spawned ranks: a rank forked from the fork server would hold the installed tree's pipedsl, imported before
    # this module's finder (both trees spawn, so the comparison stays fair)
    env = {**os.environ, "PIPEDSL_TREE": tree, "PIPEDSL_START_METHOD": "spawn"}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        subprocess.run([sys.executable, script, *args, "--json", f.name], env=env, check=True)
        return json.load(open(f.name))


def sleep_arguments(ap: argparse.ArgumentParser) -> None:
    """The synthetic stage's times (`sleep_stages`): --F and --B, in seconds."""
    ap.add_argument("--F", type=float, default=0.010, help="synthetic stage: forward per rank's share, s (0.010)")
    ap.add_argument("--B", type=float, default=0.020,
                    help="synthetic stage: backward per rank's share, s, I = W = B/2 (0.020)")


def ab_arguments(ap: argparse.ArgumentParser, name: str) -> None:
    """The flags of a benchmark that measures this tree against another (`alternate`), and its child's."""
    ap.add_argument("--against", help="a commit to measure too (a temporary worktree), alternating with this tree")
    ap.add_argument("--json", help=f"output file (default benchmarks/results/{name}.json)")
    ap.add_argument("--no-append", action="store_true", help="no row in RESULTS.md")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)


def child_result(args: argparse.Namespace, measure: Any) -> dict | None:
    """In a child process (`--child P`): `measure(P, config)` written to `--json`; None in the parent."""
    if not args.child:
        return None
    result = measure(args.child, json.loads(args.config))
    Path(args.json).write_text(json.dumps(result))
    return result


def alternate(script: str, tree_paths: dict[str, str], Ps: Sequence[int], rounds: int,
              cfg: dict) -> dict[tuple[str, int], list[Any]]:
    """{(tree, P): results}: `script --child P` in each tree, `rounds` times, the trees' order swapped each round
    (what drifts with the machine's load reaches every tree alike)."""
    got: dict[tuple[str, int], list[Any]] = {}
    for k in range(rounds):
        for P in Ps:
            for name in (list(tree_paths) if k % 2 == 0 else list(tree_paths)[::-1]):
                got.setdefault((name, P), []).append(
                    in_tree(script, tree_paths[name], ["--child", str(P), "--config", json.dumps(cfg)]))
    return got


# ---------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired_median(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-repetition ratios a/b, measured alternately (the load drifting during the run hits
    both alike)."""
    return median([x / y for x, y in zip(a, b, strict=True)])


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the interquartile range of a sample."""
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "iqr": float("nan"), "n": 0}
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "iqr": q[2] - q[0], "n": len(xs)}


# ---------------------------------------------------------------- results


def small_gpt_parser(description: str, name: str) -> argparse.ArgumentParser:
    """The flags every small-GPT variant benchmark takes (schedule, sizes, repetitions, -p, --json);
    `small_gpt_config` turns the parsed flags into the ranks' config."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--P", type=int, default=2)
    ap.add_argument("--M", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4, help="sequences per microbatch (default 4)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed repetition (default 3)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--json", help=f"output file (default benchmarks/results/{name}.json)")
    return ap


def small_gpt_config(args: argparse.Namespace) -> dict[str, Any]:
    params = {k: int(v) for k, _, v in (p.partition("=") for p in args.param)}
    return {"M": args.M, "rows": args.rows, "layers": args.layers, "embd": args.embd, "seq": args.seq,
            "steps": args.steps, "reps": args.reps, "warmup": args.warmup, "params": params}


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def today() -> str:
    return datetime.date.today().isoformat()


def write_json(name: str, result: dict[str, Any], path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out


def publish(name: str, argv: Sequence[str] | None, cfg: dict[str, Any], rows: list[dict[str, Any]],
            checks: dict[str, float], table: Callable[[dict[str, Any]], str], summary: str, json_path: str | None,
            no_append: bool) -> dict[str, Any]:
    """A benchmark's end: its record (command, machine, date, config, rows, checks) to JSON, its table and
    `summary` printed, and `summary` as its row in RESULTS.md unless `no_append`."""
    given = list(argv) if argv is not None else sys.argv[1:]
    command = f"python benchmarks/{name}.py" + (" " + " ".join(given)).rstrip()
    result = {"benchmark": name, "command": command, "machine": machine(), "date": today(), "config": cfg,
              "rows": rows, "checks": checks}
    path = write_json(name, result, json_path)
    print(table(result))
    print(summary)
    if not no_append:
        append_results(results_row(command, summary))
    print(f"wrote {path}")
    return result


def append_results(row: str, path: Path | None = None) -> None:
    """Append one `| date | command | machine | result |` row to benchmarks/RESULTS.md."""
    path = path or Path(os.environ.get("PIPEDSL_RESULTS_MD", RESULTS_MD))
    if not path.exists():
        path.write_text("# Benchmark results\n\nEach benchmark appends one row per run.\n\n"
                        "| date | command | machine | result |\n|---|---|---|---|\n")
    with path.open("a") as f:
        f.write(row + "\n")


def results_row(command: str, result: str) -> str:
    return f"| {today()} | `{command}` | {machine()} | {result} |"


# ---------------------------------------------------------------- torch.distributed.pipelining

# our name -> (torch schedule class, stage indices of rank r for P ranks)
TORCH_SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zb-v": ("ScheduleZBVZeroBubble", "v"),
}


def torch_stage_indices(style: str, P: int, r: int) -> list[int]:
    if style == "single":
        return [r]
    if style == "loop":
        return [r, r + P]  # V = 2 chunks, chunk v of rank r is stage v*P + r
    return [r, 2 * P - 1 - r]


def num_stages_for(name: str, P: int) -> int:
    return P if TORCH_SCHEDULES[name][1] == "single" else 2 * P


def build_torch_schedule(name: str, modules: Sequence[nn.Module], P: int, rank: int, M: int, loss_fn: Any,
                         device: torch.device | str = "cpu") -> Any:
    """torch's schedule `name` over this rank's stages of `modules` (one per stage), moved to `device`."""
    from torch.distributed import pipelining as tp

    cls_name, style = TORCH_SCHEDULES[name]
    cls = getattr(tp, cls_name)
    S = len(modules)
    device = torch.device(device)
    stages = [tp.PipelineStage(modules[s].to(device), s, S, device) for s in torch_stage_indices(style, P, rank)]
    if style == "single":
        return cls(stages[0], n_microbatches=M, loss_fn=loss_fn)
    return cls(stages, n_microbatches=M, loss_fn=loss_fn)


def program_from_torch(schedule: Any, name: str, P: int, M: int) -> Any:
    """The compute order torch's schedule runs, as a validated pipedsl Program (same order, our runtime)."""
    from pipedsl.ir import Op
    from pipedsl.lowering import ComputePlan, lower
    from pipedsl.validate import validate

    kinds = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}
    order = schedule.pipeline_order
    orders, placement = [], {}
    for r in range(P):
        ops = []
        for a in order[r]:
            if a is None or a.computation_type.value not in kinds:
                continue
            ops.append((kinds[a.computation_type.value], a.microbatch_index, a.stage_index, 0))
            placement[(0, a.stage_index)] = r
        orders.append(ops)
    S = len({s for _, s in placement})
    plan = ComputePlan(f"torch-{name}", {"P": P, "M": M}, S, 1, placement, (0,) * M, orders)
    program = lower(plan)
    validate(program)
    return program


# ---------------------------------------------------------------- measuring pipedsl on ranks


def run_steps(pipe: Any, x: Any, y: Any, steps: int, trace: bool = True) -> tuple[list[float], list[Any]]:
    """`steps` timed steps (barrier before each); per step the wall time and (rank 0, `trace`) its Timeline."""
    import torch.distributed as dist

    times, timelines = [], []
    for _ in range(steps):
        dist.barrier(group=pipe.group)
        t0 = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - t0)
        for p in pipe.parameters():
            p.grad = None
        if trace:
            tl = pipe.timeline()
            if tl is not None:
                timelines.append(tl)
    return times, timelines


def shape_change_times(step: Any, x: torch.Tensor, y: torch.Tensor, lengths: Sequence[int],
                       group: Any = None) -> tuple[list[float], list[float]]:
    """Wall times of steps at the known sequence length and at each never-seen length in `lengths`, in
    alternation (known, new, known, new ...) so drifting load reaches both; `step(x, y)` runs one step."""
    import torch.distributed as dist

    known, new = [], []
    for L in lengths:
        for target, xs, ys in ((known, x, y), (new, x[:, :L].contiguous(), y[:, :L].contiguous())):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            step(xs, ys)
            dist.barrier(group=group)
            target.append(time.perf_counter() - t0)
    return known, new


def fit_profile(timelines: Sequence[Any], statistic: str = "mean") -> Any:
    """One cost model from profiles: F, B, messages and sends from the first (a B schedule), I and W
    (overall and per stage) from a split-backward profile if one is given.  Means by default: the
    simulator sums costs along paths, and a path's expected length is the sum of the mean costs."""
    from dataclasses import replace

    from pipedsl import Cost

    base = Cost.fit(timelines[0], statistic)
    for tl in timelines[1:]:
        other = Cost.fit(tl, statistic)
        if not any(e.instr.op.value == "I" for ev in tl.ranks for e in ev):
            continue
        per_stage = {s: dict(v) for s, v in base.per_stage.items()}
        for s, v in other.per_stage.items():
            per_stage.setdefault(s, {}).update({k: v[k] for k in ("I", "W") if k in v})
        base = replace(base, I=other.I, W=other.W, per_stage=per_stage)
    return base


def dispatch_gaps(timeline: Any) -> list[float]:
    """Gaps between an instruction's end and the next one's start on a rank, where the next one did
    not wait for a message: the runtime's own time between instructions."""
    from pipedsl.ir import COMPUTE, RECVS

    gaps = []
    for events in timeline.ranks:
        pending: set[tuple] = set()
        for a, b in zip(events, events[1:]):
            if a.instr.op in RECVS:
                pending.add((a.instr.op.value == "RECV_F", a.instr.mb, a.instr.stage))
            ins = b.instr
            if ins.op in COMPUTE and (ins.op.value == "F", ins.mb, ins.stage) in pending:
                continue  # may have waited for its input
            gaps.append(b.start - a.end)
    return gaps


def cost_dict(cost: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: v for k, v in asdict(cost).items() if k != "bandwidth" or v != float("inf")}


def average_cost(costs: Sequence[Any]) -> Any:
    """Field-wise mean of cost models (one per profiled round)."""
    from dataclasses import fields, replace

    out = costs[0]
    for f in fields(out):
        if f.name == "per_stage":
            stages = {s for c in costs for s in c.per_stage}
            per = {s: {k: sum(c.per_stage[s][k] for c in costs) / len(costs) for k in costs[0].per_stage.get(s, {})}
                   for s in stages}
            out = replace(out, per_stage=per)
        elif isinstance(getattr(out, f.name), float) and getattr(out, f.name) != float("inf"):
            out = replace(out, **{f.name: sum(getattr(c, f.name) for c in costs) / len(costs)})
    return out
