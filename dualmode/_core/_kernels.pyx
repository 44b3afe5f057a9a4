# cython: language_level=3
"""Hot numeric kernels over typed memoryviews (GIL released).

Each kernel has a plain numpy reference in `dualmode/_core/reference.py` that the
tests compare it against.
"""
from libc.math cimport log, sqrt

import numpy as np

cimport numpy as cnp

cnp.import_array()

ctypedef fused floating_t:
    float
    double

ctypedef fused index_t:
    int
    long long


cdef inline double _row_sum(const floating_t* p, Py_ssize_t n) noexcept nogil:
    """The sum of p[0:n] in float64 as four partial sums (independent adds, so they
    overlap), added in a fixed order: a row's sum does not depend on where it lies."""
    cdef Py_ssize_t n4 = n - n % 4, j
    cdef double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0
    for j in range(0, n4, 4):
        s0 += p[j]
        s1 += p[j + 1]
        s2 += p[j + 2]
        s3 += p[j + 3]
    for j in range(n4, n):
        s0 += p[j]
    return (s0 + s1) + (s2 + s3)


cdef Py_ssize_t _xent_shift(const floating_t[:, ::1] logits, const index_t[::1] labels,
                            floating_t[:, ::1] shifted, double[::1] row_max) noexcept nogil:
    """Each row's max into `row_max` and the row minus it into `shifted` (numpy then
    takes the exponentials, vectorised). Returns -1, or the first row whose label is out
    of range."""
    cdef Py_ssize_t n = logits.shape[0], c = logits.shape[1], i, j
    cdef floating_t m
    cdef index_t lab
    for i in range(n):
        lab = labels[i]
        if lab < 0 or lab >= c:
            return i
        m = logits[i, 0]
        for j in range(1, c):
            if logits[i, j] > m:
                m = logits[i, j]
        for j in range(c):
            shifted[i, j] = logits[i, j] - m
        row_max[i] = m
    return -1


cdef void _xent_finish(const floating_t[:, ::1] logits, const index_t[::1] labels,
                       floating_t[:, ::1] probs, const double[::1] row_max,
                       floating_t[::1] loss) noexcept nogil:
    """`probs` holding exp(logit - max) per row: its sum in float64 (:func:`_row_sum`),
    the row scaled to the softmax, and -log softmax[label] = log(sum) + max - logit."""
    cdef Py_ssize_t n = logits.shape[0], c = logits.shape[1], i, j
    cdef double s, r
    cdef floating_t* p
    for i in range(n):
        p = &probs[i, 0]
        s = _row_sum(p, c)
        r = 1.0 / s
        for j in range(c):
            p[j] = <floating_t>(p[j] * r)
        loss[i] = <floating_t>(log(s) + row_max[i] - logits[i, labels[i]])


def sparse_softmax_xent(logits, labels):
    """Per-row softmax cross-entropy with integer labels: each row shifted by its max,
    numpy's vectorised exp in place, then each row's sum in float64 scales it to the
    softmax and gives the loss log(sum) + max - logit[label].

    Parameters
    ----------
    logits : float32/float64 array (N, C), C-contiguous
    labels : int32/int64 array (N,)

    Returns
    -------
    (loss (N,), probs (N, C)) in the dtype of `logits`.
    """
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
            bad = _run_xent[float, int](logits, labels_c, probs, loss, probs)
        else:
            bad = _run_xent[float, 'long long'](logits, labels_c, probs, loss, probs)
    elif logits.dtype == np.float64:
        if labels_c.dtype == np.int32:
            bad = _run_xent[double, int](logits, labels_c, probs, loss, probs)
        else:
            bad = _run_xent[double, 'long long'](logits, labels_c, probs, loss, probs)
    else:
        raise TypeError(f"sparse_softmax_xent: logits dtype {logits.dtype} is not "
                        f"supported; expected float32 or float64")
    if bad >= 0:
        raise ValueError(f"SparseSoftmaxCrossEntropyWithLogits: label {labels[bad]} at "
                         f"row {bad} is out of range; labels must be in [0, {c})")
    return loss, probs


cdef Py_ssize_t _run_xent(const floating_t[:, ::1] x, const index_t[::1] y,
                          floating_t[:, ::1] p, floating_t[::1] l, object probs):
    cdef Py_ssize_t bad
    row_max = np.empty(x.shape[0], np.float64)
    cdef double[::1] m = row_max
    with nogil:
        bad = _xent_shift(x, y, p, m)
    if bad >= 0 or x.shape[1] == 0:
        return bad
    np.exp(probs, out=probs)                # numpy's vectorised exp, in place
    with nogil:
        _xent_finish(x, y, p, m, l)
    return -1


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


