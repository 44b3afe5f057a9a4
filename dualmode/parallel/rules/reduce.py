"""Reductions (``family=("reduce", "sum"|"mean"|"max"|"min"|"arg")``): a sum or mean
over a split dim stays a pending sum (resolved by the next op that needs the value); max
and min finish with an AllReduce of that kind over the reduced dims' device axes; the
index ops ("arg": ArgMaxWithValue, ArgMinWithValue, Argmax, Argmin) take the reduced
axis whole (gathered when split), so every index is global."""
from __future__ import annotations

import math

import numpy as np

from ..sharding import ShardPlan, layout, register_rule
from .base import pending_sums

__all__ = ["rule"]


def _make_reduce(op):
    name, combine = op.name, op.extras["family"][1]

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
            return _arg_plan(op, x, axes, tmap, shape, stack_axes)
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

        def local(attrs, stacks):
            return ufunc.reduce(stacks[0], axis=stack_axes, keepdims=keep)

        post = ((combine, red_axes),) if red_axes else ()
        return ShardPlan((x,), (out,), local, post)
    return rule


def _arg_plan(op, x, axes, tmap, shape, stack_axes):
    """ArgMaxWithValue / ArgMinWithValue / Argmax / Argmin: the reduced axis whole (an
    AllGather of that dim when it is split), so each device finds the global index; the
    other dims keep their splits and the outputs (index, value) have them."""
    dm = x.device_matrix
    need = layout(dm, [() if d in axes else m for d, m in enumerate(x.tensor_map)], x.shape)
    out = layout(dm, tmap, shape)

    def local(attrs, stacks):
        at = dict(attrs)
        at["axis"] = stack_axes
        return op.kernel(at, stacks[0])

    return ShardPlan((need,), (out, out) if op.multi_output else (out,), local)


def rule(op):
    """Register the rule of `op`, which declares ``family=("reduce", combine)``."""
    return register_rule(op.name, per_device=True)(_make_reduce(op))
