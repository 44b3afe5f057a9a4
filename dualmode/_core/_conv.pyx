# cython: language_level=3
"""Data-movement kernels of the convolutions over typed memoryviews (GIL released).

The convolutions run their GEMMs in a channels-last layout: an image batch (B, C, H, W)
is first copied, zero-bordered, into (B, Hp, Wp, C); im2col then copies whole
channel runs (one ``memcpy`` per kernel tap) into columns ordered
``(group, kh, kw, C/group)``; col2im adds such columns back onto a channels-last grid;
and the result comes back to (B, C, H, W) in one more pass. Max pooling and its gradient
run over (B, H, W) planes, one window maximum per output pixel; BatchNorm's per-channel
float64 sums and its per-channel affine map take one pass each. Each kernel has a numpy
reference in :mod:`dualmode.ops._conv` (``*_numpy``) that the tests compare it against
and that float16 arrays take.

The ``def`` entries check shapes, dtypes and window geometry while holding the GIL and
raise ValueError/TypeError naming the kernel and the parameter; the ``cdef ...
noexcept nogil`` kernels trust them.
"""
import numpy as np

from libc.math cimport INFINITY
from libc.string cimport memcpy, memset

ctypedef fused real_t:
    float
    double


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------
cdef void _to_last(const real_t[:, :, :, ::1] x, real_t[:, :, :, ::1] out,
                   Py_ssize_t top, Py_ssize_t left) noexcept nogil:
    """out[b, top + h, left + w, c] = x[b, c, h, w]; every other pixel of out = 0."""
    cdef Py_ssize_t nb = x.shape[0], nc = x.shape[1], nh = x.shape[2], nw = x.shape[3]
    cdef Py_ssize_t hp = out.shape[1], wp = out.shape[2], plane = nh * nw
    cdef Py_ssize_t b, c, h, w
    cdef real_t* row
    cdef const real_t* src
    for b in range(nb):
        if top:
            memset(&out[b, 0, 0, 0], 0, top * wp * nc * sizeof(real_t))
        if hp > top + nh:
            memset(&out[b, top + nh, 0, 0], 0, (hp - top - nh) * wp * nc * sizeof(real_t))
        for h in range(nh):
            row = &out[b, top + h, 0, 0]
            if left:
                memset(row, 0, left * nc * sizeof(real_t))
            if wp > left + nw:
                memset(row + (left + nw) * nc, 0, (wp - left - nw) * nc * sizeof(real_t))
            row += left * nc
            src = &x[b, 0, h, 0]
            for w in range(nw):
                for c in range(nc):
                    row[w * nc + c] = src[c * plane + w]


cdef void _to_first(const real_t[:, :, :, ::1] xh, real_t[:, :, :, ::1] out,
                    Py_ssize_t top, Py_ssize_t left) noexcept nogil:
    """out[b, c, h, w] = xh[b, top + h, left + w, c]."""
    cdef Py_ssize_t nb = out.shape[0], nc = out.shape[1], nh = out.shape[2]
    cdef Py_ssize_t nw = out.shape[3]
    cdef Py_ssize_t b, c, h, w
    cdef const real_t* row
    cdef real_t* dst
    for b in range(nb):
        for h in range(nh):
            row = &xh[b, top + h, left, 0]
            for c in range(nc):
                dst = &out[b, c, h, 0]
                for w in range(nw):
                    dst[w] = row[w * nc + c]


cdef void _im2col(const real_t[:, :, :, ::1] xh, real_t[:, ::1] cols, Py_ssize_t kh,
                  Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t dh,
                  Py_ssize_t dw, Py_ssize_t ho, Py_ssize_t wo,
                  Py_ssize_t group) noexcept nogil:
    """cols[(b, oh, ow), (g, i, j, c)] = xh[b, oh*sh + i*dh, ow*sw + j*dw, g*Cg + c]."""
    cdef Py_ssize_t nb = xh.shape[0], nc = xh.shape[3], cg = nc // group
    cdef Py_ssize_t b, oh, ow, g, i, j, p = 0
    cdef size_t run = cg * sizeof(real_t)
    cdef bint rows_run = group == 1 and dw == 1
    cdef real_t* dst
    for b in range(nb):
        for oh in range(ho):
            for ow in range(wo):
                dst = &cols[p, 0]
                if rows_run:       # one group, taps of a row adjacent: one run per row
                    for i in range(kh):
                        memcpy(dst, &xh[b, oh * sh + i * dh, ow * sw, 0], run * kw)
                        dst += kw * nc
                else:
                    for g in range(group):
                        for i in range(kh):
                            for j in range(kw):
                                memcpy(dst, &xh[b, oh * sh + i * dh, ow * sw + j * dw,
                                                g * cg], run)
                                dst += cg
                p += 1


