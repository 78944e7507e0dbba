"""One point of the search space: how a model is laid out on a cluster."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """dp × pp × tp ranks, ZeRO stage, pipeline schedule and its batch split.

    `microbatch` samples per microbatch and `microbatches` (M) per pipeline and iteration, so
    global batch = dp · M · microbatch.  `params` are the schedule's parameters (V, W).
    """

    dp: int
    pp: int
    tp: int
    schedule: str
    microbatch: int
    microbatches: int
    zero: int = 0
    recompute: bool = True
    tp_mode: str = "1d"  # or "3d" (tp = q³)
    params: tuple[tuple[str, int], ...] = ()
    grads: str = "bf16"  # bf16 parameters, fp32 main parameters; gradients in bf16 (the ZeRO paper) or fp32 (Megatron)

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
        return (f"dp{self.dp} pp{self.pp} {tp} {self.schedule}{extra} b{self.microbatch} M{self.microbatches} "
                f"zero{self.zero}{' recompute' if self.recompute else ''}{grads}")
