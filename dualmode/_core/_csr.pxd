# cython: language_level=3
"""Graph helpers shared by the Cython search kernels (_propagate, _search), header-only
(``cdef inline``): the problem graph arrives as flat CSR arrays (see _propagate.pyx)."""
from libc.stdint cimport int64_t


cdef inline void adjacency(int64_t N, int64_t E, const int64_t* src, const int64_t* dst,
                           int64_t* adj_ptr, int64_t* adj_edge) noexcept nogil:
    """CSR of incident edges per node (each edge listed at both ends), by edge index."""
    cdef int64_t i, e, p
    for i in range(N + 1):
        adj_ptr[i] = 0
    for e in range(E):
        adj_ptr[src[e] + 1] += 1
        adj_ptr[dst[e] + 1] += 1
    for i in range(N):
        adj_ptr[i + 1] += adj_ptr[i]
    # adj_ptr[i] is used as the fill cursor, then shifted back
    for e in range(E):
        p = adj_ptr[src[e]]
        adj_edge[p] = e
        adj_ptr[src[e]] = p + 1
        p = adj_ptr[dst[e]]
        adj_edge[p] = e
        adj_ptr[dst[e]] = p + 1
    for i in range(N, 0, -1):
        adj_ptr[i] = adj_ptr[i - 1]
    adj_ptr[0] = 0


cdef inline void transpose_edges(int64_t E, const int64_t* node_ptr, const int64_t* src,
                                 const int64_t* dst, const int64_t* edge_ptr,
                                 const double* edge_cost, double* edge_cost_t) noexcept nogil:
    """Each edge's (c_src, c_dst) matrix transposed, so both ends read a contiguous row."""
    cdef int64_t e, a, b, cs, cd
    cdef const double* m
    cdef double* t
    for e in range(E):
        cs = node_ptr[src[e] + 1] - node_ptr[src[e]]
        cd = node_ptr[dst[e] + 1] - node_ptr[dst[e]]
        m = &edge_cost[edge_ptr[e]]
        t = &edge_cost_t[edge_ptr[e]]
        for a in range(cs):
            for b in range(cd):
                t[b * cs + a] = m[a * cd + b]
