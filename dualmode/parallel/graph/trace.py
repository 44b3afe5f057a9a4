"""Tracing: run a function once on abstract values and record every op call as a node.

While a trace runs, the dispatcher's distributed hook is swapped for :func:`_Trace.apply`:
abstract tensors (:class:`Tracer`) carry a :class:`TraceLayout` in place of a layout,
so every op with an abstract input reaches the tracer, which evaluates its shape and
dtype with the op's infer rule and records a :class:`~.ir.Node`. Nothing is computed.

* Python control flow runs as usual and unrolls for the traced shapes; reading the
  value of an abstract tensor (``asnumpy``, ``float``, ``if t:``) raises.
* Parameters: the ones the function can reach (its Cell, the Cells and Parameters in
  its closure and globals, the weights of its ``value_and_grad``) are swapped for
  abstract values for the trace, so even ops on parameters alone are recorded; any
  other Parameter met as an op input is lifted then. The graph refers to the
  Parameter objects themselves, so a call always sees their current values.
* Autograd inside the function (``value_and_grad``) runs its tape over the abstract
  values: the backward ops are recorded like the forward ones (flagged ``backward``).
* A Primitive with a strategy tags the node its call records; an optimizer's update
  is recorded as one opaque :data:`~.ir.CALL` node run eagerly on the gradients.
"""
from __future__ import annotations

import functools
import itertools
import threading
import types
from typing import Optional

import numpy as np

from ..._core import _tensor as _core
from ..._core._tensor import TensorBase
from ...ops.interpreter import interpreting
from ...ops.primitive import _flat
from ...tensor import Parameter, Tensor
from ..devices import device_num
from ..moves import REDISTRIBUTE
from ..sharding import op_strategy_layouts
from ..strategy import strategies_active
from ..strategy_checks import check_strategy_for
from .ir import CALL, Const, Graph, Node, Ref, Value, flatten_refs, verify

__all__ = ["Tracer", "TraceLayout", "TraceError", "trace", "current_trace", "find_parameters",
           "walk_reachable"]


class TraceError(RuntimeError):
    """User code did something a traced function cannot do."""


class TraceLayout:
    """Stands in a tensor's ``_layout`` while it is abstract: which graph value it is."""

    __slots__ = ("vid", "shape", "dtype")
    partial = ()
    tensor_map = ()
    abstract = True         # what lower layers ask (they cannot import this class)

    def __init__(self, vid, shape, dtype):
        self.vid = vid
        self.shape = tuple(shape)
        self.dtype = dtype

    def __repr__(self):
        return f"TraceLayout(%{self.vid}, {self.shape}, {self.dtype})"


def _readout_error(t):
    return TraceError(
        f"graph mode: the value of an abstract tensor (shape {t.shape}, dtype {t.dtype}) "
        f"was read while tracing a compiled function; a compiled function may branch on "
        f"shapes but not on tensor values (compute such values outside ops.shard / "
        f"AutoParallel, or run it in PyNative mode)")


class Tracer(Tensor):
    """A Tensor without a value, seen by the traced function."""

    __slots__ = ()

    def asnumpy(self):
        raise _readout_error(self)

    def __array__(self, dtype=None, copy=None):
        raise _readout_error(self)

    def item(self):
        raise _readout_error(self)

    def __bool__(self):
        raise _readout_error(self)

    def __repr__(self):
        return f"Tracer(shape={self.shape}, dtype={self.dtype})"

    __str__ = __repr__


def _dummy(shape, dtype):
    """A zero-strided stand-in of the given shape (no memory)."""
    return np.broadcast_to(np.zeros((), dtype), tuple(shape))


_STATE = threading.local()


def current_trace() -> Optional["_Trace"]:
    """The trace in progress on this thread, or None."""
    return getattr(_STATE, "trace", None)