# ----------------------------------------------------------------------------
# elementwise gradients from an op's output: one pass, no temporaries
# ----------------------------------------------------------------------------
# Each reads the forward output y and the incoming gradient dy (one shape and
# dtype) and writes the input gradient with numpy's rounding of the same formula:
#   ReluGrad     dy * (y > 0)          (the bool as 0/1 of the dtype: -0 and NaN as numpy)
#   TanhGrad     dy * (1 - y * y)
#   SigmoidGrad  (dy * y) * (1 - y)
# over "rows": one row for C-contiguous arrays, else one per index of the leading axis
# when each leading slice is C-contiguous (a device stack, possibly stride 0 along it).

cdef int _F32 = np.dtype(np.float32).num
cdef int _F64 = np.dtype(np.float64).num
cdef int _I32 = np.dtype(np.int32).num
cdef int _I64 = np.dtype(np.int64).num
cdef int _LL = np.dtype(np.longlong).num

cdef int _RELU = 0
cdef int _TANH = 1
cdef int _SIGMOID = 2


cdef void _grad_rows(int kind, const floating_t* y, Py_ssize_t y_step,
                     const floating_t* dy, Py_ssize_t dy_step, floating_t* out,
                     Py_ssize_t rows, Py_ssize_t n) noexcept nogil:
    # row r of y starts y_step bytes after row r - 1 (0: one row read for every output
    # row), likewise dy; the n elements of a row are contiguous; out is C-contiguous
    cdef Py_ssize_t r, i
    cdef const floating_t* yr
    cdef const floating_t* dr
    cdef floating_t* o
    cdef floating_t one = 1, zero = 0, t, u      # typed: every step rounds as numpy's
    for r in range(rows):
        yr = <const floating_t*>(<const char*>y + r * y_step)
        dr = <const floating_t*>(<const char*>dy + r * dy_step)
        o = out + r * n
        if kind == _RELU:
            for i in range(n):
                o[i] = dr[i] * (one if yr[i] > zero else zero)
        elif kind == _TANH:
            for i in range(n):
                t = yr[i] * yr[i]
                u = one - t
                o[i] = dr[i] * u
        else:
            for i in range(n):
                t = dr[i] * yr[i]
                u = one - yr[i]
                o[i] = t * u


cdef bint _inner_contiguous(cnp.ndarray a, int first):
    """Are dims first.. of `a` laid out C-contiguously (size-1 dims ignored)?"""
    cdef Py_ssize_t expect = cnp.PyArray_ITEMSIZE(a)
    cdef int d
    for d in range(cnp.PyArray_NDIM(a) - 1, first - 1, -1):
        if cnp.PyArray_DIM(a, d) != 1:
            if cnp.PyArray_STRIDE(a, d) != expect:
                return False
            expect *= cnp.PyArray_DIM(a, d)
    return True


cdef object _output_grad(int kind, object y, object dy):
    """The gradient array, or None when the inputs do not qualify (numpy's form then)."""
    if type(y) is not np.ndarray or type(dy) is not np.ndarray:
        return None
    cdef cnp.ndarray ya = <cnp.ndarray>y, da = <cnp.ndarray>dy
    cdef int num = cnp.PyArray_TYPE(ya)
    if (num != _F32 and num != _F64) or cnp.PyArray_TYPE(da) != num:
        return None
    cdef int nd = cnp.PyArray_NDIM(ya)
    if cnp.PyArray_NDIM(da) != nd or y.shape != dy.shape:
        return None
    cdef Py_ssize_t size = cnp.PyArray_SIZE(ya), rows = 1, y_step = 0, d_step = 0
    if size == 0:
        return np.empty(y.shape, y.dtype)
    if not (_inner_contiguous(ya, 0) and _inner_contiguous(da, 0)):
        # a stack: rows along the leading axis, each contiguous
        if nd < 2 or not (_inner_contiguous(ya, 1) and _inner_contiguous(da, 1)):
            return None
        rows = cnp.PyArray_DIM(ya, 0)
        y_step = cnp.PyArray_STRIDE(ya, 0)
        d_step = cnp.PyArray_STRIDE(da, 0)
    out = np.empty(y.shape, y.dtype)
    cdef void* yp = cnp.PyArray_DATA(ya)
    cdef void* dp = cnp.PyArray_DATA(da)
    cdef void* op = cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef Py_ssize_t n = size // rows
    with nogil:
        if num == _F32:
            _grad_rows(kind, <const float*>yp, y_step, <const float*>dp, d_step,
                       <float*>op, rows, n)
        else:
            _grad_rows(kind, <const double*>yp, y_step, <const double*>dp, d_step,
                       <double*>op, rows, n)
    return out