cdef void _col2im(const real_t[:, ::1] cols, real_t[:, :, :, ::1] out, Py_ssize_t kh,
                  Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t dh,
                  Py_ssize_t dw, Py_ssize_t ho, Py_ssize_t wo,
                  Py_ssize_t group) noexcept nogil:
    """out[b, oh*sh + i*dh, ow*sw + j*dw, g*Cg + c] += cols[(b, oh, ow), (g, i, j, c)]
    (out zeroed first)."""
    cdef Py_ssize_t nb = out.shape[0], nc = out.shape[3], cg = nc // group
    cdef Py_ssize_t b, oh, ow, g, i, j, c, p = 0
    cdef const real_t* src
    cdef real_t* dst
    memset(&out[0, 0, 0, 0], 0, out.shape[0] * out.shape[1] * out.shape[2] * nc
           * sizeof(real_t))
    for b in range(nb):
        for oh in range(ho):
            for ow in range(wo):
                src = &cols[p, 0]
                for g in range(group):
                    for i in range(kh):
                        for j in range(kw):
                            dst = &out[b, oh * sh + i * dh, ow * sw + j * dw, g * cg]
                            for c in range(cg):
                                dst[c] += src[c]
                            src += cg
                p += 1


# ---------------------------------------------------------------------------
# typed runners (one per fused specialisation, GIL released)
# ---------------------------------------------------------------------------
cdef int _run_to_last(const real_t[:, :, :, ::1] x, real_t[:, :, :, ::1] out,
                      Py_ssize_t top, Py_ssize_t left) except -1:
    with nogil:
        _to_last(x, out, top, left)
    return 0


cdef int _run_to_first(const real_t[:, :, :, ::1] xh, real_t[:, :, :, ::1] out,
                       Py_ssize_t top, Py_ssize_t left) except -1:
    with nogil:
        _to_first(xh, out, top, left)
    return 0


cdef int _run_im2col(const real_t[:, :, :, ::1] xh, real_t[:, ::1] cols, Py_ssize_t kh,
                     Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t dh,
                     Py_ssize_t dw, Py_ssize_t ho, Py_ssize_t wo,
                     Py_ssize_t group) except -1:
    with nogil:
        _im2col(xh, cols, kh, kw, sh, sw, dh, dw, ho, wo, group)
    return 0


cdef int _run_col2im(const real_t[:, ::1] cols, real_t[:, :, :, ::1] out, Py_ssize_t kh,
                     Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t dh,
                     Py_ssize_t dw, Py_ssize_t ho, Py_ssize_t wo,
                     Py_ssize_t group) except -1:
    with nogil:
        _col2im(cols, out, kh, kw, sh, sw, dh, dw, ho, wo, group)
    return 0


# ---------------------------------------------------------------------------
# checked entries
# ---------------------------------------------------------------------------
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _array(name, key, a, ndim):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: {key} is a {type(a).__name__}; expected a numpy array")
    if a.dtype not in DTYPES:
        raise TypeError(f"{name}: {key} has dtype {a.dtype}; expected float32 or float64")
    if a.ndim != ndim:
        raise ValueError(f"{name}: {key} has shape {a.shape}; expected {ndim} dims")
    return np.ascontiguousarray(a)


def _ints(name, key, v, n, lo):
    try:
        v = tuple(int(e) for e in v)
    except TypeError:
        v = ()
    if len(v) != n or any(e < lo for e in v):
        raise ValueError(f"{name}: {key}={v!r} is not valid; expected {n} ints >= {lo}")
    return v