class _Trace:
    def __init__(self, name):
        self.name = name
        self.nodes = []
        self.ids = itertools.count()
        self.params = {}           # id(param) -> (param, Value)
        self.swapped = []          # (param, _data, _layout) to restore
        self.scope = []            # [primitive, node or None] of active Primitive calls
        self.counts = {}
        self.real_apply, self.real_assemble = _core.get_dist_hooks()

    # ---- values ------------------------------------------------------------------
    def value(self, shape, dtype) -> Value:
        return Value(next(self.ids), tuple(int(s) for s in shape), np.dtype(dtype))

    def tracer(self, v: Value) -> Tracer:
        t = _core.wrap_dist(_dummy(v.shape, v.dtype), TraceLayout(v.id, v.shape, v.dtype))
        t.__class__ = Tracer
        return t

    def swap_param(self, p: Parameter) -> Value:
        """Make `p` abstract for the trace (restored by :meth:`restore`)."""
        key = id(p)
        if key in self.params:
            return self.params[key][1]
        v = self.value(p.shape, p.dtype)
        self.params[key] = (p, v)
        self.swapped.append((p, p._data, p._layout))
        p._data = _dummy(v.shape, v.dtype)
        p._layout = TraceLayout(v.id, v.shape, v.dtype)
        return v

    def restore(self):
        for p, data, layout in reversed(self.swapped):
            p._data = data
            p._layout = layout
        self.swapped.clear()

    # ---- recording -----------------------------------------------------------------
    def _name(self, op_name):
        k = self.counts.get(op_name, 0)
        self.counts[op_name] = k + 1
        return f"{op_name}-{k}"

    def _ref(self, x):
        """(input ref, abstract stand-in, traced?) of one op input."""
        if isinstance(x, TensorBase):
            lay = x._layout
            if isinstance(lay, TraceLayout):
                return Ref(lay.vid), _dummy(lay.shape, lay.dtype), True
            if isinstance(x, Parameter):
                v = self.swap_param(x)
                return Ref(v.id), _dummy(v.shape, v.dtype), True
            return Const(x), x._value(), False
        return Const(x), x, False

    def apply(self, op, attrs, inputs, rec):
        """The dispatcher's distributed hook during a trace."""
        refs, stand_ins, traced = [], [], False
        for x in inputs:
            r, s, t = self._ref(x)
            refs.append(r)
            stand_ins.append(s)
            traced |= t
        if not traced:          # distributed constants only: run it (constant folding)
            return self.real_apply(op, attrs, inputs, rec)
        metas = _core.infer(op, attrs, *stand_ins)
        outs = tuple(self.value(shape, dtype) for shape, dtype in metas)
        node = Node(op=op, attrs=attrs, inputs=tuple(refs), outputs=outs,
                    name=self._name(op.name), backward=_core.in_backward())
        if self.scope and self.scope[-1][1] is None and not node.backward \
                and op.name != "Redistribute":
            prim = self.scope[-1][0]
            node = node.replace(strategy=(prim.in_strategy, prim.out_strategy))
            self.scope[-1][1] = node
        self.nodes.append(node)
        stand = tuple(_dummy(v.shape, v.dtype) for v in outs)
        lays = tuple(TraceLayout(v.id, v.shape, v.dtype) for v in outs)
        res = _core.finish(op, attrs, tuple(inputs), stand if op.multi_output else stand[0],
                           rec, lays)
        for t in (res if op.multi_output else (res,)):
            t.__class__ = Tracer
        return res

    def assemble(self, t):
        lay = t._layout
        if isinstance(lay, TraceLayout):
            return _dummy(lay.shape, lay.dtype)     # dtype/shape queries of the dispatcher
        return self.real_assemble(t)

    def call_primitive(self, prim, args, kwargs):
        """A Primitive call: its strategy tags the first node the call records."""
        if prim.in_strategy is None and prim.out_strategy is None:
            return prim.construct(*args, **kwargs)
        check_strategy_for(prim, args)
        # a call on constants only (Tile of a constant Tensor) runs at trace time: no op
        # to record, its result a constant (moved by an out_strategy)
        traced = any(isinstance(t, Tracer) for t in _flat(args))
        if prim.in_strategy is not None:
            args = self._moved_args(prim, args)
        self.scope.append([prim, None])
        try:
            out = prim.construct(*args, **kwargs)
        finally:
            _, node = self.scope.pop()
        if prim.out_strategy is not None:
            out = self.move_outputs(out, prim.out_strategy, prim.name, "the op has")
        if node is None and prim.in_strategy is not None and traced:
            raise TraceError(f"{prim.name}: has in_strategy={prim.in_strategy} but its call "
                             f"inside the traced function recorded no op on a traced tensor, "
                             f"so the strategy has nothing to apply to")
        return out

    def move_outputs(self, out, out_strategy, owner, has="the op has"):
        """`out` (one tensor or a tuple) moved into `out_strategy`'s layouts (entries
        None, and non-tensor outputs, stay as they are)."""
        outs = out if isinstance(out, tuple) else (out,)
        if len(out_strategy) != len(outs):
            raise ValueError(f"{owner}: out_strategy has {len(out_strategy)} entries but "
                             f"{has} {len(outs)} output(s)")
        moved = tuple(self._move(o, s, owner, k, "out_strategy")
                      if s is not None and isinstance(o, TensorBase) else o
                      for k, (s, o) in enumerate(zip(out_strategy, outs)))
        return moved if isinstance(out, tuple) else moved[0]

    def _move(self, x, strategy, owner, index, param, layout=None):
        """`x` moved into a strategy's layout, as a recorded Redistribute node (its
        layout is fixed at compile time; the tape sees the moved value, as in PyNative)."""
        if not is_abstract(x) and not isinstance(x, Parameter):
            return x
        return _core.apply(REDISTRIBUTE, {"strategy": strategy, "owner": owner,
                                          "index": index, "param": param, "layout": layout},
                           (x,))

    def _moved_args(self, prim, args):
        lays = None
        if strategies_active():             # the op's layouts over ONE device matrix
            tensors = [t for t in _flat(args) if isinstance(t, (TensorBase, np.ndarray))]
            lays = op_strategy_layouts(prim, tensors, device_num())
        out, k = [], 0
        for a in args:
            if isinstance(a, (tuple, list)) and a and isinstance(a[0], TensorBase):
                moved = []
                for t in a:
                    moved.append(self._move(t, prim.in_strategy[k], prim.name, k,
                                            "in_strategy", lays and lays[k]))
                    k += 1
                out.append(type(a)(moved))
            elif isinstance(a, (TensorBase, np.ndarray)):
                if isinstance(a, TensorBase):
                    a = self._move(a, prim.in_strategy[k], prim.name, k, "in_strategy",
                                   lays and lays[k])
                out.append(a)
                k += 1
            else:
                out.append(a)
        return tuple(out)

    def call_opaque(self, fn, label, tensors, params=None):
        """Record ``fn(tensors)`` as one opaque node (run eagerly at execution).
        `params`: for an optimizer update, the Parameters its gradients `tensors` are
        for (aligned): lowering then moves each gradient where its update needs it."""
        refs = tuple(self._ref(x)[0] for x in tensors)
        attrs = {"fn": fn, "label": label}
        if params is not None:
            attrs["params"] = tuple(params)
        node = Node(op=CALL, attrs=attrs, inputs=refs, outputs=(), name=self._name(label))
        self.nodes.append(node)


