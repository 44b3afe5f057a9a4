# cython: language_level=3
"""Counter-based random numbers: Philox4x32-10 over typed memoryviews (GIL released).

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC 2011) maps a 128-bit counter and a 64-bit key to 128 random bits with ten
rounds of 32x32->64 multiplies and xors. Element ``i`` of a tensor uses the counter
``(lo32(i), hi32(i), 0, 0)`` and the tensor's key, so its value depends on nothing but
``(key, i)``: any block of a tensor is computed on its own and equals the same slice
of the whole tensor bit for bit.

Conversions (one counter per element, so each element uses only its own words):

* uniform, float64: ``(((x1 << 32) | x0) >> 11) * 2**-53`` in [0, 1);
* uniform, float32: ``(x0 >> 8) * 2**-24`` in [0, 1);
* both then ``low + (high - low) * u`` in double, rounded once to the output type;
* normal (Box-Muller on the element's two 53-bit uniforms):
  ``u1 = ((((x1 << 32) | x0) >> 11) + 1) * 2**-53`` in (0, 1],
  ``u2 = (((x3 << 32) | x2) >> 11) * 2**-53``,
  ``z = sqrt(-2 log u1) * cos(2 pi u2)``, then ``mean + std * z`` in double, rounded
  once to the output type (float32 values are the float64 values rounded).

`dualmode/_core/random_reference.py` holds a plain Python/numpy reference the tests
compare against (and the published Random123 known-answer vectors).
"""
from libc.math cimport cos, log, sqrt
from libc.stdint cimport int64_t, uint32_t, uint64_t

ctypedef fused floating_t:
    float
    double

cdef uint32_t _M0 = 0xD2511F53u, _M1 = 0xCD9E8D57u      # round multipliers
cdef uint32_t _W0 = 0x9E3779B9u, _W1 = 0xBB67AE85u      # key schedule (Weyl) increments
cdef double _TWO_PI = 6.283185307179586                  # 2 * math.pi
cdef double _INV53 = 1.0 / 9007199254740992.0            # 2 ** -53
cdef double _INV24 = 1.0 / 16777216.0                    # 2 ** -24

UNIFORM = 0
NORMAL = 1


cdef inline void _philox(uint32_t* x, uint32_t k0, uint32_t k1) noexcept nogil:
    """Ten Philox4x32 rounds on the counter words `x` in place under key (k0, k1)."""
    cdef uint64_t p0, p1
    cdef uint32_t x1, x3
    cdef int r
    for r in range(10):
        if r:
            k0 = <uint32_t>(k0 + _W0)
            k1 = <uint32_t>(k1 + _W1)
        p0 = <uint64_t>_M0 * x[0]
        p1 = <uint64_t>_M1 * x[2]
        x1 = x[1]
        x3 = x[3]
        x[0] = <uint32_t>(p1 >> 32) ^ x1 ^ k0
        x[1] = <uint32_t>p1
        x[2] = <uint32_t>(p0 >> 32) ^ x3 ^ k1
        x[3] = <uint32_t>p0


cdef inline double _draw(uint64_t i, uint32_t k0, uint32_t k1, int dist, double a, double b,
                         bint single) noexcept nogil:
    """The value of element `i`: U(a, b) (dist 0) or N(a, b^2) (dist 1), in double."""
    cdef uint32_t x[4]
    cdef double u1, u2
    x[0] = <uint32_t>i
    x[1] = <uint32_t>(i >> 32)
    x[2] = 0
    x[3] = 0
    _philox(x, k0, k1)
    if dist == 0:
        if single:
            u1 = (x[0] >> 8) * _INV24
        else:
            u1 = (((<uint64_t>x[1] << 32) | x[0]) >> 11) * _INV53
        return a + (b - a) * u1
    u1 = ((((<uint64_t>x[1] << 32) | x[0]) >> 11) + 1) * _INV53
    u2 = (((<uint64_t>x[3] << 32) | x[2]) >> 11) * _INV53
    return a + b * (sqrt(-2.0 * log(u1)) * cos(_TWO_PI * u2))


cdef void _fill_index(uint64_t key, const int64_t[::1] index, floating_t[::1] out, int dist,
                      double a, double b) noexcept nogil:
    """out[j] = value of element index[j]."""
    cdef Py_ssize_t j, n = out.shape[0]
    cdef uint32_t k0 = <uint32_t>key, k1 = <uint32_t>(key >> 32)
    cdef bint single = floating_t is float
    for j in range(n):
        out[j] = <floating_t>_draw(<uint64_t>index[j], k0, k1, dist, a, b, single)


