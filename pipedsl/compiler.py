"""`Schedule`: a parsed `.pipe` declaration that binds sizes and compiles to a `Program`.

Compilation: bind parameters → evaluate `require`s and `let`s → placement (stage, replica
→ rank) and routing (microbatch → replica) → each rank's compute order → lowering →
validation.  The order comes from one fixed rule (docs/language.md): sort the rank's forwards by
the `order F` key and its backwards by the `order B` key (ties by microbatch, stage,
replica); emit `warmup` forwards, then one forward and one backward alternately until the
forwards run out, then the remaining backwards.  With `merge` instead of `warmup`, the
forwards and backwards form one sequence sorted by their keys (the F and B keys compared
with each other, a forward first on ties): the keys are then ideal start times.  With
`wlag` the backward is split into I (input gradient) and W (weight gradient), each W
emitted `wlag` backwards after its I.  A `compute` block replaces the rule by an explicit
per-rank list.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pipedsl import nodes as n
from pipedsl.auto_order import search_orders
from pipedsl.errors import PipeDSLError, PipeSemanticError, Span, ValidationError
from pipedsl.expr import BOOL, INT, Env, Expansion, compile_exprs, evaluate, free_context, type_of
from pipedsl.ir import Instr, Op, Program
from pipedsl.limits import MAX_COMPUTE_OPS, MAX_COMPUTE_STEPS, MAX_MICROBATCHES, MAX_RANKS, MAX_VALUE_BITS, shorten
from pipedsl.lowering import ComputeOp, ComputePlan, lower, parts
from pipedsl.parser import parse
from pipedsl.perf import no_gc
from pipedsl.simulate import Cost, simulate
from pipedsl.squeeze import squeeze
from pipedsl.validate import validate

# Which context variables each declaration may use.
CONTEXT: dict[str, tuple[str, ...]] = {
    "stages": (),
    "replicas": (),
    "route": ("m",),
    "place": ("s", "c"),
    "order": ("m", "s", "v", "c", "r"),
    "warmup": ("r",),
    "wlag": ("r",),
    "memory": ("r",),
    "period": (),
    "require": (),
}
ALL_CONTEXT = ("m", "s", "v", "c", "r")
BUILTIN_PARAMS = ("P", "M")
_OPS = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}


@dataclass(frozen=True)
class Parameter:
    name: str
    default: n.Expr | None


class Schedule:
    """A schedule declaration, checked once when loaded; `compile` binds sizes."""

    def __init__(self, decl: n.ScheduleDecl, file: str = "<string>") -> None:
        self.decl = decl
        self.file = file
        self.source = decl.source
        try:
            self._check()
        except PipeDSLError as err:
            raise err.with_source(self.source) from None

    @classmethod
    def from_text(cls, text: str, file: str = "<string>") -> Schedule:
        return cls(parse(text, file), file)

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def doc(self) -> str:
        return next((s.text for s in self.decl.body if isinstance(s, n.Doc)), "")

    @property
    def searched(self) -> bool:
        """Whether its order is searched from costs (`order auto`): it needs the costs it will run under."""
        return any(isinstance(stmt, n.Flag) and stmt.keyword == "order auto" for stmt in self.decl.body)

    @property
    def parameters(self) -> list[Parameter]:
        """Declared parameters beyond P and M, in order."""
        return [Parameter(p.name, p.default) for p in self.decl.params if p.name not in BUILTIN_PARAMS]

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, file={self.file!r})"

    # ------------------------------------------------------------ static checks

    def _check(self) -> None:
        seen_params: dict[str, n.Param] = {}
        expansion = Expansion()
        for expr, visible in _expressions(self.decl):  # before anything walks them with lets inlined
            expansion.charge(expr, visible)
        env = Env()
        for p in self.decl.params:
            if p.name in seen_params:
                raise PipeSemanticError(f"parameter {p.name!r} is declared twice", p.span)
            if p.name in BUILTIN_PARAMS and p.default is not None:
                raise PipeSemanticError(f"{p.name} is always given by the caller and takes no default", p.span)
            if p.name in ALL_CONTEXT:
                raise PipeSemanticError(f"{p.name!r} is a context variable (m, s, v, c, r) and cannot be a "
                                        f"parameter", p.span)
            if p.default is not None:
                _require_type(p.default, env, (), INT, f"the default of {p.name}")
            seen_params[p.name] = p
            env.consts[p.name] = 0
        for name in BUILTIN_PARAMS:
            env.consts.setdefault(name, 0)
        settings: dict[str, n.Stmt] = {}
        for stmt in self.decl.body:
            match stmt:
                case n.Require(cond=cond):
                    _require_type(cond, env, (), BOOL, "require")
                case n.Let(name=name, value=value, span=span):
                    if name in env.consts or name in env.macros or name in ALL_CONTEXT:
                        raise PipeSemanticError(f"{name!r} is already defined", span)
                    type_of(value, env, ALL_CONTEXT, f"let {name}")
                    env.macros[name] = value
                case n.Setting(keyword=kw, value=value):
                    _once(settings, kw, stmt)
                    _require_type(value, env, CONTEXT[kw], INT, kw)
                case n.Order(kind=kind, keys=keys):
                    _once(settings, f"order {kind}", stmt)
                    for k in keys:
                        _require_type(k, env, CONTEXT["order"], INT, f"order {kind}")
                case n.Compute(body=body):
                    _once(settings, "compute", stmt)
                    _check_items(body, env, ("r",))
                case n.Flag(keyword=kw):
                    _once(settings, kw, stmt)
                case n.Doc():
                    _once(settings, "doc", stmt)
        if "merge" in settings:
            if "warmup" in settings:
                raise PipeSemanticError("'warmup' has no effect with 'merge' (the F and B keys alone decide the "
                                        "order); use one or the other", settings["warmup"].span)
            for kw in ("order F", "order B"):
                if kw not in settings and "compute" not in settings:
                    raise PipeSemanticError(f"'merge' compares the 'order F' and 'order B' keys with each other, "
                                            f"so it needs both ('{kw}' is missing)", settings["merge"].span)
        if "memory" in settings:
            for kw in ("warmup", "merge"):
                if kw in settings:
                    raise PipeSemanticError(f"'{kw}' has no effect with 'memory' (the compiler orders the ops "
                                            f"greedily under the cap); use one or the other", settings[kw].span)
        if "order auto" in settings:
            if "memory" not in settings:
                raise PipeSemanticError("'order auto' searches each rank's order under a memory cap: it needs "
                                        "'memory CAP'", settings["order auto"].span)
            if "wlag" in settings:
                raise PipeSemanticError("'wlag' has no effect with 'order auto' (the search places every W); use "
                                        "one or the other", settings["wlag"].span)
        elif "period" in settings:
            raise PipeSemanticError("'period' says what 'order auto' minimises; without 'order auto' it has no "
                                    "effect", settings["period"].span)
        if "compute" in settings:
            for kw in ("order F", "order B", "order auto", "warmup", "merge", "wlag", "memory"):
                if kw in settings:
                    raise PipeSemanticError(f"'{kw}' has no effect next to an explicit 'compute' block; "
                                            f"use one or the other", settings[kw].span)

    # ------------------------------------------------------------ binding

    def bind(self, P: int, M: int, **params: int) -> dict[str, int]:
        """Parameter values (P, M, declared ones with defaults filled in), checked."""
        values: dict[str, int] = {}
        for name, v, most in (("P", P, MAX_RANKS), ("M", M, MAX_MICROBATCHES)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PipeSemanticError(f"{name} must be a positive integer, got {shorten(v)}", self.decl.span)
            if v > most:
                limit = "MAX_RANKS" if name == "P" else "MAX_MICROBATCHES"
                raise PipeSemanticError(f"{name}={shorten(v)} is over the limit of {most:,} ({limit})", self.decl.span)
            values[name] = v
        declared = {p.name: p for p in self.decl.params if p.name not in BUILTIN_PARAMS}
        unknown = sorted(set(params) - set(declared))
        if unknown:
            takes = ", ".join(declared) or "no other parameters"
            raise PipeSemanticError(f"schedule {self.name!r} has no parameter {unknown[0]!r} (it takes P, M"
                                    f"{', ' + takes if declared else ''})", self.decl.span)
        env = Env(consts=values)
        for name, p in declared.items():
            if name in params:
                v = params[name]
                if not isinstance(v, int) or isinstance(v, bool):
                    raise PipeSemanticError(f"parameter {name} must be an integer, got {shorten(v)}", p.span)
                if v.bit_length() > MAX_VALUE_BITS:
                    raise PipeSemanticError(f"parameter {name}={shorten(v)} is over the limit of 2**{MAX_VALUE_BITS} "
                                            f"(MAX_VALUE_BITS)", p.span)
                values[name] = v
            elif p.default is not None:
                values[name] = _eval_int(p.default, env, {})
            else:
                raise PipeSemanticError(f"parameter {name} has no default: give it (-p {name}=…)", p.span)
        return values

    def plan(self, P: int, M: int, cost: Cost | str | None = None, **params: int) -> ComputePlan:
        """Bind sizes and derive placement, routing and each rank's compute order (`cost`: what `order auto`
        searches with; other schedules ignore it)."""
        try:
            return self._plan(P, M, params, _cost(cost))
        except PipeDSLError as err:
            raise err.with_source(self.source) from None

    def compile(self, P: int, M: int, cost: Cost | str | None = None, **params: int) -> Program:
        """Bind sizes, derive the per-rank orders, lower and validate them.  `cost` (a `Cost` or "F=1,B=2,…"):
        the op and message times an `order auto` schedule is searched under (default `Cost()`)."""
        with no_gc():
            plan = self.plan(P, M, cost, **params)
            program = lower(plan)
            try:
                return validate(program)
            except ValidationError as err:
                raise self._blame(plan, err).with_source(self.source) from None

    def _plan(self, P: int, M: int, params: dict[str, int], cost: Cost | None = None) -> ComputePlan:
        values = self.bind(P, M, **params)
        env = Env(consts=dict(values))
        decls: dict[str, tuple[n.Stmt, Env]] = {}
        for stmt in self.decl.body:
            match stmt:
                case n.Require(cond=cond, message=message, span=span):
                    if not evaluate(cond, env, {}):
                        shown = ", ".join(f"{k}={v}" for k, v in values.items())
                        raise PipeSemanticError(f"requirement failed: {message}", span, notes=(f"with {shown}",))
                case n.Let(name=name, value=value):
                    if free_context(value, env, ALL_CONTEXT):
                        env.macros[name] = value
                    else:
                        env.consts[name] = _eval_int(value, env, {})
                case n.Setting(keyword=kw) | n.Flag(keyword=kw):
                    decls[kw] = (stmt, _snapshot(env))
                case n.Order(kind=kind):
                    decls[f"order {kind}"] = (stmt, _snapshot(env))
                case n.Compute():
                    decls["compute"] = (stmt, _snapshot(env))
        b = _Binder(self, values, env, decls, cost)
        return b.plan()

    # ------------------------------------------------------------ diagnosis

    def _blame(self, plan: ComputePlan, err: ValidationError) -> PipeDSLError:
        """Point a failed validation at the declaration responsible for it."""
        sizes = ", ".join(f"{k}={v}" for k, v in plan.params.items())
        if "compute" in plan.meta["decl_spans"]:
            span, what = plan.meta["decl_spans"]["compute"], "the explicit compute order cannot run"
        else:
            stuck_f = _first_stall(plan, forward=True)
            stuck_b = _first_stall(plan, forward=False) if stuck_f is None else None
            early_b = _backward_before_forward(plan) if not (stuck_f or stuck_b) else None
            mixer = "merge" if "merge" in plan.meta["decl_spans"] else "warmup"
            key = "order F" if stuck_f else ("order B" if stuck_b or early_b else mixer)
            span = plan.meta["decl_spans"].get(key) or self.decl.span
            detail = stuck_f or stuck_b or early_b
            if key == "warmup":
                what = ("the forwards and backwards are each in a feasible order, but the warmup interleaves them "
                        "so that ranks wait on each other")
            elif key == "merge":
                what = ("the forwards and backwards are each in a feasible order, but merging them by their keys "
                        "puts a backward before its forward or makes ranks wait on each other")
            else:
                what = f"'{key}' puts an op before one it depends on: {detail}"
        return PipeSemanticError(f"schedule cannot make progress with {sizes}: {what}", span,
                                 notes=(err.message,))


def _cost(cost: Cost | str | None) -> Cost | None:
    if cost is None or isinstance(cost, Cost):
        return cost
    if isinstance(cost, str):
        return Cost.parse(cost)
    raise PipeDSLError(f"compile: cost is a Cost, a string like 'F=1,B=2' or None, got {type(cost).__name__}")


class _Binder:
    """Evaluates the declarations of one schedule for one set of sizes."""

    def __init__(self, schedule: Schedule, values: dict[str, int], env: Env,
                 decls: dict[str, tuple[n.Stmt, Env]], cost: Cost | None = None) -> None:
        self.schedule = schedule
        self.values = values
        self.env = env
        self.decls = decls
        self.cost = cost
        self.P, self.M = values["P"], values["M"]

    def _setting(self, kw: str, default: int | None = None) -> int | None:
        if kw not in self.decls:
            return default
        stmt, env = self.decls[kw]
        return _eval_int(stmt.value, env, {})

    def _compiled(self, kw: str):
        stmt, env = self.decls[kw]
        exprs = stmt.keys if isinstance(stmt, n.Order) else (stmt.value,)
        context = CONTEXT["order" if isinstance(stmt, n.Order) else kw]
        return compile_exprs(exprs, env, context, INT, kw, as_tuple=isinstance(stmt, n.Order)), stmt.span

    def plan(self) -> ComputePlan:
        P, M = self.P, self.M
        head = self.schedule.decl.span
        S = self._setting("stages", P)
        C = self._setting("replicas", 1)
        for kw, v in (("stages", S), ("replicas", C)):
            if v < 1:
                raise PipeSemanticError(f"{kw} must be at least 1, got {v}", self.decls[kw][0].span)
        if max(M, P) * S * C > MAX_COMPUTE_OPS:
            span = self.decls["stages"][0].span if "stages" in self.decls else head
            raise PipeSemanticError(f"{max(M, P)} {'microbatches' if M >= P else 'ranks'} × {S} stages × {C} "
                                    f"replica(s) exceeds {MAX_COMPUTE_OPS:,} (MAX_COMPUTE_OPS); pipedsl refuses "
                                    f"programs that large", span)

        routes = [0] * M
        if "route" in self.decls:
            fn, span = self._compiled("route")
            for m in range(M):
                c = fn(m)
                if not 0 <= c < C:
                    raise PipeSemanticError(f"microbatch {m} is routed to replica {c}, but there "
                                            f"{'is 1 replica' if C == 1 else f'are {C} replicas'}", span)
                routes[m] = c
        elif C > 1:
            raise PipeSemanticError(f"{C} replicas need a 'route' saying which replica each microbatch m takes",
                                    self.decls["replicas"][0].span)

        placement: dict[tuple[int, int], int] = {}
        place_span = self.decls["place"][0].span if "place" in self.decls else head
        fn = self._compiled("place")[0].fn if "place" in self.decls else (lambda s, c: s % P)
        for c in range(C):
            for s in range(S):
                try:
                    r = fn(s, c)
                except ArithmeticError:
                    self._compiled("place")[0].explain(s, c)
                    raise
                if not 0 <= r < P:
                    raise PipeSemanticError(f"stage {s}{f' of replica {c}' if C > 1 else ''} is placed on rank {r}, "
                                            f"but the ranks are 0..{P - 1}", place_span)
                placement[(c, s)] = r
        held = [[(c, s) for c in range(C) for s in range(S) if placement[(c, s)] == r] for r in range(P)]
        empty = [r for r in range(P) if not held[r]]
        if empty:
            raise PipeSemanticError(f"rank {empty[0]} holds no stage (P={P}, {S} stages"
                                    f"{f', {C} replicas' if C > 1 else ''}); every rank needs work",
                                    place_span, notes=("the default placement is 'place s % P'",))
        chunk = {}
        for r in range(P):
            for c in range(C):
                for v, s in enumerate(sorted(s for cc, s in held[r] if cc == c)):
                    chunk[(c, s)] = v

        spans = {kw: stmt.span for kw, (stmt, _) in self.decls.items()}
        if "compute" in self.decls:
            orders = self._explicit(S, C, routes, placement)
        else:
            orders = self._by_rule(S, C, routes, placement, held, chunk)
        name = self.schedule.name
        return ComputePlan(name, dict(self.values), S, C, placement, tuple(routes), orders,
                           meta={"decl_spans": spans, "file": self.schedule.file})

    # ------------------------------------------------------------ the ordering rule

    def _by_rule(self, S, C, routes, placement, held, chunk) -> list[list[ComputeOp]]:
        P = self.P
        by_replica = [[m for m in range(self.M) if routes[m] == c] for c in range(C)]
        keys = {}
        for kind in ("F", "B"):
            if f"order {kind}" in self.decls:
                keys[kind] = self._compiled(f"order {kind}")[0]
        warmup = self._compiled("warmup")[0] if "warmup" in self.decls else None
        wlag = self._compiled("wlag")[0] if "wlag" in self.decls else None
        merge = "merge" in self.decls
        split = wlag is not None
        if "memory" in self.decls:
            held_ops = [[(m, s, c) for c, s in held[r] for m in by_replica[c]] for r in range(P)]
            cap, span = self._compiled("memory")
            fwd = [_keyed(ops, keys.get("F"), chunk, r) for r, ops in enumerate(held_ops)]
            bwd = [_keyed(ops, keys.get("B"), chunk, r) for r, ops in enumerate(held_ops)]
            if "order auto" in self.decls:
                return self._auto(fwd, bwd, S, C, cap, span, placement, routes, held)
            return squeeze(fwd, bwd, S, cap, wlag, span, wmem=self.cost.wmem if self.cost else 1.0)
        orders = []
        for r in range(P):
            ops = [(m, s, c) for c, s in held[r] for m in by_replica[c]]
            fwd = _keyed(ops, keys.get("F"), chunk, r)
            bwd = _keyed(ops, keys.get("B"), chunk, r)
            lag = wlag(r) if split else 0
            if lag < 0:
                raise PipeSemanticError(f"wlag of rank {r} is {lag}; it cannot be negative", self.decls["wlag"][0].span)
            if merge:
                seq = [(Op.F, *op) for op in fwd] + [(Op.B, *op) for op in bwd]
                seq.sort(key=lambda x: (x[1], x[0] is Op.B, *x[2:]))  # by key; a forward first on ties
                orders.append(list(_split_backward([(k, m, s, c) for k, _, m, s, c in seq], split, lag)))
                continue
            w = len(fwd) if warmup is None else warmup(r)
            if w < 0:
                raise PipeSemanticError(f"warmup of rank {r} is {w}; it counts forwards and cannot be negative",
                                        self.decls["warmup"][0].span)
            fwd_ops = [op[1:] for op in fwd]
            bwd_ops = [op[1:] for op in bwd]
            orders.append(list(_split_backward(_interleave(fwd_ops, bwd_ops, min(w, len(fwd))), split, lag)))
        return orders

    def _auto(self, fwd, bwd, S, C, cap, span, placement, routes, held) -> list[list[ComputeOp]]:
        """`order auto`: the search of auto_order.py, each candidate lowered, validated and simulated under the
        cost; the rule's warm-up/lag family among them where every rank holds one stage.  A candidate is scored
        by its makespan, or with `period 1` (steps that overlap) by its longest rank span; one over the cap
        (in fractional activations, `Cost.wmem`) is dropped."""
        cost = self.cost or Cost()
        name = self.schedule.name
        period = self._setting("period", 0)
        if period not in (0, 1):
            raise PipeSemanticError(f"period is 0 (a step ends with a collective: its makespan is minimised) or 1 "
                                    f"(steps overlap: the longest rank span is), got {period}",
                                    self.decls["period"][0].span)
        caps = [cap(r) for r in range(self.P)]
        scored: dict[tuple, float | None] = {}  # the candidates repeat (families overlap, the descent comes back)

        def evaluate(orders: list[list[ComputeOp]]) -> float | None:
            key = tuple(map(tuple, orders))
            if key not in scored:
                scored[key] = score(orders)
            return scored[key]

        def score(orders: list[list[ComputeOp]]) -> float | None:
            plan = ComputePlan(name, dict(self.values), S, C, placement, tuple(routes), orders)
            try:
                program = validate(lower(plan))
            except (ValidationError, PipeDSLError):
                return None
            timeline = simulate(program, cost)
            if any(peak > c + 1e-9 for peak, c in zip(timeline.peak_activations, caps)):
                return None
            return max(timeline.rank_spans) if period else timeline.makespan

        structured = None
        if all(len(h) == 1 for h in held):
            fwd_ops = [[op[1:] for op in f] for f in fwd]  # the keyed ops without their keys, once
            bwd_ops = [[op[1:] for op in b] for b in bwd]

            def structured(warmups: list[int], lags: list[int]) -> list[list[ComputeOp]]:
                return [list(_split_backward(_interleave(fwd_ops[r], bwd_ops[r], warmups[r]), True, lags[r]))
                        for r in range(self.P)]
        return search_orders(fwd, bwd, S, cap, span, cost, placement, evaluate, structured)

    # ------------------------------------------------------------ explicit lists

    def _explicit(self, S, C, routes, placement) -> list[list[ComputeOp]]:
        stmt, env = self.decls["compute"]
        orders: list[list[ComputeOp]] = []
        first: dict[tuple, Span] = {}
        budget = [MAX_COMPUTE_STEPS]  # shared by the ranks: each runs the whole block
        for r in range(self.P):
            order: list[ComputeOp] = []
            queue = _PendingWork(r, self.M, routes, placement, first)
            for resolved in _run_items(stmt.body, env, {"r": r}, budget):
                ops = []
                for item, kind, m, s, c in resolved:
                    if s is None:  # W(): the oldest pending weight gradient, if any
                        oldest = queue.oldest_w()
                        if oldest is None:
                            continue
                        m, s, c = oldest
                    elif m is None:
                        taken = queue.next_mb(item, kind, s, c, S)
                        if taken is None:  # past the last microbatch: nothing (torch prunes these too)
                            continue
                        m, c = taken
                    ops.append(self._checked_op(item, kind, m, s, c, r, S, routes, placement, first))
                    queue.listed(kind, m, s, ops[-1][3])
                if ops:
                    order.append(ops[0] if len(ops) == 1 else (Op.OVERLAP, ops[0], ops[1], 0))
            orders.append(order)
        for m in range(self.M):
            c = routes[m]
            for s in range(S):
                home = placement[(c, s)]
                have = {k for k in ("F", "B", "I", "W") if (k, m, s, c) in first}
                missing = ["F"] if "F" not in have else []
                if "B" in have and have & {"I", "W"}:
                    raise PipeSemanticError(f"the compute block lists both B and {'I' if 'I' in have else 'W'} for "
                                            f"microbatch {m} stage {s} (rank {home}): each backward is either "
                                            f"full (B) or split (I then W)", first[("B", m, s, c)])
                if not have & {"B", "I", "W"}:
                    missing.append("B (or I and W)")
                elif "B" not in have and not {"I", "W"} <= have:
                    missing.append("W" if "I" in have else "I")
                if missing:
                    raise PipeSemanticError(f"the compute block never lists {' or '.join(missing)} for microbatch {m} "
                                            f"stage {s} (rank {home})", stmt.span)
        return orders

    def _checked_op(self, item: n.OpItem, kind: str, m: int, s: int, c: int | None, r: int, S: int,
                    routes: list[int], placement: dict, first: dict[tuple, Span]) -> ComputeOp:
        """One op of a compute block, checked against sizes, routing, placement and repetition."""
        label = f"{kind}({m}, {s}{f', {c}' if c is not None else ''})"
        if not 0 <= m < self.M:
            raise PipeSemanticError(f"{label} on rank {r}: microbatch {m} does not exist (M={self.M})",
                                    item.span)
        if not 0 <= s < S:
            raise PipeSemanticError(f"{label} on rank {r}: stage {s} does not exist ({S} stages)", item.span)
        c = routes[m] if c is None else c
        if c != routes[m]:
            raise PipeSemanticError(f"{label} on rank {r}: microbatch {m} is routed to replica {routes[m]}",
                                    item.span)
        if placement[(c, s)] != r:
            raise PipeSemanticError(f"{label} is listed for rank {r}, but stage {s} is placed on rank "
                                    f"{placement[(c, s)]}", item.span)
        key = (kind, m, s, c)
        if key in first:
            raise PipeSemanticError(f"{label} is listed twice for rank {r}", item.span,
                                    notes=(f"first listed at {first[key]}",))
        first[key] = item.span
        return (_OPS[kind], m, s, c)


class _PendingWork:
    """One rank's queues while its compute block runs: the next microbatch of each op and stage
    (`F(next, s)`; B and I share one; None past the last) and the I's whose W is not listed yet,
    oldest first (`W()`, or `W(next, s)` on one stage)."""

    def __init__(self, rank: int, M: int, routes: list[int], placement: dict, first: dict[tuple, Span]) -> None:
        self.rank, self.M, self.routes, self.placement, self.first = rank, M, routes, placement, first
        self.cursor: dict[tuple[str, int, int], int] = {}
        self.pending_w: dict[tuple[int, int, int], None] = {}  # insertion-ordered set

    def next_mb(self, item: n.OpItem, kind: str, s: int, c: int | None, S: int) -> tuple[int, int] | None:
        if not 0 <= s < S:
            raise PipeSemanticError(f"{kind}(next, {s}) on rank {self.rank}: stage {s} does not exist ({S} stages)",
                                    item.span)
        if c is None:
            held = sorted({cc for (cc, ss), rank in self.placement.items() if ss == s and rank == self.rank})
            if len(held) > 1:
                raise PipeSemanticError(f"{kind}(next, {s}) on rank {self.rank}: this rank holds stage {s} of "
                                        f"replicas {held}; name one: {kind}(next, {s}, c)", item.span)
            c = held[0] if held else 0
        if kind == "W":
            return next(((m, cc) for m, ss, cc in self.pending_w if ss == s and cc == c), None)
        group = "F" if kind == "F" else "B"
        kinds = ("F",) if group == "F" else ("B", "I")
        m = self.cursor.get((group, s, c), 0)
        while m < self.M and (self.routes[m] != c or any((k, m, s, c) in self.first for k in kinds)):
            m += 1
        self.cursor[(group, s, c)] = m
        if m >= self.M:
            return None
        return m, c

    def listed(self, kind: str, m: int, s: int, c: int) -> None:
        if kind == "I":
            self.pending_w[(m, s, c)] = None
        elif kind == "W":
            self.pending_w.pop((m, s, c), None)

    def oldest_w(self) -> tuple[int, int, int] | None:
        return next(iter(self.pending_w), None)


def _expressions(decl: n.ScheduleDecl) -> Iterator[tuple[n.Expr, Env]]:
    """Every expression of a declaration with the lets it can see (as macros), in source order."""
    env = Env()
    for p in decl.params:
        if p.default is not None:
            yield p.default, env

    def items(body) -> Iterator[n.Expr]:
        for item in body:
            match item:
                case n.OpItem(mb=mb, stage=stage, replica=rep):
                    yield from (e for e in (mb, stage, rep) if e is not None)
                case n.PairItem(forward=forward, backward=backward):
                    yield from items((forward, backward))
                case n.ForItem(lo=lo, hi=hi, body=inner):
                    yield lo
                    yield hi
                    yield from items(inner)
                case n.IfItem(cond=cond, then=then, orelse=orelse):
                    yield cond
                    yield from items(then)
                    yield from items(orelse)
                case n.Let(value=value):
                    yield value

    for stmt in decl.body:
        match stmt:
            case n.Let(name=name, value=value):
                yield value, env
                if name not in env.macros:
                    env.macros[name] = value
            case n.Require(cond=e) | n.Setting(value=e):
                yield e, env
            case n.Order(keys=keys):
                for k in keys:
                    yield k, env
            case n.Compute(body=body):
                for e in items(body):
                    yield e, env


def _snapshot(env: Env) -> Env:
    return Env(dict(env.consts), dict(env.macros))


def _once(settings: dict[str, n.Stmt], key: str, stmt: n.Stmt) -> None:
    if key in settings:
        raise PipeSemanticError(f"'{key}' is declared twice", stmt.span,
                                notes=(f"first declared at {settings[key].span}",))
    settings[key] = stmt


def _require_type(expr: n.Expr, env: Env, context: tuple[str, ...], want: str, where: str) -> None:
    got = type_of(expr, env, context, where)
    if got != want:
        raise PipeSemanticError(f"{where} needs a {want}, but this is a {got}", expr.span)


def _eval_int(expr: n.Expr, env: Env, values: dict[str, int]) -> int:
    v = evaluate(expr, env, values)
    return int(v)


def _keyed(ops: list[tuple[int, int, int]], key, chunk, r: int) -> list[tuple[tuple, int, int, int]]:
    """`(key, m, s, c)` for each op, sorted (ties by microbatch, stage, replica); key () if none."""
    if key is None:
        return [((), m, s, c) for m, s, c in sorted(ops)]
    fn = key.fn
    try:
        return sorted((fn(m, s, chunk[(c, s)], c, r), m, s, c) for m, s, c in ops)
    except ArithmeticError:
        for m, s, c in ops:
            key.explain(m, s, chunk[(c, s)], c, r)
        raise


def _interleave(fwd, bwd, warmup: int) -> Iterator[ComputeOp]:
    """The one ordering rule: warmup forwards, then 1F1B, then the remaining backwards."""
    F, B = Op.F, Op.B
    for m, s, c in fwd[:warmup]:
        yield (F, m, s, c)
    nf = warmup
    for m, s, c in bwd:
        if nf < len(fwd):
            fm, fs, fc = fwd[nf]
            nf += 1
            yield (F, fm, fs, fc)
        yield (B, m, s, c)


def _split_backward(order, split: bool, lag: int) -> Iterator[ComputeOp]:
    """With `wlag`: each B becomes I, and its W follows `lag` backwards later (or at the end)."""
    if not split:
        yield from order
        return
    pending_w: list[tuple[int, int, int]] = []
    for kind, m, s, c in order:
        if kind is not Op.B:
            yield (kind, m, s, c)
            continue
        yield (Op.I, m, s, c)
        pending_w.append((m, s, c))
        if len(pending_w) > lag:
            wm, ws, wc = pending_w.pop(0)
            yield (Op.W, wm, ws, wc)
    for m, s, c in pending_w:
        yield (Op.W, m, s, c)


def _check_items(items: tuple[n.Item, ...], env: Env, context: tuple[str, ...]) -> None:
    for item in items:
        match item:
            case n.OpItem(mb=mb, stage=stage, replica=rep):
                for e in (mb, stage, rep):
                    if e is not None:
                        _require_type(e, env, context, INT, "a compute op")
            case n.PairItem(forward=forward, backward=backward):
                _check_items((forward, backward), env, context)
            case n.ForItem(var=var, lo=lo, hi=hi, body=body):
                _require_type(lo, env, context, INT, "for")
                _require_type(hi, env, context, INT, "for")
                _check_items(body, env, context + (var,))
            case n.IfItem(cond=cond, then=then, orelse=orelse):
                _require_type(cond, env, context, BOOL, "if")
                _check_items(then, env, context)
                _check_items(orelse, env, context)
            case n.Let(name=name, value=value):
                _require_type(value, env, context, INT, f"let {name}")
                context = context + (name,)


def _run_items(items: tuple[n.Item, ...], env: Env, values: dict[str, int], budget: list[int] | None = None
               ) -> Iterator[tuple[tuple[n.OpItem, str, int, int, int | None], ...]]:
    """Interpret a compute block, yielding each instruction as its ops (two for a pair).

    `budget` counts the items run (loops, ifs and lets included) over the whole block; a loop
    whose iterations alone would exceed it is refused before its first iteration."""
    values = dict(values)
    budget = [MAX_COMPUTE_STEPS] if budget is None else budget
    budget[0] -= len(items)
    if budget[0] < 0:
        raise PipeSemanticError(f"the compute block runs more than {MAX_COMPUTE_STEPS:,} items over all ranks "
                                f"(MAX_COMPUTE_STEPS)", items[0].span)
    for item in items:
        match item:
            case n.OpItem():
                yield (_op_values(item, env, values),)
            case n.PairItem(forward=forward, backward=backward):
                yield (_op_values(forward, env, values), _op_values(backward, env, values))
            case n.ForItem(var=var, lo=lo, hi=hi, body=body, span=span):
                first, stop = _eval_int(lo, env, values), _eval_int(hi, env, values)
                if (stop - first) * (1 + len(body)) > budget[0]:  # each iteration a step, then its items
                    raise PipeSemanticError(f"the compute block runs more than {MAX_COMPUTE_STEPS:,} items over all "
                                            f"ranks (MAX_COMPUTE_STEPS; this loop: {stop - first:,} iterations of "
                                            f"{len(body)} item(s))", span)
                budget[0] -= max(0, stop - first)
                for x in range(first, stop):
                    yield from _run_items(body, env, {**values, var: x}, budget)
            case n.IfItem(cond=cond, then=then, orelse=orelse):
                yield from _run_items(then if evaluate(cond, env, values) else orelse, env, values, budget)
            case n.Let(name=name, value=value):
                values[name] = _eval_int(value, env, values)


def _op_values(item: n.OpItem, env: Env, values: dict[str, int]
               ) -> tuple[n.OpItem, str, int | None, int | None, int | None]:
    """The op's evaluated arguments; None where it says `next` (mb) or is `W()` (mb and stage)."""
    mb, stage, rep = (None if e is None else _eval_int(e, env, values) for e in (item.mb, item.stage, item.replica))
    return (item, item.kind, mb, stage, rep)


