"""Every built-in schedule, every `pipedsl train` option, every `ParallelConfig` field and every `Pipeline` keyword
is exercised by at least one *equality test*: a test whose docstring names the reference it is held to (one process,
a dense layer, plain data parallel, a run that never stopped, …).  A new option that no such test runs fails here,
naming it; an option that changes no number (logging, paths) is exempt below with the reason and the test holding it.

A test's text, for this check, is its decorators and body, the module-level names it uses (constants, helpers,
jobs its workers run), transitively, and the whole of any local helper module it imports (tests/*_cases.py, …).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from functools import cache
from pathlib import Path

import pipedsl

TESTS = Path(__file__).resolve().parent
NAMED = re.compile(r"equal|matches|same|bit_exact|one_process|like_one|dense")  # a test's name that says it compares
REFERENCE = re.compile(r"one process|equals?\b|equal to|reference|dense|bit[- ]?(exact|equal|identical)|bitwise|"
                       r"never stopped|data parallel|the unsplit|the synchronous|bit for bit", re.I)

# options that change no number a test could compare, each with the test that holds what it does instead
EXEMPT = {
    "--help": "argparse's",
    "--wandb": "a logging sink (tests/trainer/test_train_cli.py: the loggers' tests run tensorboard and jsonl)",
    "--out": "where the run writes (its short form -o is in every trainer equality test)",
    "--microbatches": "its short form -M is in every trainer equality test",
    "--min-lr": "the schedule's values against its formula (tests/runtime/test_precision.py::test_lr_schedule_*)",
    "--decay-steps": "the schedule's values against its formula (tests/runtime/test_precision.py::test_lr_schedule_*)",
    "--join-timeout": "a bound on a run's time (tests/reliability/test_faults.py::test_the_join_timeout_bounds_a_whole_run)",
    "--max-time": "when a run stops (tests/trainer/test_train_cli.py::test_max_time_stops_with_a_checkpoint_*)",
    "--keep-checkpoints": "how many checkpoints stay (tests/trainer/test_train_cli.py::test_max_time_stops_*)",
    "--stop-timeout": "the launcher's stop_grace (tests/reliability/test_signals.py: a rank past it is killed)",
}
PIPELINE_EXEMPT = {"check_finite": "refuses a nan loss or lets it through "
                                   "(tests/runtime/test_pipeline.py::test_a_nan_loss_is_returned_when_the_check_is_off)"}
ALSO = {"--grad-dtype": ["grads="]}  # an option's spelling in the Python API, where its equality tests are


@cache
def _helper_modules() -> dict[str, str]:
    """Local modules a test may import by name (tests/**/*.py that are not test files), by module name."""
    return {p.stem: p.read_text() for p in TESTS.rglob("*.py") if not p.name.startswith("test_")}


def _module_sources(path: Path) -> list[str]:
    """The text of each equality test of one file, with what it uses (see the module docstring)."""
    text = path.read_text()
    tree = ast.parse(text)
    top: dict[str, ast.AST] = {}
    local_imports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            top[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        top[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                module = (node.module if isinstance(node, ast.ImportFrom) else alias.name) or ""
                if module.split(".")[0] in _helper_modules():
                    local_imports[alias.asname or alias.name] = module.split(".")[0]

    def segment(node: ast.AST) -> str:
        decorators = getattr(node, "decorator_list", [])
        return "\n".join([*(ast.get_source_segment(text, d) or "" for d in decorators),
                          ast.get_source_segment(text, node) or ""])

    def closure(node: ast.AST) -> str:
        seen, todo, parts = {id(node)}, [node], []
        while todo:
            here = todo.pop()
            parts.append(segment(here))
            used = {n.id for d in [here, *getattr(here, "decorator_list", [])] for n in ast.walk(d)
                    if isinstance(n, ast.Name)}
            for name in used:
                if name in local_imports:
                    parts.append(_helper_modules()[local_imports[name]])
                dep = top.get(name)
                if dep is not None and id(dep) not in seen:
                    seen.add(id(dep))
                    todo.append(dep)
        return "\n".join(parts)

    return [closure(node) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            and (REFERENCE.search(ast.get_docstring(node) or "") or NAMED.search(node.name))]


@cache
def equality_sources() -> tuple[str, ...]:
    return tuple(src for path in sorted(TESTS.rglob("test_*.py")) if path.name != Path(__file__).name
                 for src in _module_sources(path))


def _unheld(names: dict[str, list[str]]) -> list[str]:
    """The names none of whose spellings appears in any equality test."""
    sources = equality_sources()
    return [name for name, spellings in names.items() if not any(s in src for src in sources for s in spellings)]


def test_equality_tests_are_found() -> None:
    """The scan itself: it finds the suite's equality tests (hundreds), not a handful."""
    assert len(equality_sources()) > 100


