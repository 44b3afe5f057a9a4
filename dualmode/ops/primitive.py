"""Primitive: the class form of an op (``ops.MatMul()``), with ``.shard(...)``.

A primitive holds its init attributes and an optional sharding strategy. Calling it
runs the functional form. Strategies are validated for form at ``shard`` time and,
where they run (semi-auto and auto parallel), against the inputs' ranks and sizes at
call time; in the other modes they are ignored, as in MindSpore (the interpreter's
``ignores_strategies``). The parallel layer's interpreter
(:mod:`dualmode.ops.interpreter`) runs them on shards, and a graph trace records them.
"""
from __future__ import annotations

import copy

import numpy as np

from .._core._tensor import TensorBase
from . import interpreter
from ._registry import REGISTRY


def _is_scalar_operand(v):
    """A Python/numpy float given where an op takes a tensor (an int next to tensors is
    an attribute such as OneHot's depth or an axis)."""
    return isinstance(v, (float, np.floating))


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_strategy(opname, strategy, param):
    """A strategy is a tuple of per-input tuples of positive ints (or None)."""
    if strategy is None:
        return None
    if not isinstance(strategy, tuple) or not strategy:
        raise TypeError(f"{opname}: {param} must be a non-empty tuple of tuples of ints, "
                        f"e.g. ((2, 4), (4, 1)); got {strategy!r}")
    out = []
    for i, s in enumerate(strategy):
        if hasattr(s, "tensor_map") or hasattr(s, "device_slices"):
            out.append(s)   # a Layout-applied value (validated by the layout itself)
            continue
        if not isinstance(s, tuple) or not all(_is_int(v) for v in s):
            raise TypeError(f"{opname}: {param}[{i}]={s!r} must be a tuple of ints")
        for j, v in enumerate(s):
            if v < 1:
                raise ValueError(f"{opname}: {param}[{i}][{j}]={v} must be a positive int "
                                 f"(the number of parts dim {j} is split into)")
        out.append(tuple(int(v) for v in s))
    return tuple(out)


def _device_target(prim, value):
    """``primitive_target``: MindSpore runs the op on that device kind; every op here
    runs on the CPU and gives the same numbers, so any of MindSpore's targets is
    accepted."""
    if value not in ("CPU", "GPU", "Ascend"):
        raise ValueError(f"{prim.name}: add_prim_attr('primitive_target', {value!r}) is not "
                         f"valid; expected 'CPU', 'GPU' or 'Ascend'")
    return value


def _manual_split(prim, value):
    raise ValueError(f"{prim.name}: add_prim_attr('manual_split', {value!r}) is not "
                     f"supported: dualmode splits a table into the equal row blocks its "
                     f"strategy gives; drop the attribute and give the strategy alone")


#: attributes with a meaning for parallel execution: a checker returns the value to
#: store or raises naming the primitive and the attribute
PRIM_ATTR_RULES = {"primitive_target": _device_target, "manual_split": _manual_split}


#: bumped by every ``shard`` call: part of graph mode's cache key
STRATEGY_EPOCH = [0]


def _handles_unequal_pieces(name) -> bool:
    """Does the sharding rule of the op `name` handle splits that do not divide their
    dims (its registration says so)?"""
    op = REGISTRY.get("RealDiv" if name == "Div" else name)
    return op is not None and getattr(op.extras.get("shard"), "uneven", False)


