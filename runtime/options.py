"""How a `Pipeline` runs, as a few typed options (frozen dataclasses, each checking its own values).

What runs is `Pipeline`'s arguments (stages, schedule and microbatches, or a compiled program) and where
it runs is `parallel=`; everything else is one `PipelineOptions`:

    PipelineOptions(schedule=ScheduleOptions(lookahead=16, strict_pair_order=False, overlap=True),
                    precision=MixedPrecision("bf16"), recompute=RecomputeOptions("selective", filter=is_attention),
                    loss=LossOptions("token", ignore_index=-100), batch="local")

The older flat keywords (`Pipeline(precision="bf16", recompute="full", lookahead=8, …)`) keep working: each
sets one field, as `KEYWORDS` maps it, and `with_keywords` applies them; any other keyword is a parameter
of the schedule (`V=2`), as it always was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime.loss import LOSS_REDUCTIONS
from pipedsl.runtime.precision import MixedPrecision, policy
from pipedsl.runtime.recompute import RECOMPUTE_MODES, ModulePredicate

if TYPE_CHECKING:  # pragma: no cover - for the annotations
    import torch
    import torch.distributed as dist

BATCH_MODES = ("global", "local")


@dataclass(frozen=True)
class ScheduleOptions:
    """How the executor runs the program's instructions.

    `lookahead`: how many receives may be posted ahead of the instruction that consumes them.
    `strict_pair_order`: never post a receive ahead of an earlier send to the same peer (off: on NCCL each
    direction of a pair has a communicator of its own, nccl_model.LAYOUT, so no receive queues behind a send).
    `overlap`: an F&B pair whose stages exchange tokens (expert parallelism) hides each half's exchanges behind
    the other's compute (overlap.py).  `params`: the schedule's own parameters (`V=2`), for compiling it.
    """

    lookahead: int = 16
    strict_pair_order: bool = False
    overlap: bool = True
    params: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strict_pair_order", bool(self.strict_pair_order))  # None was the old default
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))  # read-only: defaults are shared


@dataclass(frozen=True)
class RecomputeOptions:
    """Activation recomputation per stage (recompute.py): `mode` None (or "none"), "full" or "selective";
    `filter(module) -> bool` names the modules "selective" recomputes (e.g. the attention modules)."""

    mode: str | None = None
    filter: ModulePredicate | None = None

    def __post_init__(self) -> None:
        if self.mode == "none":
            object.__setattr__(self, "mode", None)
        if self.mode is not None and self.mode not in RECOMPUTE_MODES:
            raise PipeRuntimeError(f"recompute must be None, 'none', {', '.join(map(repr, RECOMPUTE_MODES))}, "
                                   f"got {self.mode!r}")
        if self.mode == "selective" and self.filter is None:
            raise PipeRuntimeError("recompute='selective' needs recompute_filter=predicate(module) -> bool, the "
                                   "modules whose activations are recomputed (e.g. the attention modules)")


@dataclass(frozen=True)
class LossOptions:
    """The loss's normalisation (loss.py): "microbatch" (each microbatch's mean, scaled 1/M) or "token" (the
    loss function's sum over the microbatch's tokens, divided by the global batch's targets != `ignore_index`).
    `check_finite`: refuse a step whose loss is inf/NaN (under fp16 loss scaling it is skipped instead)."""

    reduction: str = "microbatch"
    ignore_index: int = -100
    check_finite: bool = True

    def __post_init__(self) -> None:
        if self.reduction not in LOSS_REDUCTIONS:
            raise PipeRuntimeError(f"loss_reduction must be one of {', '.join(map(repr, LOSS_REDUCTIONS))}, "
                                   f"got {self.reduction!r}")


@dataclass(frozen=True)
class PipelineOptions:
    """Everything about how a pipeline runs but its program and its parallel layout (see the module docstring).

    `precision`: a `MixedPrecision`, or "fp32" / "bf16" / "fp16" (made one).  `batch`: "global" (every rank
    passes the global batch) or "local" (each dp replica its own share).  `ties`: parameters shared between
    stages, [[(stage, name), …], …], when they cannot be found in a list of stage modules.  `activation_bytes`:
    count the bytes every stage's saved tensors hold (a hook on every saved tensor, so off by default).
    `group`: the process group to run on (default the world; not with `parallel=`).  `device`: default the
    current CUDA device under NCCL, else the CPU.
    """

    schedule: ScheduleOptions = ScheduleOptions()
    precision: MixedPrecision = MixedPrecision()
    recompute: RecomputeOptions = RecomputeOptions()
    loss: LossOptions = LossOptions()
    batch: str = "global"
    ties: Sequence[Sequence[tuple[int, str]]] | None = None
    activation_bytes: bool = False
    group: dist.ProcessGroup | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", policy(self.precision))
        if self.batch not in BATCH_MODES:
            raise PipeRuntimeError(f"batch must be one of {', '.join(map(repr, BATCH_MODES))}, got {self.batch!r}")


# every older Pipeline keyword: (the PipelineOptions field holding its group, or None for its own field; the field)
KEYWORDS: dict[str, tuple[str | None, str]] = {
    "lookahead": ("schedule", "lookahead"),
    "strict_pair_order": ("schedule", "strict_pair_order"),
    "overlap": ("schedule", "overlap"),
    "precision": (None, "precision"),
    "recompute": ("recompute", "mode"),
    "recompute_filter": ("recompute", "filter"),
    "loss_reduction": ("loss", "reduction"),
    "ignore_index": ("loss", "ignore_index"),
    "check_finite": ("loss", "check_finite"),
    "batch": (None, "batch"),
    "ties": (None, "ties"),
    "activation_bytes": (None, "activation_bytes"),
    "group": (None, "group"),
    "device": (None, "device"),
}


def with_keywords(options: PipelineOptions | None, keywords: Mapping[str, Any]) -> PipelineOptions:
    """`options` (default `PipelineOptions()`) with the older keywords set (a keyword wins over `options`'s field);
    any keyword not in `KEYWORDS` is a schedule parameter, added to `schedule.params`."""
    if options is None:
        options = PipelineOptions()
    elif not isinstance(options, PipelineOptions):
        raise PipeRuntimeError(f"options= takes a PipelineOptions, got {type(options).__name__}")
    own: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in keywords.items():
        group, name_there = KEYWORDS.get(name, ("schedule", "params"))
        if group is None:
            own[name_there] = value
        elif name_there == "params":
            grouped.setdefault(group, {}).setdefault("params", dict(options.schedule.params))[name] = value
        else:
            grouped.setdefault(group, {})[name_there] = value
    own.update({group: replace(getattr(options, group), **changes) for group, changes in grouped.items()})
    return replace(options, **own) if own else options