# ---------------------------------------------------------------------------
# finding the parameters a function can reach
# ---------------------------------------------------------------------------
def is_cell(obj) -> bool:
    """Is `obj` a network Cell (this layer sits below ``nn``, so it asks the Cell
    protocol instead of the class: ``construct`` and ``get_parameters``)."""
    return callable(getattr(obj, "construct", None)) and \
        callable(getattr(obj, "get_parameters", None))


def walk_reachable(fn, depth, on_cell, on_parameter=None) -> None:
    """Call `on_cell` for every Cell and `on_parameter` for every Parameter reachable
    from `fn` (`depth` levels): its closure and the globals it names, a method's owner,
    a partial's function and arguments, the items of lists and tuples, and the
    attributes of dualmode's callable objects."""
    seen = set()

    def visit(obj, d):
        if id(obj) in seen or d < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, Parameter):
            if on_parameter is not None:
                on_parameter(obj)
        elif is_cell(obj):
            on_cell(obj)
        elif isinstance(obj, (list, tuple)):
            for x in obj[:64]:
                visit(x, d - 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, d)
            visit(obj.__func__, d)
        elif isinstance(obj, functools.partial):
            visit(obj.func, d - 1)
            for a in obj.args:
                visit(a, d - 1)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, d - 1)
                except ValueError:        # an empty cell
                    pass
            g = obj.__globals__
            for name in obj.__code__.co_names:
                if name in g:
                    visit(g[name], d - 1)
            wrapped = getattr(obj, "__wrapped__", None)
            if wrapped is not None:
                visit(wrapped, d - 1)
        elif hasattr(obj, "__call__") and not isinstance(obj, type) and \
                hasattr(obj, "__dict__") and type(obj).__module__.startswith("dualmode"):
            for v in vars(obj).values():
                visit(v, d - 1)

    visit(fn, depth)


