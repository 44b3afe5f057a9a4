"""Reductions (``family=("reduce", "sum"|"mean"|"max"|"min"|"arg"|"square_all")``): a sum
or mean over a split dim stays a pending sum (resolved by the next op that needs the
value), as do SquareSumAll's sums of squares ("square_all", each input over all dims); max
and min finish with an AllReduce of that kind over the reduced dims' device axes; the
index ops ("arg": ArgMaxWithValue, ArgMinWithValue, Argmax, Argmin) over a split axis
find each device's best (value, global index) and keep the best pair with one AllReduce
(max) of 8-byte keys packing both (ties: the first index, as one device), so every
index is global (values wider than 32 bits: the axis is gathered instead)."""
from __future__ import annotations

import math

import numpy as np

from ..devices import backend as _backend
from ..devices import op_cause
from ..sharding import ShardPlan, layout, register_rule
from .base import pending_sums

__all__ = ["rule"]


def _make_reduce(op):
    name, combine = op.name, op.extras["family"][1]
    if combine == "square_all":
        return _square_sum_all

    def rule(attrs, lays, dtypes):
        x = lays[0]
        pend = pending_sums(name, attrs, lays)
        if x is None or pend is None:
            return None
        dm = x.device_matrix
        axes, keep = attrs["axis"], attrs["keep_dims"]
        red_axes = tuple(sorted(a for d in axes for a in x.tensor_map[d]))
        tmap = [() if d in axes else m for d, m in enumerate(x.tensor_map)] if keep else \
            [m for d, m in enumerate(x.tensor_map) if d not in axes]
        shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape)) if keep else \
            tuple(s for d, s in enumerate(x.shape) if d not in axes)
        stack_axes = tuple(d + 1 for d in axes)
        count = math.prod(x.shape[d] for d in axes)
        if combine == "arg":
            return _arg_plan(op, x, axes, tmap, shape, stack_axes, dtypes[0])
        if combine in ("sum", "mean"):
            out = layout(dm, tmap, shape, set(red_axes) | set(pend[0]))

            def local(attrs, stacks):
                s = stacks[0]
                r = np.add.reduce(s, axis=stack_axes, dtype=s.dtype, keepdims=keep)
                if combine == "mean":
                    r = np.true_divide(r, count, dtype=s.dtype)
                return r

            return ShardPlan((x,), (out,), local)
        ufunc = np.maximum if combine == "max" else np.minimum
        out = layout(dm, tmap, shape)
        short = tuple(d for d in axes if d in x.uneven_dims)

        def local(attrs, stacks):
            s = stacks[0]
            if short:                 # pieces of unequal size: the pads must not compete
                s = x.fill_pads(np.array(s), _worst(s.dtype, combine), _ranks(x, s), short)
            return ufunc.reduce(s, axis=stack_axes, keepdims=keep)

        post = ((combine, red_axes),) if red_axes else ()
        return ShardPlan((x,), (out,), local, post)
    return rule


