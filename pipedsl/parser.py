"""Text → `ScheduleDecl`: the Lark front end, with errors that say file:line:col in words."""

from __future__ import annotations

import functools
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from lark.lexer import PatternStr

from pipedsl import nodes as n
from pipedsl.errors import PipeDSLError, PipeSyntaxError, Span
from pipedsl.limits import MAX_NESTING, MAX_NUMBER_DIGITS, MAX_SOURCE_BYTES

_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "STRING": 'a quoted string ("…")',
    "CMP": "a comparison (==, <, …)",
    "FUNC": "min or max",
    "$END": "the end of the file",
}


@functools.cache
def grammar() -> Lark:
    """The language's parser, built once a process (about 1 s): the fork server builds it for every rank."""
    path = Path(__file__).with_name("grammar.lark")
    return Lark(path.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=True,
                tree_class=_MeasuredTree)


def parse(text: str, file: str = "<string>") -> n.ScheduleDecl:
    """Parse one schedule; raise `PipeSyntaxError` (or `PipeSemanticError`) that points into `text`.

    Lark's LALR parser keeps its own stack (no recursion); its depth is watched token by token
    and the size limit bounds its time.  The tree builder and every later pass recurse, so the
    tree's depth (a chain a + b + … too) is measured without recursion before anything walks it.
    The tree is immutable, so the last few sources' trees are kept: a built-in loaded in a loop (a pipeline a run, a
    planner's layouts) is parsed once (1–10 ms a built-in).
    """
    if not isinstance(text, str):
        raise PipeSyntaxError(f"a schedule source is text, got {type(text).__name__}", Span(file, 1, 1))
    if len(text) > MAX_SOURCE_BYTES:
        raise PipeSyntaxError(f"the source is {len(text):,} characters, over the limit of {MAX_SOURCE_BYTES:,} "
                              f"(MAX_SOURCE_BYTES)", Span(file, 1, 1))
    return _parsed(text, file)


@functools.lru_cache(maxsize=32)  # errors are raised, not kept
def _parsed(text: str, file: str) -> n.ScheduleDecl:
    try:
        tree = _parse_bounded(text, file)
        decl = _Builder(file).transform(tree)
    except UnexpectedInput as err:
        raise _syntax_error(err, text, file) from None
    except VisitError as err:
        if isinstance(err.orig_exc, PipeDSLError):
            raise err.orig_exc.with_source(text) from None
        raise
    except PipeDSLError as err:
        raise err.with_source(text) from None
    return n.ScheduleDecl(decl.name, decl.params, decl.body, decl.span, source=text)


# An LALR stack holds at most a few symbols per level of the tree it builds (a `for` header
# before its block: 8), so a source within MAX_NESTING never grows the stack past this.
_MAX_STACK = 10 * MAX_NESTING + 20


def _parse_bounded(text: str, file: str) -> Tree:
    """Lark's parse, one token at a time, refused as soon as the source nests deeper than
    `MAX_NESTING`: the parser's stack grows on a run of `- -`, `not not`, `((` or `if … else
    if …` (stopped within a thousand tokens), a tree grows when a chain `a + b + …` reduces."""
    parser = grammar().parse_interactive(text)
    try:
        for token in parser.iter_parse():
            if len(parser.parser_state.state_stack) > _MAX_STACK:
                raise _TooDeepError(token, len(parser.parser_state.state_stack))
        return parser.feed_eof()
    except _TooDeepError as deep:
        token = deep.token
        if deep.open_constructs:
            message = (f"nested too deeply: {deep.open_constructs:,} brackets, operators and blocks open at once "
                       f"(10 × MAX_NESTING = {_MAX_STACK - 20:,})")
        else:
            message = (f"nested deeper than {MAX_NESTING} levels (MAX_NESTING: every operator, 'if' and block is "
                       f"a level, a chain a + b + … one per operator)")
        raise PipeSyntaxError(message, Span(file, getattr(token, "line", 1) or 1,
                                            getattr(token, "column", 1) or 1)) from None


_FLAT = frozenset({"start", "schedule", "compute", "block"})  # containers that add no level of their own