def _geometry(name, hw, kernel, stride, dilation, out_hw, channels, group):
    """Checked (kernel, stride, dilation, out_hw, group); every window inside `hw`."""
    kernel = _ints(name, "kernel", kernel, 2, 1)
    stride = _ints(name, "stride", stride, 2, 1)
    dilation = _ints(name, "dilation", dilation, 2, 1)
    out_hw = _ints(name, "out_hw", out_hw, 2, 1)
    group = int(group)
    if group < 1 or channels % group:
        raise ValueError(f"{name}: group={group} does not divide the {channels} channels")
    for a in range(2):
        reach = (out_hw[a] - 1) * stride[a] + (kernel[a] - 1) * dilation[a] + 1
        if reach > hw[a]:
            raise ValueError(f"{name}: {out_hw[a]} windows of kernel {kernel[a]} (stride "
                             f"{stride[a]}, dilation {dilation[a]}) reach {reach} pixels "
                             f"along spatial dim {a}; the grid has {hw[a]}")
    return kernel, stride, dilation, out_hw, group


def to_channels_last(x, pads=(0, 0, 0, 0)):
    """(B, C, H, W) -> (B, H + top + bottom, W + left + right, C) with a zero border;
    pads = (top, bottom, left, right)."""
    name = "conv to_channels_last"
    x = _array(name, "x", x, 4)
    t, b, l, r = _ints(name, "pads", pads, 4, 0)
    nb, nc, nh, nw = x.shape
    out = np.empty((nb, nh + t + b, nw + l + r, nc), x.dtype)
    if out.size == 0:
        out[...] = 0
        return out
    if x.size == 0:
        out[...] = 0
    elif x.dtype == np.float32:
        _run_to_last[float](x, out, t, l)
    else:
        _run_to_last[double](x, out, t, l)
    return out


def to_channels_first(xh, origin=(0, 0), hw=None):
    """(B, Hp, Wp, C) -> (B, C, H, W): the block of `hw` pixels from `origin` (top,
    left); hw defaults to what is left of the grid after origin."""
    name = "conv to_channels_first"
    xh = _array(name, "xh", xh, 4)
    top, left = _ints(name, "origin", origin, 2, 0)
    nb, hp, wp, nc = xh.shape
    if hw is None:
        hw = (hp - top, wp - left)
    nh, nw = _ints(name, "hw", hw, 2, 0)
    if top + nh > hp or left + nw > wp:
        raise ValueError(f"{name}: the block of hw={(nh, nw)} at origin={(top, left)} "
                         f"does not fit the grid {(hp, wp)}")
    out = np.empty((nb, nc, nh, nw), xh.dtype)
    if out.size == 0:
        return out
    if xh.dtype == np.float32:
        _run_to_first[float](xh, out, top, left)
    else:
        _run_to_first[double](xh, out, top, left)
    return out


def im2col(xh, kernel, stride, dilation, out_hw, group=1):
    """Columns of a channels-last grid xh (B, Hp, Wp, C): (B * Ho * Wo, kh * kw * C),
    each row one window, ordered (group, kh, kw, C / group)."""
    name = "conv im2col"
    xh = _array(name, "xh", xh, 4)
    nb, hp, wp, nc = xh.shape
    kernel, stride, dilation, out_hw, group = _geometry(name, (hp, wp), kernel, stride,
                                                        dilation, out_hw, nc, group)
    cols = np.empty((nb * out_hw[0] * out_hw[1], kernel[0] * kernel[1] * nc), xh.dtype)
    if cols.size == 0:
        return cols
    args = kernel + stride + dilation + out_hw + (group,)
    if xh.dtype == np.float32:
        _run_im2col[float](xh, cols, *args)
    else:
        _run_im2col[double](xh, cols, *args)
    return cols


