"""Candidate sharding strategies of one op, from its sharding rule.

:func:`op_candidates` enumerates strategies the way MindSpore's strategy generation
does and keeps those the op's rule (:data:`dualmode.parallel.sharding.RULES`) runs
without moving its inputs:

1. **Tied dims.** Dims of different inputs that must be split alike (MatMul's
   contracted dim, equal dims of elementwise operands, BiasAdd's channel, the losses'
   batch dim) are found by asking the rule: each input dim is offered alone, split over
   one device axis, with the other inputs replicated; the dims the rule then requires
   split on that axis are tied to it (a union-find); a class none of whose dims the rule
   keeps split when offered alone (Softmax's axis, the classes of a loss, a Reshape's
   inner dims) stays whole.
2. **Split factors.** Each class of tied dims gets one factor: a divisor of
   ``device_num`` that divides the dim (the powers of two for the usual power-of-two
   device counts); the product over all classes must divide ``device_num``.
3. **Layouts.** A strategy's layouts use MindSpore's device matrix for the op: the
   repeated-calculation factor ``device_num / product`` first (when > 1), then one axis
   per split class in order of first appearance (input 0's dims first), so tied dims
   share an axis and independent dims get their own (MatMul ``((2, 2), (2, 2))`` on 8
   devices: device matrix ``(M=2, K=2, N=2)``). For one input, and whenever the inputs'
   splits nest, these are exactly ``TensorLayout.from_strategy``'s layouts re-expressed
   over one device matrix; unlike per-input ``from_strategy`` they also represent
   strategies splitting independent dims of different inputs (MatMul's M, K and N).
4. **Acceptance.** The rule is called on the layouts; a candidate is kept only when it
   returns a plan whose required input layouts equal the offered ones. Its ``cost`` is
   the op's own communication under the cost model: the AllReduce of each ``post`` entry
   of the plan over its axes, for the output's local bytes (itemsize of the first tensor
   input's dtype). Pending partial outputs are not charged here: the redistribution into
   the consumer's layout (an edge cost) resolves them.

**Cap.** Strategies are tried in order of devices used (the product of the factors,
largest first; ties: larger factors on earlier classes first, i.e. data parallel
first), at most :data:`MAX_TRIES` rule calls, keeping at most :data:`MAX_CANDIDATES`
accepted split candidates; the fully replicated candidate is always added last. With
``fully_use_devices=True`` only candidates using every device are kept (or the
replicated one when none does). Ops without a rule, or without tensor inputs, get the
single replicated candidate. Results are cached per signature.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from ..._core import _tensor as _core
from .. import rules as _rules  # noqa: F401  (registers the sharding rules)
from ..tensor_layout import TensorLayout
from ..sharding import RULES
from .cost import CostModel, allreduce_cost

__all__ = ["Candidate", "op_candidates", "clear_candidate_cache", "MAX_CANDIDATES",
           "MAX_TRIES"]

#: Accepted split candidates kept per op (the replicated one comes on top).
MAX_CANDIDATES = 64
#: Strategies offered to the rule per op at most.
MAX_TRIES = 512

# the rule rejecting a layout by raising counts as "no plan for these layouts"
_RULE_ERRORS = (ValueError, TypeError, IndexError, KeyError)


@dataclass(frozen=True)
class Candidate:
    """One way to run an op sharded.

    in_layouts   per input, the layout it must have (None for a non-tensor input)
    out_layouts  per output, its layout as the rule gives it (may carry pending sums)
    strategy     per tensor input, the MindSpore strategy tuple (parts per dim)
    cost         the op's own communication (seconds under the cost model)
    """

    in_layouts: Tuple[Optional[TensorLayout], ...]
    out_layouts: Tuple[TensorLayout, ...]
    strategy: Tuple[Tuple[int, ...], ...]
    cost: float

    @property
    def devices(self) -> int:
        """Devices holding different pieces of the work: the product of the splits."""
        lays = [lay for lay in self.in_layouts if lay is not None]
        if not lays:
            return 1
        dm = lays[0].device_matrix
        used = {a for lay in lays for a in lay.split_axes}
        return math.prod(dm[a] for a in used)

    def __repr__(self):
        return f"Candidate(strategy={self.strategy}, cost={self.cost:g})"


# ============================================================================ helpers

def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _smallest_prime(n):
    p = 2
    while p * p <= n:
        if n % p == 0:
            return p
        p += 1
    return n


def _freeze(value):
    """A hashable stand-in for attrs (dicts, lists, arrays)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    hash(value)
    return value


def _itemsize(dtypes, tensors):
    for i in tensors:
        try:
            return int(np.dtype(dtypes[i]).itemsize)
        except TypeError:
            break
    return 4


def _call(rule, attrs, lays, dtypes):
    try:
        return rule(attrs, list(lays), list(dtypes))
    except _RULE_ERRORS:
        return None