def _backward_before_forward(plan: ComputePlan) -> str | None:
    """The first backward a rank's order runs before its own forward *because* the backwards of its
    stage are ordered unlike the forwards (`order B by -m`: no warmup short of all the forwards can
    help), described; None when each stage's backwards follow its forwards' order (the mixer's fault)."""
    for r, order in enumerate(plan.orders):
        ops = [op for entry in order for op in parts(entry)]
        done: set[tuple[int, int, int]] = set()
        for k, m, s, c in ops:
            if k is Op.F:
                done.add((m, s, c))
            elif k in (Op.B, Op.I) and (m, s, c) not in done:
                forwards = [mb for kk, mb, ss, cc in ops if kk is Op.F and (ss, cc) == (s, c)]
                backwards = [mb for kk, mb, ss, cc in ops if kk in (Op.B, Op.I) and (ss, cc) == (s, c)]
                if forwards == backwards:
                    return None
                few = ", ".join(map(str, backwards[:4])) + (", …" if len(backwards) > 4 else "")
                late, early = Instr(k, m, s, replica=c), Instr(Op.F, m, s, replica=c)
                return (f"rank {r} runs {late} before its forward {early}: stage {s}'s backwards run "
                        f"microbatches {few}, its forwards {', '.join(map(str, forwards[:4]))}"
                        f"{', …' if len(forwards) > 4 else ''}")
    return None


def _first_stall(plan: ComputePlan, forward: bool) -> str | None:
    """Run only the forwards (or only the backwards) of each rank's order, honouring data
    dependencies across ranks; describe the first wait cycle, or None if all complete."""
    S = plan.num_stages
    kinds = (Op.F,) if forward else (Op.B, Op.I)
    orders = [[op for entry in order for op in parts(entry) if op[0] in kinds] for order in plan.orders]
    done: set[tuple[int, int, int]] = set()
    pos = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                _, m, s, c = order[pos[r]]
                need = (m, s - 1, c) if forward else (m, s + 1, c)
                if 0 <= need[1] < S and need not in done:
                    break
                done.add((m, s, c))
                pos[r] += 1
                progress = True
    stuck = [r for r, order in enumerate(orders) if pos[r] < len(order)]
    if not stuck:
        return None
    waits = []
    for r in stuck[:4]:
        k, m, s, c = orders[r][pos[r]]
        dep = s - 1 if forward else s + 1
        waits.append(f"rank {r} waits with {k.value}{m}.{s} for stage {dep} (rank {plan.placement[(c, dep)]})")
    return "; ".join(waits)
