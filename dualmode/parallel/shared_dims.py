"""The dims an op's inputs share, per op family: ``(i, di, j, dj, what)`` says dim ``di``
of input ``i`` and dim ``dj`` of input ``j`` are one dim (contracted, batch, broadcast,
channel...). A rule declares its op's function at registration (``register_rule(...,
shared=...)``); the contraction family derives it from the op's einsum subscripts
(:func:`dualmode.parallel.rules.contract.contract_pairs`). Strategy checks and the op's device
matrix read it through :func:`dualmode.parallel.sharding.shared_dims`."""
from __future__ import annotations

import numpy as np

__all__ = ["elementwise_pairs", "concat_pairs"]


def _aligned(s0, s1):
    """Dims of equal size when the shapes are aligned from the right (broadcasting)."""
    out = []
    for k in range(1, min(len(s0), len(s1)) + 1):
        d0, d1 = len(s0) - k, len(s1) - k
        if s0[d0] == s1[d1]:
            out.append((d0, d1))
    return out[::-1]


def elementwise_pairs(prim, xs):
    """Every pair of tensor inputs' dims aligned from the right with equal sizes (any
    number of inputs: Select, AddN)."""
    shapes = [tuple(x.shape) if hasattr(x, "shape") else None for x in xs]
    return [(i, d0, j, d1, "broadcast dim")
            for i in range(len(xs)) for j in range(i + 1, len(xs))
            if shapes[i] is not None and shapes[j] is not None
            for d0, d1 in _aligned(shapes[i], shapes[j])]


def concat_pairs(prim, xs):
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
