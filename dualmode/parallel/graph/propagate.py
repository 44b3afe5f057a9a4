"""Sharding propagation: one candidate strategy per op, spreading from the configured ops.

The problem is a graph: node ``i`` (an op) has ``c_i >= 1`` candidate strategies, each
with its own cost (the op's own communication); edge ``e`` (data flowing from op
``edges[e, 0]`` to op ``edges[e, 1]``) has a ``(c_src, c_dst)`` matrix of redistribution
costs. Configured ops are *fixed* to one candidate and never change. The total cost of a
choice is the sum of the chosen own costs plus the chosen entry of every edge matrix
(:func:`total_cost`).

Algorithm (MindSpore's sharding propagation):

1. **Visit order.** Breadth-first layers (over edges in both directions) from all fixed
   nodes at once, each layer sorted by node index, so every free node is visited after
   the nodes nearer a configured op and conflicts resolve toward the nearest one. A
   connected component without a fixed node is visited afterwards, from its
   lowest-index node (which, having no decided neighbour, takes its candidate of least
   own cost), components in order of their lowest node index.
2. **Greedy choice.** A visited node takes the candidate minimising its own cost plus
   the edge costs to every neighbour already decided (fixed or visited before it, in
   either direction). Ties go to the lower candidate index.
3. **Refinement.** Up to ``rounds`` sweeps (default 4) in the same order re-choose each
   free node given all its neighbours. A node moves only to a strictly cheaper
   candidate; since its own cost plus its incident edges is exactly the part of the
   total that depends on it (self-loops are rejected), every move strictly lowers the
   total cost, so refinement never increases it and never touches fixed nodes. A
   sweep without change stops early.

Everything is deterministic. ``impl="cython"`` runs :mod:`dualmode._core._propagate`
over flat CSR arrays (built here with one numpy call each) without the GIL;
``impl="python"`` is a plain reference of the same rules, adding the edge costs in the
same order, so both give identical choices (the tests compare them).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from ..._core import _propagate

__all__ = ["propagate", "total_cost", "flat_total_cost", "prepare_problem",
           "propagate_flat", "unflatten", "PropagationError",
           "DEFAULT_ROUNDS"]

#: Refinement sweeps run after the greedy pass unless ``rounds`` says otherwise.
DEFAULT_ROUNDS = _propagate.DEFAULT_ROUNDS


class PropagationError(ValueError):
    """Invalid input to :func:`propagate` / :func:`total_cost`."""


# ============================================================================ validation

def _check_list(name, value):
    if not isinstance(value, (list, tuple)):
        raise PropagationError(f"propagate: {name} must be a list of numpy arrays; got "
                               f"{type(value).__name__}")


def _flatten(name, items, ndim, what):
    """(shapes, flat) of the ragged cost arrays ``items`` (the Cython copy loop)."""
    try:
        bad, shapes, flat = _propagate.flatten(items, ndim)
    except (TypeError, ValueError) as exc:
        raise PropagationError(f"propagate: {name} must hold arrays of numbers ({exc})") \
            from None
    if bad >= 0:
        raise PropagationError(f"propagate: {name}[{bad}] has shape {np.shape(items[bad])}; "
                               f"each entry must be {what}")
    return shapes, flat


def _flatten_nodes(node_costs) -> Tuple[np.ndarray, np.ndarray]:
    """node_ptr (N + 1) and the concatenated float64 costs."""
    _check_list("node_costs", node_costs)
    n = len(node_costs)
    shapes, flat = _flatten("node_costs", list(node_costs), 1,
                            "a 1-D array of costs, one per candidate")
    counts = shapes[:, 0]
    bad = np.flatnonzero(counts < 1)
    if bad.size:
        raise PropagationError(f"propagate: node_costs[{int(bad[0])}] is empty; each node "
                               f"needs at least one candidate")
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    _check_costs("node_costs", flat, ptr, lambda i: f"node_costs[{i}]")
    return ptr, flat


def _check_costs(name, flat, ptr, where):
    if flat.size == 0:
        return
    low = flat.min()                      # NaN propagates: one pass, no temporaries
    if not (np.isnan(low) or low == -np.inf):
        return
    bad = np.flatnonzero(np.isnan(flat) | (flat == -np.inf))
    i = int(np.searchsorted(ptr, bad[0], side="right") - 1)
    raise PropagationError(f"propagate: {where(i)} holds {flat[bad[0]]}; costs must be "
                           f"numbers or +inf (not NaN or -inf)")


def _check_edges(edges, n) -> np.ndarray:
    arr = np.asarray(edges)
    if arr.size == 0 and arr.ndim in (1, 2) and (arr.ndim == 1 or arr.shape[1] in (0, 2)):
        return np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise PropagationError(f"propagate: edges has shape {arr.shape}; expected (E, 2), "
                               f"one (source, destination) row per edge")
    if arr.dtype.kind not in "iu":
        raise PropagationError(f"propagate: edges has dtype {arr.dtype}; expected integer "
                               f"node indices")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    bad = np.flatnonzero((arr < 0).any(axis=1) | (arr >= n).any(axis=1))
    if bad.size:
        e = int(bad[0])
        raise PropagationError(f"propagate: edges[{e}]={tuple(arr[e].tolist())} names a node "
                               f"out of range; valid nodes are 0..{n - 1} "
                               f"(len(node_costs)={n})")
    bad = np.flatnonzero(arr[:, 0] == arr[:, 1])
    if bad.size:
        e = int(bad[0])
        raise PropagationError(f"propagate: edges[{e}]={tuple(arr[e].tolist())} is a "
                               f"self-loop; an edge must join two different nodes")
    return arr


def _flatten_edges(edge_costs, edges, counts) -> Tuple[np.ndarray, np.ndarray]:
    """edge_ptr (E + 1) and the concatenated row-major float64 matrices."""
    _check_list("edge_costs", edge_costs)
    e_num = edges.shape[0]
    if len(edge_costs) != e_num:
        raise PropagationError(f"propagate: edge_costs has {len(edge_costs)} entries but "
                               f"edges has {e_num} rows; expected one cost matrix per edge")
    if e_num == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.float64)
    shapes, flat = _flatten("edge_costs", list(edge_costs), 2, "a 2-D (c_src, c_dst) array")
    want = counts[edges]
    bad = np.flatnonzero((shapes != want).any(axis=1))
    if bad.size:
        e = int(bad[0])
        s, d = edges[e].tolist()
        raise PropagationError(
            f"propagate: edge_costs[{e}] has shape {tuple(shapes[e].tolist())} but edge {e} "
            f"runs from node {s} ({want[e, 0]} candidates) to node {d} ({want[e, 1]} "
            f"candidates); expected shape {tuple(want[e].tolist())}")
    ptr = np.zeros(e_num + 1, np.int64)
    np.cumsum(shapes[:, 0] * shapes[:, 1], out=ptr[1:])
    _check_costs("edge_costs", flat, ptr, lambda e: f"edge_costs[{e}]")
    return ptr, flat


def _check_fixed(fixed, counts) -> np.ndarray:
    n = counts.shape[0]
    arr = np.asarray(fixed)
    if arr.shape != (n,):
        raise PropagationError(f"propagate: fixed has shape {arr.shape}; expected ({n},), "
                               f"one entry per node (len(node_costs)={n})")
    if n and arr.dtype.kind not in "iu":
        raise PropagationError(f"propagate: fixed has dtype {arr.dtype}; expected integers "
                               f"(-1 for a free node, else a candidate index)")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    bad = np.flatnonzero((arr < -1) | (arr >= counts))
    if bad.size:
        i = int(bad[0])
        raise PropagationError(f"propagate: fixed[{i}]={int(arr[i])} is not valid for node "
                               f"{i} with {int(counts[i])} candidates; expected -1 (free) or "
                               f"0..{int(counts[i]) - 1}")
    return arr


def prepare_problem(node_costs, edges, edge_costs, fixed=None):
    """Validate a problem and flatten it: ``(node_ptr, node_flat, edges, edge_ptr,
    edge_flat, fixed)`` (CSR arrays as the kernels take them; ``fixed`` None when not
    given). Raises :class:`PropagationError` naming the bad parameter."""
    node_ptr, node_flat = _flatten_nodes(node_costs)
    counts = np.diff(node_ptr)
    n = counts.shape[0]
    edges = _check_edges(edges, n)
    edge_ptr, edge_flat = _flatten_edges(edge_costs, edges, counts)
    fixed = None if fixed is None else _check_fixed(fixed, counts)
    return node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed



def _check_rounds(rounds):
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise PropagationError(f"propagate: rounds={rounds!r} is not valid; expected an int "
                               f">= 0 (refinement sweeps; 0 disables refinement)")
    return int(rounds)


# ============================================================================ public API

def propagate(node_costs: Sequence[np.ndarray], edges, edge_costs: Sequence[np.ndarray],
              fixed, *, impl: str = "cython", rounds: int = DEFAULT_ROUNDS) -> np.ndarray:
    """Choose one candidate per node, spreading from the fixed (configured) nodes.

    Parameters
    ----------
    node_costs : list of 1-D float arrays, length N
        Node ``i``'s own cost per candidate (``c_i >= 1`` entries).
    edges : int array (E, 2)
        Data flows from node ``edges[e, 0]`` to node ``edges[e, 1]`` (no self-loops;
        several edges between one pair are allowed and all count).
    edge_costs : list of 2-D float arrays, length E
        ``edge_costs[e][a, b]``: the redistribution cost on edge ``e`` when its source
        takes candidate ``a`` and its destination candidate ``b``.
    fixed : int array (N,)
        -1 for a free node, else the configured candidate (never changed).
    impl : {"cython", "python"}
        The Cython kernel or the plain-Python reference (same choices).
    rounds : int
        Refinement sweeps after the greedy pass (0: none). See the module docstring.

    Returns
    -------
    np.ndarray of int64, shape (N,)
        The chosen candidate per node; ``out[i] == fixed[i]`` wherever ``fixed[i] >= 0``.

    Raises
    ------
    PropagationError (a ValueError)
        Naming the parameter, the bad value and what is valid.
    """
    if impl not in ("cython", "python"):
        raise PropagationError(f"propagate: impl={impl!r} is not valid; expected 'cython' "
                               f"or 'python'")
    rounds = _check_rounds(rounds)
    return propagate_flat(*prepare_problem(node_costs, edges, edge_costs, fixed), impl=impl,
                          rounds=rounds)


def propagate_flat(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed, *,
                   impl: str = "cython", rounds: int = DEFAULT_ROUNDS) -> np.ndarray:
    """:func:`propagate` over a problem already flattened by :func:`prepare_problem`
    (``impl`` and ``rounds`` trusted)."""
    if impl == "python":
        return _reference(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed, rounds)
    return _propagate.propagate(node_ptr, node_flat, np.ascontiguousarray(edges[:, 0]),
                                np.ascontiguousarray(edges[:, 1]), edge_ptr, edge_flat,
                                fixed, rounds)


def total_cost(choice, node_costs: Sequence[np.ndarray], edges,
               edge_costs: Sequence[np.ndarray]) -> float:
    """The own costs of the chosen candidates plus the chosen entry of every edge matrix.

    ``choice`` is an int array (N,) of candidate indices (as :func:`propagate` returns).
    """
    node_ptr, node_flat, e_arr, edge_ptr, edge_flat, _ = prepare_problem(node_costs, edges,
                                                                   edge_costs)
    counts = np.diff(node_ptr)
    n = counts.shape[0]
    arr = np.asarray(choice)
    if arr.shape != (n,) or (n and arr.dtype.kind not in "iu"):
        raise PropagationError(f"total_cost: choice has shape {arr.shape} and dtype "
                               f"{arr.dtype}; expected ({n},) integers, one candidate per node")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= counts))
    if bad.size:
        i = int(bad[0])
        raise PropagationError(f"total_cost: choice[{i}]={int(arr[i])} is not valid for node "
                               f"{i} with {int(counts[i])} candidates; expected "
                               f"0..{int(counts[i]) - 1}")
    return flat_total_cost(arr, node_ptr, node_flat, e_arr, edge_ptr, edge_flat)


def flat_total_cost(choice, node_ptr, node_flat, edges, edge_ptr, edge_flat) -> float:
    """:func:`total_cost` of a valid ``choice`` over a problem already flattened by
    :func:`prepare_problem` (no validation)."""
    counts = np.diff(node_ptr)
    own = node_flat[node_ptr[:-1] + choice].sum() if counts.shape[0] else 0.0
    if edges.shape[0] == 0:
        return float(own)
    s, d = edges[:, 0], edges[:, 1]
    edge = edge_flat[edge_ptr[:-1] + choice[s] * counts[d] + choice[d]].sum()
    return float(own + edge)


# ============================================================================ reference

def unflatten(node_ptr, node_flat, edges, edge_ptr, edge_flat):
    """The flat problem as Python lists for the plain references: ``(n, own, src, dst,
    mats, incident)`` — each node's own costs, each edge's ends and (c_src, c_dst)
    matrix, and each node's incident edges by increasing edge index (both ends)."""
    n = node_ptr.shape[0] - 1
    counts = np.diff(node_ptr).tolist()
    own = [node_flat[node_ptr[i]:node_ptr[i + 1]] for i in range(n)]
    src, dst = edges[:, 0].tolist(), edges[:, 1].tolist()
    mats = [edge_flat[edge_ptr[e]:edge_ptr[e + 1]].reshape(counts[src[e]], counts[dst[e]])
            for e in range(len(src))]
    incident = [[] for _ in range(n)]
    for e in range(len(src)):
        incident[src[e]].append(e)
        incident[dst[e]].append(e)
    return n, own, src, dst, mats, incident


