# cython: language_level=3
"""Sharding-propagation kernel: choose one candidate strategy per node of a graph,
spreading outward from the configured (fixed) nodes.

The rules are those of :mod:`dualmode.parallel.graph.propagate` (whose module
docstring explains them) and of its pure-Python reference ``impl="python"``; the tests
compare the two choice for choice.

The graph comes in as flat (CSR) arrays, validated by the caller:

* ``node_ptr`` (N + 1): node ``i``'s own costs are ``node_cost[node_ptr[i]:node_ptr[i+1]]``
  (``c_i = node_ptr[i+1] - node_ptr[i] >= 1`` candidates);
* ``src``, ``dst`` (E): edge ``e`` runs from ``src[e]`` to ``dst[e]`` (no self-loops);
* ``edge_ptr`` (E + 1): edge ``e``'s cost matrix ``(c_src, c_dst)``, row-major, is
  ``edge_cost[edge_ptr[e]:edge_ptr[e+1]]``;
* ``fixed`` (N): -1 for a free node, else its configured candidate.

Steps (all ``nogil``):

1. ``adjacency`` (_csr.pxd): per node, its incident edges in increasing edge index (both
   directions), by a counting sort; ``transpose_edges``: a transposed copy of every edge
   matrix, so a node reads one contiguous row whichever end of the edge it is.
2. ``_visit_order``: breadth-first layers from every fixed node at once, each layer
   sorted by node index; then, for each component with no fixed node (in order of its
   lowest node index), the same from that node.
3. ``_choose``: each free node in visit order takes the candidate minimising its own cost
   plus the edge costs to the neighbours decided so far (ties: the lower index).
4. ``_refine``: up to ``rounds`` sweeps in visit order re-choose each free node given all
   its neighbours, taking a new candidate only when strictly cheaper (so the total cost
   never rises); stops early on a sweep without change.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from dualmode._core._csr cimport adjacency, transpose_edges
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcpy

cnp.import_array()

DEFAULT_ROUNDS = 4


def flatten(list items, int ndim):
    """Concatenate the ragged cost arrays ``items`` (each ``ndim``-D) into one float64
    array, row-major, with their shapes: ``(bad, shapes, flat)``.

    ``bad`` is -1, or the index of the first item whose number of dims is not ``ndim``
    (then ``shapes`` and ``flat`` are None). Float64 C-contiguous arrays are copied with
    one memcpy each; anything else is converted with ``np.ascontiguousarray`` first.
    """
    cdef Py_ssize_t n = len(items), i, k, size, total = 0
    cdef object obj
    cdef cnp.ndarray arr
    cdef list conv = items
    cdef bint copied = False
    shapes_arr = np.empty((n, ndim), dtype=np.int64)
    cdef int64_t[:, ::1] shapes = shapes_arr
    for i in range(n):
        obj = items[i]
        if not (cnp.PyArray_Check(obj) and cnp.PyArray_TYPE(<cnp.ndarray>obj) == cnp.NPY_DOUBLE
                and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>obj)):
            if cnp.PyArray_Check(obj) and cnp.PyArray_NDIM(<cnp.ndarray>obj) != ndim:
                return i, None, None
            obj = np.ascontiguousarray(obj, dtype=np.float64)
            if not copied:
                conv = list(items)
                copied = True
            conv[i] = obj
        arr = <cnp.ndarray>obj
        if cnp.PyArray_NDIM(arr) != ndim:
            return i, None, None
        size = 1
        for k in range(ndim):
            shapes[i, k] = cnp.PyArray_DIMS(arr)[k]
            size *= shapes[i, k]
        total += size
    flat_arr = np.empty(total, dtype=np.float64)
    cdef double* flat = <double*>cnp.PyArray_DATA(flat_arr)
    total = 0
    for i in range(n):
        arr = <cnp.ndarray>conv[i]
        size = cnp.PyArray_SIZE(arr)
        if size:
            memcpy(&flat[total], cnp.PyArray_DATA(arr), size * sizeof(double))
        total += size
    return -1, shapes_arr, flat_arr


cdef int _cmp_int64(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0]
    cdef int64_t y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


cdef int64_t _bfs(int64_t head, int64_t tail, const int64_t* src, const int64_t* dst,
                  const int64_t* adj_ptr, const int64_t* adj_edge, char* seen,
                  int64_t* order) noexcept nogil:
    """Breadth-first layers from order[head:tail] (already seen), each new layer sorted by
    node index and appended to `order`. Returns the new tail."""
    cdef int64_t layer_end, k, p, e, u, v
    while head < tail:
        layer_end = tail
        for k in range(head, layer_end):
            v = order[k]
            for p in range(adj_ptr[v], adj_ptr[v + 1]):
                e = adj_edge[p]
                u = dst[e] if src[e] == v else src[e]
                if not seen[u]:
                    seen[u] = 1
                    order[tail] = u
                    tail += 1
        if tail - layer_end > 1:
            qsort(&order[layer_end], <size_t>(tail - layer_end), sizeof(int64_t), _cmp_int64)
        head = layer_end
    return tail


cdef void _visit_order(int64_t N, const int64_t* src, const int64_t* dst,
                       const int64_t* adj_ptr, const int64_t* adj_edge,
                       const int64_t* fixed, char* seen, int64_t* order) noexcept nogil:
    """Every node once: fixed nodes, then BFS layers from them, then the unreached
    components from their lowest-index node."""
    cdef int64_t i, tail = 0
    for i in range(N):
        seen[i] = 0
    for i in range(N):
        if fixed[i] >= 0:
            seen[i] = 1
            order[tail] = i
            tail += 1
    tail = _bfs(0, tail, src, dst, adj_ptr, adj_edge, seen, order)
    for i in range(N):
        if not seen[i]:
            seen[i] = 1
            order[tail] = i
            tail = _bfs(tail, tail + 1, src, dst, adj_ptr, adj_edge, seen, order)


cdef int64_t _best(int64_t v, const int64_t* node_ptr, const double* node_cost,
                   const int64_t* src, const int64_t* dst, const int64_t* edge_ptr,
                   const double* edge_cost, const double* edge_cost_t,
                   const int64_t* adj_ptr, const int64_t* adj_edge,
                   const int64_t* choice, int64_t current, double* tot) noexcept nogil:
    """The candidate of node v minimising its own cost plus the edge costs to its decided
    neighbours (choice >= 0), ties to the lower index; `current` (or -1) is kept unless
    another candidate is strictly cheaper."""
    cdef int64_t c = node_ptr[v + 1] - node_ptr[v], a, p, e, cu, best
    cdef const double* m
    for a in range(c):
        tot[a] = node_cost[node_ptr[v] + a]
    for p in range(adj_ptr[v], adj_ptr[v + 1]):
        e = adj_edge[p]
        if src[e] == v:        # v is the source: column choice[dst] = a row of the transpose
            cu = choice[dst[e]]
            if cu < 0:
                continue
            m = &edge_cost_t[edge_ptr[e] + cu * c]
        else:                  # v is the destination: row choice[src]
            cu = choice[src[e]]
            if cu < 0:
                continue
            m = &edge_cost[edge_ptr[e] + cu * c]
        for a in range(c):
            tot[a] += m[a]
    best = 0 if current < 0 else current
    for a in range(c):
        if tot[a] < tot[best]:
            best = a
    return best


cdef int64_t _propagate(int64_t N, int64_t E, const int64_t* node_ptr,
                        const double* node_cost, const int64_t* src, const int64_t* dst,
                        const int64_t* edge_ptr, const double* edge_cost,
                        double* edge_cost_t, const int64_t* fixed, int64_t rounds,
                        int64_t* choice,
                        int64_t* adj_ptr, int64_t* adj_edge, int64_t* order, char* seen,
                        double* tot) noexcept nogil:
    """Fill `choice` (N); returns the number of refinement sweeps run."""
    cdef int64_t i, k, v, best, r, changed, sweeps = 0
    adjacency(N, E, src, dst, adj_ptr, adj_edge)
    transpose_edges(E, node_ptr, src, dst, edge_ptr, edge_cost, edge_cost_t)
    _visit_order(N, src, dst, adj_ptr, adj_edge, fixed, seen, order)
    for i in range(N):
        choice[i] = fixed[i]
    for k in range(N):
        v = order[k]
        if fixed[v] < 0:
            choice[v] = _best(v, node_ptr, node_cost, src, dst, edge_ptr, edge_cost,
                              edge_cost_t, adj_ptr, adj_edge, choice, -1, tot)
    for r in range(rounds):
        changed = 0
        sweeps += 1
        for k in range(N):
            v = order[k]
            if fixed[v] >= 0:
                continue
            best = _best(v, node_ptr, node_cost, src, dst, edge_ptr, edge_cost,
                         edge_cost_t, adj_ptr, adj_edge, choice, choice[v], tot)
            if best != choice[v]:
                choice[v] = best
                changed += 1
        if changed == 0:
            break
    return sweeps


def propagate(const int64_t[::1] node_ptr, const double[::1] node_cost,
              const int64_t[::1] src, const int64_t[::1] dst,
              const int64_t[::1] edge_ptr, const double[::1] edge_cost,
              const int64_t[::1] fixed, Py_ssize_t rounds=DEFAULT_ROUNDS):
    """The chosen candidate per node (int64, length N) of a graph given as CSR arrays.

    The caller (``dualmode.parallel.graph.propagate``) validates values; this entry
    checks only that the array lengths agree, so the kernel never reads out of bounds
    given in-range values.
    """
    cdef int64_t N = fixed.shape[0], E = src.shape[0], i, cmax = 1
    if node_ptr.shape[0] != N + 1 or dst.shape[0] != E or edge_ptr.shape[0] != E + 1:
        raise ValueError(f"_propagate.propagate: array lengths disagree: node_ptr "
                         f"{node_ptr.shape[0]} (expected N + 1 = {N + 1}), dst "
                         f"{dst.shape[0]} and edge_ptr {edge_ptr.shape[0]} (expected E = "
                         f"{E} and E + 1)")
    if node_ptr[N] != node_cost.shape[0] or edge_ptr[E] != edge_cost.shape[0]:
        raise ValueError(f"_propagate.propagate: node_ptr[-1]={node_ptr[N]} and "
                         f"edge_ptr[-1]={edge_ptr[E]} must equal the lengths of node_cost "
                         f"({node_cost.shape[0]}) and edge_cost ({edge_cost.shape[0]})")
    if rounds < 0:
        raise ValueError(f"_propagate.propagate: rounds={rounds} must be >= 0")
    for i in range(N):
        cmax = max(cmax, node_ptr[i + 1] - node_ptr[i])
    out = np.empty(N, dtype=np.int64)
    cdef int64_t[::1] choice = out
    cdef int64_t* adj_ptr = <int64_t*>malloc((N + 1) * sizeof(int64_t))
    cdef int64_t* adj_edge = <int64_t*>malloc((2 * E + 1) * sizeof(int64_t))
    cdef int64_t* order = <int64_t*>malloc((N + 1) * sizeof(int64_t))
    cdef char* seen = <char*>malloc(N + 1)
    cdef double* tot = <double*>malloc(cmax * sizeof(double))
    cdef double* edge_cost_t = <double*>malloc((edge_cost.shape[0] + 1) * sizeof(double))
    try:
        if not (adj_ptr and adj_edge and order and seen and tot and edge_cost_t):
            raise MemoryError("_propagate.propagate: out of memory for the work arrays")
        if N > 0:
            with nogil:
                _propagate(N, E, &node_ptr[0], &node_cost[0] if node_cost.shape[0] else NULL,
                           &src[0] if E else NULL, &dst[0] if E else NULL, &edge_ptr[0],
                           &edge_cost[0] if edge_cost.shape[0] else NULL, edge_cost_t,
                           &fixed[0],
                           rounds, &choice[0], adj_ptr, adj_edge, order, seen, tot)
    finally:
        free(adj_ptr)
        free(adj_edge)
        free(order)
        free(seen)
        free(tot)
        free(edge_cost_t)
    return out
