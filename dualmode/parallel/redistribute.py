"""Tensor redistribution: plan, then run, the steps that move a tensor between layouts.

    plan = plan_redistribution(src, dst)        # cached per (src, dst, itemsize)
    print(plan)                                 # one line per step, bytes per device
    out = redistribute(stack, src, dst)         # runs the plan with the backend's collectives

**Planning** (MindSpore's TensorRedistribution, DTensor's planned steps):

1. *Unify the device matrices.* Ranks run row-major over both matrices, so each axis
   covers a range of rank strides; cutting at the strides of both gives the coarsest
   matrix that refines both (``(8,)`` and ``(2, 4)`` give ``(2, 4)``; ``(4, 2)`` and
   ``(2, 4)`` give ``(2, 2, 2)``). Each original axis becomes a run of unified axes
   (outer first), so both layouts are expressed over one matrix with the same ranks.
   Matrices whose strides do not nest (``(2, 3)`` and ``(3, 2)``) have no common
   refinement: the plan then replicates the tensor over the source matrix, switches
   matrix (:class:`Remesh`, no data moves) and slices over the destination matrix.
2. *Search.* A state gives, per tensor dim, the unified axes splitting it (outer first)
   and the axes still holding partial sums to resolve. Only the innermost split of a dim
   can change, so the moves are: :class:`AllGather` (drop the innermost splits of a dim),
   :class:`AllToAll` (move them to the inner end of another dim), :class:`ReduceScatter`
   (resolve partial axes by splitting a dim), :class:`AllReduce` (resolve them) and
   :class:`LocalSlice` (split a dim by free axes: no communication, taken as soon as it
   extends the destination map). Moves never undo the prefix of a dim's splits that
   already agrees with the destination, and only append to dims that agree with it so
   far (which may park splits there for a later AllToAll). An A* search over these
   moves (uniform cost plus a consistent lower bound, so still exact) returns the
   sequence moving the fewest bytes per device (formulas of
   :mod:`dualmode.communication.trace`; ties: fewer steps). If it exceeds
   :data:`SEARCH_BUDGET` expansions it returns the direct plan instead (gather every
   split that disagrees, reduce-scatter or all-reduce the partial sums, slice).

The search runs in the Cython kernel :mod:`dualmode._core._redist` over small int
arrays; :func:`reference_plan` implements the same rules plainly in Python and the
tests compare the two.

**Executing.** :func:`redistribute` runs a plan on a stack of local shards: every
collective goes through the backend (so :class:`~dualmode.parallel.CommReport` records
it, attributed to ``(op_name, "redistribution")``) over the groups
``group_members(axes)`` of the unified device matrix, whose ranks are the original ones.
When this process holds every device ("sim"), :func:`execute` (the sharding engine's
route) runs a communicating plan through the global value instead
(:func:`run_plan_direct`: assemble the source blocks, adding pending sums, then cut the
destination blocks, as views where strides allow) and records exactly the collectives
:func:`run_plan` would run; :func:`run_plan_grid` returns the destination blocks as a
device grid without writing replicas (the optimizers' gradients).
"""
from __future__ import annotations

import heapq
import math
from operator import itemgetter
from typing import Dict, Optional, Tuple, Union

import numpy as np

from .._core import _redist
from ..communication import _live_backend, trace
from ..communication.sim import SimBackend
from ..communication.trace import bytes_per_device, comm_cause
from .layout import LayoutError, LayoutSpec, TensorLayout

__all__ = ["Step", "LocalSlice", "AllGather", "AllToAll", "ReduceScatter", "AllReduce",
           "Remesh", "Plan", "RedistributionError", "plan_redistribution", "plan_uncached",
           "reference_plan", "redistribute", "run_plan", "run_plan_direct", "run_plan_grid",
           "execute",
           "unify_device_matrices",
           "plan_cache_info", "clear_plan_cache", "SEARCH_BUDGET"]

#: Expansions of the search before it settles for the direct plan (both planners).
SEARCH_BUDGET = _redist.DEFAULT_BUDGET

# step kind codes, in the kernel's order (_redist.NAMES)
_SLICE, _GATHER, _A2A, _RS, _AR = range(5)
_TRACE_KIND = (None, "AllGather", "AlltoAll", "ReduceScatter", "AllReduce")


class RedistributionError(ValueError):
    """A redistribution that cannot be planned (shapes, devices, partial sums)."""


# ============================================================================ steps

