"""`split_module`: any traceable `nn.Module` cut into pipeline stages at named submodules.

    stages = split_module(resnet, ["layer2", "layer4"], (images,))      # 3 stages
    stages = split_module(vit, ["blocks.2", "blocks.4"], (images,))
    stages = split_module(unet, ["down.2", "up.1"], (images,))          # the skips are relayed
    pipe = pipedsl.Pipeline(stages, program=pipedsl.load("1f1b").compile(P=3, M=4), loss_fn=F.cross_entropy)

How: `torch.export.export(module, args, kwargs, strict=False)` traces the model into one graph
of ATen ops (Python control flow on shapes and constants specialised away, dim 0 of every input
dynamic), and every node keeps the submodule path it ran in.  Stage k+1 begins at the first node
of split point k (torch.distributed.pipelining's `SplitPoint.BEGINNING`).  Each stage is a
`ModuleStage`: its own graph, run eagerly, and the model's own `Parameter` and buffer objects.

What crosses a boundary is every value the later stages read, as a flat tuple of tensors, in
graph order: an activation, an input still needed later, a skip connection.  A value read two
or more stages later is relayed: each stage in between receives it and sends it on (cloned), so
its gradient comes back along the same path and is autograd's exact sum.  Constants are baked
into the graphs; a size computed from the batch is recomputed from a received tensor (or, failing
that, relayed as a 0-d integer tensor).

- Stage 0 takes the tensors of `(example_inputs, example_kwargs)` flattened with torch's pytree,
  positional ones first then the keyword ones in their order; every other value (a float, an
  int, a flag) is a constant of the trace.  The last stage returns the model's output structure
  (a tensor, a tuple, a dict …): the loss function receives what the model returns.
- Parameters and buffers are the model's objects, never copies, at their original names
  (`stage.named_parameters()` yields `layer3.0.conv1.weight`).  A parameter read in two stages is
  in both: the pipeline finds it as a tie and sums its gradients.  Frozen stays frozen.
  BatchNorm updates the model's running statistics in place.
- train() / eval(): the graph fixes the mode it was traced in (dropout, BatchNorm), so both are
  traced, the mode the module is in (its submodules' flags as they are) and the other one
  (`module.train(not module.training)`), and a stage runs the graph of its own `training` flag.
- Refused in one line: a split point that is not a submodule, never runs or runs out of order,
  and code torch.export cannot trace (data-dependent Python control flow, …), naming the file:line.

Why torch.export rather than torch.fx.symbolic_trace: fx fails on any Python branch on a shape
(`if x.dim() == 4`, `B, N, C = ...` used in a condition) and loses the module path of what runs
inside a leaf; export specialises such branches, sees through every module, and flattens dict
and dataclass outputs with pytree.  The price is the train/eval pair of traces above.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import inspect
import io
import itertools
import linecache
import logging
import operator
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from pipedsl.errors import PipeRuntimeError
from pipedsl.models.split import unshared

_NOISY_LOGGERS = ("torch.fx", "torch._export", "torch.export", "torch._subclasses", "torch._dynamo",
                  "torch._functorch", "torch._guards", "torch._utils_internal")
_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = str(Path(__file__).resolve())
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_CONST = (int, float, bool)
_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException")
_TRACES = itertools.count()  # names the generated sources (linecache) apart


def split_module(module: nn.Module, split_points: Sequence[str], example_inputs: Any,
                 example_kwargs: dict[str, Any] | None = None) -> list[ModuleStage]:
    """`module` as `len(split_points) + 1` stages; stage k+1 begins where submodule `split_points[k]` first runs.

    `example_inputs` (a tuple of positional arguments, or one tensor) and `example_kwargs` are what
    `module(*example_inputs, **example_kwargs)` is traced with; any batch size but 1 (dim 0 is
    traced dynamic, a batch of 1 would fix it).  See the module docstring."""
    if not isinstance(module, nn.Module):
        raise PipeRuntimeError(f"split_module takes an nn.Module, got {type(module).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    names = [str(n) for n in split_points]
    _check_names(module, names)
    mode = module.training
    plans: dict[bool, _Plan | PipeRuntimeError] = {mode: _plan(_trace(module, args, kwargs), module, names, mode)}
    flags = {m: m.training for m in module.modules()}
    try:  # the other mode's graph: a failure there is reported when a stage first runs in that mode
        module.train(not mode)
        plans[not mode] = _plan(_trace(module, args, kwargs), module, names, not mode)
    except PipeRuntimeError as err:
        plans[not mode] = err
    finally:
        for m, flag in flags.items():
            m.training = flag
    stages = [ModuleStage(k, len(names) + 1) for k in range(len(names) + 1)]
    for training, plan in plans.items():
        for k, stage in enumerate(stages):
            stage._install(training, plan if isinstance(plan, PipeRuntimeError) else plan.program(k, module))
    for stage in stages:
        stage.train(mode)
    return stages


class ModuleStage(nn.Module):
    """One stage of `split_module`: traced graphs (one per train/eval mode) over the model's own parameters.

    Its parameters and buffers sit at their names in the original model (containers for the
    path, no other submodules).  Called with the tensors the previous stage returned (stage 0:
    the model's flattened input tensors); returns a tensor or a tuple of tensors, the last stage
    the model's output structure.  `print(stage.code())` shows the graph of the current mode."""

    def __init__(self, index: int, num_stages: int) -> None:
        super().__init__()
        self.stage_index = index
        self.num_stages = num_stages
        self._programs: dict[bool, _Program | PipeRuntimeError] = {}

    def _install(self, training: bool, program: _Program | PipeRuntimeError) -> None:
        self._programs[training] = program
        if isinstance(program, _Program):
            for target, (obj, persistent) in program.attrs.items():
                _install_attr(self, target, obj, persistent)
            program.attrs = {}  # the stage holds them now (and `.to()` moves them there)

    def _program(self) -> _Program:
        program = self._programs[self.training]
        if isinstance(program, PipeRuntimeError):
            raise PipeRuntimeError(f"stage {self.stage_index} cannot run in {_mode(self.training)} mode: "
                                   f"{program.message}")
        return program

    def forward(self, *inputs: Any) -> Any:
        program = self._program()
        if len(inputs) != len(program.inputs):
            raise TypeError(f"stage {self.stage_index} takes {len(program.inputs)} tensors "
                            f"({', '.join(program.inputs)}), got {len(inputs)}")
        for k, size in program.fixed_batch:
            got = inputs[k].shape[0] if isinstance(inputs[k], torch.Tensor) and inputs[k].dim() else None
            if got != size:
                raise PipeRuntimeError(f"stage 0 was traced with dim 0 of {program.inputs[k]} fixed at {size} (the "
                                       f"model's code fixes it, or the example batch was 1), got {got}")
        out = program.fn(self, *inputs)
        if program.out_spec is not None:
            return pytree.tree_unflatten(list(out), program.out_spec)
        out = tuple(unshared(t, inputs) for t in out)  # a received tensor (or a view) is relayed as a copy
        return out[0] if len(out) == 1 else out

    def code(self) -> str:
        """The Python source of this stage's graph in the current mode."""
        return self._program().source

    def extra_repr(self) -> str:
        program = self._programs.get(self.training)
        if not isinstance(program, _Program):
            return f"stage {self.stage_index} of {self.num_stages}"
        outs = "the model's output" if program.out_spec is not None else ", ".join(program.outputs)
        return (f"stage {self.stage_index} of {self.num_stages} ({_mode(self.training)}): "
                f"({', '.join(program.inputs)}) -> ({outs})")


# ------------------------------------------------------------ tracing


@dataclass
class _Traced:
    graph: fx.Graph
    root: nn.Module  # the unlifted module: constants the graph reads that the model does not hold as attributes
    placeholders: list[fx.Node]  # one per flattened input leaf
    leaves: list[Any]
    out_spec: Any


def _trace(module: nn.Module, args: tuple, kwargs: dict) -> _Traced:
    """torch.export (non-strict) of `module` in its current mode, dim 0 of every input tensor dynamic."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError as err:
        raise PipeRuntimeError(f"the example inputs do not fit {type(module).__name__}.forward: {err}") from None
    dims = {name: pytree.tree_map(_batch_dim, value) for name, value in bound.items()}
    with _quiet(), torch.random.fork_rng(devices=[]):
        try:
            ep = torch.export.export(module, args, kwargs, dynamic_shapes=dims, strict=False)
        except Exception as err:  # noqa: BLE001 - any tracer failure becomes one line
            raise PipeRuntimeError(_untraceable(module, err)) from None
        try:
            gm = ep.module(check_guards=False)
        except TypeError:  # an older torch
            gm = ep.module()
    graph = gm.graph
    for node in list(graph.nodes):  # the input guards: the stages check the one they need themselves
        if node.op == "call_module" and not node.users:
            graph.erase_node(node)
    leaves = pytree.tree_leaves((args, kwargs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise PipeRuntimeError(f"split_module: the traced graph of {type(module).__name__} takes {len(placeholders)} "
                               f"inputs for {len(leaves)} example values")
    return _Traced(graph, gm, placeholders, leaves, ep.call_spec.out_spec)


def _batch_dim(value: Any) -> Any:
    return {0: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() else None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without torch's fake-tensor and symbolic-shape log lines and warnings, for the length of a trace."""
    names = {n for n in logging.root.manager.loggerDict if n.startswith(_NOISY_LOGGERS)} | set(_NOISY_LOGGERS)
    loggers = [logging.getLogger(n) for n in sorted(names)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:  # torch.export also prints the partial graph of a failed trace to stderr
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _untraceable(module: nn.Module, err: Exception) -> str:
    """One line: where in the user's code the trace failed and why."""
    where = _user_frame(err)
    text = str(err).strip()
    if "data-dependent" in text or type(err).__name__ in _DATA_DEPENDENT:
        reason = ("data-dependent control flow: Python branches on a tensor's value (use torch.where or torch.cond; "
                  "branches on shapes and constants are fine)")
    else:
        first = text.splitlines()[0] if text else ""
        reason = f"{type(err).__name__}: {first[:240]}"
    return f"split_module cannot trace {type(module).__name__}{where}: {reason}"


def _user_frame(err: BaseException) -> str:
    """' at file:line (`code`)' of the innermost frame outside torch and this file, or ''."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_TORCH_DIR) and f.filename != _THIS_FILE and not _stdlib(f.filename)]
    if frames:
        f = frames[-1]
        code = f" (`{f.line.strip()}`)" if f.line else ""
        return f" at {f.filename}:{f.lineno}{code}"
    found = re.findall(r'File "([^"]+)", line (\d+)', str(err))
    return f" at {found[-1][0]}:{found[-1][1]}" if found else ""


def _stdlib(filename: str) -> bool:
    return filename.startswith(str(Path(contextlib.__file__).parent)) and "site-packages" not in filename


# ------------------------------------------------------------ split points


def _check_names(module: nn.Module, names: list[str]) -> None:
    known = dict(module.named_modules(remove_duplicate=False))
    for name in names:
        if not name or name not in known:
            raise PipeRuntimeError(f"split point {name!r} is not a submodule of {type(module).__name__}; "
                                   f"near it: {_near(module, name)}")
    if len(set(names)) != len(names):
        raise PipeRuntimeError(f"split points {names} name a submodule twice")


def _near(module: nn.Module, name: str, called: set[str] | None = None) -> str:
    """Submodule names near `name`: its siblings, else close spellings, else the top-level children."""
    known = [n for n, _ in module.named_modules(remove_duplicate=False) if n and (called is None or n in called)]
    parent = name.rpartition(".")[0]
    near = [n for n in known if n.rpartition(".")[0] == parent and n != name] if parent in {"", *known} else []
    if not near or len(near) > 12:
        near = difflib.get_close_matches(name, known, n=8, cutoff=0.5) or near
    if not near and known:
        depth = min(n.count(".") for n in known)
        near = [n for n in known if n.count(".") == depth]
    near = near[:12]
    return ", ".join(near) if near else "(none)"


def _paths(node: fx.Node) -> set[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return {re.sub(r"@\d+$", "", str(v[0])) for v in stack.values()}


# ------------------------------------------------------------ the partition


@dataclass
class _Plan:
    """One traced graph cut into stages: which nodes each stage runs and what crosses each boundary."""

    traced: _Traced
    stage_of: dict[fx.Node, int]  # compute nodes
    carried: list[list[fx.Node]]  # carried[k]: what stage k sends to stage k+1, in graph order
    sym_carried: set[fx.Node]  # sizes sent as 0-d tensors (nothing could recompute them)
    num_stages: int
    training: bool

    def program(self, k: int, module: nn.Module) -> _Program:
        return _build(self, k, module)


def _static(val: Any) -> Any:
    """A Python constant for `val` if the trace fixed it (a SymInt specialised to 6 is 6), else None."""
    if isinstance(val, _CONST):
        return val
    if isinstance(val, _SYM):
        try:
            return val.node.maybe_as_int() if isinstance(val, torch.SymInt) else None
        except AttributeError:
            return None
    return None


def _kind(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor"
    if _static(val) is not None:
        return "const"
    if isinstance(val, _SYM):
        return "sym"
    if isinstance(val, (list, tuple)):
        return "multi"
    return "other"


def _plan(traced: _Traced, module: nn.Module, names: list[str], training: bool) -> _Plan:
    nodes = list(traced.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    starts = []
    for name in names:
        first = next((n for n in compute if name in _paths(n)), None)
        if first is None:
            called = {p for n in compute for p in _paths(n)}
            kind = type(module.get_submodule(name)).__name__
            raise PipeRuntimeError(f"split point {name!r} ({kind}) runs no operation in "
                                   f"{type(module).__name__}.forward ({_mode(training)} mode, on the example inputs: "
                                   f"never called, or an identity); "
                                   f"submodules that run near it: {_near(module, name, called)}")
        starts.append(pos[first])
    for a, b, sa, sb in zip(names, names[1:], starts, starts[1:]):
        if sb < sa:
            raise PipeRuntimeError(f"split points must follow the order the model runs them: {b!r} runs before {a!r}")
        if sb == sa:
            raise PipeRuntimeError(f"split points {a!r} and {b!r} begin at the same operation: the stage between "
                                   f"them would be empty")
    S = len(names) + 1
    stage_of: dict[fx.Node, int] = {}
    for n in compute:
        src = n.args[0] if n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node) else None
        if src is not None and src in stage_of and _kind(src) == "multi":
            stage_of[n] = stage_of[src]  # an element of a multi-output op goes with it
        else:
            stage_of[n] = bisect.bisect_right(starts, pos[n])
    work = [0] * S
    for n, s in stage_of.items():
        work[s] += _kind(n) == "tensor"
    for s in range(S):
        if not work[s]:
            where = "before the first split point" if s == 0 else f"from {names[s - 1]!r}"
            raise PipeRuntimeError(f"stage {s} ({where}) would compute nothing: move the split point")
    # where each value is made and the last stage that reads it
    made: dict[fx.Node, int] = {p: 0 for p in traced.placeholders}
    made.update(stage_of)
    last: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "output":
            reader = S - 1
        elif n in stage_of:
            reader = stage_of[n]
        else:
            continue
        for u in n.all_input_nodes:
            if u in made and made[u] < reader:
                last[u] = max(last.get(u, reader), reader)
    sym_carried: set[fx.Node] = set()
    carried: list[list[fx.Node]] = [[] for _ in range(S - 1)]
    for u in sorted(last, key=pos.__getitem__):
        kind = _kind(u)
        if kind == "const" or (u.op == "placeholder" and not isinstance(traced.leaves[traced.placeholders.index(u)],
                                                                         torch.Tensor)):
            continue  # baked into the stages that read it
        if kind == "multi" or kind == "other":
            raise PipeRuntimeError(f"split_module cannot pass {u.name} (a {type(u.meta.get('val')).__name__}) from "
                                   f"stage {made[u]} to stage {last[u]}: move a split point")
        if kind == "sym":
            continue  # decided below, once the tensors each stage receives are known
        for k in range(made[u], last[u]):
            carried[k].append(u)
    for u in sorted(last, key=pos.__getitem__):
        if _kind(u) != "sym":
            continue
        readers = {S - 1 if r.op == "output" else stage_of[r] for r in u.users if r.op == "output" or r in stage_of}
        if any(not _can_remat(u, carried[s - 1]) for s in readers if s > made[u]):
            sym_carried.add(u)
            for k in range(made[u], last[u]):
                carried[k].append(u)
    for k in range(S - 1):
        carried[k].sort(key=pos.__getitem__)
        if not carried[k]:
            raise PipeRuntimeError(f"stage {k} passes nothing to stage {k + 1}: nothing after "
                                   f"{names[k]!r} reads what runs before it")
    return _Plan(traced, stage_of, carried, sym_carried, S, training)


def _output_leaves(graph: fx.Graph) -> list[Any]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    return pytree.tree_leaves(out.args[0])


_SYM_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
                  operator.neg, operator.pow, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
                  operator.ge, torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not}


def _symbol_source(expr: Any, received: list[fx.Node]) -> tuple[fx.Node, int] | None:
    """A received tensor and dim whose size is the symbol `expr`."""
    for r in received:
        val = r.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return r, d
    return None


def _can_remat(u: Any, received: list[fx.Node]) -> bool:
    """Can a size be recomputed in a stage from the tensors it receives?"""
    if not isinstance(u, fx.Node):
        return True
    val = u.meta.get("val")
    if _static(val) is not None:
        return True
    if u.target is torch.ops.aten.sym_size.int and isinstance(val, torch.SymInt):
        return _symbol_source(val.node.expr, received) is not None
    if u.target in _SYM_FUNCTIONS:
        return all(_can_remat(a, received) for a in u.args)
    return False


# ------------------------------------------------------------ one stage's graph


@dataclass
class _Program:
    fn: Callable[..., tuple]
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    out_spec: Any  # the model's output structure (last stage), else None
    attrs: dict[str, tuple[Any, bool]] = field(default_factory=dict)  # target -> (object, persistent)
    fixed_batch: list[tuple[int, int]] = field(default_factory=list)  # stage 0: (input, dim 0) fixed by the trace

    def __deepcopy__(self, memo: dict) -> _Program:
        return self  # immutable once installed: a deep copy of a stage (and of its model) runs the same code


def _build(plan: _Plan, k: int, module: nn.Module) -> _Program:
    traced, S = plan.traced, plan.num_stages
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    raw: dict[fx.Node, fx.Node] = {}  # sizes received as 0-d tensors: the placeholder, to relay as is
    attrs: dict[str, tuple[Any, bool]] = {}
    fixed: list[tuple[int, int]] = []
    for p, leaf in zip(traced.placeholders, traced.leaves):
        if not isinstance(leaf, torch.Tensor):
            env[p] = leaf  # a constant of the trace
    if k == 0:
        received = [p for p, leaf in zip(traced.placeholders, traced.leaves) if isinstance(leaf, torch.Tensor)]
    else:
        received = plan.carried[k - 1]
    for i, u in enumerate(received):
        ph = g.placeholder(u.name)
        ph.meta = dict(u.meta)
        if u in plan.sym_carried:
            raw[u] = ph
            env[u] = g.call_method("item", (ph,))
        else:
            env[u] = ph
        val = u.meta.get("val")
        if k == 0 and isinstance(val, torch.Tensor) and val.dim() and _static(val.shape[0]) is not None:
            fixed.append((i, _static(val.shape[0])))
    mine = [n for n in traced.graph.nodes if plan.stage_of.get(n) == k]
    if k > 0:  # an in-place op on a received tensor (or a view of one) would write into a reused receive buffer
        for u in _mutated_inputs(mine, set(received)):
            env[u] = g.call_function(torch.ops.aten.clone.default, (env[u],))

    def value(u: fx.Node) -> Any:
        if u in env:
            return env[u]
        if u.op == "get_attr":
            node = g.get_attr(u.target)
            node.meta = dict(u.meta)
            attrs[u.target] = _resolve(module, traced.root, u.target)
            env[u] = node
            return node
        val = u.meta.get("val")
        if _static(val) is not None:
            return _static(val)
        if u.target is torch.ops.aten.sym_size.int:
            src, d = _symbol_source(val.node.expr, received)
            env[u] = g.call_function(torch.ops.aten.sym_size.int, (env[src], d))
            return env[u]
        if u.target in _SYM_FUNCTIONS:
            env[u] = g.node_copy(u, value)
            return env[u]
        raise AssertionError(f"split_module: {u.name} is not available in stage {k}")  # _plan rules this out

    for n in mine:
        env[n] = g.node_copy(n, value)
    if k == S - 1:
        leaves = [value(v) if isinstance(v, fx.Node) else v for v in _output_leaves(traced.graph)]
        g.output(tuple(leaves))
        outputs: tuple[str, ...] = ()
        out_spec = traced.out_spec
    else:
        sent = []
        for u in plan.carried[k]:
            if u in plan.sym_carried:  # made here: as a 0-d tensor on the device of the stage's tensors
                like = next(env[n] for n in [*received, *mine] if _kind(n) == "tensor")
                sent.append(raw[u] if u in raw else g.call_function(_as_tensor, (value(u), like)))
            else:
                sent.append(value(u))
        g.output(tuple(sent))
        outputs = tuple(u.name for u in plan.carried[k])
        out_spec = None
    g.lint()
    code = g.python_code(root_module="self")
    filename = f"<split_module {next(_TRACES)}: stage {k} ({_mode(plan.training)})>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102 - fx's generated code, as GraphModule does
    return _Program(namespace["forward"], code.src, tuple(u.name for u in received), outputs, out_spec, attrs, fixed)


def _as_tensor(size: Any, like: torch.Tensor) -> torch.Tensor:
    """A size computed at run time, as the 0-d tensor that carries it to the next stage (on `like`'s device)."""
    dtype = torch.bool if isinstance(size, bool) else torch.int64 if isinstance(size, int) else torch.float64
    return torch.tensor(size, dtype=dtype, device=like.device)


def _mutated_inputs(nodes: list[fx.Node], received: set[fx.Node]) -> list[fx.Node]:
    """The received values that an in-place op of `nodes` writes into (directly or through a view)."""
    root: dict[fx.Node, fx.Node] = {}

    def base(a: Any) -> Any:
        return root.get(a, a) if isinstance(a, fx.Node) else None

    out: list[fx.Node] = []
    for n in nodes:
        schema = getattr(n.target, "_schema", None)
        if n.target is operator.getitem:
            root[n] = base(n.args[0])
        if schema is None:
            continue
        written = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append(n.args[i] if i < len(n.args) else n.kwargs.get(arg.name))
        for a in written:
            b = base(a)
            if b in received and b not in out:
                out.append(b)
        if schema.returns and schema.returns[0].alias_info is not None and n.args:
            root[n] = base(n.args[0])
    return out


def _resolve(module: nn.Module, root: nn.Module, target: str) -> tuple[Any, bool]:
    """The object behind a graph attribute: the model's own parameter or buffer (and whether it is persistent),
    else the traced module's constant or submodule."""
    owner_path, _, name = target.rpartition(".")
    try:
        owner = module.get_submodule(owner_path)
    except AttributeError:
        owner = None
    if owner is not None:
        if name in owner._parameters and owner._parameters[name] is not None:
            return owner._parameters[name], True
        if name in owner._buffers and owner._buffers[name] is not None:
            return owner._buffers[name], name not in owner._non_persistent_buffers_set
        obj = getattr(owner, name, None)
        if isinstance(obj, torch.Tensor):
            return obj, False
    return operator.attrgetter(target)(root), False


def _install_attr(stage: nn.Module, target: str, obj: Any, persistent: bool) -> None:
    *path, name = target.split(".")
    owner = stage
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(obj, nn.Parameter):
        if owner._parameters.get(name) is not obj:
            owner.register_parameter(name, obj)
    elif isinstance(obj, nn.Module):
        if owner._modules.get(name) is not obj:
            owner.add_module(name, obj)
    elif isinstance(obj, torch.Tensor):
        if owner._buffers.get(name) is not obj:
            owner.register_buffer(name, obj, persistent=persistent)
    else:
        setattr(owner, name, obj)


def _mode(training: bool) -> str:
    return "train" if training else "eval"