class Primitive:
    """Base of all primitive ops: attrs, ``shard``, strategy checks."""

    name = "Primitive"

    def __init__(self):
        self.in_strategy = None
        self.out_strategy = None

    def add_prim_attr(self, name, value):
        """Set attribute `name` of this primitive, as MindSpore's ``add_prim_attr``;
        returns self. Read them all with :attr:`attrs`. Attributes that change how
        an op is parallelised are honoured or refused by name (see
        :data:`PRIM_ATTR_RULES`); others are kept for the user to read."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.name}: add_prim_attr name must be a non-empty str, got "
                            f"{name!r}")
        rule = PRIM_ATTR_RULES.get(name)
        if rule is not None:
            value = rule(self, value)
        self.__dict__.setdefault("_prim_attrs", {})[name] = value
        return self

    @property
    def attrs(self):
        """This primitive's attributes: those given at construction and by
        :meth:`add_prim_attr` (a copy)."""
        own = {k: v for k, v in vars(self).items()
               if not k.startswith("_") and k not in ("in_strategy", "out_strategy")}
        own.update(self.__dict__.get("_prim_attrs", {}))
        return own

    def shard(self, in_strategy, out_strategy=None):
        """Set the sharding strategy (one tuple per tensor input); returns self."""
        ins = check_strategy(self.name, in_strategy, "in_strategy")
        outs = check_strategy(self.name, out_strategy, "out_strategy")
        self.in_strategy, self.out_strategy = ins, outs
        STRATEGY_EPOCH[0] += 1          # compiled graphs traced before this re-trace
        return self

    def _tensor_strategy(self, args):
        """The in_strategy entries of the tensor inputs among `args`, and those inputs.

        A strategy has one entry per tensor input. Entries ``()`` for scalar operands
        (Python floats), as MindSpore writes them (``OneHot().shard(((4,), (), ()))``
        for indices, on_value, off_value), may be given or left out."""
        st = self.in_strategy
        tensors = [a for a in _flat(args) if isinstance(a, (TensorBase, np.ndarray))]
        if len(st) == len(tensors):
            return st, tensors
        if len(st) > len(tensors):
            out, k, spare = [], 0, len(st) - len(tensors)
            for a in _flat(args):
                if k >= len(st):
                    break
                if isinstance(a, (TensorBase, np.ndarray)):
                    out.append(st[k])
                    k += 1
                elif spare and _is_scalar_operand(a) and st[k] == ():
                    k += 1
                    spare -= 1
            if k == len(st) and len(out) == len(tensors):
                return tuple(out), tensors
        raise ValueError(f"{self.name}: in_strategy has {len(st)} entries but the op got "
                         f"{len(tensors)} tensor inputs; give one entry per tensor input "
                         f"(float operands take an entry () or none)")

    def _check_inputs(self, tensors, st):
        for i, (s, x) in enumerate(zip(st, tensors)):
            if not isinstance(s, tuple):
                continue
            shape = tuple(x.shape)
            if len(s) != len(shape):
                raise ValueError(f"{self.name}: in_strategy[{i}]={s} has {len(s)} entries but "
                                 f"input {i} has rank {len(shape)} (shape {shape})")
            for j, (v, d) in enumerate(zip(s, shape)):
                if 0 < d < v:
                    raise ValueError(f"{self.name}: in_strategy[{i}][{j}]={v} exceeds dim "
                                     f"{j} (size {d}) of input {i}: some devices would hold "
                                     f"an empty piece; a split may not exceed the dim")
                if d % v and not _handles_unequal_pieces(self.name):
                    raise ValueError(f"{self.name}: in_strategy[{i}][{j}]={v} does not "
                                     f"divide dim {j} (size {d}) of input {i}, and "
                                     f"{self.name} does not handle pieces of unequal size "
                                     f"yet")

    def __call__(self, *args, **kwargs):
        if (self.in_strategy is None and self.out_strategy is None) \
                or interpreter.base().ignores_strategies():
            return self.construct(*args, **kwargs)
        prim = self
        if self.in_strategy is not None:
            # the checks depend only on the strategy and the input shapes: a strategy
            # with one entry per input remembers the shapes it passed
            shapes = _tensor_shapes(args) if len(args) == len(self.in_strategy) else None
            passed = self.__dict__.get("_passed_shapes")
            if passed is None or passed[0] is not self.in_strategy or shapes not in passed[1]:
                st, tensors = self._tensor_strategy(args)
                self._check_inputs(tensors, st)
                if st is not self.in_strategy:   # scalar entries dropped: this call only
                    prim = copy.copy(self)
                    prim.in_strategy = st
                elif shapes is not None:
                    if passed is None or passed[0] is not st or len(passed[1]) >= 64:
                        passed = self.__dict__["_passed_shapes"] = (st, set())
                    passed[1].add(shapes)
        # the interpreter decides how a strategy runs: on shards (the parallel layer's
        # eager interpreter), recorded into a graph (a trace), or not at all (one device)
        return interpreter.current().call_primitive(prim, args, kwargs)

    def construct(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name}: primitive has no construct")

    def __repr__(self):
        extra = f", in_strategy={self.in_strategy}" if self.in_strategy is not None else ""
        return f"{self.name}(){extra}" if not extra else f"{self.name}({extra[2:]})"


def _tensor_shapes(args):
    """The shapes of `args` when every one is a Tensor or an array, else None."""
    shapes = []
    for a in args:
        if not isinstance(a, (TensorBase, np.ndarray)):
            return None
        shapes.append(a.shape)
    return tuple(shapes)


def _flat(args):
    for a in args:
        if isinstance(a, (tuple, list)) and a and isinstance(a[0], TensorBase):
            yield from a
        else:
            yield a
