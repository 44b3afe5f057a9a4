# cython: language_level=3
"""Kernels of the simulated collectives (typed memoryviews, GIL released).

* ``reduce_rows``: sum / max / min / prod of an ``(n, m)`` array over its rows (the
  direct AllReduce of ``n`` device buffers), blocked so the output stays in cache.
* ``accumulate``: ``dst[i] = dst[i] (op) src[i]``, one chunk transfer of a ring step;
  ``ring_reduce_scatter_step`` / ``ring_all_gather_step`` run every device's transfer of
  one step of the ring AllReduce over a ``(groups, n, m)`` work buffer.
* ``pack`` / ``unpack``: copy many arrays into one fusion buffer at given offsets and
  back (gradient fusion: one collective instead of many).

Each has a plain numpy reference in ``dualmode/_core/comm_reference.py``; the tests
compare the two. The ``def`` entries validate their arguments with the GIL held and
raise errors naming the kernel, the parameter and the valid values; the ``cdef ...
noexcept nogil`` kernels trust them.
"""
cimport numpy as cnp
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free

import numpy as np

cnp.import_array()

# the row kernels are shared with _fusion (one loop: the fused and the unfused AllReduce
# add the same numbers in the same order)
from ._rows cimport ROWS_MAX, ROWS_MIN, ROWS_PROD, ROWS_SUM, f32, f64, i32, i64
from ._rows cimport combine_rows as _combine
from ._rows cimport reduce_rows as _reduce_rows
from ._rows cimport rows_t as comm_t

OPS = ("sum", "max", "min", "prod")
DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
_OP_CODE = {"sum": ROWS_SUM, "max": ROWS_MAX, "min": ROWS_MIN, "prod": ROWS_PROD}


# --------------------------------------------------------------------- kernels


cdef void _ring_rs_step(comm_t* w, Py_ssize_t groups, Py_ssize_t n, Py_ssize_t m,
                        const i64* bounds, Py_ssize_t step, int op) noexcept nogil:
    """Step `step` of the ring reduce-scatter: device i sends chunk (i - step) mod n to
    device (i + 1) mod n, which combines it into its own copy of that chunk."""
    cdef Py_ssize_t g, i, c, d
    cdef comm_t* base
    for g in range(groups):
        base = w + g * n * m
        for i in range(n):
            c = (i - step + n) % n
            d = (i + 1) % n
            _combine(base + d * m + bounds[c], base + i * m + bounds[c],
                     bounds[c + 1] - bounds[c], op)


cdef void _ring_ag_step(comm_t* w, Py_ssize_t groups, Py_ssize_t n, Py_ssize_t m,
                        const i64* bounds, Py_ssize_t step) noexcept nogil:
    """Step `step` of the ring all-gather: device i sends its complete chunk
    (i + 1 - step) mod n to device (i + 1) mod n, which stores it."""
    cdef Py_ssize_t g, i, c, d
    cdef comm_t* base
    for g in range(groups):
        base = w + g * n * m
        for i in range(n):
            c = (i + 1 - step + n) % n
            d = (i + 1) % n
            memcpy(base + d * m + bounds[c], base + i * m + bounds[c],
                   (bounds[c + 1] - bounds[c]) * sizeof(comm_t))


cdef void _copy_segments(char** src, char** dst, const Py_ssize_t* nbytes, Py_ssize_t k,
                         Py_ssize_t rows, const Py_ssize_t* src_stride,
                         const Py_ssize_t* dst_stride) noexcept nogil:
    """For each segment s and row r: copy nbytes[s] bytes from src[s] + r*src_stride[s]
    to dst[s] + r*dst_stride[s]."""
    cdef Py_ssize_t s, r
    for s in range(k):
        if nbytes[s] == 0:
            continue
        for r in range(rows):
            memcpy(dst[s] + r * dst_stride[s], src[s] + r * src_stride[s], nbytes[s])


# ---------------------------------------------- typed entries (one per fused dtype)


cdef int _run_reduce_rows(const comm_t[:, ::1] x, comm_t[::1] out, int op) except -1:
    if x.shape[1] == 0:
        return 0
    with nogil:
        _reduce_rows(&x[0, 0], &out[0], x.shape[0], x.shape[1], op)
    return 0


cdef int _run_accumulate(comm_t[::1] dst, const comm_t[::1] src, int op) except -1:
    if dst.shape[0] == 0:
        return 0
    with nogil:
        _combine(&dst[0], &src[0], dst.shape[0], op)
    return 0