def _reference(node_ptr, node_flat, edges, edge_ptr, edge_flat, fixed, rounds):
    """The same algorithm as the kernel, written plainly (one node at a time)."""
    n, own, src, dst, mats, incident = unflatten(node_ptr, node_flat, edges, edge_ptr,
                                                 edge_flat)
    fixed = fixed.tolist()

    # visit order: BFS layers from the fixed nodes, each sorted; then free components
    seen = [f >= 0 for f in fixed]
    order = [i for i in range(n) if fixed[i] >= 0]

    def bfs(layer):
        while layer:
            nxt = []
            for v in layer:
                for e in incident[v]:
                    u = dst[e] if src[e] == v else src[e]
                    if not seen[u]:
                        seen[u] = True
                        nxt.append(u)
            nxt.sort()
            order.extend(nxt)
            layer = nxt

    bfs(list(order))
    for i in range(n):
        if not seen[i]:
            seen[i] = True
            order.append(i)
            bfs([i])

    choice = list(fixed)

    def best(v, current):
        tot = own[v].copy()
        for e in incident[v]:
            if src[e] == v:
                cu = choice[dst[e]]
                if cu >= 0:
                    tot += mats[e][:, cu]
            else:
                cu = choice[src[e]]
                if cu >= 0:
                    tot += mats[e][cu, :]
        b = int(np.argmin(tot))                  # first minimum: the lower index
        if current >= 0 and not tot[b] < tot[current]:
            return current
        return b

    for v in order:
        if fixed[v] < 0:
            choice[v] = best(v, -1)
    for _ in range(rounds):
        changed = False
        for v in order:
            if fixed[v] < 0:
                b = best(v, choice[v])
                if b != choice[v]:
                    choice[v] = b
                    changed = True
        if not changed:
            break
    return np.asarray(choice, dtype=np.int64).reshape(n)