def _check_args(op, in_shapes, in_dtypes, device_num):
    name = getattr(op, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"op_candidates: op={op!r} is not an OpDef (dualmode.ops.REGISTRY[name])")
    if isinstance(device_num, bool) or not isinstance(device_num, (int, np.integer)) or \
            device_num < 1:
        raise ValueError(f"op_candidates: {name}: device_num={device_num!r} is not valid; "
                         f"expected a positive int")
    shapes = []
    for i, s in enumerate(in_shapes):
        if s is None:
            shapes.append(None)
            continue
        try:
            s = tuple(int(v) for v in s)
        except (TypeError, ValueError):
            raise ValueError(f"op_candidates: {name}: in_shapes[{i}]={s!r} is not valid; "
                             f"expected a tuple of ints, or None for a non-tensor input") \
                from None
        if any(v < 0 for v in s):
            raise ValueError(f"op_candidates: {name}: in_shapes[{i}]={s} has a negative size")
        shapes.append(s)
    if len(in_dtypes) != len(shapes):
        raise ValueError(f"op_candidates: {name}: in_dtypes has {len(in_dtypes)} entries but "
                         f"in_shapes has {len(shapes)}; expected one per input")
    return name, tuple(shapes), int(device_num)


# ============================================================================ tied dims

class _Classes:
    """Union-find over (input, dim) pairs."""

    def __init__(self, keys):
        self.parent = {k: k for k in keys}

    def find(self, k):
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _tied_classes(rule, attrs, shapes, dtypes, tensors, device_num):
    """Classes of dims split alike: a list of lists of (input, dim), in order of first
    appearance, keeping the classes with a dim the rule lets stay split when offered
    alone (BiasAdd's bias follows the input's channel split but cannot lead it; the
    final acceptance test settles every strategy)."""
    keys = [(i, d) for i in tensors for d in range(len(shapes[i]))]
    uf = _Classes(keys)
    ok = {}
    for i, d in keys:
        g = math.gcd(device_num, shapes[i][d])
        if g == 1:
            ok[(i, d)] = False
            continue
        p = _smallest_prime(g)
        dm = (p, device_num // p) if device_num > p else (p,)
        lays = [None if s is None else
                TensorLayout(dm, tuple((0,) if (j, k) == (i, d) else () for k in range(len(s))),
                             s) for j, s in enumerate(shapes)]
        plan = _call(rule, attrs, lays, dtypes)
        need = None if plan is None or len(plan.inputs) != len(shapes) else plan.inputs
        if need is None or need[i] is None or need[i].tensor_map[d] != (0,):
            ok[(i, d)] = False
            continue
        ok[(i, d)] = True
        for j in tensors:
            if need[j] is None or need[j].ndim != len(shapes[j]):
                continue
            for k, axes in enumerate(need[j].tensor_map):
                if 0 in axes and (j, k) != (i, d):
                    uf.union((i, d), (j, k))
    groups = {}
    for k in keys:
        groups.setdefault(uf.find(k), []).append(k)
    return [g for g in (groups[r] for r in sorted(groups, key=keys.index))
            if any(ok[k] for k in g)]


def _assignments(options, device_num):
    """Every factor per class whose product divides device_num (all-ones excluded),
    most devices first; ties: larger factors on earlier classes first."""
    out = []

    def rec(k, prod, acc):
        if k == len(options):
            if prod > 1:
                out.append(tuple(acc))
            return
        for f in options[k]:
            if device_num % (prod * f) == 0:
                acc.append(f)
                rec(k + 1, prod * f, acc)
                acc.pop()

    rec(0, 1, [])
    out.sort(key=lambda fs: (-math.prod(fs), tuple(-f for f in fs)))
    return out


# ============================================================================ candidates

def _layouts(shapes, tensors, classes, factors, device_num):
    """The input layouts of one strategy over the op's device matrix, and the strategy."""
    prod = math.prod(factors)
    repeat = device_num // prod
    dm, axis_of = [], {}
    if repeat > 1:
        dm.append(repeat)
    for c, f in zip(classes, factors):
        if f > 1:
            for key in c:
                axis_of[key] = len(dm)
            dm.append(f)
    dm = tuple(dm) or (1,)
    lays, strategy = [], []
    for i, s in enumerate(shapes):
        if s is None:
            lays.append(None)
            continue
        tmap = tuple((axis_of[(i, d)],) if (i, d) in axis_of else () for d in range(len(s)))
        lay = TensorLayout(dm, tmap, s)
        lays.append(lay)
        strategy.append(lay.dim_parts)
    return tuple(lays), tuple(strategy)


def _own_cost(plan, itemsize, model):
    cost = 0.0
    for out, post in zip(plan.outputs, plan.post):
        if post is not None:
            cost += allreduce_cost(out, tuple(post[1]), itemsize, model)
    return cost


def _replicated(op, name, attrs, shapes, dtypes, tensors, device_num, rule, itemsize, model,
                out_shapes):
    lays = tuple(None if s is None else TensorLayout.replicated(s, device_num) for s in shapes)
    strategy = tuple((1,) * len(shapes[i]) for i in tensors)
    plan = _call(rule, attrs, lays, dtypes) if rule is not None else None
    if plan is not None and all(lay is None or need == lay
                                for lay, need in zip(lays, plan.inputs)):
        return Candidate(lays, tuple(plan.outputs), strategy, _own_cost(plan, itemsize, model))
    if out_shapes is None:
        stand_ins = [np.broadcast_to(np.zeros((), dtypes[i]), s) if s is not None else None
                     for i, s in enumerate(shapes)]
        try:
            out_shapes = [tuple(shape) for shape, _ in _core.infer(op, attrs, *stand_ins)]
        except Exception as exc:   # noqa: BLE001  (any failure: the caller must say)
            raise ValueError(f"op_candidates: {name}: cannot infer the output shapes from "
                             f"in_shapes={shapes} ({type(exc).__name__}: {exc}); pass "
                             f"out_shapes=") from None
    outs = tuple(TensorLayout.replicated(tuple(s), device_num) for s in out_shapes)
    return Candidate(lays, outs, strategy, 0.0)


def op_candidates(op, attrs, in_shapes: Sequence, in_dtypes: Sequence, device_num: int, *,
                  fully_use_devices: bool = False, model: Optional[CostModel] = None,
                  out_shapes: Optional[Sequence] = None,
                  max_candidates: int = MAX_CANDIDATES) -> list:
    """The candidate strategies of ``op`` on inputs of the given shapes and dtypes.

    Parameters
    ----------
    op : OpDef
        ``dualmode.ops.REGISTRY[name]``.
    attrs : dict
        The op's attributes, as its rule and kernel take them.
    in_shapes : sequence
        Per input, its global shape, or None for a non-tensor input (a scalar attribute
        passed positionally, e.g. OneHot's depth).
    in_dtypes : sequence
        Per input, its dtype (None allowed for non-tensor inputs).
    device_num : int
    fully_use_devices : bool
        Keep only candidates using every device (the replicated one if none does).
    model : CostModel, optional
        Prices each candidate's own communication (default :data:`cost.DEFAULT_MODEL`).
    out_shapes : sequence of shapes, optional
        Output shapes for ops without a rule when inference from the shapes alone fails.
    max_candidates : int
        Split candidates kept at most (the replicated one comes on top).

    Returns
    -------
    list of Candidate
        Most devices first, the fully replicated candidate last (always present unless
        ``fully_use_devices`` found candidates using every device).
    """
    name, shapes, device_num = _check_args(op, in_shapes, in_dtypes, device_num)
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or \
            max_candidates < 0:
        raise ValueError(f"op_candidates: {name}: max_candidates={max_candidates!r} is not "
                         f"valid; expected an int >= 0")
    args = (op, attrs, shapes, tuple(in_dtypes), device_num, bool(fully_use_devices),
            model, None if out_shapes is None else tuple(tuple(o) for o in out_shapes),
            max_candidates)
    try:
        key = (name, _freeze(attrs), shapes, tuple(str(d) for d in in_dtypes)) + args[4:]
        hash(key)
    except TypeError:                        # attrs we cannot key: no caching
        return list(_enumerate(*args))
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        hit = _CACHE[key] = tuple(_enumerate(*args))
    return list(hit)


_CACHE: dict = {}
_CACHE_LIMIT = 4096


def clear_candidate_cache() -> None:
    """Forget every cached candidate list."""
    _CACHE.clear()


def _enumerate(op, attrs, shapes, dtypes, device_num, fully, model, out_shapes, cap):
    name = op.name
    tensors = [i for i, s in enumerate(shapes) if s is not None]
    itemsize = _itemsize(dtypes, tensors)
    rule = RULES.get(name)
    rep = _replicated(op, name, attrs, shapes, dtypes, tensors, device_num, rule, itemsize,
                      model, out_shapes)
    if rule is None or not tensors or device_num == 1:
        return [rep]
    classes = _tied_classes(rule, attrs, shapes, dtypes, tensors, device_num)
    options = []
    for c in classes:
        g = functools.reduce(math.gcd, (shapes[i][d] for i, d in c), device_num)
        options.append(_divisors(g))
    found = []
    for tries, factors in enumerate(_assignments(options, device_num)):
        if len(found) >= cap or tries >= MAX_TRIES:
            break
        if fully and math.prod(factors) != device_num:
            break                              # sorted by devices: none further qualifies
        lays, strategy = _layouts(shapes, tensors, classes, factors, device_num)
        plan = _call(rule, attrs, lays, dtypes)
        if plan is None or len(plan.inputs) != len(lays) or \
                any(lay is not None and need != lay for lay, need in zip(lays, plan.inputs)):
            continue
        found.append(Candidate(lays, tuple(plan.outputs), strategy,
                               _own_cost(plan, itemsize, model)))
    if fully and found:
        return found
    return found + [rep]