# a name that promises a comparison against a reference: its docstring must say which (the test-suite issue's rule)
PROMISES = re.compile(r"equals?_(one_process|dense|data_parallel|torch|the_|synchronous|tp)|equal_one_process|"
                      r"matches_single_process|bit_?exact|like_one_process|equal_the_unsplit|equal_synchronous")


def test_every_test_named_as_a_comparison_names_its_reference() -> None:
    """A test named `…_equals_one_process`, `…_is_bit_exact`, … says in its docstring what it is held to (one
    process, a dense layer, DDP, FSDP2, a run that never stopped, …), so a reader need not reverse-engineer it."""
    unnamed = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and PROMISES.search(node.name) \
                    and not REFERENCE.search(ast.get_docstring(node) or ""):
                unnamed.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}::{node.name}")
    assert not unnamed, "tests whose docstring does not name their reference:\n" + "\n".join(unnamed)


def test_every_builtin_schedule_is_in_an_equality_test() -> None:
    sources = equality_sources()
    if any("builtin_names()" in src for src in sources):  # a grid over every built-in
        return
    assert not _unheld({name: [f'"{name}"', f"'{name}'"] for name in pipedsl.builtin_names()})


def _train_options() -> dict[str, list[str]]:
    from pipedsl.trainer import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    train = parser._subparsers._group_actions[0].choices["train"]  # noqa: SLF001 - argparse keeps them there
    return {action.option_strings[-1]: [*(f'"{o}"' for o in action.option_strings),
                                         *(f"'{o}'" for o in action.option_strings), f"{action.dest}=",
                                         *ALSO.get(action.option_strings[-1], [])]
            for action in train._actions if action.option_strings}  # noqa: SLF001


def test_every_train_option_is_in_an_equality_test() -> None:
    options = _train_options()
    unheld = [o for o in _unheld(options) if o not in EXEMPT]
    assert not unheld, f"`pipedsl train` options that no equality test runs: {unheld}"
    assert set(EXEMPT) <= set(options), f"exempt options that no longer exist: {set(EXEMPT) - set(options)}"


def test_every_parallel_config_field_is_in_an_equality_test() -> None:
    from pipedsl.parallel import ParallelConfig

    fields = {f.name: [f"{f.name}=", f"--{f.name.replace('_', '-')}"] for f in dataclasses.fields(ParallelConfig)}
    assert not _unheld(fields)


def _pipeline_keywords() -> list[str]:
    """Pipeline's own keywords but `options` (a `PipelineOptions`), and each keyword that sets a field of it
    (runtime/options.py's KEYWORDS); every such field has one, but the schedule's parameters (any other keyword)."""
    from pipedsl.runtime.options import KEYWORDS, PipelineOptions

    own = [p.name for p in inspect.signature(pipedsl.Pipeline).parameters.values()
           if p.kind is inspect.Parameter.KEYWORD_ONLY or p.default is not inspect.Parameter.empty]
    groups = {group for group, _ in KEYWORDS.values() if group is not None}
    fields = {(None, f.name) for f in dataclasses.fields(PipelineOptions) if f.name not in groups}
    fields |= {(group, f.name) for group in groups for f in dataclasses.fields(getattr(PipelineOptions(), group))}
    assert fields - {("schedule", "params")} == set(KEYWORDS.values()), "an option without its keyword"
    return [k for k in own if k != "options"] + list(KEYWORDS)


def test_every_pipeline_keyword_is_in_an_equality_test() -> None:
    keywords = _pipeline_keywords()
    assert not [k for k in _unheld({k: [f"{k}="] for k in keywords}) if k not in PIPELINE_EXEMPT]
    assert set(PIPELINE_EXEMPT) <= set(keywords)
