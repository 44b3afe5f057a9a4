"""Row-wise ops (``family=("rowwise",)``: the losses): every input and output holds
the batch rows on dim 0 and the kernel treats rows independently."""
from __future__ import annotations

import numpy as np

from ..._core import _tensor as _core
from ..sharding import ShardPlan, layout, register_rule
from ..tensor_layout import stand_in

__all__ = ["rule", "row_pairs"]


def rule(op):
    """``family=("rowwise",)``: every input and output holds the batch rows on dim 0
    and the kernel treats rows independently, so rows split alike on every input, the
    outputs keep that split, and each device runs the kernel on its rows."""
    def plan(attrs, lays, dtypes):
        if any(lay is None or lay.partial or lay.ndim == 0 for lay in lays):
            return None
        dm, rows = lays[0].device_matrix, lays[0].tensor_map[0]
        count = lays[0].shape[0]
        outs = _core.infer(op, attrs, *[stand_in(d, lay.shape) for d, lay in zip(dtypes, lays)])
        if any(lay.shape[0] != count for lay in lays) or \
                any(not shape or shape[0] != count for shape, _ in outs):
            return None

        def rowwise(shape):
            return layout(dm, (rows,) + ((),) * (len(shape) - 1), shape)

        def local(attrs, stacks):
            n = stacks[0].shape[0]
            flat = [np.ascontiguousarray(s).reshape((-1,) + s.shape[2:]) for s in stacks]
            res = op.kernel(attrs, *flat)
            res = [r.reshape((n, -1) + r.shape[1:]) for r in (res if op.multi_output else (res,))]
            return tuple(res) if op.multi_output else res[0]

        return ShardPlan(tuple(rowwise(lay.shape) for lay in lays),
                         tuple(rowwise(shape) for shape, _ in outs), local)
    return register_rule(op.name, per_device=True, shared=row_pairs, uneven=True)(plan)


def row_pairs(prim, xs):
    """Dim 0 of every input is the one batch dim (when the sizes agree); an input of
    input 0's whole shape (dense labels of the logits) is aligned with it element for
    element, so every other dim pairs too."""
    pairs = []
    for j in range(1, len(xs)):
        a, b = tuple(xs[0].shape), tuple(xs[j].shape)
        if a and b and a[0] == b[0]:
            pairs.append((0, 0, j, 0, "batch dim"))
            if a == b:
                pairs.extend((0, d, j, d, f"dim {d}") for d in range(1, len(a)))
    return pairs
