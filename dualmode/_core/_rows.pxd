# cython: language_level=3
"""The row reduction of the simulated collectives, for the modules that cimport it.

``reduce_rows(x, out, n, m, op)``: ``out[j] = x[0, j] (op) x[1, j] (op) ... x[n-1, j]``,
added in row order for every column, blocked so the output stays in cache. Each
column's result depends on that column only, so reducing stacks one by one or packed
side by side gives the same bits. ``_comm`` (the unfused collectives and the ring steps)
and ``_fusion`` (the fused AllReduce) both cimport it; its plain numpy reference is
``comm_reference.reduce_rows``.
"""
from libc.string cimport memcpy

ctypedef float f32
ctypedef double f64
ctypedef int i32
ctypedef long long i64

ctypedef fused rows_t:
    f32
    f64
    i32
    i64

cdef enum:
    ROWS_SUM = 0
    ROWS_MAX = 1
    ROWS_MIN = 2
    ROWS_PROD = 3

cdef enum:
    # columns per block: 16 KiB of float32 output stays in L1 while the rows stream past
    ROWS_BLOCK = 4096


cdef inline void combine_rows(rows_t* dst, const rows_t* src, Py_ssize_t m,
                              int op) noexcept nogil:
    """dst[i] = dst[i] (op) src[i] for i < m; max/min propagate NaN as numpy does."""
    cdef Py_ssize_t i
    cdef rows_t v, d
    # unconditional stores and `|` instead of `or` keep the loops branch-free, so the
    # compiler vectorises them
    if op == ROWS_SUM:
        for i in range(m):
            dst[i] = dst[i] + src[i]
    elif op == ROWS_PROD:
        for i in range(m):
            dst[i] = dst[i] * src[i]
    elif op == ROWS_MAX:
        for i in range(m):
            v = src[i]
            d = dst[i]
            dst[i] = v if (v > d) | (v != v) else d
    else:
        for i in range(m):
            v = src[i]
            d = dst[i]
            dst[i] = v if (v < d) | (v != v) else d


cdef inline void reduce_rows(const rows_t* x, rows_t* out, Py_ssize_t n, Py_ssize_t m,
                             int op) noexcept nogil:
    """out[j] = (op) over i of x[i, j], for x row-major (n, m), n >= 1."""
    cdef Py_ssize_t j0 = 0, b, i
    while j0 < m:
        b = m - j0
        if b > ROWS_BLOCK:
            b = ROWS_BLOCK
        memcpy(out + j0, x + j0, b * sizeof(rows_t))
        for i in range(1, n):
            combine_rows(out + j0, x + i * m + j0, b, op)
        j0 += b
