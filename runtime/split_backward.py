"""The split backward's graph algebra: what I computes, where W restarts, and what stays alive between them.

A zero-bubble program splits a stage's backward in two: I, the gradient w.r.t. the stage inputs
(which the previous stage waits for), and W, the parameters' gradients, run later to fill gaps.
From the forward's autograd graph alone this module decides where W restarts (the nodes on I's
path whose other branches lead only to parameters, `WeightPlan`), which parameters' gradients I
computes anyway (vectors, parameters shared along I's path), which nodes W runs, and after I which
saved tensors W never reads (`drop_unread`) and how many bytes the pending W still holds
(`pending_w_bytes`).  The plan is in node numbers of a `Graph`, so it is derived once per graph
shape.  stage.py runs the passes; this module holds no state of its own: what W reads is marked on
the `Saved` entries of one activation, so two threads (an overlapped pair, runtime/overlap.py)
never see each other's marks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from pipedsl.runtime.recompute import Region


def storage_key(t: Any) -> tuple[int, int] | None:
    """(storage address, bytes) of an activation tensor; None for parameters and views of them.

    Runs for every tensor autograd saves: a plain tensor (almost all of them) is told apart by its
    type alone, since `isinstance(t, nn.Parameter)` goes through Parameter's metaclass."""
    plain = type(t) is torch.Tensor and (t._base is None or type(t._base) is torch.Tensor)
    if not plain and (not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter)
                      or isinstance(t._base, nn.Parameter)):
        return None
    if not plain:
        t = getattr(t, "_local_tensor", t)  # a DTensor keeps its local shard (its numel is the global one)
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return id(t), t.numel() * t.element_size()


class Saved:
    """One tensor autograd saved, as the pack hook hands it to autograd: the token keeps the activation
    counted while autograd holds it; `tensor` is None once I dropped it (W never reads it); `read` is set
    by every unpack, so `drop_unread` learns what W's nodes read from the entries themselves."""

    __slots__ = ("token", "tensor", "read")

    def __init__(self, token: object, tensor: torch.Tensor) -> None:
        self.token = token
        self.tensor: torch.Tensor | None = tensor
        self.read = False


def unpack(saved: Saved) -> torch.Tensor:
    """The unpack hook of a `Saved`: its tensor, marked as read."""
    t = saved.tensor
    if t is None:
        raise RuntimeError("pipedsl: W read a tensor its I had dropped as unread; please report this with the model")
    saved.read = True
    return t


def pending_w_bytes(saved: list[Saved], inputs: list, boundary: list[tuple], counted: set[int]) -> int:
    """After I: the bytes W still holds — the stage inputs, the saved tensors it reads and the gradients captured for
    it (`boundary`, `WeightPlan.weight_groups`), each storage once.  A kept tensor counts where the forward counted
    its storage (`counted`; a parameter's, saved detached, is not): the activation is recounted at that."""
    held: dict[int, int] = {}
    kept = [s.tensor for s in saved if s.tensor is not None] + list(inputs)
    for t in kept:
        key_n = storage_key(t) if isinstance(t, torch.Tensor) else None
        if key_n is not None and key_n[0] in counted:
            held[key_n[0]] = key_n[1]
    for _, gs, _, _ in boundary:
        for g in gs:
            key_n = storage_key(g) if isinstance(g, torch.Tensor) else None
            if key_n is not None:
                held[key_n[0]] = key_n[1]
    return sum(held.values())


def drop_unread(saved: list[Saved], regions: list[Region], weight_nodes: list[Node]) -> None:
    """After I: drop every tensor an activation's forward saved, and every tensor its recomputed regions saved
    again, except those W's nodes read (reading each node's saved tensors once marks them), so a pending W holds
    only what it needs; the caller lets go of the regions.  The marks are the activation's own (its `Saved`
    entries, its regions): nothing another thread's backward reads meanwhile can touch them."""
    for s in saved:
        s.read = False  # I's backward read them too
    for region in regions:  # what W reads of a recomputed region: marked by the region itself
        region.read = set()
    try:
        for node in weight_nodes:
            for name in saved_names(node):
                getattr(node, name)
    finally:
        for region in regions:
            region.drop_unread()
    for s in saved:
        if not s.read:
            s.tensor = None


_UNREADABLE = frozenset({"CopySlices", "CppFunction"})  # nodes that hold saved tensors without naming them


