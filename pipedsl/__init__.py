"""pipedsl: pipeline-parallel schedules as data, compiled to validated per-rank programs."""

from pipedsl.compiler import Schedule
from pipedsl.errors import (
    DeadlockError,
    PipeDSLError,
    PipeRuntimeError,
    PipeSemanticError,
    PipeSyntaxError,
    ValidationError,
)
from pipedsl.ir import Instr, Op, Program
from pipedsl.library import builtin_names, load
from pipedsl.simulate import Cost, simulate
from pipedsl.timeline import Event, Timeline
from pipedsl.torch_csv import from_torch_csv, to_torch_csv
from pipedsl.validate import validate

__all__ = [
    "Cost",
    "DeadlockError",
    "Event",
    "Instr",
    "Op",
    "PipeDSLError",
    "PipeRuntimeError",
    "PipeSemanticError",
    "PipeSyntaxError",
    "Program",
    "Schedule",
    "Timeline",
    "Pipeline",  # lazy (torch)
    "ValidationError",
    "builtin_names",
    "from_torch_csv",
    "launch",  # lazy (torch)
    "load",
    "simulate",
    "to_torch_csv",
    "validate",
]
__version__ = "0.1.0"


# Pipeline and launch are imported on first use: `import pipedsl` and the CLI stay torch-free (registry.py).
def __getattr__(name: str):
    if name in ("Pipeline", "launch"):
        from pipedsl.registry import lend

        return lend(name)
    raise AttributeError(f"module 'pipedsl' has no attribute {name!r}")
