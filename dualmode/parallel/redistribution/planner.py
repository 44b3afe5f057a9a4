"""Planning a redistribution: unify the device matrices, search the cheapest steps
(Cython kernel, Python reference beyond its sizes), cache the plans."""
from __future__ import annotations

import math
from typing import Dict, Tuple, Union

import numpy as np

from ... import context
from ..._core import _redist
from ...communication.trace import bytes_per_device
from .._layout_checks import LayoutError
from ..layout_spec import LayoutSpec
from ..tensor_layout import TensorLayout
from .reference import _reference_raw
from .steps import (_BY_NAME, SEARCH_BUDGET, AllGather, LocalSlice, Plan, RedistributionError,
                    Remesh)
from .unify import _refine, unify_device_matrices


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
            if 0 < n < parts:
                raise _fail(src, spec, f"the destination splits dim {d} (size {n}) into "
                            f"{parts} parts ({', '.join(spec.spec[d])}), more than it has "
                            "rows: some pieces would be empty")
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
    return dst         # a TensorLayout's splits leave no piece empty (checked when built)


def _partial_error(src, dst):
    sp = [src.axis_name(a) for a in src.partial]
    dp = [dst.axis_name(a) for a in dst.partial]
    return _fail(src, dst, f"the destination keeps partial sums over {tuple(dp)}, which are "
                 f"not pending in the source (partial over {tuple(sp)}); a redistribution "
                 "resolves pending sums but never creates them, so the destination's "
                 "partial axes must stay partial from the source")


# ============================================================================ planning

def _build(raw, src, dst, itemsize) -> Plan:
    new, kinds = tuple.__new__, _BY_NAME
    steps = [new(kinds[r[0]], r) for r in raw[2]]
    if not context._STATE.auto_parallel.enable_alltoall:
        steps = _without_alltoall(steps)
    if not (src.even and dst.even):
        steps = _real_steps(steps, src, raw[1], itemsize)
    return Plan(steps, src, dst, raw[1], itemsize)


def _without_alltoall(steps) -> list:
    """`steps` with every AllToAll replaced by an AllGather of its source dim and a
    LocalSlice of its destination dim over the same axes (``enable_alltoall=False``, as
    MindSpore circumvents AlltoAll). The AllGather moves ``(k - 1) S`` bytes where the
    AllToAll moved ``(k - 1) / k S``: ``k`` times as many."""
    out = []
    for st in steps:
        if st[0] == "AllToAll":
            (a, b), axes, k, nbytes = st[1], st[2], st[3], st[4]
            out.append(AllGather(a, axes, k, nbytes * k))
            out.append(LocalSlice(b, axes, k))
        else:
            out.append(st)
    return out


def _proxy_shape(src, dst) -> tuple:
    """The shape the steps between layouts that do not divide their dims are searched
    for: each dim rounded up to a multiple of the device count (which every split of
    it divides), so the steps and their costs are those of a shape within one row per
    device of the real one."""
    n = src.device_num
    return tuple(-(-d // n) * n for d in src.shape)


def _pieces(sizes, lists, shape):
    """``(starts, stops)``, each ``(devices, ndim)`` int64: per rank (row-major over the
    device matrix `sizes`) the rows of its piece along each dim when dim ``d`` is split
    by the axes ``lists[d]`` (numpy.array_split's rule; a part may be empty)."""
    n = math.prod(sizes)
    coords = np.stack(np.unravel_index(np.arange(n, dtype=np.int64), sizes), 1)
    starts = np.empty((n, len(shape)), np.int64)
    stops = np.empty((n, len(shape)), np.int64)
    for d, axes in enumerate(lists):
        b, p = np.zeros(n, np.int64), 1
        for a in axes:
            b = b * sizes[a] + coords[:, a]
            p *= sizes[a]
        q, r = divmod(shape[d], p)
        starts[:, d] = b * q + np.minimum(b, r)
        stops[:, d] = starts[:, d] + q + (b < r)
    return starts, stops


def _real_steps(steps, src, sizes, itemsize) -> list:
    """`steps` (searched for a proxy shape) with each one's bytes those of the real
    pieces, averaged over the devices: an AllGather or AllToAll moves to each device
    what its new piece holds beyond its old one (pieces of a split that does not divide
    need not nest: rows 2-3 of 6 cut in 4 are not inside rows 0-2 of 6 cut in 2), and so
    does a LocalSlice whose new pieces are not inside the old ones (recorded as an
    AlltoAll of unequal counts over its axes); a ReduceScatter or AllReduce moves the
    formulas' bytes of its (equal) buffer."""
    runs = unify_device_matrices(src.device_matrix, sizes)[1]
    lists = list(_refine(src, runs)[0])
    shape, out = src.shape, []
    starts, stops = _pieces(sizes, lists, shape)
    for st in steps:
        kind, dims, axes, k = st[0], st[1], tuple(st[2]), st[3]
        new = list(lists)
        if kind in ("LocalSlice", "ReduceScatter"):
            new[dims[0]] = new[dims[0]] + axes
        elif kind == "AllGather":
            new[dims[0]] = new[dims[0]][:len(new[dims[0]]) - len(axes)]
        elif kind == "AllToAll":
            new[dims[0]] = new[dims[0]][:len(new[dims[0]]) - len(axes)]
            new[dims[1]] = new[dims[1]] + axes
        s2, e2 = _pieces(sizes, new, shape)
        before = itemsize * float(np.prod(stops - starts, axis=1).mean())
        if kind in ("AllGather", "AllToAll", "LocalSlice"):
            # (a LocalSlice of pieces that do not nest moves the rows a device lacks)
            overlap = np.prod(np.clip(np.minimum(stops, e2) - np.maximum(starts, s2), 0,
                                      None), axis=1)
            moved = itemsize * float((np.prod(e2 - s2, axis=1) - overlap).mean())
        else:
            moved = bytes_per_device(kind, k, before)
        out.append(tuple.__new__(type(st), tuple(st[:4]) + (moved,) + tuple(st[5:])))
        lists, starts, stops = new, s2, e2
    return out


def _plan(src, dst, itemsize, planner) -> Plan:
    uneven = not (src.even and dst.even)
    shape = _proxy_shape(src, dst) if uneven else src.shape
    raw = planner(src.device_matrix, src.tensor_map, src.partial, dst.device_matrix,
                  dst.tensor_map, dst.partial, shape, itemsize, SEARCH_BUDGET)
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
    a2a = context._STATE.auto_parallel.enable_alltoall
    hit = _BY_ID.get((id(src), id(dst), itemsize, a2a))
    if hit is not None:
        _STATS[0] += 1
        return hit[2]
    # equal layouts: keyed by their fields, cheaper to hash and compare than the layouts
    if type(src) is TensorLayout and type(dst) is TensorLayout:
        key = (src.device_matrix, src.tensor_map, src.shape, src.partial, dst.device_matrix,
               dst.tensor_map, dst.shape, dst.partial, itemsize, a2a)
    else:                           # an applied Layout, or not layouts at all
        key = (src, dst, itemsize, a2a)
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
    _BY_ID[(id(src), id(dst), itemsize, a2a)] = (src, dst, plan)
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
