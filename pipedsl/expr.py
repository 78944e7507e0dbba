"""Integer expressions: static types, a tree-walking evaluator and a fast compiled form.

Schedules evaluate their keys once per operation (millions of times for big programs), so
expressions are compiled to Python lambdas with parameters folded in.  The slow evaluator
is the reference: it runs `compute` blocks and, when a compiled expression fails (a
division by zero), re-runs it to name the exact sub-expression.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipedsl import nodes as n
from pipedsl.errors import PipeSemanticError
from pipedsl.limits import MAX_COMPUTE_OPS, MAX_EXPANSION, MAX_NESTING, MAX_VALUE_BITS

INT, BOOL = "number", "condition"

# Context variables are renamed so that no user name can shadow a Python builtin.
_PY_GLOBALS = {"__builtins__": {}, "min": min, "max": max}


@dataclass
class Env:
    """Names an expression may use: constants (parameters, folded lets) and let macros.

    A `let` whose value mentions a context variable (m, s, r, …) stays a macro and is
    inlined where it is used, so `let ml = m % (M / 2)` works inside an order key.
    """

    consts: dict[str, int] = field(default_factory=dict)
    macros: dict[str, n.Expr] = field(default_factory=dict)
    measures: dict[str, tuple[int, int]] = field(default_factory=dict)  # macro -> (nodes, depth) inlined

    def names(self) -> list[str]:
        return [*self.consts, *self.macros]


def free_context(expr: n.Expr, env: Env, context: tuple[str, ...]) -> set[str]:
    """Which context variables `expr` needs (through macros too)."""
    found: set[str] = set()

    def walk(node: n.Expr) -> None:
        match node:
            case n.Var(name=name):
                if name in env.consts:
                    return
                if name in env.macros:
                    walk(env.macros[name])
                elif name in context:
                    found.add(name)
            case n.Num():
                return
            case n.Unary(operand=x):
                walk(x)
            case n.Binary(left=a, right=b):
                walk(a)
                walk(b)
            case n.IfExpr(cond=c, then=a, orelse=b):
                walk(c)
                walk(a)
                walk(b)
            case n.Call(args=args):
                for a in args:
                    walk(a)

    walk(expr)
    return found


def measure(expr: n.Expr, env: Env) -> tuple[int, int]:
    """(nodes, depth) of `expr` with every macro inlined, without inlining anything.

    A macro's measure is remembered in `env.measures`, so a chain `let a1 = a0 + a0; let
    a2 = a1 + a1; …` costs one step per let here although its expansion doubles each time.
    Recursion follows the source nesting only (≤ MAX_NESTING, checked by the parser).
    """
    match expr:
        case n.Var(name=name) if name in env.macros and name not in env.consts:
            if name not in env.measures:
                env.measures[name] = measure(env.macros[name], env)
            nodes, depth = env.measures[name]
            return nodes, depth
        case n.Num() | n.Var():
            return 1, 1
        case n.Unary(operand=x):
            parts = [x]
        case n.Binary(left=a, right=b):
            parts = [a, b]
        case n.IfExpr(cond=c, then=a, orelse=b):
            parts = [c, a, b]
        case n.Call(args=args):
            parts = list(args)
        case _:  # pragma: no cover
            raise AssertionError(f"unknown node {expr!r}")
    measured = [measure(p, env) for p in parts]
    return 1 + sum(m[0] for m in measured), 1 + max(m[1] for m in measured)


class Expansion:
    """The budget of syntax nodes a schedule's expressions may take with their lets inlined.

    Every pass after parsing (typing, folding, compiling to lambdas) walks expressions with
    lets inlined; charging each expression its inlined size before those passes run bounds
    their work, and refuses let chains whose expansion grows exponentially.
    """

    def __init__(self) -> None:
        self.left = MAX_EXPANSION

    def charge(self, expr: n.Expr, env: Env) -> None:
        nodes, depth = measure(expr, env)
        if depth > MAX_NESTING:
            raise PipeSemanticError(f"with its lets inlined, this expression nests {depth:,} levels deep, over the "
                                    f"limit of {MAX_NESTING} (MAX_NESTING)", expr.span)
        self.left -= nodes
        if self.left < 0:
            raise PipeSemanticError(f"with lets inlined where they are used, the expressions of this schedule "
                                    f"exceed {MAX_EXPANSION:,} syntax nodes (MAX_EXPANSION; this one alone has "
                                    f"{nodes:,}: does a let chain double at each step?)", expr.span)


def value_bits(expr: n.Expr, env: Env) -> int:
    """An upper bound on the bit length of any value `expr` computes, context variables being
    below MAX_COMPUTE_OPS (they count microbatches, stages, replicas and ranks)."""
    context_bits = MAX_COMPUTE_OPS.bit_length()
    match expr:
        case n.Num(value=v):
            return v.bit_length()
        case n.Var(name=name):
            if name in env.consts:
                return abs(env.consts[name]).bit_length()
            return value_bits(env.macros[name], env) if name in env.macros else context_bits
        case n.Unary(op="-", operand=x):
            return value_bits(x, env)
        case n.Binary(op="*", left=a, right=b):
            return value_bits(a, env) + value_bits(b, env)
        case n.Binary(op="+" | "-", left=a, right=b):
            return max(value_bits(a, env), value_bits(b, env)) + 1
        case n.Binary(op="/", left=a, right=b):
            return value_bits(a, env) + 1  # -1 // -1 … and floor rounding away from zero
        case n.Binary(op="%", left=a, right=b):
            return value_bits(b, env)
        case n.IfExpr(then=a, orelse=b):
            return max(value_bits(a, env), value_bits(b, env))
        case n.Call(args=args):
            return max(value_bits(a, env) for a in args)
    return 1  # conditions


def _checked(value: int | bool, expr: n.Expr) -> int | bool:
    if type(value) is int and value.bit_length() > MAX_VALUE_BITS:
        raise PipeSemanticError(f"this expression computes a number of {value.bit_length():,} bits, over the limit "
                                f"of {MAX_VALUE_BITS} (MAX_VALUE_BITS)", expr.span)
    return value


def type_of(expr: n.Expr, env: Env, context: tuple[str, ...], where: str) -> str:
    """Static type of `expr`; unknown names and type mismatches raise with the span."""
    match expr:
        case n.Num():
            return INT
        case n.Var(name=name, span=span):
            if name in env.consts or name in context:
                return INT
            if name in env.macros:
                return type_of(env.macros[name], env, context, where)
            visible = ", ".join(sorted(set(env.names()) | set(context))) or "nothing"
            raise PipeSemanticError(f"unknown name {name!r} in {where} (visible here: {visible})", span)
        case n.Unary(op="-", operand=x):
            _expect(x, INT, env, context, where, "'-' needs")
            return INT
        case n.Unary(op="not", operand=x):
            _expect(x, BOOL, env, context, where, "'not' needs")
            return BOOL
        case n.Binary(op=op, left=a, right=b) if op in n.ARITHMETIC:
            _expect(a, INT, env, context, where, f"'{op}' needs")
            _expect(b, INT, env, context, where, f"'{op}' needs")
            return INT
        case n.Binary(op=op, left=a, right=b) if op in n.LOGICAL:
            _expect(a, BOOL, env, context, where, f"'{op}' needs")
            _expect(b, BOOL, env, context, where, f"'{op}' needs")
            return BOOL
        case n.Binary(op=op, left=a, right=b):  # comparison
            left = type_of(a, env, context, where)
            _expect(b, left, env, context, where, f"'{op}' compares like with like and needs")
            if left == BOOL and op not in ("==", "!="):
                raise PipeSemanticError(f"'{op}' orders numbers, not conditions", expr.span)
            return BOOL
        case n.IfExpr(cond=c, then=a, orelse=b):
            _expect(c, BOOL, env, context, where, "'if' needs")
            kind = type_of(a, env, context, where)
            _expect(b, kind, env, context, where, "both branches of 'if' must agree: 'else' needs")
            return kind
        case n.Call(func=func, args=args, span=span):
            if len(args) < 2:
                raise PipeSemanticError(f"{func}() takes at least two numbers", span)
            for a in args:
                _expect(a, INT, env, context, where, f"{func}() needs")
            return INT
    raise AssertionError(f"unknown node {expr!r}")  # pragma: no cover


def _expect(expr: n.Expr, want: str, env: Env, context: tuple[str, ...], where: str, what: str) -> None:
    got = type_of(expr, env, context, where)
    if got != want:
        raise PipeSemanticError(f"{what} a {want}, but this is a {got}", expr.span)


def evaluate(expr: n.Expr, env: Env, values: Mapping[str, int]) -> int | bool:
    """Reference evaluator; `values` binds the context variables."""
    match expr:
        case n.Num(value=v):
            return v
        case n.Var(name=name):
            if name in values:
                return values[name]
            if name in env.consts:
                return env.consts[name]
            return evaluate(env.macros[name], env, values)
        case n.Unary(op="-", operand=x):
            return -evaluate(x, env, values)
        case n.Unary(op="not", operand=x):
            return not evaluate(x, env, values)
        case n.Binary(op="and", left=a, right=b):
            return bool(evaluate(a, env, values)) and bool(evaluate(b, env, values))
        case n.Binary(op="or", left=a, right=b):
            return bool(evaluate(a, env, values)) or bool(evaluate(b, env, values))
        case n.Binary(op=op, left=a, right=b):
            x, y = evaluate(a, env, values), evaluate(b, env, values)
            if op in ("/", "%") and y == 0:
                shown = ", ".join(f"{k}={v}" for k, v in values.items())
                raise PipeSemanticError(f"division by zero in '{op}'" + (f" (with {shown})" if shown else ""),
                                        expr.span)
            return _checked(_BINARY[op](x, y), expr)
        case n.IfExpr(cond=c, then=a, orelse=b):
            return evaluate(a, env, values) if evaluate(c, env, values) else evaluate(b, env, values)
        case n.Call(func=func, args=args):
            return (min if func == "min" else max)(evaluate(a, env, values) for a in args)
    raise AssertionError(f"unknown node {expr!r}")  # pragma: no cover


_BINARY: dict[str, Callable[[int, int], int | bool]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def _python(expr: n.Expr, env: Env) -> str:
    match expr:
        case n.Num(value=v):
            return str(v)
        case n.Var(name=name):
            if name in env.consts:
                return f"({env.consts[name]})"
            if name in env.macros:
                return f"({_python(env.macros[name], env)})"
            return f"_{name}"
        case n.Unary(op="-", operand=x):
            return f"(-{_python(x, env)})"
        case n.Unary(op="not", operand=x):
            return f"(not {_python(x, env)})"
        case n.Binary(op=op, left=a, right=b):
            py = {"/": "//"}.get(op, op)
            return f"({_python(a, env)} {py} {_python(b, env)})"
        case n.IfExpr(cond=c, then=a, orelse=b):
            return f"({_python(a, env)} if {_python(c, env)} else {_python(b, env)})"
        case n.Call(func=func, args=args):
            return f"{func}({', '.join(_python(a, env) for a in args)})"
    raise AssertionError(f"unknown node {expr!r}")  # pragma: no cover


@dataclass
class Compiled:
    """Expressions compiled into one Python function of the context variables.

    `fn(*values)` returns one value, or a tuple when several expressions were compiled
    together (an order key).  Call `explain(*values)` after `fn` raised: it re-evaluates
    slowly and raises a `PipeSemanticError` pointing at the failing sub-expression.
    """

    exprs: tuple[n.Expr, ...]
    env: Env
    context: tuple[str, ...]
    fn: Callable[..., object]

    def __call__(self, *values: int) -> object:
        try:
            return self.fn(*values)
        except ArithmeticError:
            self.explain(*values)
            raise

    def explain(self, *values: int) -> None:
        bound = dict(zip(self.context, values, strict=True))
        for e in self.exprs:
            evaluate(e, self.env, bound)


def compile_exprs(exprs: tuple[n.Expr, ...], env: Env, context: tuple[str, ...], want: str, where: str,
                  as_tuple: bool = False) -> Compiled:
    """Type-check `exprs` (each must be a `want`) and compile them into one function."""
    for e in exprs:
        got = type_of(e, env, context, where)
        if got != want:
            raise PipeSemanticError(f"{where} needs a {want}, but this is a {got}", e.span)
        bits = value_bits(e, env)
        if bits > MAX_VALUE_BITS:
            raise PipeSemanticError(f"{where} may compute numbers of up to {bits:,} bits, over the limit of "
                                    f"{MAX_VALUE_BITS} (MAX_VALUE_BITS)", e.span)
    body = ", ".join(_python(e, env) for e in exprs)
    if as_tuple:
        body = f"({body},)"
    args = ", ".join(f"_{c}" for c in context)
    fn = eval(f"lambda {args}: {body}", dict(_PY_GLOBALS))  # noqa: S307 - generated from our own AST
    return Compiled(exprs, env, context, fn)
