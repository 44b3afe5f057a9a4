"""Ops computed along one axis (``family=("along_axis",)``: Softmax, LogSoftmax) or
several (L2Normalize: ``attrs["axis"]`` a tuple): those axes must be whole on each
device; every other dim keeps its split."""
from __future__ import annotations

from ..sharding import ShardPlan, layout, register_rule

__all__ = ["rule"]


def _along_axis_whole(op):
    def rule(attrs, lays, dtypes):
        x = lays[0]
        if x is None or x.partial:
            return None
        axis = attrs["axis"]
        axes = set(axis) if isinstance(axis, tuple) else {axis}
        tmap = [() if d in axes else m for d, m in enumerate(x.tensor_map)]
        need = layout(x.device_matrix, tmap, x.shape)
        # the same axes of the stacks, behind their device axis
        shifted = tuple(a + 1 for a in axis) if isinstance(axis, tuple) else axis + 1

        def local(attrs, stacks):
            return op.kernel(dict(attrs, axis=shifted), stacks[0])

        return ShardPlan((need,), (need,), local)
    return rule


def rule(op):
    """Register the rule of `op`, which declares ``family=("along_axis",)``."""
    return register_rule(op.name, per_device=True, uneven=True)(_along_axis_whole(op))