cdef int _run_rs_step(comm_t[:, :, ::1] w, const i64[::1] bounds, Py_ssize_t step,
                      int op) except -1:
    if w.shape[0] == 0 or w.shape[2] == 0:
        return 0
    with nogil:
        _ring_rs_step(&w[0, 0, 0], w.shape[0], w.shape[1], w.shape[2], &bounds[0], step, op)
    return 0


cdef int _run_ag_step(comm_t[:, :, ::1] w, const i64[::1] bounds,
                      Py_ssize_t step) except -1:
    if w.shape[0] == 0 or w.shape[2] == 0:
        return 0
    with nogil:
        _ring_ag_step(&w[0, 0, 0], w.shape[0], w.shape[1], w.shape[2], &bounds[0], step)
    return 0


# ------------------------------------------------------------------ validation


cdef int _op_code(str func, object op) except -1:
    if not isinstance(op, str) or op not in _OP_CODE:
        raise ValueError(f"{func}: op={op!r} is not valid; expected one of "
                         + ", ".join(repr(o) for o in OPS))
    return _OP_CODE[op]


cdef int _dtype_code(str func, str name, object dtype) except -1:
    for code, d in enumerate(DTYPES):
        if dtype == d:
            return code
    raise TypeError(f"{func}: {name} has dtype {dtype}; expected one of "
                    + ", ".join(str(d) for d in DTYPES))


cdef object _check_array(str func, str name, object a, int ndim, bint writable):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{func}: {name} must be a numpy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{func}: {name} has shape {a.shape}; expected {ndim} dimension(s)")
    if not a.flags.c_contiguous:
        raise ValueError(f"{func}: {name} must be C-contiguous (got strides {a.strides})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{func}: {name} is read-only; it is written in place")
    return a


# ------------------------------------------------------------------ def entries


def reduce_rows(x, out, op="sum"):
    """out[j] = op over rows i of x[i, j]; returns `out`.

    Parameters
    ----------
    x : (n, m) C-contiguous float32/float64/int32/int64 array, n >= 1
    out : (m,) C-contiguous writable array of the same dtype
    op : "sum", "max", "min" or "prod"
    """
    cdef int code = _op_code("reduce_rows", op)
    _check_array("reduce_rows", "x", x, 2, False)
    _check_array("reduce_rows", "out", out, 1, True)
    if x.shape[0] < 1:
        raise ValueError(f"reduce_rows: x has shape {x.shape}; expected at least one row")
    if out.shape[0] != x.shape[1]:
        raise ValueError(f"reduce_rows: out has shape {out.shape}; expected ({x.shape[1]},) "
                         f"for x of shape {x.shape}")
    if out.dtype != x.dtype:
        raise TypeError(f"reduce_rows: out has dtype {out.dtype}; expected x's dtype {x.dtype}")
    cdef int dt = _dtype_code("reduce_rows", "x", x.dtype)
    if dt == 0:
        _run_reduce_rows[f32](x, out, code)
    elif dt == 1:
        _run_reduce_rows[f64](x, out, code)
    elif dt == 2:
        _run_reduce_rows[i32](x, out, code)
    else:
        _run_reduce_rows[i64](x, out, code)
    return out


def accumulate(dst, src, op="sum"):
    """dst[i] = dst[i] (op) src[i] in place (one chunk of a ring step); returns `dst`.

    Parameters
    ----------
    dst : (m,) C-contiguous writable float32/float64/int32/int64 array
    src : (m,) C-contiguous array of the same dtype (must not overlap `dst`)
    op : "sum", "max", "min" or "prod"
    """
    cdef int code = _op_code("accumulate", op)
    _check_array("accumulate", "dst", dst, 1, True)
    _check_array("accumulate", "src", src, 1, False)
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"accumulate: src has shape {src.shape} and dst {dst.shape}; "
                         "expected equal lengths")
    if src.dtype != dst.dtype:
        raise TypeError(f"accumulate: src has dtype {src.dtype}; expected dst's dtype "
                        f"{dst.dtype}")
    cdef int dt = _dtype_code("accumulate", "dst", dst.dtype)
    if dt == 0:
        _run_accumulate[f32](dst, src, code)
    elif dt == 1:
        _run_accumulate[f64](dst, src, code)
    elif dt == 2:
        _run_accumulate[i32](dst, src, code)
    else:
        _run_accumulate[i64](dst, src, code)
    return dst