def col2im(cols, batch, grid_hw, kernel, stride, dilation, out_hw, group=1):
    """Sum of the window columns `cols` (B * Ho * Wo, kh * kw * C), ordered as
    :func:`im2col` makes them, back onto a zero channels-last grid (B, Hp, Wp, C)."""
    name = "conv col2im"
    cols = _array(name, "cols", cols, 2)
    batch = int(batch)
    hp, wp = _ints(name, "grid_hw", grid_hw, 2, 1)
    kernel, stride, dilation, out_hw, _ = _geometry(name, (hp, wp), kernel, stride,
                                                    dilation, out_hw, 1, 1)
    taps = kernel[0] * kernel[1]
    rows = batch * out_hw[0] * out_hw[1]
    if batch < 0 or cols.shape[0] != rows or cols.shape[1] % taps:
        raise ValueError(f"{name}: cols has shape {cols.shape}; expected ({rows}, "
                         f"a multiple of {taps}) for batch={batch}, out_hw={out_hw} and "
                         f"kernel={kernel}")
    nc = cols.shape[1] // taps
    group = int(group)
    if group < 1 or nc % group:
        raise ValueError(f"{name}: group={group} does not divide the {nc} channels")
    out = np.empty((batch, hp, wp, nc), cols.dtype)
    if out.size == 0:
        return out
    if cols.size == 0:
        out[...] = 0
        return out
    args = kernel + stride + dilation + out_hw + (group,)
    if cols.dtype == np.float32:
        _run_col2im[float](cols, out, *args)
    else:
        _run_col2im[double](cols, out, *args)
    return out


# ---------------------------------------------------------------------------
# max pooling over (B, H, W) planes
# ---------------------------------------------------------------------------
cdef inline Py_ssize_t _window_argmax(const real_t* plane, Py_ssize_t h, Py_ssize_t w,
                                      Py_ssize_t r0, Py_ssize_t c0, Py_ssize_t kh,
                                      Py_ssize_t kw, real_t* best) noexcept nogil:
    """Flat index r * w + c of the first maximum of the window at (r0, c0) (padding,
    outside the plane, never wins; the first NaN does), or -1 if the window holds no
    pixel (or only -inf ones behind a padding tap); the maximum goes to best."""
    cdef Py_ssize_t i, j, r, c, at = -1
    cdef real_t v, m = 0
    cdef bint seen = False, nan = False
    cdef const real_t* row
    cdef Py_ssize_t k
    cdef bint gt
    if r0 >= 0 and c0 >= 0 and r0 + kh <= h and c0 + kw <= w:     # inside: no padding
        row = plane + r0 * w + c0
        m = row[0]
        at = 0
        nan = m != m
        for i in range(kh):            # branch-free (selects), NaN looked for after
            for j in range(kw):
                k = i * w + j
                v = row[k]
                gt = v > m
                at = k if gt else at
                m = v if gt else m
                nan = nan | (v != v)
        if not nan:
            best[0] = m
            return r0 * w + c0 + at
        for i in range(kh):            # the first NaN wins
            for j in range(kw):
                v = row[i * w + j]
                if v != v:
                    best[0] = v
                    return r0 * w + c0 + i * w + j
    nan = False
    for i in range(kh):
        r = r0 + i
        for j in range(kw):
            c = c0 + j
            if r < 0 or r >= h or c < 0 or c >= w:
                if not seen:          # numpy's argmax: a leading -inf padding tap
                    seen = True
                    m = -INFINITY
                    at = -1
                continue
            v = plane[r * w + c]
            if not seen or v > m or (v != v and not nan):
                seen = True
                m = v
                at = r * w + c
                if v != v:
                    nan = True
                    best[0] = m
                    return at
    best[0] = m if seen else -INFINITY
    return at


cdef void _max_pool(const real_t[:, :, ::1] x, real_t[:, :, ::1] out, Py_ssize_t kh,
                    Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t top,
                    Py_ssize_t left) noexcept nogil:
    """out[b, oh, ow] = max of x[b] over the window at (oh*sh - top, ow*sw - left)."""
    cdef Py_ssize_t nb = x.shape[0], h = x.shape[1], w = x.shape[2]
    cdef Py_ssize_t ho = out.shape[1], wo = out.shape[2], b, oh, ow
    cdef real_t m
    for b in range(nb):
        for oh in range(ho):
            for ow in range(wo):
                _window_argmax(&x[b, 0, 0], h, w, oh * sh - top, ow * sw - left, kh, kw,
                               &m)
                out[b, oh, ow] = m


