"""Per-operator validation of ``Primitive.shard`` strategies (SPEC §3, §9).

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

Softmax / LogSoftmax over a split axis is allowed (the input is redistributed).
:func:`check_strategy_for` runs before any input is moved, so a failing call leaves
tensors, parameters and the context untouched. Every error names the op, the strategy
entries and their values, and what would be valid.
"""
from __future__ import annotations

import math

import numpy as np

from .._core._tensor import KIND_BINARY, TensorBase
from ..ops._registry import REGISTRY
from .layout import LayoutSpec

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
        raise StrategyError(
            f"{prim.name}: in_strategy[{i}][{di}]={a.text} and in_strategy[{j}][{dj}]="
            f"{b.text} split the {what} differently; they must be equal (dim {di} of input "
            f"{i} and dim {dj} of input {j} are one dim of size {size}; valid: {valid})")


# ---------------------------------------------------------------------------
# shared dims per op: (i, di, j, dj, what)
# ---------------------------------------------------------------------------
def _matmul_pairs(prim, xs):
    if len(xs) != 2:
        return []
    a, b = xs
    batch = prim.name == "BatchMatMul"
    if (a.ndim != 2 or b.ndim != 2) if not batch else (a.ndim < 2 or b.ndim < 2):
        return []
    ta, tb = bool(getattr(prim, "transpose_a", False)), bool(getattr(prim, "transpose_b", False))
    ka = a.ndim - 2 if ta else a.ndim - 1
    kb = b.ndim - 1 if tb else b.ndim - 2
    if a.shape[ka] != b.shape[kb]:
        return []                           # the op's own check names the shape error
    pairs = [(0, ka, 1, kb, "contracted dim")]
    if batch:
        pairs += [(0, da, 1, db, f"batch dim {da}")
                  for da, db in _aligned(a.shape[:-2], b.shape[:-2])]
    return pairs


def _aligned(s0, s1):
    """Dims of equal size when the shapes are aligned from the right (broadcasting)."""
    out = []
    for k in range(1, min(len(s0), len(s1)) + 1):
        d0, d1 = len(s0) - k, len(s1) - k
        if s0[d0] == s1[d1]:
            out.append((d0, d1))
    return out[::-1]


def _elementwise_pairs(prim, xs):
    if len(xs) != 2:
        return []
    return [(0, d0, 1, d1, "broadcast dim")
            for d0, d1 in _aligned(tuple(xs[0].shape), tuple(xs[1].shape))]


def _bias_add_pairs(prim, xs):
    if len(xs) != 2 or xs[0].ndim < 2 or xs[1].ndim != 1 or xs[0].shape[1] != xs[1].shape[0]:
        return []
    return [(0, 1, 1, 0, "channel dim")]


def _concat_pairs(prim, xs):
    if not xs:
        return []
    rank = xs[0].ndim
    axis = getattr(prim, "axis", 0)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or \
            not -rank <= axis < rank:
        return []
    axis = int(axis) % rank
    pairs = []
    for j in range(1, len(xs)):
        if xs[j].ndim != rank:
            return []
        pairs += [(0, d, j, d, f"dim {d} (not the concat axis)") for d in range(rank)
                  if d != axis and xs[0].shape[d] == xs[j].shape[d]]
    return pairs


def _sparse_xent_pairs(prim, xs):
    if len(xs) != 2 or xs[0].ndim != 2 or xs[1].ndim != 1 or xs[0].shape[0] != xs[1].shape[0]:
        return []
    return [(0, 0, 1, 0, "batch dim")]


def _dense_xent_pairs(prim, xs):
    if len(xs) != 2 or tuple(xs[0].shape) != tuple(xs[1].shape):
        return []
    return [(0, d, 1, d, f"dim {d}") for d in range(xs[0].ndim)]


_PAIRS = {
    "MatMul": _matmul_pairs, "BatchMatMul": _matmul_pairs, "BiasAdd": _bias_add_pairs,
    "Concat": _concat_pairs,
    "SparseSoftmaxCrossEntropyWithLogits": _sparse_xent_pairs,
    "SoftmaxCrossEntropyWithLogits": _dense_xent_pairs,
}


def _pairs_for(prim, xs):
    fn = _PAIRS.get(prim.name)
    if fn is not None:
        return fn(prim, xs)
    op = REGISTRY.get("RealDiv" if prim.name == "Div" else prim.name)
    if op is not None and op.kind == KIND_BINARY:
        return _elementwise_pairs(prim, xs)
    return []


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
    pairs = _pairs_for(prim, xs)
    pairs = [p for p in pairs if _entry_ok(strategy[p[0]], xs[p[0]])
             and _entry_ok(strategy[p[2]], xs[p[2]])]
    if pairs:
        _check_pairs(prim, strategy, xs, pairs)
