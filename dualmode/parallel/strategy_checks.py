"""Per-operator validation of ``Primitive.shard`` strategies: every bad strategy is
refused by name before anything moves.

:meth:`TensorLayout.from_strategy` checks each input's strategy on its own (rank,
divisibility, product <= device_num). This module checks what involves several
inputs: a dim that two inputs share must be split the same way in both, e.g.

- MatMul / BatchMatMul: the contracted dim (after ``transpose_a`` / ``transpose_b``)
  and, for BatchMatMul, the batch dims of equal size;
- elementwise binary ops (Add, Mul, Maximum, Pow, comparisons, ...): the dims of
  equal size once the shapes are aligned from the right (broadcast dims of size 1
  are free);
- BiasAdd: dim 1 of the input and the bias;
- Concat: every dim but the concat axis; the fused losses: the dims logits and labels
  share.

Which dims an op's inputs share is declared once, with the op's sharding rule
(``register_rule(..., shared=...)``, functions in :mod:`.shared_dims`).

Softmax / LogSoftmax over a split axis is allowed (the input is redistributed).
:func:`check_strategy_for` runs before any input is moved, so a failing call leaves
tensors, parameters and the context untouched. Every error names the op, the strategy
entries and their values, and what would be valid.
"""
from __future__ import annotations

import math

import numpy as np

from .._core._tensor import TensorBase
from .layout_spec import LayoutSpec
from .sharding import shared_dims, shared_dims_hint

__all__ = ["check_strategy_for", "StrategyError"]


class StrategyError(ValueError):
    """Strategies of an op's inputs disagree on a dim the inputs share."""


def _flat(args):
    """The op's inputs as Primitive._check_inputs counts them (strategy order)."""
    for a in args:
        if isinstance(a, (tuple, list)) and a and isinstance(a[0], TensorBase):
            yield from a
        elif isinstance(a, (TensorBase, np.ndarray)):
            yield a


class _Dim:
    """How one strategy entry splits one dim: part count and, for layouts, the axes."""

    __slots__ = ("parts", "aliases", "layout", "text")

    def __init__(self, entry, d):
        if isinstance(entry, LayoutSpec):
            names = entry.spec[d]
            dm = dict(zip(entry.alias_name, entry.device_matrix))
            self.parts = math.prod(dm[a] for a in names)
            self.aliases = names
            self.layout = entry.layout
            self.text = repr("None") if not names else repr(names[0]) if len(names) == 1 \
                else repr(tuple(names))
        else:
            self.parts = int(entry[d])
            self.aliases = None
            self.layout = None
            self.text = str(self.parts)

    def agrees(self, other):
        if self.layout is not None and other.layout is not None and self.layout == other.layout:
            return self.aliases == other.aliases
        return self.parts == other.parts


def _entry_ok(entry, x):
    """Can the entry be read against tensor `x` (rank matches)? Others are left to
    TensorLayout.from_strategy, which names the problem."""
    if isinstance(entry, LayoutSpec):
        return entry.ndim == x.ndim
    return isinstance(entry, tuple) and len(entry) == x.ndim


def _check_pairs(prim, strategy, xs, pairs):
    """pairs: (i, di, j, dj, what) -- dim di of input i and dim dj of input j are one."""
    for i, di, j, dj, what in pairs:
        a, b = _Dim(strategy[i], di), _Dim(strategy[j], dj)
        if a.agrees(b):
            continue
        size = xs[i].shape[di]
        if a.layout is not None and b.layout is not None and a.layout == b.layout:
            valid = f"the same device axes in both, e.g. both {a.text}"
        else:
            valid = f"the same number of parts in both, e.g. both {a.parts} (a divisor of " \
                    f"{size})"
            other = shared_dims_hint(prim, xs) if a.layout is None and b.layout is None \
                else None
            if other:
                valid += f", {other}"
        raise StrategyError(
            f"{prim.name}: in_strategy[{i}][{di}]={a.text} and in_strategy[{j}][{dj}]="
            f"{b.text} split the {what} differently; they must be equal (dim {di} of input "
            f"{i} and dim {dj} of input {j} are one dim of size {size}; valid: {valid})")


def check_strategy_for(prim, tensor_args):
    """Check that `prim`'s in_strategy splits the dims its inputs share the same way.

    `tensor_args` are the op's call arguments (tensors, tuples of tensors for Concat,
    and non-tensor arguments, which are skipped). Raises :class:`StrategyError` (a
    ValueError) naming the op, both strategy entries and their values."""
    strategy = getattr(prim, "in_strategy", None)
    if not strategy:
        return
    xs = list(_flat(tensor_args))
    if len(xs) != len(strategy):
        return                               # Primitive._check_inputs names this
    pairs = shared_dims(prim, xs)
    pairs = [p for p in pairs if _entry_ok(strategy[p[0]], xs[p[0]])
             and _entry_ok(strategy[p[2]], xs[p[2]])]
    if pairs:
        _check_pairs(prim, strategy, xs, pairs)