class _MeasuredTree(Tree):
    """A parse-tree node that knows its depth when Lark builds it, so a tree nested deeper than
    `MAX_NESTING` (a sum of 200 terms is 199 deep) is refused mid-parse, before anything
    recurses over it.  The containers above add no level; a node without subtrees (a number,
    a name) is level 0."""

    def __init__(self, data, children, meta=None) -> None:
        super().__init__(data, children, meta)
        if data.startswith("_"):  # a list Lark grows in place and splices into its parent: measured there
            self.depth = 0
            return
        inner = [c.depth for c in children if isinstance(c, _MeasuredTree)]
        self.depth = 0 if not inner else max(inner) + (data not in _FLAT)
        if self.depth > MAX_NESTING:
            first = self
            while isinstance(first, Tree):  # its leftmost token, for the position
                first = next((c for c in first.children if c is not None), None)
            raise _TooDeepError(first if isinstance(first, Token) else None)


class _TooDeepError(Exception):
    def __init__(self, token: Token | None, open_constructs: int = 0) -> None:
        self.token, self.open_constructs = token, open_constructs


def _describe(terminal: str) -> str:
    if terminal in _WORDS:
        return _WORDS[terminal]
    try:
        pattern = grammar().get_terminal(terminal).pattern
    except KeyError:
        return terminal.lower()
    return f"'{pattern.value}'" if isinstance(pattern, PatternStr) else terminal.lower()


def _expected(names: set[str] | frozenset[str]) -> str:
    words = sorted({_describe(t) for t in names})
    if not words:
        return ""
    if len(words) == 1:
        return f"; expected {words[0]}"
    return "; expected " + ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_error(err: UnexpectedInput, text: str, file: str) -> PipeSyntaxError:
    line, column = max(err.line, 1), max(err.column, 1)
    if isinstance(err, UnexpectedCharacters):
        char = text[err.pos_in_stream] if err.pos_in_stream < len(text) else "?"
        allowed = err.allowed or set()
        message = f"unexpected character {char!r}" + (_expected(allowed) if len(allowed) <= 6 else "")
    elif isinstance(err, UnexpectedEOF) or (isinstance(err, UnexpectedToken) and err.token.type == "$END"):
        lines = text.splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
        message = "unexpected end of file" + _expected(err.expected)
    elif isinstance(err, UnexpectedToken):
        message = f"unexpected {_token_words(err.token)}" + _expected(err.accepts or err.expected)
    else:  # pragma: no cover - Lark has no other kinds today
        message = str(err)
    return PipeSyntaxError(message, Span(file, line, column), source=text)


def _token_words(token: Token) -> str:
    if token.type == "NAME":
        return f"name '{token}'"
    if token.type == "INT":
        return f"number {token}"
    return f"'{token}'"


_NEXT = object()  # the `next` microbatch argument, before it becomes OpItem.mb = None