class Step(tuple):
    """One step of a plan: ``(kind, dims, axes, parts, bytes)``, immutable and hashable.

    ``axes`` are axes of the plan's (unified) ``device_matrix``, outer first; ``parts``
    is the number of devices in each group (the product of their sizes); ``bytes`` the
    bytes each device moves (0 for :class:`LocalSlice`).
    """

    __slots__ = ()
    kind = property(itemgetter(0), doc="The step's name, e.g. 'AllGather'.")
    dims = property(itemgetter(1), doc="The tensor dims it works on.")
    axes = property(itemgetter(2), doc="The device axes it works over, outer first.")
    parts = property(itemgetter(3), doc="Devices per group.")
    bytes = property(itemgetter(4), doc="Bytes moved per device.")
    communicates = True

    def _args(self) -> str:
        return f"axes={self[2]}"

    def __repr__(self) -> str:
        b = self[4]
        nb = f"{b:.0f}" if b == int(b) else f"{b:g}"
        return f"{self[0]}({self._args()}, parts={self[3]}, bytes={nb})"

    def __reduce__(self):
        return (_rebuild, (type(self), tuple(self)))


def _rebuild(cls, items):
    return tuple.__new__(cls, items)


class LocalSlice(Step):
    """Each device keeps its block of ``dim`` along ``axes`` (free axes): no communication."""

    __slots__ = ()
    communicates = False
    dim = property(lambda self: self[1][0])

    def __new__(cls, dim: int, axes, parts: int, bytes: float = 0.0):
        return tuple.__new__(cls, ("LocalSlice", (dim,), tuple(axes), parts, float(bytes)))

    def _args(self):
        return f"dim={self[1][0]}, axes={self[2]}"


class AllGather(Step):
    """Concatenate the blocks of ``dim`` over ``axes`` (its innermost splits)."""

    __slots__ = ()
    dim = property(lambda self: self[1][0])

    def __new__(cls, dim: int, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("AllGather", (dim,), tuple(axes), parts, float(bytes)))

    def _args(self):
        return f"dim={self[1][0]}, axes={self[2]}"


class AllToAll(Step):
    """Move the innermost splits ``axes`` of ``src_dim`` to the inner end of ``dst_dim``."""

    __slots__ = ()
    src_dim = property(lambda self: self[1][0])
    dst_dim = property(lambda self: self[1][1])

    def __new__(cls, src_dim: int, dst_dim: int, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("AllToAll", (src_dim, dst_dim), tuple(axes), parts,
                                   float(bytes)))

    def _args(self):
        return f"src_dim={self[1][0]}, dst_dim={self[1][1]}, axes={self[2]}"


class ReduceScatter(Step):
    """Sum the pending partial values over ``axes`` and split ``dim`` by them."""

    __slots__ = ()
    dim = property(lambda self: self[1][0])

    def __new__(cls, dim: int, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("ReduceScatter", (dim,), tuple(axes), parts,
                                   float(bytes)))

    def _args(self):
        return f"dim={self[1][0]}, axes={self[2]}"


class AllReduce(Step):
    """Sum the pending partial values over ``axes``; every device gets the sum."""

    __slots__ = ()

    def __new__(cls, axes, parts: int, bytes: float):
        return tuple.__new__(cls, ("AllReduce", (), tuple(axes), parts, float(bytes)))


class Remesh(Step):
    """Re-express a replicated tensor over another device matrix of the same ranks
    (only in plans between device matrices that do not nest). Moves nothing."""

    __slots__ = ()
    communicates = False
    device_matrix = property(lambda self: self[5])

    def __new__(cls, device_matrix):
        return tuple.__new__(cls, ("Remesh", (), (), 1, 0.0, tuple(device_matrix)))

    def __repr__(self):
        return f"Remesh(device_matrix={self[5]})"


_KINDS = (LocalSlice, AllGather, AllToAll, ReduceScatter, AllReduce)
_NAMES = tuple(k.__name__ for k in _KINDS)
_BY_NAME = {k.__name__: k for k in _KINDS}


# ============================================================================ Plan

class Plan(tuple):
    """An immutable tuple of :class:`Step` that moves a tensor from ``src`` to ``dst``.

    Attributes
    ----------
    src, dst : TensorLayout
    device_matrix : tuple of int
        The unified device matrix the steps' axes refer to (until a :class:`Remesh`).
    itemsize : int
        Bytes per element the byte counts assume.
    bytes : float
        Bytes moved per device by the whole plan.
    """

    def __new__(cls, steps, src, dst, device_matrix, itemsize):
        self = tuple.__new__(cls, steps)
        total = 0.0
        for s in steps:
            total += s[4]
        d = self.__dict__
        d["src"] = src
        d["dst"] = dst
        d["device_matrix"] = tuple(device_matrix)
        d["itemsize"] = itemsize
        d["bytes"] = total
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Plan is immutable; cannot set {name!r}")

    def __reduce__(self):
        return (Plan, (tuple(self), self.src, self.dst, self.device_matrix, self.itemsize))

    @property
    def steps(self) -> Tuple[Step, ...]:
        return tuple(self)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(s[0] for s in self)

    def collectives(self) -> int:
        """Number of steps that communicate."""
        return sum(1 for s in self if s.communicates)

    def _mesh(self, device_matrix) -> TensorLayout:
        """A replicated scalar layout over ``device_matrix`` (for groups and coordinates),
        built once per plan."""
        meshes = self.__dict__.setdefault("_meshes", {})
        m = meshes.get(device_matrix)
        if m is None:
            m = meshes[device_matrix] = TensorLayout(device_matrix, (), ())
        return m

    def __repr__(self):
        return (f"Plan({self.src!r} -> {self.dst!r}: {len(self)} steps, "
                f"{self.bytes:g} bytes per device over device matrix {self.device_matrix})")

    def __str__(self):
        lines = [repr(self)]
        for i, s in enumerate(self):
            lines.append(f"  {i}: {s!r}")
        return "\n".join(lines)