def relu_grad(y, dy):
    """``dy * (y > 0)`` in one pass (ReLU's gradient from its output `y`), or None when
    `y` and `dy` are not float32/float64 arrays of one shape and dtype, C-contiguous or
    stacks of C-contiguous slices along their leading axis (the caller uses numpy)."""
    return _output_grad(_RELU, y, dy)


def tanh_grad(y, dy):
    """``dy * (1 - y * y)`` in one pass (Tanh's gradient from its output), or None
    (as :func:`relu_grad`)."""
    return _output_grad(_TANH, y, dy)


def sigmoid_grad(y, dy):
    """``dy * y * (1 - y)`` in one pass (Sigmoid's gradient from its output), or None
    (as :func:`relu_grad`)."""
    return _output_grad(_SIGMOID, y, dy)


# ----------------------------------------------------------------------------
# sparse softmax cross-entropy gradient
# ----------------------------------------------------------------------------
cdef Py_ssize_t _xent_grad(const floating_t[:, ::1] probs, const index_t[::1] labels,
                           const floating_t[:] g, floating_t[:, ::1] out) noexcept nogil:
    """out = probs * g[:, None], then out[i, labels[i]] -= g[i]; returns -1, or the
    first row whose label is outside [0, C) (nothing is promised about `out` then)."""
    cdef Py_ssize_t n = probs.shape[0], c = probs.shape[1], i, j
    cdef index_t lab
    cdef floating_t gi
    for i in range(n):
        lab = labels[i]
        if lab < 0 or lab >= c:
            return i
        gi = g[i]
        for j in range(c):
            out[i, j] = probs[i, j] * gi
        out[i, lab] = out[i, lab] - gi
    return -1


cdef Py_ssize_t _xg_f_i(const float[:, ::1] p, const int[::1] y, const float[:] g,
                        float[:, ::1] o):
    with nogil:
        return _xent_grad(p, y, g, o)


cdef Py_ssize_t _xg_f_l(const float[:, ::1] p, const long long[::1] y, const float[:] g,
                        float[:, ::1] o):
    with nogil:
        return _xent_grad(p, y, g, o)


cdef Py_ssize_t _xg_d_i(const double[:, ::1] p, const int[::1] y, const double[:] g,
                        double[:, ::1] o):
    with nogil:
        return _xent_grad(p, y, g, o)


cdef Py_ssize_t _xg_d_l(const double[:, ::1] p, const long long[::1] y, const double[:] g,
                        double[:, ::1] o):
    with nogil:
        return _xent_grad(p, y, g, o)


def sparse_xent_grad(probs, labels, g):
    """The gradient of per-row softmax cross-entropy with integer labels, given the
    softmax `probs` (N, C) and the loss gradient `g` (N,): ``probs * g[:, None]`` with
    ``g`` subtracted at each row's label, in one pass. None when the inputs do not
    qualify (the caller uses numpy): `probs` C-contiguous float32/float64, `g` 1-D of
    its dtype (any stride), `labels` C-contiguous int32/int64 of N, every label in
    [0, C)."""
    if type(probs) is not np.ndarray or type(labels) is not np.ndarray \
            or type(g) is not np.ndarray:
        return None
    dt = probs.dtype
    if (dt.num != _F32 and dt.num != _F64) or g.dtype != dt \
            or probs.ndim != 2 or g.ndim != 1 or labels.ndim != 1 \
            or not probs.flags.c_contiguous or not labels.flags.c_contiguous:
        return None
    n = probs.shape[0]
    if g.shape[0] != n or labels.shape[0] != n:
        return None
    ln = labels.dtype.num
    if ln != _I32 and ln != _I64 and ln != _LL:
        return None
    out = np.empty(probs.shape, dt)
    cdef Py_ssize_t bad
    if dt.num == _F32:
        bad = _xg_f_i(probs, labels, g, out) if ln == _I32 else \
            _xg_f_l(probs, labels, g, out)
    else:
        bad = _xg_d_i(probs, labels, g, out) if ln == _I32 else \
            _xg_d_l(probs, labels, g, out)
    return None if bad >= 0 else out