def _worst(dtype, combine):
    """The value that never wins a `combine` ("max" or "min") of `dtype`: what the pads
    of pieces of unequal size hold while they are reduced."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return -np.inf if combine == "max" else np.inf
    if dt.kind == "b":
        return combine != "max"
    info = np.iinfo(dt)
    return info.min if combine == "max" else info.max


def _ranks(x, s):
    """The ranks of the devices of stack `s` of layout `x` (all, or this process's)."""
    return None if s.shape[0] == x.device_num else _backend().local_ranks


def _square_sum_all(attrs, lays, dtypes):
    """SquareSumAll: each input's sum of squares over all its dims; each device sums its
    block, so the sum of an input split over some device axes is pending over them (the
    AllReduce MindSpore inserts, made when the value is needed). An input holding a
    pending sum is resolved first (its square is not the sum of its terms' squares)."""
    if any(lay is None or lay.partial for lay in lays):
        return None
    dm = lays[0].device_matrix
    outs = tuple(layout(dm, (), (), {a for axes in lay.tensor_map for a in axes})
                 for lay in lays)

    def local(attrs, stacks):
        return tuple(np.add.reduce(np.square(s), axis=tuple(range(1, s.ndim)), dtype=s.dtype)
                     for s in stacks)

    return ShardPlan(tuple(lays), outs, local)


def _arg_plan(op, x, axes, tmap, shape, stack_axes, dtype):
    """ArgMaxWithValue / ArgMinWithValue / Argmax / Argmin: other dims keep their splits
    and the outputs (index, value) have them. A split reduced axis: each device finds its
    best element and that element's global index, packed in one int64 key that orders
    the pairs as one device would choose (the best value, then the first index), and one
    AllReduce(max) of the keys over the axis's devices picks the best pair. Values of
    more than 32 bits cannot be packed: the axis is then gathered."""
    dm = x.device_matrix
    (ax,) = axes
    split = x.tensor_map[ax]
    outs = (layout(dm, tmap, shape),) * (2 if op.multi_output else 1)
    if split and _packable(dtype):
        return ShardPlan((x,), outs, _packed_arg_local(op, x, ax, split), (None,) * len(outs))
    need = layout(dm, [() if d in axes else m for d, m in enumerate(x.tensor_map)], x.shape)

    def local(attrs, stacks):
        at = dict(attrs)
        at["axis"] = stack_axes
        return op.kernel(at, stacks[0])

    return ShardPlan((need,), outs, local)


def _packable(dtype):
    dt = np.dtype(dtype)
    return dt in (np.float16, np.float32) or (dt.kind in "iu" and dt.itemsize <= 4 and
                                              dt != np.uint32)


_SIGN = np.uint32(0x80000000)
_LOW = (1 << 31) - 1                     # the index field: 31 bits


def _order_bits(v):
    """uint32 (as int64) ordering like the values `v` (float16/32 or <= 32-bit ints);
    NaN orders above every number, as numpy's argmax / argmin pick it."""
    if v.dtype.kind == "f":              # + 0.0: -0.0 and 0.0 tie, as numpy compares them
        b = (v.astype(np.float32) + np.float32(0.0)).view(np.uint32)
        u = np.where(b & _SIGN, ~b, b | _SIGN).astype(np.int64)
        return np.where(np.isnan(v), (1 << 32) - 1, u)
    return v.astype(np.int64) + (1 << 31 if v.dtype.kind == "i" else 0)


def _from_order_bits(u, dtype):
    """The values whose :func:`_order_bits` are `u`."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        b = u.astype(np.uint32)
        bits = np.where(b & _SIGN, b & ~_SIGN, ~b)
        return bits.astype(np.uint32).view(np.float32).astype(dtype)
    return (u - (1 << 31 if dtype.kind == "i" else 0)).astype(dtype)


def _packed_arg_local(op, x, ax, split):
    """The local computation of an arg op whose reduced dim `ax` is split over `split`."""
    members = x.group_members(split)
    name = op.name

    def local(attrs, stacks):
        s = stacks[0]
        n = s.shape[0]
        is_max = attrs["kind"] == "max"
        pick = np.argmax if is_max else np.argmin
        ranks = np.asarray(_backend().local_ranks, dtype=np.int64)
        if ranks.shape[0] != n:
            ranks = np.arange(n, dtype=np.int64)
        if ax in x.uneven_dims:       # pieces of unequal size: the pads must not win
            s = x.fill_pads(np.array(s), _worst(s.dtype, attrs["kind"]), ranks, (ax,))
        li = pick(s, axis=ax + 1, keepdims=True)
        lv = np.take_along_axis(s, li, axis=ax + 1)
        off = x.part_starts[ranks, ax].reshape((n,) + (1,) * (s.ndim - 1))
        u = _order_bits(lv)
        if not is_max:
            u = ((1 << 32) - 1) - u
            u = np.where(np.isnan(lv), (1 << 32) - 1, u) if lv.dtype.kind == "f" else u
        key = (u << 31) | (_LOW - (li + off))
        with op_cause(name):
            key = np.asarray(_backend().all_reduce(np.ascontiguousarray(key),
                                                   members=members, op="max"))
        u, gi = key >> 31, _LOW - (key & _LOW)
        if not is_max:
            u = ((1 << 32) - 1) - u
        if not attrs["keep_dims"]:
            u, gi = np.squeeze(u, ax + 1), np.squeeze(gi, ax + 1)
        idx = gi.astype(attrs["index_dtype"])
        if not attrs["with_value"]:
            return idx
        return idx, _from_order_bits(u, s.dtype)

    return local


def rule(op):
    """Register the rule of `op`, which declares ``family=("reduce", combine)``."""
    return register_rule(op.name, per_device=True, uneven=True)(_make_reduce(op))
