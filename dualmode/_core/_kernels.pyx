# cython: language_level=3
"""Hot numeric kernels over typed memoryviews (GIL released).

Each kernel has a plain numpy reference in `dualmode/_core/reference.py` that the
tests compare it against.
"""
from libc.math cimport exp, log

ctypedef fused floating_t:
    float
    double

ctypedef fused index_t:
    int
    long long


cdef Py_ssize_t _sparse_xent(const floating_t[:, ::1] logits, const index_t[::1] labels,
                             floating_t[:, ::1] probs, floating_t[::1] loss) noexcept nogil:
    """Row-wise softmax into `probs` and -log softmax[label] into `loss`.

    Returns -1, or the first row whose label is out of range."""
    cdef Py_ssize_t n = logits.shape[0], c = logits.shape[1], i, j
    cdef double m, s, e
    cdef index_t lab
    for i in range(n):
        lab = labels[i]
        if lab < 0 or lab >= c:
            return i
        m = logits[i, 0]
        for j in range(1, c):
            if logits[i, j] > m:
                m = logits[i, j]
        s = 0.0
        for j in range(c):
            e = exp(logits[i, j] - m)
            probs[i, j] = <floating_t>e
            s += e
        for j in range(c):
            probs[i, j] = <floating_t>(probs[i, j] / s)
        loss[i] = <floating_t>(log(s) + m - logits[i, lab])
    return -1


def sparse_softmax_xent(logits, labels):
    """Per-row softmax cross-entropy with integer labels.

    Parameters
    ----------
    logits : float32/float64 array (N, C), C-contiguous
    labels : int32/int64 array (N,)

    Returns
    -------
    (loss (N,), probs (N, C)) in the dtype of `logits`.
    """
    import numpy as np
    logits = np.ascontiguousarray(logits)
    labels = np.ascontiguousarray(labels)
    if logits.ndim != 2 or labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"sparse_softmax_xent: logits have shape {logits.shape} and labels "
                         f"shape {labels.shape}; expected logits (N, C) and labels (N,)")
    if labels.dtype.kind not in "iu":
        raise TypeError(f"sparse_softmax_xent: labels have dtype {labels.dtype}; expected an "
                        f"integer dtype")
    if labels.dtype == np.int32:
        labels_c = labels
    else:
        labels_c = labels.astype(np.int64)    # huge uint64 wrap negative: out of range
    n, c = logits.shape
    probs = np.empty((n, c), dtype=logits.dtype)
    loss = np.empty((n,), dtype=logits.dtype)
    cdef Py_ssize_t bad
    if logits.dtype == np.float32:
        if labels_c.dtype == np.int32:
            bad = _run_f_i(logits, labels_c, probs, loss)
        else:
            bad = _run_f_l(logits, labels_c, probs, loss)
    elif logits.dtype == np.float64:
        if labels_c.dtype == np.int32:
            bad = _run_d_i(logits, labels_c, probs, loss)
        else:
            bad = _run_d_l(logits, labels_c, probs, loss)
    else:
        raise TypeError(f"sparse_softmax_xent: logits dtype {logits.dtype} is not "
                        f"supported; expected float32 or float64")
    if bad >= 0:
        raise ValueError(f"SparseSoftmaxCrossEntropyWithLogits: label {labels[bad]} at "
                         f"row {bad} is out of range; labels must be in [0, {c})")
    return loss, probs


cdef Py_ssize_t _run_f_i(const float[:, ::1] x, const int[::1] y, float[:, ::1] p,
                         float[::1] l):
    with nogil:
        return _sparse_xent(x, y, p, l)


cdef Py_ssize_t _run_f_l(const float[:, ::1] x, const long long[::1] y, float[:, ::1] p,
                         float[::1] l):
    with nogil:
        return _sparse_xent(x, y, p, l)


cdef Py_ssize_t _run_d_i(const double[:, ::1] x, const int[::1] y, double[:, ::1] p,
                         double[::1] l):
    with nogil:
        return _sparse_xent(x, y, p, l)


cdef Py_ssize_t _run_d_l(const double[:, ::1] x, const long long[::1] y,
                         double[:, ::1] p, double[::1] l):
    with nogil:
        return _sparse_xent(x, y, p, l)


cdef void _sub_scaled_loop(floating_t[::1] w, const floating_t[::1] g,
                           floating_t a) noexcept nogil:
    cdef Py_ssize_t i
    cdef floating_t t
    for i in range(w.shape[0]):
        t = a * g[i]                  # rounded to the dtype, as numpy's a * g
        w[i] = w[i] - t


cdef void _sub_scaled_replicas_loop(floating_t[:, ::1] w, const floating_t[::1] g,
                                    floating_t a) noexcept nogil:
    # chunk by chunk of g, every replica row of w: g is read from memory once
    cdef Py_ssize_t n = g.shape[0], r, i, start, stop
    cdef Py_ssize_t chunk = 4096
    cdef floating_t t
    start = 0
    while start < n:
        stop = start + chunk if start + chunk < n else n
        for r in range(w.shape[0]):
            for i in range(start, stop):
                t = a * g[i]
                w[r, i] = w[r, i] - t
        start = stop


cdef void _sub_scaled(floating_t[:, ::1] w, const floating_t[::1] g, floating_t a):
    with nogil:
        if w.shape[0] == 1:
            _sub_scaled_loop(w[0], g, a)
        else:
            _sub_scaled_replicas_loop(w, g, a)


def sub_scaled(w, g, a):
    """``w -= a * g`` in place, in one pass and without a temporary (the optimizers'
    update). `w` and `g` are C-contiguous arrays of one dtype (float32 or float64), `w`
    writable, of one shape — or `g` of `w`'s trailing shape (leading size-1 axes
    allowed), broadcast over `w`'s leading axes: a sharded weight's replicas updated
    from one gradient block, which is read once. `a` is rounded to their dtype first,
    as numpy does with a Python float. Returns False (doing nothing) when the arrays do
    not qualify, so the caller takes the numpy form."""
    import numpy as np
    if not (isinstance(w, np.ndarray) and isinstance(g, np.ndarray)) or \
            w.dtype != g.dtype or w.dtype not in (np.float32, np.float64) \
            or not w.flags.c_contiguous or not g.flags.c_contiguous or not w.flags.writeable:
        return False
    if w.shape != g.shape:
        inner = g.shape
        while inner and inner[0] == 1:
            inner = inner[1:]
        if len(inner) > w.ndim or w.shape[w.ndim - len(inner):] != inner or g.size == 0:
            return False
    rows = w.size // g.size if g.size else 1
    if w.dtype == np.float32:
        _sub_scaled[float](w.reshape(rows, -1), g.reshape(-1), <float>float(a))
    else:
        _sub_scaled[double](w.reshape(rows, -1), g.reshape(-1), <double>float(a))
    return True