cdef object _check_ring(str func, object work, object bounds, object step):
    _check_array(func, "work", work, 3, True)
    cdef Py_ssize_t n = work.shape[1], m = work.shape[2]
    if n < 1:
        raise ValueError(f"{func}: work has shape {work.shape}; expected (groups, n, m) "
                         "with n >= 1 devices per group")
    b = np.ascontiguousarray(bounds, dtype=np.int64)
    if b.ndim != 1 or b.shape[0] != n + 1 or b[0] != 0 or b[b.shape[0] - 1] != m or (
            np.any(np.diff(b) < 0)):
        raise ValueError(f"{func}: bounds={np.asarray(bounds).ravel().tolist()!r} are not valid "
                         f"chunk boundaries; expected {n + 1} non-decreasing ints from 0 to {m}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) \
            or not 0 <= step < n:
        raise ValueError(f"{func}: step={step!r} is not valid; expected an int in "
                         f"[0, {n})")
    return b


def ring_reduce_scatter_step(work, bounds, step, op="sum"):
    """Run every transfer of reduce-scatter step `step` of the ring, in place.

    Parameters
    ----------
    work : (groups, n, m) C-contiguous array: the flattened buffers of the n devices of
        each group (float32/float64/int32/int64).
    bounds : (n + 1,) ints, chunk c is ``[bounds[c], bounds[c + 1])``
    step : int in [0, n)
    op : "sum", "max", "min" or "prod"

    After steps 0 .. n-2, device i holds the reduced chunk (i + 1) mod n.
    """
    cdef int code = _op_code("ring_reduce_scatter_step", op)
    b = _check_ring("ring_reduce_scatter_step", work, bounds, step)
    cdef int dt = _dtype_code("ring_reduce_scatter_step", "work", work.dtype)
    if dt == 0:
        _run_rs_step[f32](work, b, step, code)
    elif dt == 1:
        _run_rs_step[f64](work, b, step, code)
    elif dt == 2:
        _run_rs_step[i32](work, b, step, code)
    else:
        _run_rs_step[i64](work, b, step, code)
    return work


def ring_all_gather_step(work, bounds, step):
    """Run every transfer of all-gather step `step` of the ring, in place.

    Device i sends chunk (i + 1 - step) mod n to device (i + 1) mod n; after the
    reduce-scatter pass, steps 0 .. n-2 leave every device with every reduced chunk.
    Parameters as :func:`ring_reduce_scatter_step`.
    """
    b = _check_ring("ring_all_gather_step", work, bounds, step)
    cdef int dt = _dtype_code("ring_all_gather_step", "work", work.dtype)
    if dt == 0:
        _run_ag_step[f32](work, b, step)
    elif dt == 1:
        _run_ag_step[f64](work, b, step)
    elif dt == 2:
        _run_ag_step[i32](work, b, step)
    else:
        _run_ag_step[i64](work, b, step)
    return work


# ------------------------------------------------------------- fusion buffers


cdef object _check_offsets(str func, object arrays, object offsets):
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{func}: arrays must be a list or tuple of numpy arrays, got "
                        f"{type(arrays).__name__}")
    try:
        items = list(offsets)
    except TypeError:
        items = None
    if items is None or not all(isinstance(o, (int, np.integer)) and not isinstance(o, bool)
                                for o in items):
        raise TypeError(f"{func}: offsets must be a sequence of ints, got {offsets!r}")
    offs = [int(o) for o in items]
    if len(offs) != len(arrays):
        raise ValueError(f"{func}: got {len(arrays)} arrays but {len(offs)} offsets; expected "
                         "one offset per array")
    return offs


