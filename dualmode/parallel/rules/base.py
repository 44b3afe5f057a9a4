"""What every sharding-rule family shares: the device count of some axes and the
pending sums an op keeps (by its declared linearity)."""
from __future__ import annotations

import math

from ...ops._registry import REGISTRY, linearity

__all__ = ["parts", "pending_sums"]


def parts(dm, axes):
    """The number of parts the device `axes` of device matrix `dm` split a dim into."""
    return math.prod(dm[a] for a in axes)


def pending_sums(op, attrs, lays):
    """``(axes, carriers)``: the device axes of the pending sums `op` keeps for inputs
    in `lays` (its outputs are pending over them too) and the positions of the inputs
    that carry them; ``((), ())`` with no pending input; None when a pending sum must be
    resolved first (the op is not linear in that input, per its registration)."""
    carriers = tuple(i for i, lay in enumerate(lays) if lay is not None and lay.partial)
    if not carriers:
        return (), ()
    lin = linearity(REGISTRY[op] if isinstance(op, str) else op, attrs)
    axes = {lays[i].partial for i in carriers}
    if lin is None or len(axes) != 1:
        return None
    if lin == "sum":                      # every input a term of the same pending sum
        return (axes.pop(), carriers) if len(carriers) == len(lays) else None
    return (axes.pop(), carriers) if len(carriers) == 1 and carriers[0] in lin else None