cdef void _max_pool_grad(const real_t[:, :, ::1] x, const real_t[:, :, ::1] dy,
                         real_t[:, :, ::1] dx, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh,
                         Py_ssize_t sw, Py_ssize_t top, Py_ssize_t left) noexcept nogil:
    """dx[b] = sum over windows of dy[b, oh, ow] at the window's first maximum."""
    cdef Py_ssize_t nb = x.shape[0], h = x.shape[1], w = x.shape[2]
    cdef Py_ssize_t ho = dy.shape[1], wo = dy.shape[2], b, oh, ow, at
    cdef real_t m
    memset(&dx[0, 0, 0], 0, nb * h * w * sizeof(real_t))
    for b in range(nb):
        for oh in range(ho):
            for ow in range(wo):
                at = _window_argmax(&x[b, 0, 0], h, w, oh * sh - top, ow * sw - left, kh,
                                    kw, &m)
                if at >= 0:
                    (&dx[b, 0, 0])[at] += dy[b, oh, ow]


cdef int _run_max_pool(const real_t[:, :, ::1] x, real_t[:, :, ::1] out, Py_ssize_t kh,
                       Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t top,
                       Py_ssize_t left) except -1:
    with nogil:
        _max_pool(x, out, kh, kw, sh, sw, top, left)
    return 0


cdef int _run_max_pool_grad(const real_t[:, :, ::1] x, const real_t[:, :, ::1] dy,
                            real_t[:, :, ::1] dx, Py_ssize_t kh, Py_ssize_t kw,
                            Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t top,
                            Py_ssize_t left) except -1:
    with nogil:
        _max_pool_grad(x, dy, dx, kh, kw, sh, sw, top, left)
    return 0


def _pool_args(name, x, kernel, stride, pads):
    """Checked (x, kernel, stride, (top, left), out_hw: every window of the padded
    grid)."""
    x = _array(name, "x", x, 3)
    kernel = _ints(name, "kernel", kernel, 2, 1)
    stride = _ints(name, "stride", stride, 2, 1)
    t, b, l, r = _ints(name, "pads", pads, 4, 0)
    out_hw = tuple((x.shape[1 + a] + (t, l)[a] + (b, r)[a] - kernel[a]) // stride[a] + 1
                   for a in range(2))
    return x, kernel, stride, (t, l), out_hw


def max_pool(x, kernel, stride, pads=(0, 0, 0, 0)):
    """Max over the windows of the planes x (B, H, W) -> (B, Ho, Wo); pads = (top,
    bottom, left, right) of padding that never wins (NaN propagates)."""
    name = "conv max_pool"
    x, kernel, stride, origin, out_hw = _pool_args(name, x, kernel, stride, pads)
    if min(out_hw) < 1:
        raise ValueError(f"{name}: the grid {x.shape[1:]} with pads {tuple(pads)} is "
                         f"smaller than the kernel {kernel}")
    out = np.empty((x.shape[0],) + out_hw, x.dtype)
    if out.size == 0:
        return out
    if x.dtype == np.float32:
        _run_max_pool[float](x, out, *(kernel + stride + origin))
    else:
        _run_max_pool[double](x, out, *(kernel + stride + origin))
    return out


def max_pool_grad(x, dy, kernel, stride, pads=(0, 0, 0, 0)):
    """Gradient of :func:`max_pool`: dy (B, Ho, Wo) added into a zero (B, H, W) at each
    window's first maximum (row-major within the window, as numpy's argmax); dy's Ho x Wo
    windows may reach past the padded grid, where they meet more padding."""
    name = "conv max_pool_grad"
    dy = _array(name, "dy", dy, 3)
    x, kernel, stride, origin, _ = _pool_args(name, x, kernel, stride, pads)
    if dy.dtype != x.dtype or dy.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: dy has shape {dy.shape} and dtype {dy.dtype}; expected "
                         f"batch {x.shape[0]} and {x.dtype} (x's)")
    dx = np.empty(x.shape, x.dtype)
    if dx.size == 0:
        return dx
    if dy.size == 0:
        dx[...] = 0
        return dx
    if x.dtype == np.float32:
        _run_max_pool_grad[float](x, dy, dx, *(kernel + stride + origin))
    else:
        _run_max_pool_grad[double](x, dy, dx, *(kernel + stride + origin))
    return dx


