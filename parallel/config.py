"""`ParallelConfig`: the data × pipeline × tensor layout of a run, validated before any group exists.

Every mistake is a `ParallelConfigError` with a one-line message that names the numbers
involved, so a launch fails at the first line of the training script, not inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.errors import PipeDSLError

TP_MODES = ("1d", "3d")
REDUCE_MODES = ("step", "microbatch")
RESHARD_MODES = ("unit", "step")  # what ZeroOptimizer runs
RESHARD_CHOICES = ("auto", *RESHARD_MODES)  # what a layout may ask for: "auto" picks by pp (`ParallelConfig.reshard`)


class ParallelConfigError(PipeDSLError):
    """A parallel layout that cannot work: sizes that do not multiply out or do not divide the model."""

    kind = "invalid parallel configuration"


def _cube_root(n: int) -> int | None:
    q = round(n ** (1 / 3))
    for c in (q - 1, q, q + 1):
        if c >= 1 and c ** 3 == n:
            return c
    return None


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks each dimension gets, and how tensor parallelism and ZeRO behave.

    `dp` data-parallel replicas, `pp` pipeline stages' ranks, `tp` tensor-parallel ranks per
    stage (a cube q³ for `tp_mode="3d"`, Bian et al. 2021), `zero` the ZeRO stage over the dp
    group (0 = plain data parallel).  Rank order is (pp, dp, tp), tp fastest, so a tensor-parallel
    group is made of consecutive ranks (the ones that talk most sit closest).

    `ep` shards each MoE layer's experts over groups of ep data-parallel ranks, which exchange
    their tokens with all-to-alls (parallel/expert.py; ep divides dp, Megatron's and torchtitan's
    placement); it adds no ranks.

    `zero_reduce` says when a pipeline reduces the gradients of its M microbatches over dp:
    "step" (default) sums them locally and reduces once after the stage's last backward
    (plain data-parallel traffic, overlapped with the cooldown); "microbatch" reduce-scatters
    after every microbatch's backward (true stage-2/3 gradient memory, M× the reduce-scatters
    on the critical path; ZeRO 2 and 3 only).

    `zero_reshard` (ZeRO-3) says when a unit's gathered parameters are freed: "unit" after each
    forward and backward that used them, so one unit is full at a time (2M all-gathers a unit a
    step); "step" after the stage's last backward of the step, one all-gather a unit a step for the
    memory of the stage's full parameters during the step (ZeRO-2's, freed between steps).  "auto"
    (default) is "step" in a pipeline (pp > 1: a stage holds 1/pp of the model, and 2M gathers on the
    critical path cost 1.26x the step at dp2 x pp2, M = 8; torchtitan's default for pipelines too)
    and "unit" without one (the step would hold the whole model).  `reshard` is the mode in effect.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    tp_mode: str = "1d"
    zero: int = 0
    zero_reduce: str = "step"
    ep: int = 1
    zero_reshard: str = "auto"

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "zero", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelConfigError(f"{name} must be an integer, got {value!r}")
        for name in ("dp", "pp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dp % self.ep:
            raise ParallelConfigError(f"ep={self.ep} does not divide dp={self.dp}: expert parallelism shards the "
                                      f"experts over groups of ep data-parallel ranks")
        if self.tp_mode not in TP_MODES:
            raise ParallelConfigError(f"tp_mode must be one of {', '.join(map(repr, TP_MODES))}, "
                                      f"got {self.tp_mode!r}")
        if not 0 <= self.zero <= 3:
            raise ParallelConfigError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero}")
        if self.zero_reduce not in REDUCE_MODES:
            raise ParallelConfigError(f"zero_reduce must be one of {', '.join(map(repr, REDUCE_MODES))}, "
                                      f"got {self.zero_reduce!r}")
        if self.zero_reduce == "microbatch" and self.zero < 2:
            raise ParallelConfigError(f"zero_reduce='microbatch' needs zero=2 or 3 (zero={self.zero} keeps the full "
                                      f"gradient buffer anyway); use zero_reduce='step'")
        if self.zero_reshard not in RESHARD_CHOICES:
            raise ParallelConfigError(f"zero_reshard must be one of {', '.join(map(repr, RESHARD_CHOICES))}, "
                                      f"got {self.zero_reshard!r}")
        if self.zero_reshard == "step" and self.zero != 3:
            raise ParallelConfigError(f"zero_reshard={self.zero_reshard!r} needs zero=3 (zero={self.zero} keeps the "
                                      f"full parameters anyway)")
        if self.tp_mode == "3d" and _cube_root(self.tp) is None:
            lo = max(1, int(self.tp ** (1 / 3)))
            near = sorted({lo ** 3, (lo + 1) ** 3})
            raise ParallelConfigError(f"tp_mode='3d' needs tp to be a cube q*q*q, got tp={self.tp} "
                                      f"(nearest cubes: {', '.join(map(str, near))})")

    @property
    def reshard(self) -> str:
        """The ZeRO-3 reshard mode in effect: `zero_reshard`, "auto" resolved by pp (see the class)."""
        if self.zero_reshard != "auto":
            return self.zero_reshard
        return "step" if self.pp > 1 else "unit"

    @property
    def world_size(self) -> int:
        """dp · pp · tp: the number of processes this layout needs."""
        return self.dp * self.pp * self.tp

    @property
    def q(self) -> int:
        """Edge of the 3-D tensor-parallel cube (tp = q³); 1-D layouts have none."""
        if self.tp_mode != "3d":
            raise ParallelConfigError("q (the cube edge) only exists for tp_mode='3d'")
        q = _cube_root(self.tp)
        assert q is not None
        return q

    def check_world(self, world_size: int) -> None:
        """Refuse a world whose size is not dp · pp · tp."""
        if world_size != self.world_size:
            raise ParallelConfigError(f"world size {world_size} is not dp*pp*tp = {self.dp}*{self.pp}*{self.tp} "
                                      f"= {self.world_size}")

    def check_model(self, *, hidden: int | None = None, heads: int | None = None, vocab: int | None = None,
                    ffn: int | None = None, batch: int | None = None, microbatches: int = 1,
                    experts: int | None = None) -> None:
        """Refuse model and batch sizes that this layout cannot split evenly.

        `batch` is the global batch in samples per step, split over `dp` replicas and
        `microbatches`; 3-D parallelism further splits each microbatch over q² ranks (the
        batch axis of a cube is its weight and input axes), and weights [in/q², out/q], so
        `hidden`, `ffn` and `vocab` must divide by q² and `heads` by q.
        """
        if microbatches < 1:
            raise ParallelConfigError(f"microbatches must be at least 1, got {microbatches}")
        if self.ep > 1 and experts is not None and experts % self.ep:
            raise ParallelConfigError(f"{experts} experts cannot be sharded evenly over ep={self.ep} ranks")
        if hidden is not None and heads is not None and hidden % heads:
            raise ParallelConfigError(f"hidden size {hidden} is not divisible by the {heads} attention heads")
        if self.tp_mode == "1d":
            t = self.tp
            for name, value in (("number of attention heads", heads), ("hidden size", hidden),
                                ("vocabulary size", vocab), ("ffn size", ffn)):
                if value is not None and value % t:
                    raise ParallelConfigError(f"{name} {value} is not divisible by tp={t} "
                                              f"(1-D tensor parallelism splits it over the tp ranks)")
        else:
            q = self.q
            if heads is not None and heads % q:
                raise ParallelConfigError(f"attention heads {heads} are not divisible by q={q} "
                                          f"(3-D tensor parallelism splits heads over a cube edge, tp={self.tp})")
            for name, value in (("hidden size", hidden), ("vocabulary size", vocab), ("ffn size", ffn)):
                if value is not None and value % (q * q):
                    raise ParallelConfigError(f"{name} {value} is not divisible by q*q={q * q} "
                                              f"(3-D weights are split [in/q^2, out/q], tp={self.tp})")
        if batch is not None:
            if batch % (self.dp * microbatches):
                raise ParallelConfigError(f"batch {batch} is not divisible by dp*microbatches = "
                                          f"{self.dp}*{microbatches} = {self.dp * microbatches}")
            if self.tp_mode == "3d":
                mb, q2 = batch // (self.dp * microbatches), self.q ** 2
                if mb % q2:
                    raise ParallelConfigError(f"microbatch of {mb} samples (batch {batch} / dp {self.dp} / "
                                              f"{microbatches} microbatches) is not divisible by q*q={q2} "
                                              f"(3-D tensor parallelism splits it over q^2 ranks)")