class _Builder(Transformer):
    """Lark tree → typed nodes.  Each method receives the node's `meta` (its position)."""

    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file

    def _span(self, meta) -> Span:
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, token: Token) -> Span:
        return Span(self.file, token.line, token.column, token.end_line, token.end_column)

    # ---- top level
    def start(self, children):
        return children[0]

    @v_args(meta=True)
    def schedule(self, meta, children):
        name_tok, params, *body = children
        name = _unquote(name_tok) if name_tok.type == "STRING" else str(name_tok)
        return n.ScheduleDecl(name, tuple(params or ()), tuple(body), self._span(meta))

    def params(self, children):
        return [p for p in children if p is not None]

    @v_args(meta=True)
    def param(self, meta, children):
        name, default = children
        return n.Param(str(name), default, self._span(meta))

    # ---- statements
    @v_args(meta=True)
    def doc(self, meta, children):
        return n.Doc(_unquote(children[0]), self._span(meta))

    @v_args(meta=True)
    def require(self, meta, children):
        return n.Require(children[0], _unquote(children[1]), self._span(meta))

    @v_args(meta=True)
    def let(self, meta, children):
        return n.Let(str(children[0]), children[1], self._span(meta))

    def _setting(keyword: str):  # noqa: N805 - a method factory used at class creation
        @v_args(meta=True)
        def build(self, meta, children):
            return n.Setting(keyword, children[0], self._span(meta))

        return build

    stages = _setting("stages")
    replicas = _setting("replicas")
    route = _setting("route")
    place = _setting("place")
    warmup = _setting("warmup")
    wlag = _setting("wlag")
    memory = _setting("memory")
    period = _setting("period")

    @v_args(meta=True)
    def merge(self, meta, children):
        return n.Flag("merge", self._span(meta))

    @v_args(meta=True)
    def order_auto(self, meta, children):
        return n.Flag("order auto", self._span(meta))

    @v_args(meta=True)
    def order(self, meta, children):
        kind_tok, key = children
        kind = str(kind_tok)
        if kind not in ("F", "B"):
            raise PipeSyntaxError(f"'order' sorts F (forwards) or B (backwards), not {kind!r}", self._tok(kind_tok))
        keys = key if isinstance(key, tuple) else (key,)
        return n.Order(kind, keys, self._span(meta))

    def tuple(self, children):
        return tuple(children)

    @v_args(meta=True)
    def compute(self, meta, children):
        return n.Compute(children[0], self._span(meta))

    # ---- explicit items
    def block(self, children):
        return tuple(children)

    @v_args(meta=True)
    def op_item(self, meta, children):
        kind_tok, mb, stage, replica = children
        if str(kind_tok) not in ("F", "B", "I", "W"):
            raise PipeSyntaxError(f"a compute op is F, B, I or W, not {str(kind_tok)!r}", self._tok(kind_tok))
        if mb is _NEXT:
            mb = None
        return n.OpItem(str(kind_tok), mb, stage, replica, self._span(meta))

    def next_mb(self, children):
        return _NEXT

    @v_args(meta=True)
    def oldest_w(self, meta, children):
        if str(children[0]) != "W":
            raise PipeSyntaxError(f"only W() takes no arguments (the oldest pending weight gradient); "
                                  f"{children[0]} needs a microbatch and a stage, e.g. {children[0]}(next, s)",
                                  self._tok(children[0]))
        return n.OpItem("W", None, None, None, self._span(meta))

    @v_args(meta=True)
    def pair_item(self, meta, children):
        forward, backward = children
        if forward.kind != "F" or backward.kind != "B":
            raise PipeSyntaxError(f"an overlapped pair is a forward and a full backward, F(…) & B(…), not "
                                  f"{forward.kind}(…) & {backward.kind}(…)", self._span(meta))
        return n.PairItem(forward, backward, self._span(meta))

    @v_args(meta=True)
    def for_item(self, meta, children):
        var, lo, hi, body = children
        return n.ForItem(str(var), lo, hi, body, self._span(meta))

    @v_args(meta=True)
    def if_item(self, meta, children):
        cond, then, orelse = children
        if isinstance(orelse, n.IfItem):
            orelse = (orelse,)
        return n.IfItem(cond, then, orelse or (), self._span(meta))

    # ---- expressions
    @v_args(meta=True)
    def num(self, meta, children):
        if len(children[0]) > MAX_NUMBER_DIGITS:
            raise PipeSyntaxError(f"a number of {len(children[0]):,} digits; numbers have at most "
                                  f"{MAX_NUMBER_DIGITS} (MAX_NUMBER_DIGITS)", self._span(meta))
        return n.Num(int(children[0]), self._span(meta))

    @v_args(meta=True)
    def var(self, meta, children):
        return n.Var(str(children[0]), self._span(meta))

    @v_args(meta=True)
    def neg(self, meta, children):
        return n.Unary("-", children[0], self._span(meta))

    @v_args(meta=True)
    def not_op(self, meta, children):
        return n.Unary("not", children[0], self._span(meta))

    def _binary(op: str):  # noqa: N805 - a method factory used at class creation
        @v_args(meta=True)
        def build(self, meta, children):
            return n.Binary(op, children[0], children[1], self._span(meta))

        return build

    add = _binary("+")
    sub = _binary("-")
    mul = _binary("*")
    floordiv = _binary("/")
    mod = _binary("%")
    and_op = _binary("and")
    or_op = _binary("or")

    @v_args(meta=True)
    def compare(self, meta, children):
        left, op, right = children
        return n.Binary(str(op), left, right, self._span(meta))

    @v_args(meta=True)
    def ifexpr(self, meta, children):
        return n.IfExpr(*children, self._span(meta))

    @v_args(meta=True)
    def call(self, meta, children):
        func, *args = children
        return n.Call(str(func), tuple(args), self._span(meta))


def _unquote(token: Token) -> str:
    body = str(token)[1:-1]
    return body.encode("latin-1", "backslashreplace").decode("unicode_escape") if "\\" in body else body
