"""Unifying two device matrices: the coarsest matrix refining both (same ranks)."""
from __future__ import annotations

import math




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
