"""The graph IR: immutable values, nodes and graphs, and the verifier run between passes.

A :class:`Graph` is a straight-line program in topological order. Every tensor it
computes is a :class:`Value` (an id, a global shape and a dtype). A node's inputs are
:class:`Ref` (a value of the graph) or :class:`Const` (a value fixed at trace time: a
number, a numpy array, a concrete Tensor). The graph's own inputs are its
arguments (``Graph.args``) and the Parameters it reads (``Graph.params``), which the
executor binds anew on every call, so parameter updates are always seen.

Passes never mutate: they return new graphs (``Graph.replace`` / ``Node.replace``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["Value", "Ref", "Const", "Node", "Graph", "GraphError", "verify", "CALL", "MOVE",
           "REDUCE", "FUSED", "FUSED_RS", "FUSED_AG", "flatten_refs", "map_leaves"]

#: ``Node.op`` of an opaque call (an optimizer update): ``attrs["fn"](*inputs)``.
CALL = "Call"
#: ``Node.op`` of a communication node inserted by lowering: one value moved from layout
#: ``attrs["src"]`` to ``attrs["dst"]`` (None: a whole value on every device).
MOVE = "Move"
#: ``Node.op`` of an AllReduce(``attrs["op"]``) finishing an op's output over device axes.
REDUCE = "AllReduce"
#: ``Node.op`` of one fused AllReduce(sum) resolving the pending sums of several values
#: (a fusion bucket, made by the fusion pass from MOVE nodes): input i -> output i.
FUSED = "FusedAllReduce"
#: ``Node.op`` of one fused ReduceScatter(sum) of several gradients into their weights'
#: layouts over one device group ``attrs["members"]``, each along its dim
#: ``attrs["axes"][i]`` of the local buffer (fuse.py): input i -> output i.
FUSED_RS = "FusedReduceScatter"
#: ``Node.op`` of one fused AllGather of several sharded parameters over one device
#: group ``attrs["members"]``, each along its dim ``attrs["axes"][i]`` (fuse.py).
FUSED_AG = "FusedAllGather"


class GraphError(RuntimeError):
    """An ill-formed graph (a bug in a pass, not in user code)."""


@dataclass(frozen=True)
class Value:
    id: int
    shape: Tuple[int, ...]
    dtype: np.dtype

    def __repr__(self):
        return f"%{self.id}:{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Ref:
    """An input that is a value of the graph."""
    id: int

    def __repr__(self):
        return f"%{self.id}"


@dataclass(frozen=True, eq=False)
class Const:
    """An input fixed at trace time."""
    value: Any

    def __repr__(self):
        v = self.value
        shape = getattr(v, "shape", None)
        return f"const{list(shape)}" if shape else f"const({v!r})"


@dataclass(frozen=True)
class Node:
    """One op call.

    op          the OpDef (or :data:`CALL` for an opaque call)
    attrs       the op's attributes (as the dispatcher got them)
    inputs      tuple of Ref / Const
    outputs     tuple of Value
    name        a unique display name ("MatMul-3")
    backward    recorded while a gradient was being computed
    strategy    the configured strategy: (in_strategy, out_strategy) or None
    in_layouts  the layout each input is moved to before the op runs (None: as it comes)
    out_layouts the layout each output is moved to after it runs (None: as it comes)
    cost        the cost of the chosen strategy (filled by propagation)
    """
    op: Any
    attrs: Any
    inputs: Tuple[Any, ...]
    outputs: Tuple[Value, ...]
    name: str
    backward: bool = False
    strategy: Optional[tuple] = None
    in_layouts: Optional[tuple] = None
    out_layouts: Optional[tuple] = None
    cost: float = 0.0
    chosen: Optional[tuple] = None      # the strategy tuples propagation chose (display)
    run: Any = field(default=None, compare=False)   # how the executor runs it (lower.py)

    @property
    def op_name(self) -> str:
        return self.op if isinstance(self.op, str) else self.op.name

    def replace(self, **changes) -> "Node":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Graph:
    """args     the Values of the traced function's tensor arguments, in order
    arg_layouts the layout each argument is moved to on entry (None: as it comes)
    params   ((Parameter, Value), ...) the Parameters the function reads
    param_layouts the layout each parameter must live in (None: as it is)
    nodes    the nodes, producers before consumers
    outputs  the output structure: a nested tuple/list/dict whose tensor leaves are Ref
             (or Const for results that do not depend on any input)
    out_layouts per output leaf (flattened order): the layout it leaves in, or None
    """
    args: Tuple[Value, ...]
    params: Tuple[Tuple[Any, Value], ...]
    nodes: Tuple[Node, ...]
    outputs: Any
    arg_layouts: Tuple[Any, ...] = ()
    param_layouts: Tuple[Any, ...] = ()
    out_layouts: Tuple[Any, ...] = ()
    meta: dict = field(default_factory=dict, compare=False)

    def replace(self, **changes) -> "Graph":
        return dataclasses.replace(self, **changes)

    def values(self) -> dict:
        """Every value by id."""
        out = {v.id: v for v in self.args}
        out.update({v.id: v for _, v in self.params})
        for n in self.nodes:
            out.update({v.id: v for v in n.outputs})
        return out

    def consumers(self) -> dict:
        """value id -> [(node index, input index), ...]."""
        out = {}
        for k, n in enumerate(self.nodes):
            for i, x in enumerate(n.inputs):
                if isinstance(x, Ref):
                    out.setdefault(x.id, []).append((k, i))
        return out

    def producers(self) -> dict:
        """value id -> (node index, output index)."""
        return {v.id: (k, j) for k, n in enumerate(self.nodes) for j, v in enumerate(n.outputs)}

    def __repr__(self):
        lines = [f"graph({', '.join(map(repr, self.args))}) params="
                 f"[{', '.join(f'{p.name}={v!r}' for p, v in self.params)}]"]
        for n in self.nodes:
            outs = ", ".join(map(repr, n.outputs))
            ins = ", ".join(map(repr, n.inputs))
            lines.append(f"  {outs} = {n.name}({ins}){'  # backward' if n.backward else ''}")
        lines.append(f"  return {flatten_refs(self.outputs)}")
        return "\n".join(lines)


def flatten_refs(tree) -> list:
    """The Ref/Const leaves of an output structure, in order."""
    out = []

    def walk(t):
        if isinstance(t, (Ref, Const)):
            out.append(t)
        elif isinstance(t, (tuple, list)):
            for x in t:
                walk(x)
        elif isinstance(t, dict):
            for k in t:
                walk(t[k])
    walk(tree)
    return out


def map_leaves(tree, fn):
    """The output structure `tree` with every Ref/Const leaf replaced by ``fn(leaf)``
    (tuples, lists and dicts rebuilt; other leaves kept)."""
    if isinstance(tree, (Ref, Const)):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(map_leaves(t, fn) for t in tree)
    if isinstance(tree, list):
        return [map_leaves(t, fn) for t in tree]
    if isinstance(tree, dict):
        return {k: map_leaves(t, fn) for k, t in tree.items()}
    return tree


def verify(graph: Graph) -> Graph:
    """Check the graph is well formed; return it (raises GraphError naming the node)."""
    defined = {}
    for v in graph.args:
        if v.id in defined:
            raise GraphError(f"graph: value %{v.id} is defined twice (argument)")
        defined[v.id] = v
    for p, v in graph.params:
        if v.id in defined:
            raise GraphError(f"graph: value %{v.id} is defined twice (parameter {p.name})")
        defined[v.id] = v
    names = set()
    for n in graph.nodes:
        if n.name in names:
            raise GraphError(f"graph: two nodes are named {n.name}")
        names.add(n.name)
        for i, x in enumerate(n.inputs):
            if isinstance(x, Ref):
                if x.id not in defined:
                    raise GraphError(f"graph: {n.name} input {i} reads %{x.id} before it is "
                                     f"defined")
            elif not isinstance(x, Const):
                raise GraphError(f"graph: {n.name} input {i} is a {type(x).__name__}; inputs "
                                 f"must be Ref or Const")
        for lays, what, count in ((n.in_layouts, "in_layouts", len(n.inputs)),
                                  (n.out_layouts, "out_layouts", len(n.outputs))):
            if lays is not None and len(lays) != count:
                raise GraphError(f"graph: {n.name} has {len(lays)} {what} for {count} "
                                 f"values")
            for lay, v in zip(lays or (), n.outputs if what == "out_layouts" else
                              [defined.get(x.id) if isinstance(x, Ref) else None
                               for x in n.inputs]):
                if lay is not None and v is not None and tuple(lay.shape) != tuple(v.shape):
                    raise GraphError(f"graph: {n.name} {what} give shape {lay.shape} to "
                                     f"{v!r}")
        for v in n.outputs:
            if v.id in defined:
                raise GraphError(f"graph: {n.name} redefines %{v.id}")
            defined[v.id] = v
    for leaf in flatten_refs(graph.outputs):
        if isinstance(leaf, Ref) and leaf.id not in defined:
            raise GraphError(f"graph: output %{leaf.id} is not defined")
    if graph.arg_layouts and len(graph.arg_layouts) != len(graph.args):
        raise GraphError(f"graph: {len(graph.arg_layouts)} argument layouts for "
                         f"{len(graph.args)} arguments")
    return graph