# ============================================================================ errors

def _fail(src, dst, reason) -> RedistributionError:
    return RedistributionError(f"redistribution from {src!r} to {dst!r}: {reason}")


def _check_pair(src, dst):
    """Validate the layouts; returns dst as a TensorLayout (a LayoutSpec is bound to
    src's shape)."""
    if not isinstance(src, TensorLayout):
        raise TypeError(f"redistribution: src must be a TensorLayout, got {src!r}")
    if isinstance(dst, LayoutSpec):
        spec = dst
        for d, (n, axes) in enumerate(zip(src.shape, spec.tensor_map)):
            parts = math.prod(spec.device_matrix[a] for a in axes)
            if n % parts:
                raise _fail(src, spec, f"the destination splits dim {d} (size {n}) into "
                            f"{parts} parts ({', '.join(spec.spec[d])}), which does not "
                            "divide it")
        try:
            dst = TensorLayout.from_spec(spec, src.shape, owner="the destination")
        except LayoutError as e:
            raise _fail(src, spec, f"the destination does not fit: {e}") from None
    elif not isinstance(dst, TensorLayout):
        raise TypeError(f"redistribution: dst must be a TensorLayout or an applied Layout, "
                        f"got {dst!r}")
    if src.shape != dst.shape:
        raise _fail(src, dst, f"the global shapes differ ({src.shape} vs {dst.shape}); a "
                    "redistribution keeps the global value")
    if src.device_num != dst.device_num:
        raise _fail(src, dst, f"the device counts differ ({src.device_num} vs "
                    f"{dst.device_num}); both layouts must cover the same devices")
    return dst         # a TensorLayout's splits divide its dims (checked when it was built)


def _partial_error(src, dst):
    sp = [src.axis_name(a) for a in src.partial]
    dp = [dst.axis_name(a) for a in dst.partial]
    return _fail(src, dst, f"the destination keeps partial sums over {tuple(dp)}, which are "
                 f"not pending in the source (partial over {tuple(sp)}); a redistribution "
                 "resolves pending sums but never creates them, so the destination's "
                 "partial axes must stay partial from the source")


# ============================================================================ unification

def _cuts(dm):
    out, p = [1], 1
    for s in reversed(dm):
        p *= s
        out.append(p)
    return out


