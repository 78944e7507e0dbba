"""The layers above the language, reached by name only.

`pipedsl/` is the bottom layer: `parallel`, `runtime`, `models`, `trainer` and `visualize` build on it,
and it imports none of them (tests/test_layers.py walks every import, function-level ones included).
What the `pipedsl` command and the package's top-level names lend from those layers is named here, as
module paths, and imported on first use: `pipedsl compile` never imports the trainer, and `import
pipedsl` never imports torch.  The same test checks that every name below resolves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True)
class Command:
    """A subcommand a module above the language adds: `add_parser(subparsers)`, then `run(args) -> status`."""

    module: str
    add_parser: str
    run: str


COMMANDS: dict[str, Command] = {
    "show": Command("pipedsl.visualize.show", "add_parser", "run"),
    "train": Command("pipedsl.trainer.cli", "add_parser", "run"),
    "run": Command("pipedsl.trainer.cli", "add_run_parser", "run_program"),
    "export": Command("pipedsl.trainer.cli", "add_export_parser", "export"),
}

# top-level names of `pipedsl` (its __getattr__) and what the CLI borrows, as "module:attribute"
API: dict[str, str] = {
    "Pipeline": "pipedsl.runtime.pipeline:Pipeline",
    "launch": "pipedsl.runtime.launch.launcher:launch",
    "exit_on_signals": "pipedsl.runtime.launch.lifecycle:exit_on_signals",  # stdlib only: no torch for compile
    "calibrate": "pipedsl.trainer.calibrate:calibrate",  # `pipedsl plan --calibrate`: runs local processes
    "SmallGPT": "pipedsl.trainer.calibrate:SmallGPT",
}


# names that lived in a lower package before the layout of 2026-11 and still resolve there, with a
# DeprecationWarning naming the new home: {package: {name: "module:attribute"}}
MOVED: dict[str, dict[str, str]] = {
    "pipedsl.runtime": {
        "causal_lm_loss": "pipedsl.models.hf.stages:causal_lm_loss",
        "causal_lm_stages": "pipedsl.models.hf.stages:causal_lm_stages",
        "shift_labels": "pipedsl.models.hf.stages:shift_labels",
        "split_gpt": "pipedsl.models.split:split_gpt",
        "split_sequential": "pipedsl.models.split:split_sequential",
    },
    "pipedsl.parallel": {
        "PipelineOptimizer": "pipedsl.runtime.optim:PipelineOptimizer",
        "tp_gpt_loss": "pipedsl.models.gpt.parallelize:tp_gpt_loss",
        "tp_gpt_stages": "pipedsl.models.gpt.parallelize:tp_gpt_stages",
        "tp_hf_loss": "pipedsl.models.hf.parallelize:tp_hf_loss",
        "tp_hf_stages": "pipedsl.models.hf.parallelize:tp_hf_stages",
    },
}


def moved(package: str, name: str) -> Any:
    """`package.name` from its new home (`MOVED`), with a DeprecationWarning; AttributeError if it never was."""
    target = MOVED.get(package, {}).get(name)
    if target is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    import warnings

    public = ".".join(target.partition(":")[0].split(".")[:2])  # the package that exports it now
    warnings.warn(f"{package}.{name} moved to {public}.{name}", DeprecationWarning, stacklevel=3)
    return resolve(target)


def resolve(target: str) -> Any:
    """The object a "module:attribute" name stands for (imported now)."""
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def lend(name: str) -> Any:
    """One of `API`'s objects."""
    return resolve(API[name])


def lazy_attributes(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A package's `__getattr__` that imports `exports[name]` (a submodule of `package`) on first use, so that
    importing the package imports neither torch nor its heavier modules."""
    def attribute(name: str) -> Any:
        if name not in exports:
            return moved(package, name)
        return getattr(import_module(f"{package}.{exports[name]}"), name)
    return attribute