# ---------------------------------------------------------------------------
# BatchNorm: per-channel sums in float64, and the per-channel affine map
# ---------------------------------------------------------------------------
cdef void _channel_sums(const real_t[:, :, :, ::1] x, double[:, :, ::1] out) noexcept nogil:
    """out[d, 0, c] = sum of x[d, :, c, :], out[d, 1, c] = sum of its squares (float64)."""
    cdef Py_ssize_t nd = x.shape[0], nb = x.shape[1], nc = x.shape[2], nl = x.shape[3]
    cdef Py_ssize_t d, b, c, i
    cdef double s, q, v
    cdef const real_t* row
    for d in range(nd):
        for c in range(nc):
            out[d, 0, c] = 0
            out[d, 1, c] = 0
        for b in range(nb):
            for c in range(nc):
                row = &x[d, b, c, 0]
                s = 0
                q = 0
                for i in range(nl):
                    v = row[i]
                    s += v
                    q += v * v
                out[d, 0, c] += s
                out[d, 1, c] += q


cdef void _channel_affine(const real_t[:, :, :, ::1] x, const real_t[:, ::1] shift,
                          const real_t[:, ::1] scale, real_t[:, :, :, ::1] out) noexcept nogil:
    """out[d, b, c, i] = shift[d, c] + scale[d, c] * x[d, b, c, i]."""
    cdef Py_ssize_t nd = x.shape[0], nb = x.shape[1], nc = x.shape[2], nl = x.shape[3]
    cdef Py_ssize_t d, b, c, i
    cdef real_t t, s
    cdef const real_t* src
    cdef real_t* dst
    for d in range(nd):
        for b in range(nb):
            for c in range(nc):
                t = shift[d, c]
                s = scale[d, c]
                src = &x[d, b, c, 0]
                dst = &out[d, b, c, 0]
                for i in range(nl):
                    dst[i] = t + s * src[i]


cdef int _run_channel_sums(const real_t[:, :, :, ::1] x, double[:, :, ::1] out) except -1:
    with nogil:
        _channel_sums(x, out)
    return 0


cdef int _run_channel_affine(const real_t[:, :, :, ::1] x, const real_t[:, ::1] shift,
                             const real_t[:, ::1] scale, real_t[:, :, :, ::1] out) except -1:
    with nogil:
        _channel_affine(x, shift, scale, out)
    return 0


def channel_sums(x):
    """Per device d and channel c of x (D, B, C, L): the float64 sum and sum of squares
    over B and L -> (D, 2, C)."""
    name = "conv channel_sums"
    x = _array(name, "x", x, 4)
    out = np.empty((x.shape[0], 2, x.shape[2]), np.float64)
    if out.size == 0:
        return out
    if x.size == 0:
        out[...] = 0
    elif x.dtype == np.float32:
        _run_channel_sums[float](x, out)
    else:
        _run_channel_sums[double](x, out)
    return out


def channel_affine(x, shift, scale):
    """``shift[d, c] + scale[d, c] * x[d, b, c, l]`` for x (D, B, C, L) and shift, scale
    (D, C) of x's dtype."""
    name = "conv channel_affine"
    x = _array(name, "x", x, 4)
    shift = _array(name, "shift", shift, 2)
    scale = _array(name, "scale", scale, 2)
    want = (x.shape[0], x.shape[2])
    if shift.shape != want or scale.shape != want or shift.dtype != x.dtype \
            or scale.dtype != x.dtype:
        raise ValueError(f"{name}: shift {shift.shape} {shift.dtype} and scale {scale.shape} "
                         f"{scale.dtype} must both be {want} {x.dtype} for x {x.shape}")
    out = np.empty(x.shape, x.dtype)
    if out.size == 0:
        return out
    if x.dtype == np.float32:
        _run_channel_affine[float](x, shift, scale, out)
    else:
        _run_channel_affine[double](x, shift, scale, out)
    return out
