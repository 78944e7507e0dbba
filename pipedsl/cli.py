"""`pipedsl` command line: a thin layer over the Python API.

Every failure the user can cause prints one clear message (with file:line:col and a caret
for `.pipe` sources) and exits with status 2; nothing prints a Python traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pipedsl import compare
from pipedsl import output as output_file
from pipedsl.arguments import add_param, add_sizes, add_steps, params_of, positive_int
from pipedsl.compiler import Schedule
from pipedsl.errors import PipeDSLError, PipeSemanticError
from pipedsl.ir import Program
from pipedsl.library import builtin_names, load
from pipedsl.limits import MAX_COMPUTE_OPS, MAX_RANKS
from pipedsl.plan import cli as plan_cli
from pipedsl.registry import COMMANDS as LENT_COMMANDS
from pipedsl.registry import lend, resolve
from pipedsl.simulate import Cost, simulate
from pipedsl.steps import period as overlapped_period
from pipedsl.timeline import Timeline
from pipedsl.torch_csv import to_torch_csv, torch_numbering

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, as ours (no usage dump)
        print(f"error: {message} ({self.prog} -h lists the options)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; of the commands other layers lend (registry.py), only the one `argv` names is
    imported (all of them when it names none, for the help)."""
    parser = _Parser(prog="pipedsl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("compile", help="print the per-rank instruction streams of a schedule")
    add_sizes(c)
    c.add_argument("--format", choices=("text", "json", "csv", "torch-csv"), default="text",
                   help="torch-csv: torch.distributed.pipelining's compute-only CSV (its _load_csv reads it)")
    c.add_argument("-o", "--output", help="write to this file instead of stdout")
    c.add_argument("--cost", default="", help="the costs an `order auto` schedule is searched under "
                                              "(e.g. F=1,B=2,I=1,W=1,comm=0.1; per stage: F@3=1.5)")

    s = sub.add_parser("simulate", help="predict makespan, bubble and memory under a cost model")
    add_sizes(s)
    s.add_argument("--cost", default="", help="e.g. F=1,B=2,I=1,W=1,comm=0 (per stage: F@3=1.5); an `order auto` "
                                              "schedule is also searched under it")
    s.add_argument("--format", choices=("text", "json"), default="text")
    add_steps(s)

    k = sub.add_parser("check", help="compile a schedule over a grid of sizes and report failures")
    k.add_argument("schedule")
    k.add_argument("--ranks", default="2,4,8", help="comma-separated P values (default 2,4,8)")
    k.add_argument("--max-factor", type=positive_int, default=4, help="M goes from 1 to this times P (default 4)")
    add_param(k)

    sub.add_parser("list", help="the built-in schedules with their doc lines")
    compare.add_parser(sub)
    named = _command_named(argv)
    for name, command in LENT_COMMANDS.items():
        if named in (None, name):
            resolve(f"{command.module}:{command.add_parser}")(sub)
    plan_cli.add_parser(sub)
    return parser


def _command_named(argv: Sequence[str] | None) -> str | None:
    """The command `argv` runs, if it names a known one (`pipedsl` takes no option before its command but -h)."""
    first = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    return first if first in LENT_COMMANDS or first in COMMANDS else None


def _compile(args: argparse.Namespace):
    schedule = load(args.schedule)
    cost = Cost.parse(args.cost) if getattr(args, "cost", "") else None
    return schedule, schedule.compile(P=args.ranks, M=args.microbatches, cost=cost, **params_of(args))


def cmd_compile(args: argparse.Namespace) -> int:
    _, program = _compile(args)
    if args.format == "torch-csv":
        _note_torch_numbering(program)
    text = {"text": program.to_text, "json": program.to_json, "csv": program.to_csv,
            "torch-csv": lambda: to_torch_csv(program)}[args.format]()
    _write(text if text.endswith("\n") else text + "\n", args.output)
    return 0


def _note_torch_numbering(program: Program) -> None:
    """Say so on stderr when torch's microbatch numbers are not pipedsl's (torch_csv.torch_numbering)."""
    number = torch_numbering(program)
    moved = [f"{m}→{n}" for m, n in enumerate(number) if m != n]
    if moved:
        shown = ", ".join(moved[:8]) + (", …" if len(moved) > 8 else "")
        print(f"note: the last stage runs its forwards out of microbatch order and torch's runtime finds a loss by "
              f"microbatch number, so the CSV numbers microbatches in that order (pipedsl→torch: {shown})",
              file=sys.stderr)


def cmd_simulate(args: argparse.Namespace) -> int:
    _, program = _compile(args)
    cost = Cost.parse(args.cost)
    timeline = simulate(program, cost, steps=args.steps)
    period = overlapped_period(timeline) if args.steps > 1 else None  # a step's time where steps overlap
    if args.format == "json":
        out = timeline.summary()
        out["messages"] = sum(1 for events in timeline.ranks for e in events if e.instr.op.value.startswith("SEND"))
        if period is not None:
            out["period"] = period
        print(json.dumps(out))
    else:
        print(format_summary(timeline))
        if period is not None:
            print(f"period        {period:g}  ({args.steps} steps overlapping: what each step adds)")
    return 0


def format_summary(t: Timeline) -> str:
    params = " ".join(f"{k}={v}" for k, v in t.params.items())
    lines = [f"{t.name}  {params}",
             f"makespan      {t.makespan:g}",
             f"bubble ratio  {t.bubble_ratio:.4f}",
             "rank  busy        peak activations"]
    lines += [f"{r:>4}  {b:<10g}  {a}" for r, (b, a) in enumerate(zip(t.busy, t.peak_activations))]
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    ranks = _check_grid(args.ranks, args.max_factor)
    schedule = load(args.schedule)
    params = params_of(args)
    failures = 0
    for P in ranks:
        ok, skipped, failed = [], {}, []
        for M in range(1, args.max_factor * P + 1):
            try:
                schedule.compile(P=P, M=M, **params)
                ok.append(M)
            except PipeSemanticError as err:
                if err.message.startswith("requirement failed"):
                    skipped.setdefault(err.message, []).append(M)
                else:
                    failed.append((M, err))
            except PipeDSLError as err:
                failed.append((M, err))
        failures += len(failed)
        print(f"P={P}: {len(ok)} ok, {sum(map(len, skipped.values()))} not applicable, {len(failed)} failed")
        for message, ms in skipped.items():
            print(f"  not applicable (M={_ranges(ms)}): {message}")
        for M, err in failed[:5]:
            print(f"  FAILED M={M}: " + err.render().replace("\n", "\n    "))
    return 1 if failures else 0


def _check_grid(text: str, max_factor: int) -> list[int]:
    """The P values of `check --ranks`, refused before any compile when the grid is larger than
    the largest single program (MAX_COMPUTE_OPS forwards, counting P·max(M, P) per size)."""
    shown = text if len(text) <= 40 else text[:37] + "..."
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipeDSLError(f"--ranks {shown!r}: expected comma-separated integers") from None
    if not ranks:
        raise PipeDSLError("--ranks: give at least one rank count")
    for P in ranks:
        if not 1 <= P <= MAX_RANKS:
            raise PipeDSLError(f"--ranks: {P if P < 10**9 else 'a huge number'} is not a rank count in "
                               f"1..{MAX_RANKS:,} (MAX_RANKS)")
    work = 0
    for P in ranks:
        top = max_factor * P  # M = 1 .. top; P * max(M, P) forwards at least (one stage a rank)
        low = min(top, P)
        work += P * (low * P + (top * (top + 1) - low * (low + 1)) // 2)
        if work > MAX_COMPUTE_OPS:
            raise PipeDSLError(f"check --ranks {shown} --max-factor {max_factor if max_factor < 10**9 else 'huge'} "
                               f"would compile more than {MAX_COMPUTE_OPS:,} forwards in all (MAX_COMPUTE_OPS, the "
                               f"largest single program); give fewer or smaller sizes")
    return ranks


def _ranges(values: list[int]) -> str:
    return ",".join(map(str, values)) if len(values) <= 6 else f"{values[0]}..{values[-1]} ({len(values)} values)"


def cmd_list(args: argparse.Namespace) -> int:
    for name in builtin_names():
        schedule: Schedule = load(name)
        extra = ", ".join(p.name for p in schedule.parameters)
        print(f"{name:<14} {schedule.doc}" + (f"  [params: {extra}]" if extra else ""))
    return 0


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output_file.write_text(output, text)
    except OSError as err:
        raise PipeDSLError(f"cannot write {output or repr(output)}: {err.strerror}") from None


COMMANDS = {"compile": cmd_compile, "simulate": cmd_simulate, "check": cmd_check, "list": cmd_list,
            "compare": compare.run, "plan": plan_cli.run}


def _handler(command: str):
    if command in COMMANDS:
        return COMMANDS[command]
    lent = LENT_COMMANDS[command]
    return resolve(f"{lent.module}:{lent.run}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        with lend("exit_on_signals")():  # SIGTERM/SIGINT/SIGHUP while compiling or drawing: one line, 128 + signal
            return _handler(args.command)(args)
    except PipeDSLError as err:
        print(err.render(), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `pipedsl compile … | head`
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
