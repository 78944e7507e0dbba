"""Predict a program's timeline from a cost model (docs/architecture.md, "The language")."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from functools import partial

from pipedsl.engine import dry_run
from pipedsl.errors import PipeDSLError
from pipedsl.ir import Instr, Op, Program
from pipedsl.limits import MAX_COST, MAX_STAGES, shorten
from pipedsl.perf import no_gc
from pipedsl.steps import prove_consecutive
from pipedsl.timeline import Event, Timeline

_KINDS = ("F", "B", "I", "W")
_EXCHANGES = ("exchange_f", "exchange_b")  # also per stage
_COMPUTE_OPS = (Op.F, Op.B, Op.I, Op.W)


@dataclass(frozen=True)
class Cost:
    """Time per op kind (optionally per stage) and per message.

    A message costs `comm + message_bytes / bandwidth` from the start of its send to its
    arrival; issuing the send keeps the sending rank busy for `send` (a runtime's cost per
    message: 0 in the ideal model).  REDUCE_GRAD and OPTIMIZER_STEP cost `reduce` and `step`.
    An overlapped pair F&B costs `FB` when given (what overlap buys: DeepSeek's F&B < F + B).
    Else, with `exchange_f` / `exchange_b` — the seconds a stage's forward / backward waits for
    its expert all-to-alls, inside F and B — the halves hand over at every exchange
    (runtime/overlap.py), so one's exchanges hide behind the other's compute:
    max(F + B − exchange_f − exchange_b, F, B) (each half still waits for its own chain);
    else the sum of its halves' costs.
    `Cost.fit(timeline)` measures all of them from a trace.
    `wmem` is the share of an activation a pending W holds, from its I to its W (the inputs and output
    gradients of the linear layers: 32h / (34h + 5as) bytes of a token's in the zero-bubble paper's unfused
    attention, about 0.9 with fused attention, above 1 where the gradients kept for W outweigh what I frees;
    1, the default, counts whole activations until W): memory caps (`memory`, `order auto`) and
    `Timeline.peak_activations` count an activation 1 from F to I and `wmem` after (a cap reserves the larger
    of the two from F on).
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the papers' name
    W: float = 1.0
    FB: float | None = None  # an overlapped pair F&B; None: from its halves (see above)
    exchange_f: float = 0.0  # of F: waiting for expert exchanges (what an overlapped pair can hide)
    exchange_b: float = 0.0  # of B: the same
    comm: float = 0.0
    bandwidth: float = float("inf")
    message_bytes: float = 0.0
    reduce: float = 0.0
    step: float = 0.0
    send: float = 0.0
    wmem: float = 1.0
    per_stage: dict[int, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Every cost a finite number in [0, MAX_COST] (bandwidth: > 0, or inf for none), so
        no sum along a path overflows and no message divides by zero."""
        for name in _NAMES:
            _check_cost(name, getattr(self, name))
        if not isinstance(self.per_stage, dict):
            raise PipeDSLError(f"Cost: per_stage is a dict {{stage: {{kind: cost}}}}, "
                               f"got {type(self.per_stage).__name__}")
        for stage, costs in self.per_stage.items():
            if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < MAX_STAGES:
                raise PipeDSLError(f"Cost: per-stage costs name a stage 0..{MAX_STAGES - 1:,}, got {str(stage)[:20]}")
            if not isinstance(costs, dict) or not set(costs) <= set(_KINDS) | set(_EXCHANGES):
                raise PipeDSLError(f"Cost: per_stage[{stage}] maps F, B, I, W, exchange_f or exchange_b to a cost")
            for kind, value in costs.items():
                _check_cost(f"{kind}@{stage}", value)

    @classmethod
    def parse(cls, text: str) -> Cost:
        """`"F=1,B=2,comm=0.1"`; per stage: `"F@3=1.5"` (stage 3's forward costs 1.5)."""
        cost = cls()
        per_stage: dict[int, dict[str, float]] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if not sep or number != number or number < 0:
                raise PipeDSLError(f"--cost: {part[:40]!r} is not NAME=VALUE with a non-negative number "
                                   f"(names: {', '.join(_NAMES)}; per stage: F@3=1.5)")
            kind, at, stage = name.partition("@")
            try:
                if at:
                    if kind not in _KINDS or not stage.isdigit() or len(stage) > len(str(MAX_STAGES)):
                        raise PipeDSLError(f"{part[:40]!r}: per-stage costs are F@S, B@S, I@S or W@S with a stage "
                                           f"below {MAX_STAGES:,}")
                    _check_cost(name, number)
                    per_stage.setdefault(int(stage), {})[kind] = number
                elif name in _NAMES:
                    cost = replace(cost, **{name: number})
                else:
                    raise PipeDSLError(f"unknown cost {name[:20]!r} (names: {', '.join(_NAMES)})")
            except PipeDSLError as err:
                raise PipeDSLError(f"--cost: {err.message.removeprefix('Cost: ')}") from None
        return replace(cost, per_stage=per_stage) if per_stage else cost

    @classmethod
    def fit(cls, timeline: Timeline, statistic: str = "median") -> Cost:
        """The costs a (measured) timeline shows: the median duration of each compute kind
        overall and per stage, of REDUCE_GRAD, OPTIMIZER_STEP and sends (`send`), and as `comm` the median
        delay from a send's start to the start of the compute op consuming the message, over
        the messages whose receiver had nothing else left to do before that op when the send
        started (so the delay is the message's own).  The consumer's start, not the RECV's end,
        marks the arrival: the runtime posts receives early and waits in the consumer, the
        simulator blocks in the RECV right before it — both start the consumer on arrival.
        Kinds absent from the trace keep the default ratios to F.

        `statistic="mean"` takes means instead of medians: the simulator adds costs along
        paths, and the expected length of a path is the sum of the *mean* costs — medians
        leave out the tail of a skewed distribution (a send that blocks, a late wake-up)."""
        if statistic not in ("median", "mean"):
            raise PipeDSLError(f"Cost.fit: statistic is 'median' or 'mean', got {statistic!r}")
        center = statistics.median if statistic == "median" else statistics.fmean
        durations: dict[tuple[str, int | None], list[float]] = {}
        sends: dict[tuple, float] = {}
        waits: list[tuple[tuple, float, float]] = []  # (message, receiver ready, consumer start)
        for rank, events in enumerate(timeline.ranks):
            expected: dict[tuple, tuple] = {}  # (is F, mb, stage, replica) of a consumer -> its message
            ready = events[0].start if events else 0.0  # end of the receiver's last non-RECV event
            for e in events:
                op, ins = e.instr.op, e.instr
                if op is Op.OVERLAP:
                    durations.setdefault(("FB", None), []).append(e.end - e.start)
                    ready = e.end  # the pair's messages give no comm sample: not told apart
                    continue
                if op in _COMPUTE_OPS:
                    durations.setdefault((op.value, None), []).append(e.end - e.start)
                    durations.setdefault((op.value, ins.stage), []).append(e.end - e.start)
                    msg = expected.pop((op is Op.F, ins.mb, ins.stage, ins.replica), None)
                    if msg is not None:
                        waits.append((msg, ready, e.start))
                elif op is Op.REDUCE_GRAD or op is Op.OPTIMIZER_STEP:
                    durations.setdefault((op.value, None), []).append(e.end - e.start)
                elif op is Op.SEND_F or op is Op.SEND_B:
                    durations.setdefault(("send", None), []).append(e.end - e.start)
                    sends[(op is Op.SEND_F, ins.mb, ins.stage + (1 if op is Op.SEND_F else -1), ins.replica,
                           rank, ins.peer)] = e.start
                else:
                    expected[(op is Op.RECV_F, ins.mb, ins.stage, ins.replica)] = (
                        op is Op.RECV_F, ins.mb, ins.stage, ins.replica, ins.peer, rank)
                    continue
                ready = e.end
        med = {k: center(v) for k, v in durations.items()}
        f = med.get(("F", None), 1.0)
        base = {"F": f, "B": med.get(("B", None), 2 * f)}
        base["I"] = med.get(("I", None), base["B"] / 2)
        base["W"] = med.get(("W", None), base["B"] / 2)
        delays = [start - sends[key] for key, ready, start in waits if key in sends and ready <= sends[key]]
        per_stage: dict[int, dict[str, float]] = {}
        for (kind, stage), value in med.items():
            if stage is not None:
                per_stage.setdefault(stage, {})[kind] = value
        return cls(**base, FB=med.get(("FB", None)), comm=center(delays) if delays else 0.0,
                   reduce=med.get(("REDUCE_GRAD", None), 0.0), step=med.get(("OPTIMIZER_STEP", None), 0.0),
                   send=med.get(("send", None), 0.0), per_stage=per_stage)

    def compute_time(self, ins: Instr) -> float:
        op = ins.op
        if op is Op.REDUCE_GRAD:
            return self.reduce
        if op is Op.OPTIMIZER_STEP:
            return self.step
        if op is Op.OVERLAP:
            if self.FB is not None:
                return self.FB
            fwd, bwd = ins.sub
            f, b = self.compute_time(fwd), self.compute_time(bwd)
            xf = self.per_stage.get(fwd.stage, {}).get("exchange_f", self.exchange_f)
            xb = self.per_stage.get(bwd.stage, {}).get("exchange_b", self.exchange_b)
            return max(f + b - xf - xb, f, b)
        over = self.per_stage.get(ins.stage)
        if over and op.value in over:
            return over[op.value]
        return getattr(self, op.value)

    def message_time(self, ins: Instr) -> float:
        if self.bandwidth == float("inf") or not self.message_bytes:
            return self.comm
        return self.comm + self.message_bytes / self.bandwidth


_NAMES = ("F", "B", "I", "W", "FB", "comm", "bandwidth", "message_bytes", "reduce", "step", "send", "exchange_f",
          "exchange_b", "wmem")


def _check_cost(name: str, value: object) -> None:
    if name == "FB" and value is None:  # F + B of the pair's halves
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise PipeDSLError(f"Cost: {name} is a number, got {type(value).__name__}")
    if name == "bandwidth":
        if not (value > 0 and (value <= MAX_COST or value == float("inf"))):
            raise PipeDSLError(f"Cost: bandwidth={shorten(value)} must be in (0, {MAX_COST:g}] or inf (MAX_COST)")
    elif not 0 <= value <= MAX_COST:  # false for nan too
        raise PipeDSLError(f"Cost: {name}={shorten(value)} must be a finite number in [0, {MAX_COST:g}] "
                           f"(MAX_COST)")


def simulate(program: Program, cost: Cost | str | None = None, steps: int = 1) -> Timeline:
    """Event-driven replay of a (validated) program under `cost`; returns the predicted `Timeline`.  `steps` > 1:
    that many consecutive steps without a barrier between them (steps that overlap, post-validated;
    pipedsl/steps.py), each proven hang-free together first."""
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    cost = cost or Cost()
    if not isinstance(cost, Cost):
        raise PipeDSLError(f"simulate: cost is a Cost, a string like 'F=1,B=2' or None, got {type(cost).__name__}")
    if not isinstance(program, Program):
        raise PipeDSLError(f"simulate: program is a Program, got {type(program).__name__}")
    table: dict[Op, dict[int | None, float]] = {op: {} for op in Op}  # op -> stage -> cost; a pair: by itself

    def compute_time(ins: Instr) -> float:
        by_stage = table[ins[0]]
        k = ins[2] if ins[5] is None else ins
        t = by_stage.get(k)
        if t is None:
            t = by_stage[k] = cost.compute_time(ins)
        return t

    with no_gc():
        program = prove_consecutive(program, steps)  # validated; several steps proven together
        # Cost's message time is the same for every message (a subclass may say otherwise): one number, no call each
        per_message = type(cost).message_time is not Cost.message_time
        latency = cost.message_time if per_message else cost.message_time(None)  # type: ignore[arg-type]
        starts, ends = dry_run(program, compute_time, latency, send_time=cost.send)
        meta = {"cost": {k: getattr(cost, k) for k in _NAMES}} | ({"steps": steps} if steps != 1 else {})
        return simulated_timeline(program, starts, ends, meta)


def simulated_timeline(program: Program, starts: list[list[float]], ends: list[list[float]],
                       meta: dict) -> Timeline:
    """The predicted `Timeline` of `program` from each instruction's start and end (a replay's output)."""
    new = partial(tuple.__new__, Event)  # without NamedTuple's Python-level __new__: 10⁶ events
    ranks = tuple(tuple(map(new, zip(stream, st, en))) for stream, st, en in zip(program.ranks, starts, ends))
    return Timeline(program.name, dict(program.params), ranks, "simulated", meta)