def saved_names(node: Node) -> tuple[str, ...]:
    """The attributes through which a node's saved tensors are read (each read unpacks them)."""
    return _saved_names_of(type(node))


@functools.cache
def _saved_names_of(kind: type) -> tuple[str, ...]:
    """Per node type (the attributes are its class's): found once."""
    if issubclass(kind, torch.autograd.function.BackwardCFunction):
        return ("saved_tensors",)
    return tuple("_saved_" + a[len("_raw_saved_"):] for a in dir(kind) if a.startswith("_raw_saved_"))


def grad_node(t: torch.Tensor) -> Node | None:
    """The node gradients of `t` flow into: its grad_fn, or (a leaf) its AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


class Graph:
    """One backward graph, numbered breadth-first from the roots, with a structural signature.

    Two graphs with equal signatures have the same node kinds, the same edges and the same
    parameters and inputs at the same numbers, so a `WeightPlan` computed for one holds for
    the other: the plan is derived once per stage structure, not once per microbatch.
    """

    __slots__ = ("nodes", "children", "roots", "signature")

    def __init__(self, roots: list[Node | None], inputs: dict[Node, int], params: dict[Node, int]) -> None:
        index: dict[Node, int] = {}
        nodes: list[Node] = []
        sig: list = []
        self.roots: list[int | None] = []
        for r in roots:
            if r is not None and r not in index:
                index[r] = len(nodes)
                nodes.append(r)
            self.roots.append(None if r is None else index[r])
        sig.append(tuple(self.roots))
        self.children: list[list[int]] = []
        i = 0
        while i < len(nodes):
            node = nodes[i]
            i += 1
            kids = []
            for fn, _ in node.next_functions:
                if fn is None:
                    continue
                j = index.get(fn)
                if j is None:
                    j = index[fn] = len(nodes)
                    nodes.append(fn)
                kids.append(j)
            self.children.append(kids)
            mark = params.get(node)
            if mark is None:
                mark = inputs.get(node, -1)
                mark = -1 if mark < 0 else -2 - mark
            sig.append((type(node), mark, *kids))
        self.nodes = nodes
        self.signature = tuple(sig)


class WeightPlan:
    """Where W restarts: nodes on the input path with a branch that leads only to parameters.

    I runs every node on a path from the outputs to the inputs; W must run the rest — the
    parameter branches hanging off that path (and outputs that never reach an input).  The
    gradient entering each branching node is captured during I; W runs `autograd.grad` from
    those nodes to the parameters below their branches, one call per group of nodes that
    share parameters, so no node of I's path is recomputed (except between two nodes of one
    group, where a pre-hook pins the deeper node's gradient to I's value: no double count).
    Everything is in node numbers of a `Graph`, so one plan serves every graph of its shape.
    """

    def __init__(self, graph: Graph, inputs: dict[Node, int], params: dict[Node, int],
                 early: set[int] = frozenset(), chains: bool = False, pinned: set[int] = frozenset()) -> None:
        # torch.compile's regions: one backward node for inputs and weights alike, which cannot be split (decided
        # once per graph shape: the signature holds every node's type)
        self.opaque = any(type(n).__name__ == "CompiledFunctionBackward" for n in graph.nodes)
        children = graph.children
        targets_in = {k for k, n in enumerate(graph.nodes) if n in inputs}
        param_of = {k: params[n] for k, n in enumerate(graph.nodes) if n in params}
        on_path = _reaching(children, targets_in)
        to_param = _reaching(children, set(param_of))

        def params_below(starts: list[int]) -> set[int]:
            found, stack, visited = set(), list(starts), set(starts)
            while stack:
                node = stack.pop()
                if node in param_of:
                    found.add(param_of[node])
                for c in children[node]:
                    if to_param[c] and c not in visited:
                        visited.add(c)
                        stack.append(c)
            return found

        entries: list[tuple[str, int, set[int]]] = []
        for u, kids in enumerate(children):
            if on_path[u] and u not in targets_in:
                side = [c for c in kids if to_param[c] and not on_path[c]]
                if side:
                    entries.append(("node", u, params_below(side)))
        for k, r in enumerate(graph.roots):
            if r is not None and not on_path[r] and to_param[r]:
                entries.append(("root", k, params_below([r])))
        # the candidates (`early`) I computes: only where every entry reaching one moves to I whole, so W reaches
        # none of them again
        in_input = set().union(*(ps for kind, _, ps in entries if kind == "node")) & early
        changed = True
        while changed:
            changed = False
            for kind, _, ps in entries:
                if ps & in_input and (kind == "root" or not ps <= in_input):
                    in_input -= ps
                    changed = True
        groups = _merge_sharing([e for e in entries if not e[2] <= in_input])
        if chains:  # a group of several nodes on I's path: W would run I's path between them again; I runs it once
            shared = [g for g in groups if sum(kind == "node" for kind, _ in g[0]) > 1 and not set(g[1]) & pinned]
            in_input.update(*(pidx for _, pidx in shared))
            groups = [g for g in groups if g not in shared]
        self.early = sorted(in_input)
        self.groups = groups
        self.hooked = [u for members, _ in groups for kind, u in members if kind == "node"]
        self.weight_nodes = sorted(self._weight_nodes(graph, param_of))
        # a node W runs whose saved tensors Python cannot read (an in-place op on a view, a C++ autograd Function):
        # what W needs is unknown, so I drops nothing
        self.keeps_all = any(type(graph.nodes[k]).__name__ in _UNREADABLE for k in self.weight_nodes)

    def _weight_nodes(self, graph: Graph, param_of: dict[int, int]) -> set[int]:
        """The nodes W runs: those on a path from a group's starts to one of the group's parameters (autograd
        runs no other node of a `backward(..., inputs=)`)."""
        run: set[int] = set()
        for members, pidx in self.groups:
            wanted = set(pidx)
            reach = _reaching(graph.children, {k for k, p in param_of.items() if p in wanted})
            starts = {u if kind == "node" else graph.roots[u] for kind, u in members}
            stack = [u for u in starts if u is not None and reach[u]]
            seen = set(stack)  # per group: a node another group ran may lead to this group's parameters
            while stack:
                for c in graph.children[stack.pop()]:
                    if reach[c] and c not in seen:
                        seen.add(c)
                        stack.append(c)
            run |= seen
        return run

    def weight_groups(self, nodes: list[Node], captured: dict[Node, tuple], outs: list[torch.Tensor],
                      gs: list) -> list[tuple]:
        """For W, per group: (roots, root gradients, parameter indices, clamps)."""
        out = []
        for members, pidx in self.groups:
            roots, grads, clamps = [], [], []
            for kind, anchor in members:
                if kind == "root":
                    roots.append(outs[anchor])
                    grads.append(gs[anchor])
                    continue
                node = nodes[anchor]
                g = captured.get(node)
                if g is None:
                    continue
                clamps.append((node, g))
                for k, gk in enumerate(g):
                    if gk is not None:
                        roots.append(GradientEdge(node, k))
                        grads.append(gk)
            if roots:
                out.append((roots, grads, pidx, clamps if len(clamps) > 1 else []))
        return out


def _merge_sharing(entries: list[tuple[str, int, set[int]]]) -> list[tuple[list[tuple[str, int]], list[int]]]:
    """Entries that share a parameter in one group (union-find): [(members, sorted parameters)]."""
    parent = list(range(len(entries)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for e, (_, _, ps) in enumerate(entries):
        for p in ps:
            if p in owner:
                parent[find(e)] = find(owner[p])
            else:
                owner[p] = e
    merged: dict[int, list[int]] = {}
    for e in range(len(entries)):
        merged.setdefault(find(e), []).append(e)
    groups = []
    for members in merged.values():
        pidx = set().union(*(entries[e][2] for e in members))
        if pidx:
            groups.append(([entries[e][:2] for e in members], sorted(pidx)))
    return groups


def _reaching(children: list[list[int]], targets: set[int]) -> list[bool]:
    """Per node: can some target be reached from it (targets included)?"""
    reach = [False] * len(children)
    state = [0] * len(children)  # 0 new, 1 on the stack, 2 done
    # iterative post-order DFS (graphs can be deep: no recursion)
    for start in range(len(children)):
        if state[start]:
            continue
        state[start] = 1
        stack = [(start, iter(children[start]))]
        while stack:
            node, it = stack[-1]
            child = next(it, None)
            if child is None:
                stack.pop()
                state[node] = 2
                reach[node] = node in targets or any(reach[c] for c in children[node])
                continue
            if not state[child]:
                state[child] = 1
                stack.append((child, iter(children[child])))
    return reach
