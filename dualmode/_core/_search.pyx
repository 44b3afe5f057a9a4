# cython: language_level=3
"""Recursive-programming kernel: one candidate per node, chosen in a given order.

The rules are those of :func:`dualmode.parallel.graph.search.recursive_programming`
(whose docstring explains them) and of its pure-Python reference ``impl="python"``; the
tests compare the two choice for choice.

The graph comes in as the flat (CSR) arrays of :mod:`dualmode._core._propagate`,
validated by the caller, plus ``order``: every node once, the fixed nodes first.

Steps (all ``nogil``):

1. ``adjacency`` / ``transpose_edges`` (_csr.pxd): incident edges per node (both directions) and a
   transposed copy of every edge matrix, so a node reads one contiguous row whichever
   end of the edge it is.
2. Greedy: each free node in ``order`` takes the candidate minimising its own cost plus,
   per incident edge, the edge cost to a decided neighbour or the least edge-plus-own
   cost of an undecided one (one step of lookahead; ties: the lower index) (``_field``).
3. Refinement: up to ``rounds`` rounds, each a sweep in ``order`` re-choosing every free
   node given all its neighbours, then a sweep over the edges (by index) re-choosing both
   free ends of each together given their other neighbours (``_pair``). A change is
   taken only when strictly cheaper, so the total cost never rises; a round without
   change stops early. A node or edge none of whose nodes or neighbours changed since
   its last evaluation is skipped (it would keep its choice).
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from dualmode._core._csr cimport adjacency, transpose_edges
from libc.stdlib cimport free, malloc

cnp.import_array()


cdef inline const double* _oriented(int64_t v, int64_t e, const int64_t* src,
                                    const int64_t* edge_ptr, const double* edge_cost,
                                    const double* edge_cost_t) noexcept nogil:
    """Edge e's matrix with v's candidates as rows: the matrix when v is the source,
    its transpose when v is the destination."""
    if src[e] == v:
        return &edge_cost[edge_ptr[e]]
    return &edge_cost_t[edge_ptr[e]]


cdef void _field(int64_t v, int64_t skip, int64_t look, const int64_t* node_ptr,
                 const double* node_cost, const int64_t* src, const int64_t* dst,
                 const int64_t* edge_ptr, const double* edge_cost,
                 const double* edge_cost_t, const int64_t* adj_ptr,
                 const int64_t* adj_edge, const int64_t* choice, double* tot) noexcept nogil:
    """tot[a]: node v's own cost of candidate a plus, over its incident edges (by edge
    index) except those to node `skip`, the edge cost to each decided neighbour, and,
    when `look`, the least edge-plus-own cost of each undecided one."""
    cdef int64_t c = node_ptr[v + 1] - node_ptr[v], a, b, p, e, u, cu, n_u
    cdef const double* m
    cdef const double* own_u
    cdef double low, val
    for a in range(c):
        tot[a] = node_cost[node_ptr[v] + a]
    for p in range(adj_ptr[v], adj_ptr[v + 1]):
        e = adj_edge[p]
        u = dst[e] if src[e] == v else src[e]
        if u == skip:
            continue
        cu = choice[u]
        n_u = node_ptr[u + 1] - node_ptr[u]
        m = _oriented(v, e, src, edge_ptr, edge_cost, edge_cost_t)   # (c, n_u)
        if cu >= 0:
            for a in range(c):
                tot[a] += m[a * n_u + cu]
        elif look:
            own_u = &node_cost[node_ptr[u]]
            for a in range(c):
                low = m[a * n_u] + own_u[0]
                for b in range(1, n_u):
                    val = m[a * n_u + b] + own_u[b]
                    if val < low:
                        low = val
                tot[a] += low


cdef int64_t _argmin(int64_t c, const double* tot, int64_t current) noexcept nogil:
    """The first least entry; `current` (or -1) is kept unless another is strictly less."""
    cdef int64_t a, best = 0 if current < 0 else current
    for a in range(c):
        if tot[a] < tot[best]:
            best = a
    return best


cdef int64_t _pair(int64_t s, int64_t d, const int64_t* node_ptr, const double* node_cost,
                   const int64_t* src, const int64_t* dst, const int64_t* edge_ptr,
                   const double* edge_cost, const double* edge_cost_t,
                   const int64_t* adj_ptr, const int64_t* adj_edge, int64_t* choice,
                   double* fs, double* fd, double* pt) noexcept nogil:
    """Re-choose nodes s and d together given all their other neighbours; move only to a
    strictly cheaper pair (the first in row-major order). Returns 1 when they moved."""
    cdef int64_t cs = node_ptr[s + 1] - node_ptr[s], cd = node_ptr[d + 1] - node_ptr[d]
    cdef int64_t a, b, p, e, ba = choice[s], bb = choice[d]
    cdef const double* m
    cdef double best
    _field(s, d, 0, node_ptr, node_cost, src, dst, edge_ptr, edge_cost, edge_cost_t,
           adj_ptr, adj_edge, choice, fs)
    _field(d, s, 0, node_ptr, node_cost, src, dst, edge_ptr, edge_cost, edge_cost_t,
           adj_ptr, adj_edge, choice, fd)
    for a in range(cs):
        for b in range(cd):
            pt[a * cd + b] = fs[a] + fd[b]
    for p in range(adj_ptr[s], adj_ptr[s + 1]):      # every edge between s and d
        e = adj_edge[p]
        if src[e] == d or dst[e] == d:
            m = _oriented(s, e, src, edge_ptr, edge_cost, edge_cost_t)
            for a in range(cs * cd):
                pt[a] += m[a]
    best = pt[ba * cd + bb]
    for a in range(cs):
        for b in range(cd):
            if pt[a * cd + b] < best:
                best = pt[a * cd + b]
                ba = a
                bb = b
    if ba == choice[s] and bb == choice[d]:
        return 0
    choice[s] = ba
    choice[d] = bb
    return 1


cdef int64_t _recent(int64_t v, const int64_t* src, const int64_t* dst,
                     const int64_t* adj_ptr, const int64_t* adj_edge,
                     const int64_t* changed_at) noexcept nogil:
    """The last time node v or one of its neighbours changed."""
    cdef int64_t p, e, u, t = changed_at[v]
    for p in range(adj_ptr[v], adj_ptr[v + 1]):
        e = adj_edge[p]
        u = dst[e] if src[e] == v else src[e]
        if changed_at[u] > t:
            t = changed_at[u]
    return t


cdef void _ordered(int64_t N, int64_t E, const int64_t* node_ptr, const double* node_cost,
                   const int64_t* src, const int64_t* dst, const int64_t* edge_ptr,
                   const double* edge_cost, double* edge_cost_t, const int64_t* fixed,
                   const int64_t* order, int64_t rounds, int64_t* choice,
                   int64_t* adj_ptr, int64_t* adj_edge, double* tot, double* fd,
                   double* pt, int64_t* changed_at, int64_t* node_seen,
                   int64_t* edge_seen) noexcept nogil:
    """Fill `choice` (N): greedy with lookahead in `order`, then refinement rounds.

    A node (an edge) is re-evaluated only when it or a neighbour (of either end) changed
    since its last evaluation: otherwise the evaluation would keep the current choice, so
    skipping it changes nothing (the reference evaluates everything)."""
    cdef int64_t i, k, v, e, s, d, t, best, r, changed, c, clock = 0
    adjacency(N, E, src, dst, adj_ptr, adj_edge)
    transpose_edges(E, node_ptr, src, dst, edge_ptr, edge_cost, edge_cost_t)
    for i in range(N):
        choice[i] = fixed[i]
        changed_at[i] = 0
        node_seen[i] = -1
    for e in range(E):
        edge_seen[e] = -1
    for k in range(N):
        v = order[k]
        if fixed[v] < 0:
            _field(v, -1, 1, node_ptr, node_cost, src, dst, edge_ptr, edge_cost,
                   edge_cost_t, adj_ptr, adj_edge, choice, tot)
            choice[v] = _argmin(node_ptr[v + 1] - node_ptr[v], tot, -1)
    for r in range(rounds):
        changed = 0
        for k in range(N):
            v = order[k]
            if fixed[v] >= 0 or _recent(v, src, dst, adj_ptr, adj_edge,
                                        changed_at) <= node_seen[v]:
                continue
            c = node_ptr[v + 1] - node_ptr[v]
            _field(v, -1, 0, node_ptr, node_cost, src, dst, edge_ptr, edge_cost,
                   edge_cost_t, adj_ptr, adj_edge, choice, tot)
            best = _argmin(c, tot, choice[v])
            if best != choice[v]:
                choice[v] = best
                changed += 1
                clock += 1
                changed_at[v] = clock
            node_seen[v] = clock
        for e in range(E):
            s = src[e]
            d = dst[e]
            if fixed[s] >= 0 or fixed[d] >= 0:
                continue
            t = _recent(s, src, dst, adj_ptr, adj_edge, changed_at)
            t = max(t, _recent(d, src, dst, adj_ptr, adj_edge, changed_at))
            if t <= edge_seen[e]:
                continue
            if _pair(s, d, node_ptr, node_cost, src, dst, edge_ptr, edge_cost, edge_cost_t,
                     adj_ptr, adj_edge, choice, tot, fd, pt):
                changed += 1
                clock += 1
                changed_at[s] = clock
                changed_at[d] = clock
            edge_seen[e] = clock
        if changed == 0:
            break


def ordered_greedy(const int64_t[::1] node_ptr, const double[::1] node_cost,
                   const int64_t[::1] src, const int64_t[::1] dst,
                   const int64_t[::1] edge_ptr, const double[::1] edge_cost,
                   const int64_t[::1] fixed, const int64_t[::1] order, Py_ssize_t rounds):
    """The chosen candidate per node (int64, length N): greedy with lookahead in
    ``order``, then up to ``rounds`` refinement rounds (node sweep, edge sweep).

    The caller (``dualmode.parallel.graph.search``) validates values; this entry checks
    only that the array lengths agree and that ``order`` is a permutation, so the kernel
    never reads out of bounds given in-range values.
    """
    cdef int64_t N = fixed.shape[0], E = src.shape[0], i, cmax = 1
    if node_ptr.shape[0] != N + 1 or dst.shape[0] != E or edge_ptr.shape[0] != E + 1 \
            or order.shape[0] != N:
        raise ValueError(f"_search.ordered_greedy: array lengths disagree: node_ptr "
                         f"{node_ptr.shape[0]} (expected N + 1 = {N + 1}), order "
                         f"{order.shape[0]} (expected N), dst {dst.shape[0]} and edge_ptr "
                         f"{edge_ptr.shape[0]} (expected E = {E} and E + 1)")
    if node_ptr[N] != node_cost.shape[0] or edge_ptr[E] != edge_cost.shape[0]:
        raise ValueError(f"_search.ordered_greedy: node_ptr[-1]={node_ptr[N]} and "
                         f"edge_ptr[-1]={edge_ptr[E]} must equal the lengths of node_cost "
                         f"({node_cost.shape[0]}) and edge_cost ({edge_cost.shape[0]})")
    if rounds < 0:
        raise ValueError(f"_search.ordered_greedy: rounds={rounds} must be >= 0")
    seen = np.zeros(N, dtype=np.uint8)
    cdef unsigned char[::1] seen_v = seen
    for i in range(N):
        if order[i] < 0 or order[i] >= N or seen_v[order[i]]:
            raise ValueError(f"_search.ordered_greedy: order is not a permutation of "
                             f"0..{N - 1} (entry {i} is {order[i]})")
        seen_v[order[i]] = 1
        cmax = max(cmax, node_ptr[i + 1] - node_ptr[i])
    out = np.empty(N, dtype=np.int64)
    cdef int64_t[::1] choice = out
    cdef int64_t* adj_ptr = <int64_t*>malloc((N + 1) * sizeof(int64_t))
    cdef int64_t* adj_edge = <int64_t*>malloc((2 * E + 1) * sizeof(int64_t))
    cdef double* tot = <double*>malloc(cmax * sizeof(double))
    cdef double* fd = <double*>malloc(cmax * sizeof(double))
    cdef double* pt = <double*>malloc(cmax * cmax * sizeof(double))
    cdef double* edge_cost_t = <double*>malloc((edge_cost.shape[0] + 1) * sizeof(double))
    cdef int64_t* changed_at = <int64_t*>malloc((N + 1) * sizeof(int64_t))
    cdef int64_t* node_seen = <int64_t*>malloc((N + 1) * sizeof(int64_t))
    cdef int64_t* edge_seen = <int64_t*>malloc((E + 1) * sizeof(int64_t))
    try:
        if not (adj_ptr and adj_edge and tot and fd and pt and edge_cost_t and changed_at
                and node_seen and edge_seen):
            raise MemoryError("_search.ordered_greedy: out of memory for the work arrays")
        if N > 0:
            with nogil:
                _ordered(N, E, &node_ptr[0], &node_cost[0] if node_cost.shape[0] else NULL,
                         &src[0] if E else NULL, &dst[0] if E else NULL, &edge_ptr[0],
                         &edge_cost[0] if edge_cost.shape[0] else NULL, edge_cost_t,
                         &fixed[0], &order[0], rounds, &choice[0], adj_ptr, adj_edge, tot,
                         fd, pt, changed_at, node_seen, edge_seen)
    finally:
        free(adj_ptr)
        free(adj_edge)
        free(tot)
        free(fd)
        free(pt)
        free(edge_cost_t)
        free(changed_at)
        free(node_seen)
        free(edge_seen)
    return out
