"""One point of the search space: how a model is laid out on a cluster."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from pipedsl.errors import PipeDSLError
from pipedsl.plan.activations import RECOMPUTE_MODES

T = TypeVar("T")

ATTENTION = ("eager", "fused")
SPLITS = ("even", "balanced")  # how a layout cuts the layers into stages (cost.py's `stage_layers`)
RESHARDS = ("auto", "unit", "step")  # when ZeRO-3 frees gathered parameters (parallel/config.py's RESHARD_CHOICES)


def _auto_reshard(pp: int) -> str:
    """`zero_reshard="auto"`'s mode, as `ParallelConfig.reshard` resolves it: a pipeline's stage holds 1/pp of the
    model whole through the step; without a pipeline that would be all of it."""
    return "step" if pp > 1 else "unit"


@dataclass(frozen=True)
class Layout:
    """dp × pp × tp ranks, ZeRO stage, pipeline schedule and its batch split.

    `microbatch` samples per microbatch and `microbatches` (M) per pipeline and iteration, so
    global batch = dp · M · microbatch.  `params` are the schedule's parameters (V, W).  `recompute`
    "none", "selective" or "full" (True/False read as "full"/"none"); `sequence_parallel` only with
    1-D tp > 1; `attention` "eager" (s² scores stored) or "fused" (FlashAttention-style); `ep` the
    expert-parallel degree of an MoE model, taken from the dp ranks (ep divides dp and the expert count);
    `split` how the layers are cut into stages ("even" or "balanced", cost.py's `stage_layers`);
    `zero_reshard` when ZeRO-3 frees a unit's gathered parameters, as `ParallelConfig.zero_reshard`
    ("auto": "step" when pp > 1, else "unit"; `reshard` resolves it).
    """

    dp: int
    pp: int
    tp: int
    schedule: str
    microbatch: int
    microbatches: int
    zero: int = 0
    recompute: str = "full"
    tp_mode: str = "1d"  # or "3d" (tp = q³)
    params: tuple[tuple[str, int], ...] = ()
    grads: str = "bf16"  # bf16 parameters, fp32 main parameters; gradients in bf16 (the ZeRO paper) or fp32 (Megatron)
    sequence_parallel: bool = False
    attention: str = "eager"
    ep: int = 1  # expert parallelism (MoE models): the routed experts split over ep of the dp ranks
    split: str = "even"  # "even": every stage the same layers (Megatron); "balanced": by FLOPs, the head counted
    zero_reshard: str = "auto"  # ZeRO-3: "unit" (2M gathers a unit a step), "step" (one; the stage whole in the step)

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute is one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention is one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"ep must divide dp {self.dp}, got {self.ep}")
        if self.split not in SPLITS:
            raise ValueError(f"split is one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.zero_reshard not in RESHARDS:
            raise ValueError(f"zero_reshard is one of {', '.join(RESHARDS)}, got {self.zero_reshard!r}")

    @property
    def fused(self) -> bool:
        return self.attention == "fused"

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (1-D tp > 1 only)."""
        return self.sequence_parallel and self.tp > 1 and self.tp_mode == "1d"

    @property
    def reshard(self) -> str:
        """ZeRO-3's reshard mode in effect ("unit" or "step"), "auto" resolved as the runtime does; "unit" below
        ZeRO-3 (nothing is gathered)."""
        if self.zero < 3:
            return "unit"
        return _auto_reshard(self.pp) if self.zero_reshard == "auto" else self.zero_reshard

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def schedule_params(self) -> dict[str, int]:
        return dict(self.params)

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.params)
        tp = f"tp{self.tp}" + ("(3d)" if self.tp_mode == "3d" else "")
        grads = " fp32-grads" if self.grads == "fp32" else ""
        recompute = {"none": "", "full": " recompute", "selective": " selective"}[self.recompute]
        return (f"dp{self.dp} pp{self.pp} {tp}{'+sp' if self.sequence_parallel else ''} {self.schedule}{extra} "
                f"b{self.microbatch} M{self.microbatches} zero{self.zero}{self._reshard_label}{recompute}"
                f"{' flash' if self.fused else ''}{grads}{f' ep{self.ep}' if self.ep > 1 else ''}"
                f"{' balanced' if self.split == 'balanced' else ''}")

    @property
    def _reshard_label(self) -> str:
        """"/unit" or "/step" where ZeRO-3 runs other than `pipedsl train --zero 3`'s default would ("auto")."""
        return f"/{self.reshard}" if self.zero == 3 and self.reshard != _auto_reshard(self.pp) else ""


class LayoutError(PipeDSLError):
    """A layout that cannot run: the reason says which rule it breaks."""


def resharded_to_fit(layout: Layout, attempt: Callable[[Layout], T]) -> tuple[Layout, T]:
    """`attempt(layout)`, and the layout it ran.  A ZeRO-3 pipeline left on "auto" runs "step" (each unit gathered
    once a step: never slower than "unit", which gathers it again for every op); where that is out of memory, the
    same layout resharding by "unit" (two units whole at a time) is tried, as `pipedsl train --zero-reshard unit`
    would run it."""
    try:
        return layout, attempt(layout)
    except LayoutError as err:
        if not (layout.zero == 3 and layout.zero_reshard == "auto" and layout.reshard == "step"
                and err.message.startswith("out of memory")):
            raise
        unit = replace(layout, zero_reshard="unit")
        return unit, attempt(unit)