cdef object _segments(str func, str what, object buf, object arrays, list offs,
                      bint arrays_writable):
    """Validate a fusion call; return (rows, row stride of buf in bytes, buf columns, the
    list of (array, offset, elements per row)) so both directions share the checks."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{func}: {what} must be a numpy array, got {type(buf).__name__}")
    if buf.ndim not in (1, 2):
        raise ValueError(f"{func}: {what} has shape {buf.shape}; expected (size,) or "
                         "(rows, size)")
    cdef Py_ssize_t isz = buf.dtype.itemsize
    if buf.ndim == 1:
        rows, cols, rstride = 1, buf.shape[0], 0
        if buf.shape[0] > 1 and buf.strides[0] != isz:
            raise ValueError(f"{func}: {what} must be contiguous (strides {buf.strides})")
    else:
        rows, cols, rstride = buf.shape[0], buf.shape[1], buf.strides[0]
        if buf.shape[1] > 1 and buf.strides[1] != isz:
            raise ValueError(f"{func}: each row of {what} must be contiguous (strides "
                             f"{buf.strides})")
    segs = []
    for k, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{func}: arrays[{k}] must be a numpy array, got "
                            f"{type(a).__name__}")
        if a.dtype != buf.dtype:
            raise TypeError(f"{func}: arrays[{k}] has dtype {a.dtype}; expected the fusion "
                            f"buffer's dtype {buf.dtype}")
        if not a.flags.c_contiguous:
            if arrays_writable:
                raise ValueError(f"{func}: arrays[{k}] must be C-contiguous to be written "
                                 f"in place (strides {a.strides})")
            a = np.ascontiguousarray(a)
        if arrays_writable and not a.flags.writeable:
            raise ValueError(f"{func}: arrays[{k}] is read-only; it is written in place")
        if rows > 1 and (a.ndim == 0 or a.shape[0] != rows):
            raise ValueError(f"{func}: arrays[{k}] has shape {a.shape}; {what} has {rows} "
                             f"rows, so each array must have {rows} rows (leading dim)")
        per_row = a.size // rows if rows else 0
        off = offs[k]
        if off < 0 or off + per_row > cols:
            raise ValueError(f"{func}: arrays[{k}] ({per_row} elements per row) at offset "
                             f"{off} does not fit in {what} (row length {cols}); expected "
                             f"0 <= offset <= {cols - per_row}")
        segs.append((a, off, per_row))
    return rows, rstride, segs


cdef object _copy(object buf, Py_ssize_t rows, Py_ssize_t rstride, list segs, bint to_buf):
    cdef Py_ssize_t k = len(segs), s, off, per_row
    cdef Py_ssize_t isz = buf.dtype.itemsize
    cdef char* base = <char*>cnp.PyArray_DATA(buf)
    cdef char** src = <char**>malloc(max(k, 1) * sizeof(char*))
    cdef char** dst = <char**>malloc(max(k, 1) * sizeof(char*))
    cdef Py_ssize_t* nbytes = <Py_ssize_t*>malloc(max(k, 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t* sstride = <Py_ssize_t*>malloc(max(k, 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t* dstride = <Py_ssize_t*>malloc(max(k, 1) * sizeof(Py_ssize_t))
    cdef cnp.ndarray a
    if not (src and dst and nbytes and sstride and dstride):
        free(src); free(dst); free(nbytes); free(sstride); free(dstride)
        raise MemoryError()
    try:
        for s in range(k):
            a, off, per_row = segs[s]
            nbytes[s] = per_row * isz
            if to_buf:
                src[s] = <char*>cnp.PyArray_DATA(a)
                dst[s] = base + off * isz
                sstride[s] = nbytes[s]
                dstride[s] = rstride
            else:
                src[s] = base + off * isz
                dst[s] = <char*>cnp.PyArray_DATA(a)
                sstride[s] = rstride
                dstride[s] = nbytes[s]
        with nogil:
            _copy_segments(src, dst, nbytes, k, rows, sstride, dstride)
    finally:
        free(src); free(dst); free(nbytes); free(sstride); free(dstride)


def pack(arrays, out, offsets):
    """Copy each array into the fusion buffer `out` at its offset; returns `out`.

    Parameters
    ----------
    arrays : list of numpy arrays of `out`'s dtype (any dtype)
    out : (size,) contiguous writable buffer: ``arrays[k]`` is copied, flattened, to
        ``out[offsets[k]:offsets[k] + arrays[k].size]``; or (rows, size) with contiguous
        rows (a stack of device buffers): each array has `rows` rows (its leading dim) and
        row r goes, flattened, to ``out[r, offsets[k]:...]``.
    offsets : one int per array, in elements
    """
    offs = _check_offsets("pack", arrays, offsets)
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("pack: out is read-only; it is written in place")
    rows, rstride, segs = _segments("pack", "out", out, arrays, offs, False)
    _copy(out, rows, rstride, segs, True)
    return out


def unpack(buf, outs, offsets):
    """Copy the fusion buffer `buf` back into the arrays `outs` (inverse of :func:`pack`).

    Parameters
    ----------
    buf : (size,) or (rows, size) buffer with contiguous rows; rows may have any stride,
        including 0 (a replicated result such as ``np.broadcast_to``)
    outs : list of C-contiguous writable arrays of `buf`'s dtype, filled in place
    offsets : one int per array, in elements
    """
    offs = _check_offsets("unpack", outs, offsets)
    rows, rstride, segs = _segments("unpack", "buf", buf, outs, offs, True)
    _copy(buf, rows, rstride, segs, False)
    return outs
