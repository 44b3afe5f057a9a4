"""The redistribution planner in plain Python: the reference the Cython kernel
(:mod:`dualmode._core._redist`) is tested against, and its fallback beyond the
kernel's fixed sizes."""
from __future__ import annotations

import heapq
import math

from ...communication.trace import bytes_per_device
from ..tensor_layout import TensorLayout
from .steps import _A2A, _AR, _GATHER, _NAMES, _RS, _SLICE, _TRACE_KIND
from .unify import _refine, unify_device_matrices


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
