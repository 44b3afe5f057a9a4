# cython: language_level=3
"""Parameter-server update kernels over raw buffers (GIL released).

A server's step of plain SGD or Momentum, fused: the sum of the workers' gradients (in
worker order), its mean, the momentum and the weight update in one pass over memory,
written to any output buffer (the server writes the new weight into the first worker's
received gradient frame, so the weight it is still sending is never written). The
numpy reference, which is the optimizers' own sequence of rounded operations, is
:func:`dualmode.ps.optim.fused_update_reference`; the kernel is bit-identical to it.
"""
from libc.stdlib cimport free, malloc

import numpy as np

ctypedef fused floating_t:
    float
    double

cdef enum:
    BLOCK = 1024        # elements per block: the block's gradient sums stay in cache


cdef void _update(floating_t* out, const floating_t* w, const floating_t** g, Py_ssize_t n,
                  Py_ssize_t size, floating_t lr, bint mean, floating_t* v,
                  floating_t momentum) noexcept nogil:
    """out = w - lr * d with s = g[0] + ... + g[n-1] (in order), s /= n when `mean`,
    d = s, or with `v`: v = v * momentum + s and d = v. Every operation is rounded to
    the dtype, as the optimizers' numpy calls are. Block by block (several gradients
    are summed into a block kept in cache), each loop over plain local pointers so
    that the compiler vectorises it."""
    cdef Py_ssize_t lo = 0, m, j, k
    cdef floating_t s, t, nf = <floating_t>n
    cdef floating_t acc[BLOCK]
    cdef const floating_t* src
    cdef const floating_t* ga
    cdef const floating_t* gb
    cdef const floating_t* wp
    cdef floating_t* op
    cdef floating_t* vp
    while lo < size:
        m = BLOCK if lo + BLOCK < size else size - lo
        if n == 1:
            src = g[0] + lo
        else:
            ga = g[0] + lo
            gb = g[1] + lo
            for j in range(m):
                acc[j] = ga[j] + gb[j]
            for k in range(2, n):
                ga = g[k] + lo
                for j in range(m):
                    acc[j] = acc[j] + ga[j]
            if mean:
                for j in range(m):
                    acc[j] = acc[j] / nf
            src = acc
        op = out + lo
        wp = w + lo
        if v != NULL:
            vp = v + lo
            for j in range(m):
                s = vp[j] * momentum
                s = s + src[j]
                vp[j] = s
                t = lr * s
                op[j] = wp[j] - t
        else:
            for j in range(m):
                t = lr * src[j]
                op[j] = wp[j] - t
        lo += m


cdef bint _qualifies(a, dtype, shape, bint writable):
    return isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape and \
        a.flags.c_contiguous and (a.flags.writeable or not writable)


def sgd_update(out, w, grads, lr, bint mean, v=None, momentum=0.0):
    """One step of plain SGD (``v`` None) or Momentum (``v`` the momentum state, updated
    in place) on weight `w`, written into `out`: with ``s`` the sum of `grads` in order
    (divided by their count when `mean`), ``v = v * momentum + s`` and
    ``out = w - lr * v`` (without ``v``: ``out = w - lr * s``). `out` may be `w` or
    ``grads[0]`` (element by element, each is read before it is written).

    Every array is C-contiguous with the dtype (float32 or float64) and shape of `w`;
    `out` and `v` writable; `lr` and `momentum` are rounded to the dtype first. Returns
    False, doing nothing, when the arrays do not qualify (the caller takes the numpy
    form)."""
    if not isinstance(w, np.ndarray) or w.dtype not in (np.float32, np.float64):
        return False
    dtype, shape = w.dtype, w.shape
    grads = list(grads)
    if not grads or not _qualifies(w, dtype, shape, False) or \
            not _qualifies(out, dtype, shape, True) or \
            not all(_qualifies(g, dtype, shape, False) for g in grads) or \
            (v is not None and not _qualifies(v, dtype, shape, True)):
        return False
    flat_v = None if v is None else v.reshape(-1)
    if dtype == np.float32:
        _run[float](out.reshape(-1), w.reshape(-1), grads, lr, mean, flat_v, momentum)
    else:
        _run[double](out.reshape(-1), w.reshape(-1), grads, lr, mean, flat_v, momentum)
    return True


cdef int _run(floating_t[::1] out_, const floating_t[::1] w_, list grads, lr, bint mean,
             v, momentum) except -1:
    """Hold the buffers' views, gather the gradients' pointers, run the loop without
    the GIL."""
    cdef Py_ssize_t n = len(grads), size = out_.shape[0], k
    cdef list views = []
    cdef const floating_t[::1] gv
    cdef floating_t[::1] vv
    cdef floating_t* vp = NULL
    cdef floating_t a = <floating_t>float(lr)
    cdef floating_t m = <floating_t>float(momentum)
    cdef const floating_t** ptrs
    if size == 0:
        return 0
    ptrs = <const floating_t**>malloc(n * sizeof(floating_t*))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for k in range(n):
            gv = grads[k].reshape(-1)
            views.append(gv)
            ptrs[k] = &gv[0]
        if v is not None:
            vv = v
            vp = &vv[0]
        with nogil:
            _update(&out_[0], &w_[0], ptrs, n, size, a, mean, vp, m)
    finally:
        free(ptrs)
    return 0
