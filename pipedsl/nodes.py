"""Typed syntax tree of a `.pipe` file; every node keeps the `Span` it was parsed from."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipedsl.errors import Span

# ---------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class Num:
    value: int
    span: Span


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    span: Span


@dataclass(frozen=True, slots=True)
class Unary:
    op: str  # "-" or "not"
    operand: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Binary:
    op: str  # + - * / % == != < <= > >= and or
    left: Expr
    right: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class IfExpr:
    cond: Expr
    then: Expr
    orelse: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    func: str  # "min" or "max"
    args: tuple[Expr, ...]
    span: Span


Expr = Num | Var | Unary | Binary | IfExpr | Call

ARITHMETIC = frozenset({"+", "-", "*", "/", "%"})
COMPARISONS = frozenset({"==", "!=", "<", "<=", ">", ">="})
LOGICAL = frozenset({"and", "or"})

# ---------------------------------------------------------------- explicit compute items


@dataclass(frozen=True, slots=True)
class OpItem:
    """`F(m, s)` or `F(m, s, c)` inside a `compute` block.  `mb` None: `F(next, s)`, the lowest
    microbatch not listed yet; `mb` and `stage` None: `W()`, the W of the oldest pending I."""

    kind: str
    mb: Expr | None
    stage: Expr | None
    replica: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class PairItem:
    """`F(m, s) & B(m2, s2)`: a forward overlapped with another microbatch's full backward."""

    forward: OpItem
    backward: OpItem
    span: Span


@dataclass(frozen=True, slots=True)
class ForItem:
    """`for x in lo .. hi { … }`, half-open like Python's range."""

    var: str
    lo: Expr
    hi: Expr
    body: tuple[Item, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class IfItem:
    cond: Expr
    then: tuple[Item, ...]
    orelse: tuple[Item, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Let:
    name: str
    value: Expr
    span: Span


Item = OpItem | PairItem | ForItem | IfItem | Let

# ---------------------------------------------------------------- statements


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Doc:
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class Require:
    cond: Expr
    message: str
    span: Span


@dataclass(frozen=True, slots=True)
class Setting:
    """A single-expression declaration: stages, replicas, route, place, warmup, wlag."""

    keyword: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Flag:
    """A declaration without a value: `merge`."""

    keyword: str
    span: Span


@dataclass(frozen=True, slots=True)
class Order:
    """`order F by (k1, k2, …)`: the sort key of a rank's forwards (F) or backwards (B)."""

    kind: str
    keys: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Compute:
    """Explicit per-rank compute list: the body runs once per rank with `r` bound."""

    body: tuple[Item, ...]
    span: Span


Stmt = Doc | Require | Let | Setting | Flag | Order | Compute


@dataclass(frozen=True, slots=True)
class ScheduleDecl:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    span: Span
    source: str = field(repr=False, compare=False, default="")