# ----------------------------------------------------------------------------
# LayerNorm over the last axis of (D, R, N) stacks: the statistics of each row in
# float64 (a row is read from cache after its first pass). Four partial sums per
# reduction break the chain of dependent adds; the order is fixed, so a row gives the
# same numbers whichever device holds it and however many rows come with it.
# ----------------------------------------------------------------------------
cdef void _ln_forward(const floating_t[:, :, ::1] x, const floating_t[:, ::1] g,
                      const floating_t[:, ::1] b, double eps, floating_t[:, :, ::1] y,
                      floating_t[:, ::1] mean, floating_t[:, ::1] var) noexcept nogil:
    cdef Py_ssize_t nd = x.shape[0], nr = x.shape[1], n = x.shape[2], d, r, j
    cdef Py_ssize_t n4 = n - n % 4
    cdef const floating_t* xr
    cdef const floating_t* gr
    cdef const floating_t* br
    cdef floating_t* yr
    cdef double s0, s1, s2, s3, mu, v, rs, t0, t1, t2, t3
    for d in range(nd):
        gr = &g[d, 0]
        br = &b[d, 0]
        for r in range(nr):
            xr = &x[d, r, 0]
            yr = &y[d, r, 0]
            mu = _row_sum(xr, n) / n
            s0 = s1 = s2 = s3 = 0.0
            for j in range(0, n4, 4):
                t0 = xr[j] - mu
                t1 = xr[j + 1] - mu
                t2 = xr[j + 2] - mu
                t3 = xr[j + 3] - mu
                s0 += t0 * t0
                s1 += t1 * t1
                s2 += t2 * t2
                s3 += t3 * t3
            for j in range(n4, n):
                t0 = xr[j] - mu
                s0 += t0 * t0
            v = ((s0 + s1) + (s2 + s3)) / n
            rs = 1.0 / sqrt(v + eps)
            for j in range(n):
                yr[j] = <floating_t>(((xr[j] - mu) * rs) * gr[j] + br[j])
            mean[d, r] = <floating_t>mu
            var[d, r] = <floating_t>v


cdef void _ln_backward(const floating_t[:, :, ::1] x, const floating_t[:, :, ::1] dy,
                       const floating_t[:, ::1] mean, const floating_t[:, ::1] var,
                       const floating_t[:, ::1] g, double eps, floating_t[:, :, ::1] dx,
                       double[:, ::1] dg, double[:, ::1] db) noexcept nogil:
    cdef Py_ssize_t nd = x.shape[0], nr = x.shape[1], n = x.shape[2], d, r, j
    cdef Py_ssize_t n2 = n - n % 2
    cdef const floating_t* xr
    cdef const floating_t* dyr
    cdef const floating_t* gr
    cdef floating_t* dxr
    cdef double* dgr
    cdef double* dbr
    cdef double mu, rs, a0, a1, c0, c1, h0, h1, e0, e1, ma, mc
    for d in range(nd):
        gr = &g[d, 0]
        dgr = &dg[d, 0]
        dbr = &db[d, 0]
        for r in range(nr):
            xr = &x[d, r, 0]
            dyr = &dy[d, r, 0]
            dxr = &dx[d, r, 0]
            mu = mean[d, r]
            rs = <double>var[d, r] + eps
            # a row with nothing to normalise (epsilon 0, every element its mean: the
            # zero rows padding a split that does not divide) passes no gradient
            rs = 1.0 / sqrt(rs) if rs > 0.0 else 0.0
            a0 = a1 = c0 = c1 = 0.0
            for j in range(0, n2, 2):
                h0 = (xr[j] - mu) * rs
                h1 = (xr[j + 1] - mu) * rs
                e0 = <double>dyr[j] * gr[j]
                e1 = <double>dyr[j + 1] * gr[j + 1]
                a0 += e0
                a1 += e1
                c0 += e0 * h0
                c1 += e1 * h1
                dgr[j] += dyr[j] * h0
                dgr[j + 1] += dyr[j + 1] * h1
                dbr[j] += dyr[j]
                dbr[j + 1] += dyr[j + 1]
            for j in range(n2, n):
                h0 = (xr[j] - mu) * rs
                e0 = <double>dyr[j] * gr[j]
                a0 += e0
                c0 += e0 * h0
                dgr[j] += dyr[j] * h0
                dbr[j] += dyr[j]
            ma = (a0 + a1) / n
            mc = (c0 + c1) / n
            for j in range(n):
                h0 = (xr[j] - mu) * rs
                dxr[j] = <floating_t>(rs * ((<double>dyr[j] * gr[j] - ma) - h0 * mc))


cdef bint _ln_qualifies(x, params):
    if type(x) is not np.ndarray or x.ndim != 3 or x.dtype.num not in (_F32, _F64):
        return False
    for p in params:
        if type(p) is not np.ndarray or p.dtype != x.dtype or p.ndim != 2 \
                or p.shape[0] != x.shape[0]:
            return False
    return True