def unify_device_matrices(a, b):
    """The common refinement of two device matrices of the same device count.

    Returns ``(sizes, runs_a, runs_b)``: the unified axis sizes (axis 0 highest, ranks
    row-major as in both inputs) and, for each axis of ``a`` and of ``b``, the run of
    unified axes it splits into (outer first; empty for an axis of size 1); ``None``
    when the rank strides of the two matrices do not nest (e.g. ``(2, 3)`` and
    ``(3, 2)``).
    """
    a, b = tuple(a), tuple(b)
    if math.prod(a) != math.prod(b):
        raise ValueError(f"unify_device_matrices: {a} and {b} hold different numbers of "
                         f"devices ({math.prod(a)} vs {math.prod(b)})")
    cuts = sorted(set(_cuts(a)) | set(_cuts(b)), reverse=True)
    for hi, lo in zip(cuts, cuts[1:]):
        if hi % lo:
            return None
    pos = {v: j for j, v in enumerate(cuts)}
    sizes = tuple(hi // lo for hi, lo in zip(cuts, cuts[1:]))

    def runs(dm):
        out, hi = [], math.prod(dm)
        for s in dm:
            lo = hi // s
            out.append(tuple(range(pos[hi], pos[lo])))
            hi = lo
        return tuple(out)

    return sizes, runs(a), runs(b)


def _refine(layout, runs):
    """(per-dim lists of unified axes, set of unified partial axes)."""
    lists = tuple(tuple(x for a in axes for x in runs[a]) for axes in layout.tensor_map)
    partial = frozenset(x for a in layout.partial for x in runs[a])
    return lists, partial


# ============================================================================ reference planner

def _reference_search(sizes, shape, start, target, pending, floor, itemsize, budget):
    """The planner's rules, plainly: A* search over redistribution states.

    ``start``/``target``: per dim, tuples of unified axes (outer first); ``pending``:
    bitmask of axes whose partial sums must be resolved; ``floor``: the smallest buffer
    (elements) a device can ever hold (every axis but the kept partial ones splitting).
    Returns raw steps ``(name, dims, axes, parts, bytes)`` as the Cython kernel does.
    """
    D = len(shape)
    total = math.prod(shape)
    tset = {x for t in target for x in t}

    def prod(axes):
        p = 1
        for x in axes:
            p *= sizes[x]
        return p

    def elems(lists):
        return total // prod([x for lst in lists for x in lst])

    def closure(lists, pend):
        """Slice every dim that agrees with its destination so far by the free axes that
        come next there; -> (lists, [(dim, axes), ...])."""
        used = {x for lst in lists for x in lst}
        used.update(x for x in range(len(sizes)) if pend >> x & 1)
        out, slices = list(lists), []
        for d in range(D):
            cur, tgt = out[d], target[d]
            n = len(cur)
            if cur != tgt[:n]:
                continue
            j = n
            while j < len(tgt) and tgt[j] not in used:
                j += 1
            if j > n:
                out[d] = tgt[:j]
                slices.append((d, tgt[n:j]))
        return tuple(out), slices

    def apply(lists, pend, mv):
        """-> (lists, pend, (kind, dims, axes, parts, buffer elems before))."""
        kind, d, e, k = mv
        S = elems(lists)
        L = list(lists)
        if kind == _GATHER:
            moved = L[d][len(L[d]) - k:]
            L[d] = L[d][:len(L[d]) - k]
            return tuple(L), pend, (_GATHER, (d,), moved, prod(moved), S)
        if kind == _A2A:
            moved = L[d][len(L[d]) - k:]
            L[d] = L[d][:len(L[d]) - k]
            L[e] = L[e] + moved
            return tuple(L), pend, (_A2A, (d, e), moved, prod(moved), S)
        if kind == _RS:
            n = len(L[d])
            moved = target[d][n:n + k]
            L[d] = L[d] + moved
            for x in moved:
                pend &= ~(1 << x)
            return tuple(L), pend, (_RS, (d,), moved, prod(moved), S)
        # AllReduce: every pending axis (e == 0) or those no dim wants (e == 1)
        moved = tuple(x for x in range(len(sizes))
                      if pend >> x & 1 and (e == 0 or x not in tset))
        for x in moved:
            pend &= ~(1 << x)
        return tuple(L), pend, (_AR, (), moved, prod(moved), S)

    def cost(kind, n, S):
        if kind == _GATHER:
            return float((n - 1) * S)
        if kind == _AR:
            return (2 * (n - 1) * S) / n
        return ((n - 1) * S) / n

    def moves(lists, pend):
        pre = [prefix(lists[d], target[d]) for d in range(D)]
        settled = [pre[d] == len(lists[d]) for d in range(D)]
        for d in range(D):
            for k in range(1, len(lists[d]) - pre[d] + 1):
                yield (_GATHER, d, 0, k)
        for d in range(D):
            for k in range(1, len(lists[d]) - pre[d] + 1):
                n = prod(lists[d][len(lists[d]) - k:])
                for e in range(D):
                    if e != d and settled[e] and (shape[e] // prod(lists[e])) % n == 0:
                        yield (_A2A, d, e, k)
        for d in range(D):
            if settled[d]:
                n, tgt, k = len(lists[d]), target[d], 0
                while n + k < len(tgt) and pend >> tgt[n + k] & 1:
                    k += 1
                if k:
                    yield (_RS, d, 0, k)
        if pend:
            yield (_AR, 0, 0, 0)
            free = [x for x in range(len(sizes)) if pend >> x & 1 and x not in tset]
            if free and len(free) != bin(pend).count("1"):
                yield (_AR, 0, 1, 0)

    def prefix(cur, tgt):
        p = 0
        while p < len(cur) and p < len(tgt) and cur[p] == tgt[p]:
            p += 1
        return p

    def lower_bound(lists, pend):
        """Elements still to move, at least (consistent, so A* stays exact): every split
        the destination drops needs an AllGather ((n - 1) floor, the growth it causes);
        every other dim that must drop splits needs a collective over its innermost axis
        ((n - 1) / n floor); pending sums need one over their largest axis."""
        h = 0.0
        for lst in lists:
            for x in lst:
                if x not in tset:
                    h += float((sizes[x] - 1) * floor)
        for d in range(D):
            cur = lists[d]
            p = prefix(cur, target[d])
            if p < len(cur) and all(x in tset for x in cur[p:]):
                n = sizes[cur[-1]]
                h += ((n - 1) * floor) / n
        if pend:
            n = max(sizes[x] for x in range(len(sizes)) if pend >> x & 1)
            h += ((n - 1) * floor) / n
        return h

    def greedy(lists, pend):
        """The direct plan (after the budget runs out): gather, reduce-scatter, reduce."""
        path = []
        lists, _ = closure(lists, pend)
        while lists != target or pend:
            mv = None
            for d in range(D):
                p = prefix(lists[d], target[d])
                if p < len(lists[d]):
                    mv = (_GATHER, d, 0, len(lists[d]) - p)
                    break
            if mv is None:
                mv = next((m for m in moves(lists, pend) if m[0] == _RS), (_AR, 0, 0, 0))
            path.append(mv)
            lists, pend, _ = apply(lists, pend, mv)
            lists, _ = closure(lists, pend)
        return path

    # ---- A*: key = (lists, pend); heap by (g + bound, steps, push order)
    s0, slices0 = closure(start, pending)
    key0 = (s0, pending)
    best = {key0: (0.0, len(slices0))}
    parent = {key0: None}
    closed = set()
    heap = [(lower_bound(s0, pending), len(slices0), 0, key0)]
    counter = 1
    expansions = 0
    path = None
    while heap:
        _, _, _, key = heapq.heappop(heap)
        if key in closed:
            continue
        g, ns = best[key]
        closed.add(key)
        lists, pend = key
        if lists == target and not pend:
            path = []
            while parent[key] is not None:
                key, mv = parent[key]
                path.append(mv)
            path.reverse()
            break
        expansions += 1
        if expansions > budget:
            break
        for mv in moves(lists, pend):
            nl, npend, info = apply(lists, pend, mv)
            nl, sl = closure(nl, npend)
            nkey = (nl, npend)
            if nkey in closed:
                continue
            ng, nns = g + cost(info[0], info[3], info[4]), ns + 1 + len(sl)
            b = best.get(nkey)
            if b is None or (ng, nns) < b:
                best[nkey] = (ng, nns)
                parent[nkey] = (key, mv)
                heapq.heappush(heap, (ng + lower_bound(nl, npend), nns, counter, nkey))
                counter += 1
    if path is None:
        path = greedy(start, pending)

    # ---- replay the moves into steps with bytes
    steps = []
    lists, sl = closure(start, pending)
    pend = pending
    steps += [("LocalSlice", (d,), ax, prod(ax), 0.0) for d, ax in sl]
    for mv in path:
        lists, pend, (kind, dims, ax, n, S) = apply(lists, pend, mv)
        steps.append((_NAMES[kind], dims, ax, n, _bytes(kind, n, S * itemsize)))
        lists, sl = closure(lists, pend)
        steps += [("LocalSlice", (d,), a, prod(a), 0.0) for d, a in sl]
    return steps


def _bytes(kind, n, s):
    """Bytes per device of a step of kind code ``kind`` over groups of ``n`` on buffers
    of ``s`` bytes: trace.py's formula (the kernel repeats its arithmetic)."""
    return 0.0 if kind == _SLICE else bytes_per_device(_TRACE_KIND[kind], n, s)


def _reference_raw(dm_s, map_s, part_s, dm_d, map_d, part_d, shape, itemsize, budget):
    """Same contract as ``_redist.plan``: ``(status, sizes, raw_steps)``."""
    u = unify_device_matrices(dm_s, dm_d)
    if u is None:
        return 1, None, None
    sizes, runs_s, runs_d = u
    src = TensorLayout(dm_s, map_s, shape, part_s)
    dst = TensorLayout(dm_d, map_d, shape, part_d)
    start, ps = _refine(src, runs_s)
    target, pd = _refine(dst, runs_d)
    if not pd <= ps:
        return 2, sizes, None
    pending = 0
    for x in ps - pd:
        pending |= 1 << x
    floor = math.prod(shape) // math.prod(sizes[x] for x in range(len(sizes)) if x not in pd)
    return 0, sizes, _reference_search(sizes, shape, start, target, pending, floor, itemsize,
                                       budget)


# ============================================================================ planning

def _build(raw, src, dst, itemsize) -> Plan:
    new, kinds = tuple.__new__, _BY_NAME
    return Plan([new(kinds[r[0]], r) for r in raw[2]], src, dst, raw[1], itemsize)


def _plan(src, dst, itemsize, planner) -> Plan:
    raw = planner(src.device_matrix, src.tensor_map, src.partial, dst.device_matrix,
                  dst.tensor_map, dst.partial, src.shape, itemsize, SEARCH_BUDGET)
    if raw[0] == 0:
        return _build(raw, src, dst, itemsize)
    if raw[0] == 2:
        raise _partial_error(src, dst)
    # the device matrices do not nest: replicate over src's matrix, switch, slice
    if dst.partial:
        raise _fail(src, dst, f"the device matrices {src.device_matrix} and "
                    f"{dst.device_matrix} have no common refinement, so partial sums "
                    "cannot be kept across them; resolve them first")
    rep_s = TensorLayout(src.device_matrix, ((),) * src.ndim, src.shape)
    rep_d = TensorLayout(dst.device_matrix, ((),) * dst.ndim, dst.shape)
    first = _plan(src, rep_s, itemsize, planner)
    second = _plan(rep_d, dst, itemsize, planner)
    return Plan(tuple(first) + (Remesh(dst.device_matrix),) + tuple(second), src, dst,
                src.device_matrix, itemsize)


def _kernel(*args):
    try:
        return _redist.plan(*args)
    except OverflowError:        # beyond the kernel's fixed sizes: same rules in Python
        return _reference_raw(*args)


_CACHE: Dict[tuple, Plan] = {}        # layout fields of (src, dst) + itemsize -> plan
_BY_ID: Dict[tuple, tuple] = {}        # (id(src), id(dst), itemsize) -> (src, dst, plan)
_CACHE_LIMIT = 4096
_STATS = [0, 0]                        # hits, misses


def plan_redistribution(src: TensorLayout, dst: Union[TensorLayout, LayoutSpec],
                        itemsize: int = 4) -> Plan:
    """The cheapest plan (bytes per device) moving a tensor from ``src`` to ``dst``.

    Parameters
    ----------
    src : TensorLayout
    dst : TensorLayout, or an applied Layout (``layout("mp", "None")``) bound to
        ``src.shape``
    itemsize : int
        Bytes per element for the byte counts (the choice of steps does not depend on it).

    Returns
    -------
    Plan
        Cached per ``(src, dst, itemsize)``: planning an equal pair again returns the
        same object (the layout objects first planned are found by identity, equal ones
        by value).

    Raises
    ------
    RedistributionError (a ValueError)
        Naming both layouts: different shapes or device counts, a destination split that
        does not divide its dim, or destination partial sums not pending in the source.
    """
    # the entry holds src and dst, so their ids cannot be reused while it lives
    hit = _BY_ID.get((id(src), id(dst), itemsize))
    if hit is not None:
        _STATS[0] += 1
        return hit[2]
    # equal layouts: keyed by their fields, cheaper to hash and compare than the layouts
    if type(src) is TensorLayout and type(dst) is TensorLayout:
        key = (src.device_matrix, src.tensor_map, src.shape, src.partial, dst.device_matrix,
               dst.tensor_map, dst.shape, dst.partial, itemsize)
    else:                           # an applied Layout, or not layouts at all
        key = (src, dst, itemsize)
    try:
        plan = _CACHE.get(key)
    except TypeError:               # unhashable: not layouts; let validation say so
        return plan_uncached(src, dst, itemsize)
    if plan is not None:
        _STATS[0] += 1
        return plan
    plan = plan_uncached(src, dst, itemsize)
    _STATS[1] += 1
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
        _BY_ID.clear()
    _CACHE[key] = plan
    _BY_ID[(id(src), id(dst), itemsize)] = (src, dst, plan)
    return plan


def plan_uncached(src: TensorLayout, dst: Union[TensorLayout, LayoutSpec],
                  itemsize: int = 4) -> Plan:
    """:func:`plan_redistribution` without the cache (the Cython planner every time)."""
    dst_l = _check_pair(src, dst)
    if not isinstance(itemsize, int) or isinstance(itemsize, bool) or itemsize < 1:
        raise ValueError(f"plan_redistribution: itemsize={itemsize!r} is not valid; "
                         "expected a positive int (bytes per element)")
    return _plan(src, dst_l, itemsize, _kernel)


def reference_plan(src: TensorLayout, dst: Union[TensorLayout, LayoutSpec],
                   itemsize: int = 4) -> Plan:
    """The same plan as :func:`plan_redistribution`, computed by the pure-Python
    reference planner (not cached)."""
    dst_l = _check_pair(src, dst)
    return _plan(src, dst_l, itemsize, _reference_raw)


def plan_cache_info() -> Tuple[int, int, int]:
    """``(hits, misses, size)`` of the plan cache."""
    return _STATS[0], _STATS[1], len(_CACHE)


def clear_plan_cache() -> None:
    """Forget every cached plan (and the hit/miss counts)."""
    _CACHE.clear()
    _BY_ID.clear()
    _STATS[0] = _STATS[1] = 0


# ============================================================================ executor

_SIM: Dict[int, object] = {}


def _resolve_backend(backend, src, stack):
    if backend is not None:
        if backend.world_size != src.device_num:
            raise ValueError(f"redistribute: the backend has {backend.world_size} devices but "
                             f"{src!r} has {src.device_num}")
        return backend
    live = _live_backend()
    if live is not None and live.world_size == src.device_num:
        return live
    if stack.shape[0] == src.device_num:     # a stack of every device: simulate them
        sim = _SIM.get(src.device_num)
        if sim is None:
            sim = _SIM[src.device_num] = SimBackend(src.device_num)
        return sim
    raise RuntimeError(f"redistribute: no backend holds {src.device_num} devices; call "
                       "dualmode.communication.init() or pass backend=")


def _local_slice(x, dim, axes, parts, mesh, local_ranks):
    """Each local device keeps piece (its coordinates along ``axes``, row-major) of its
    block along ``dim``."""
    coords = mesh.rank_coords[list(local_ranks)]
    sizes = mesh.device_matrix
    piece = np.zeros(len(local_ranks), np.int64)
    for a in axes:
        piece = piece * sizes[a] + coords[:, a]
    n, local = x.shape[0], x.shape[1:]
    y = x.reshape((n,) + local[:dim] + (parts, local[dim] // parts) + local[dim + 1:])
    y = np.moveaxis(y, dim + 1, 1)
    return y[np.arange(n), piece]


def redistribute(stack: np.ndarray, src: TensorLayout, dst: Union[TensorLayout, LayoutSpec],
                 backend=None, *, op_name: Optional[str] = None,
                 reason: str = "redistribution") -> np.ndarray:
    """Move a stack of local shards from layout ``src`` to layout ``dst``.

    Parameters
    ----------
    stack : ndarray ``(local devices, *src.local_shape)``
        This process's shards in ``src`` (partial values for ``src.partial`` axes).
    src, dst : TensorLayout (``dst`` may be an applied Layout)
    backend : Backend, optional
        Defaults to the live backend (a "sim" backend of ``src.device_num`` devices when
        none is live and the stack holds every device).
    op_name : str, optional
        The op the redistribution is for, as CommReport shows it.

    Returns
    -------
    ndarray ``(local devices, *dst.local_shape)``
        The shards in ``dst`` (the input itself when the layouts are equal). May be a
        read-only view; copy before writing.
    """
    if not isinstance(stack, np.ndarray):
        stack = np.asarray(stack)
    plan = plan_redistribution(src, dst, stack.itemsize or 1)
    return run_plan(plan, stack, backend, op_name=op_name, reason=reason)


def run_plan(plan: Plan, stack: np.ndarray, backend=None, *,
             op_name: Optional[str] = None, reason: str = "redistribution") -> np.ndarray:
    """Execute ``plan`` on a stack of local shards in ``plan.src`` (see :func:`redistribute`).

    Every collective goes through ``backend`` inside ``comm_cause(op_name,
    "redistribution")``; LocalSlices are local numpy indexing.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"run_plan: expected a Plan, got {plan!r}")
    if not isinstance(stack, np.ndarray):
        stack = np.asarray(stack)
    src = plan.src
    backend = _resolve_backend(backend, src, stack)
    local_ranks = backend.local_ranks
    want = (len(local_ranks),) + src.local_shape
    if stack.shape != want:
        raise ValueError(f"redistribute: the stack has shape {np.shape(stack)}, expected "
                         f"{want} (local devices, *local shape of {src!r})")
    if not len(plan):
        return stack
    x = stack
    mesh = plan._mesh(plan.device_matrix)
    with comm_cause(op_name, reason):
        for step in plan:
            kind = step[0]
            if kind == "LocalSlice":
                x = _local_slice(x, step[1][0], step[2], step[3], mesh, local_ranks)
            elif kind == "AllGather":
                x = backend.all_gather(x, mesh.group_members(step[2]), axis=step[1][0])
            elif kind == "AllToAll":
                x = backend.all_to_all(x, mesh.group_members(step[2]), split_axis=step[1][1],
                                       concat_axis=step[1][0])
            elif kind == "ReduceScatter":
                x = backend.reduce_scatter(x, mesh.group_members(step[2]), axis=step[1][0])
            elif kind == "AllReduce":
                x = backend.all_reduce(x, mesh.group_members(step[2]))
            else:                                       # Remesh
                mesh = plan._mesh(step.device_matrix)
    return x


# ============================================================================ direct executor

_RECORD_KIND = {"AllGather": "AllGather", "AllToAll": "AlltoAll",
                "ReduceScatter": "ReduceScatter", "AllReduce": "AllReduce"}


def _record_steps(plan: Plan, itemsize: int) -> None:
    """Record ``plan``'s collectives exactly as :func:`run_plan` makes the backend record
    them (kind, group size, groups, input bytes per device, and input plus output bytes
    as the memory note), without running them."""
    if not trace._STATE.reports:
        return
    n = plan.src.device_num
    local = list(plan.src.local_shape)
    for step in plan:
        kind, dims, parts = step[0], step[1], step[3]
        if kind in ("LocalSlice", "Remesh"):
            if kind == "LocalSlice":
                local[dims[0]] //= parts
            continue
        before = math.prod(local) * itemsize
        if kind == "AllGather":
            local[dims[0]] *= parts
        elif kind == "AllToAll":
            local[dims[1]] //= parts
            local[dims[0]] *= parts
        elif kind == "ReduceScatter":
            local[dims[0]] //= parts
        trace.record(_RECORD_KIND[kind], parts, n // parts, before)
        trace.note_memory(before + math.prod(local) * itemsize)


def global_value(stack: np.ndarray, layout: TensorLayout) -> np.ndarray:
    """The global value held by a stack of every device's shards in ``layout`` (pending
    sums added up). A stride-0 stack (one buffer viewed by every device) is read once;
    a batch split is a view."""
    if stack.strides[0] == 0 and stack.shape[0] > 1 and not layout.split_axes:
        one = stack[0]
        if not layout.partial:
            return one
        parts = math.prod(layout.device_matrix[a] for a in layout.partial)
        return np.multiply(one, parts, dtype=stack.dtype)
    return layout.assemble(stack)


def blocks_of(value: np.ndarray, layout: TensorLayout) -> np.ndarray:
    """The stack of every device's block of the global ``value`` in ``layout`` (no
    partial axes): a read-only view of ``value`` when its strides allow (one buffer
    viewed by every device when nothing is split; a split of one dim over the device
    axes in order), else one copy."""
    if not layout.split_axes:
        return np.broadcast_to(value[None], (layout.device_num,) + tuple(value.shape))
    return layout.local_blocks_view(value)


def run_plan_direct(plan: Plan, stack: np.ndarray, backend=None, *,
                    op_name: Optional[str] = None,
                    reason: str = "redistribution") -> np.ndarray:
    """The result of :func:`run_plan`, computed through the global value when this
    process holds every device ("sim"): the source blocks are assembled (pending sums
    added) and the destination blocks cut from it, one or two numpy passes whatever the
    number of steps. CommReport records exactly the collectives :func:`run_plan` would
    run. Plans that keep partial sums, or processes that hold only some devices, run
    step by step."""
    if not isinstance(plan, Plan):
        raise TypeError(f"run_plan_direct: expected a Plan, got {plan!r}")
    if not isinstance(stack, np.ndarray):
        stack = np.asarray(stack)
    src, dst = plan.src, plan.dst
    backend = _resolve_backend(backend, src, stack)
    if not len(plan) or dst.partial or len(backend.local_ranks) != src.device_num:
        return run_plan(plan, stack, backend, op_name=op_name, reason=reason)
    want = (src.device_num,) + src.local_shape
    if stack.shape != want:
        raise ValueError(f"redistribute: the stack has shape {np.shape(stack)}, expected "
                         f"{want} (local devices, *local shape of {src!r})")
    with comm_cause(op_name, reason):
        _record_steps(plan, stack.itemsize)
    return blocks_of(global_value(stack, src), dst)


def run_plan_grid(plan: Plan, stack: np.ndarray, backend=None, *,
                  op_name: Optional[str] = None,
                  reason: str = "redistribution") -> Optional[np.ndarray]:
    """The destination blocks of :func:`run_plan_direct` without writing the replicas:
    an array broadcastable to ``dst.device_matrix + dst.local_shape``, of size 1 along
    the device axes that split nothing (usually a view of the global value). Records
    the same collectives. None when this process does not hold every device or the
    destination keeps partial sums (use :func:`execute` then)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"run_plan_grid: expected a Plan, got {plan!r}")
    src, dst = plan.src, plan.dst
    backend = _resolve_backend(backend, src, stack)
    if dst.partial or len(backend.local_ranks) != src.device_num:
        return None
    want = (src.device_num,) + src.local_shape
    if stack.shape != want:
        raise ValueError(f"redistribute: the stack has shape {np.shape(stack)}, expected "
                         f"{want} (local devices, *local shape of {src!r})")
    if not len(plan):
        return stack.reshape(dst.device_matrix + dst.local_shape)
    with comm_cause(op_name, reason):
        _record_steps(plan, stack.itemsize)
    return dst.local_blocks_grid(global_value(stack, src))


def execute(plan: Plan, stack: np.ndarray, backend=None, *, op_name: Optional[str] = None,
            reason: str = "redistribution") -> np.ndarray:
    """Run ``plan`` the cheapest way for this process: LocalSlice-only plans step by
    step (one indexing each), anything that communicates through
    :func:`run_plan_direct` when every device is local, else :func:`run_plan`."""
    if any(s.communicates for s in plan):
        return run_plan_direct(plan, stack, backend, op_name=op_name, reason=reason)
    return run_plan(plan, stack, backend, op_name=op_name, reason=reason)