cdef void _fill_blocks(uint64_t key, const int64_t[::1] strides, const int64_t[:, ::1] starts,
                       const int64_t[::1] steps, const int64_t[::1] bshape,
                       floating_t[::1] out, int dist, double a, double b,
                       int64_t* pos) noexcept nogil:
    """out (flat, C order) = the blocks at `starts` (one row each) of shape `bshape`,
    element (k, j) at flat index sum_d (starts[k, d] + j_d * steps[d]) * strides[d]."""
    cdef Py_ssize_t nd = bshape.shape[0], nb = starts.shape[0], size = 1, k, j, d
    cdef uint32_t k0 = <uint32_t>key, k1 = <uint32_t>(key >> 32)
    cdef bint single = floating_t is float
    cdef int64_t flat, base
    for d in range(nd):
        size *= bshape[d]
    if size == 0:
        return
    for k in range(nb):
        base = 0
        for d in range(nd):
            base += starts[k, d] * strides[d]
            pos[d] = 0
        flat = base
        for j in range(size):
            out[k * size + j] = <floating_t>_draw(<uint64_t>flat, k0, k1, dist, a, b, single)
            # odometer: advance the last dim, carrying into the earlier ones
            d = nd - 1
            while d >= 0:
                pos[d] += 1
                flat += steps[d] * strides[d]
                if pos[d] < bshape[d]:
                    break
                flat -= pos[d] * steps[d] * strides[d]
                pos[d] = 0
                d -= 1


def _check_dist(int dist):
    if dist != UNIFORM and dist != NORMAL:
        raise ValueError(f"philox: dist={dist!r} is not valid; expected 0 (uniform) or "
                         f"1 (normal)")


def fill_index(uint64_t key, const int64_t[::1] index, floating_t[::1] out, int dist=UNIFORM,
               double a=0.0, double b=1.0):
    """Fill `out` with the values of the elements `index` (flat, int64) of the tensor of
    `key`: U(a, b) for dist=UNIFORM, N(a, b^2) for dist=NORMAL (float32 or float64)."""
    _check_dist(dist)
    if index.shape[0] != out.shape[0]:
        raise ValueError(f"philox fill_index: index has {index.shape[0]} entries but out has "
                         f"{out.shape[0]}; they must match")
    with nogil:
        _fill_index(key, index, out, dist, a, b)


def fill_blocks(uint64_t key, const int64_t[::1] strides, const int64_t[:, ::1] starts,
                const int64_t[::1] steps, const int64_t[::1] bshape, floating_t[::1] out,
                int dist=UNIFORM, double a=0.0, double b=1.0):
    """Fill `out` (flat, C order, ``len(starts) * prod(bshape)`` values) with the blocks of
    the tensor of `key` whose element strides are `strides`: block k starts at
    ``starts[k]`` and takes ``bshape[d]`` elements ``steps[d]`` apart along dim d.
    Values as in :func:`fill_index`."""
    import numpy as np
    cdef Py_ssize_t nd = bshape.shape[0], size = 1, d
    _check_dist(dist)
    if strides.shape[0] != nd or steps.shape[0] != nd or starts.shape[1] != nd:
        raise ValueError(f"philox fill_blocks: strides ({strides.shape[0]}), steps "
                         f"({steps.shape[0]}), starts ({starts.shape[1]} columns) and bshape "
                         f"({nd}) must all have one entry per dim")
    for d in range(nd):
        if bshape[d] < 0:
            raise ValueError(f"philox fill_blocks: bshape[{d}]={bshape[d]} is negative")
        size *= bshape[d]
    if out.shape[0] != starts.shape[0] * size:
        raise ValueError(f"philox fill_blocks: out has {out.shape[0]} values, expected "
                         f"{starts.shape[0] * size} ({starts.shape[0]} blocks of {size})")
    cdef int64_t[::1] pos = np.zeros(max(nd, 1), np.int64)
    with nogil:
        _fill_blocks(key, strides, starts, steps, bshape, out, dist, a, b, &pos[0])


def philox4x32_10(uint64_t c01, uint64_t c23, uint64_t key):
    """The four 32-bit output words of Philox4x32-10 for counter words
    ``(lo32(c01), hi32(c01), lo32(c23), hi32(c23))`` and key ``(lo32(key), hi32(key))``
    (for known-answer tests)."""
    cdef uint32_t x[4]
    x[0] = <uint32_t>c01
    x[1] = <uint32_t>(c01 >> 32)
    x[2] = <uint32_t>c23
    x[3] = <uint32_t>(c23 >> 32)
    _philox(x, <uint32_t>key, <uint32_t>(key >> 32))
    return (x[0], x[1], x[2], x[3])