def layer_norm(x, gamma, beta, double eps):
    """LayerNorm of the rows (last axis) of a stack `x` (D, R, N): ``(y, mean,
    variance)`` with y (D, R, N) and the statistics (D, R), in x's dtype; `gamma` and
    `beta` (D, N) per device. The statistics are accumulated in float64 and y computed
    in float64 from them. None when the inputs do not qualify (float32/float64 arrays of
    one dtype, those shapes): the caller uses numpy."""
    if not _ln_qualifies(x, (gamma, beta)) or gamma.shape[1] != x.shape[2] \
            or beta.shape[1] != x.shape[2]:
        return None
    x, gamma, beta = (np.ascontiguousarray(a) for a in (x, gamma, beta))
    nd, nr, n = x.shape[0], x.shape[1], x.shape[2]
    y = np.empty((nd, nr, n), x.dtype)
    mean = np.empty((nd, nr), x.dtype)
    var = np.empty((nd, nr), x.dtype)
    if nd * nr * n == 0:
        mean[...] = np.nan
        var[...] = np.nan
        return y, mean, var
    if x.dtype.num == _F32:
        _ln_f32(x, gamma, beta, eps, y, mean, var)
    else:
        _ln_f64(x, gamma, beta, eps, y, mean, var)
    return y, mean, var


cdef void _ln_f32(const float[:, :, ::1] x, const float[:, ::1] g, const float[:, ::1] b,
                  double eps, float[:, :, ::1] y, float[:, ::1] m, float[:, ::1] v):
    with nogil:
        _ln_forward(x, g, b, eps, y, m, v)


cdef void _ln_f64(const double[:, :, ::1] x, const double[:, ::1] g,
                  const double[:, ::1] b, double eps, double[:, :, ::1] y,
                  double[:, ::1] m, double[:, ::1] v):
    with nogil:
        _ln_forward(x, g, b, eps, y, m, v)


def layer_norm_grad(x, dy, mean, var, gamma, double eps):
    """The gradients of :func:`layer_norm` for the output gradient `dy` (D, R, N), from
    x (D, R, N), its statistics `mean` and `var` (D, R) and `gamma` (D, N): ``(dx,
    dgamma, dbeta)`` with dx = rstd (d - mean(d) - xhat mean(d xhat)), d = dy gamma,
    xhat = (x - mean) rstd, rstd = 1 / sqrt(var + eps), and per device the sums over its
    rows dgamma = sum(dy xhat), dbeta = sum(dy) (D, N), accumulated in float64 and given
    in x's dtype. None when the inputs do not qualify (as :func:`layer_norm`)."""
    if not _ln_qualifies(x, (mean, var, gamma)) or type(dy) is not np.ndarray \
            or dy.dtype != x.dtype or dy.shape != x.shape \
            or mean.shape[1] != x.shape[1] or var.shape[1] != x.shape[1] \
            or gamma.shape[1] != x.shape[2]:
        return None
    x, dy, mean, var, gamma = (np.ascontiguousarray(a) for a in (x, dy, mean, var, gamma))
    nd, nr, n = x.shape[0], x.shape[1], x.shape[2]
    dx = np.empty((nd, nr, n), x.dtype)
    dg = np.zeros((nd, n), np.float64)
    db = np.zeros((nd, n), np.float64)
    if nd * nr * n:
        if x.dtype.num == _F32:
            _lng_f32(x, dy, mean, var, gamma, eps, dx, dg, db)
        else:
            _lng_f64(x, dy, mean, var, gamma, eps, dx, dg, db)
    return dx, dg.astype(x.dtype, copy=False), db.astype(x.dtype, copy=False)


cdef void _lng_f32(const float[:, :, ::1] x, const float[:, :, ::1] dy,
                   const float[:, ::1] m, const float[:, ::1] v, const float[:, ::1] g,
                   double eps, float[:, :, ::1] dx, double[:, ::1] dg, double[:, ::1] db):
    with nogil:
        _ln_backward(x, dy, m, v, g, eps, dx, dg, db)


cdef void _lng_f64(const double[:, :, ::1] x, const double[:, :, ::1] dy,
                   const double[:, ::1] m, const double[:, ::1] v,
                   const double[:, ::1] g, double eps, double[:, :, ::1] dx,
                   double[:, ::1] dg, double[:, ::1] db):
    with nogil:
        _ln_backward(x, dy, m, v, g, eps, dx, dg, db)