def find_parameters(fn, depth=3) -> list:
    """The Parameters reachable from `fn`: a Cell's parameters, and those of the Cells,
    Parameters and functions in its closure and the globals it names (`depth` levels)."""
    found = {}

    def add_cell(c):
        for p in c.get_parameters():
            found.setdefault(id(p), p)
        for name in c.__dict__.get("_state_names", ()):      # optimizer states
            for p in getattr(c, name, ()):
                if isinstance(p, Parameter):
                    found.setdefault(id(p), p)

    def on_cell(cell):
        add_cell(cell)
        for _, c in cell.cells_and_names():
            add_cell(c)

    walk_reachable(fn, depth, on_cell, lambda p: found.setdefault(id(p), p))
    return list(found.values())


# ---------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------
def _flatten_out(tr, out):
    """The output structure with tensors replaced by Ref (traced) / Const (concrete)."""
    if isinstance(out, TensorBase):
        lay = out._layout
        if isinstance(lay, TraceLayout):
            return Ref(lay.vid)
        return Const(out)
    if isinstance(out, tuple):
        return tuple(_flatten_out(tr, x) for x in out)
    if isinstance(out, list):
        return [_flatten_out(tr, x) for x in out]
    if isinstance(out, dict):
        return {k: _flatten_out(tr, v) for k, v in out.items()}
    return Const(out)


def trace(fn, args, kwargs=None, *, name="fn", params=()) -> Graph:
    """Trace ``fn(*args, **kwargs)``: each Tensor argument becomes an abstract value
    of its global shape and dtype; returns the verified Graph."""
    if current_trace() is not None:
        raise TraceError(f"{name}: a compiled function was called while another one is "
                         f"being traced; nesting compiled functions is not supported (call "
                         f"the inner function directly)")
    tr = _Trace(name)
    arg_values, targs = [], []
    for a in args:
        if isinstance(a, TensorBase) and not isinstance(a, Parameter):
            v = tr.value(a.shape, a.dtype)
            arg_values.append(v)
            targs.append(tr.tracer(v))
        else:
            targs.append(a)
    _STATE.trace = tr
    _core.set_dist_hooks(tr.apply, tr.assemble)
    try:
        with interpreting(tr):          # strategy-carrying primitive calls are recorded
            for p in params:
                tr.swap_param(p)
            out = fn(*targs, **(kwargs or {}))
            outputs = _flatten_out(tr, out)
    finally:
        _core.set_dist_hooks(tr.real_apply, tr.real_assemble)
        _STATE.trace = None
        tr.restore()
    used = set()
    for n in tr.nodes:
        used.update(x.id for x in n.inputs if isinstance(x, Ref))
    used.update(x.id for x in flatten_refs(outputs) if isinstance(x, Ref))
    params_used = tuple((p, v) for p, v in tr.params.values() if v.id in used)
    graph = Graph(args=tuple(arg_values), params=params_used, nodes=tuple(tr.nodes),
                  outputs=outputs, meta={"name": name})
    return verify(graph)


def is_abstract(x) -> bool:
    """Is `x` a tensor without a value (being traced)?"""
    return isinstance(x, TensorBase) and isinstance(x._layout, TraceLayout)
