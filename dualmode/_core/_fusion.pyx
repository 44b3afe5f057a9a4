# cython: language_level=3
"""Fused AllReduce in C: the loops over the members of one collective over many stacks.

* :func:`check_stacks`: the members checked (one dtype, the device leading dim) and
  deferred ones written unless the backend reads them (``Backend._check_fused``).
* :func:`fusion_offsets`: each member's offset in a fusion buffer, and its row length.
* :func:`grouped_all_reduce`: the fused AllReduce over other groups as the base backend
  runs it (``Backend._all_reduce_fused``: the stacks packed side by side, one
  AllReduce, per stack a view of its columns), with the packing and the views in C.
* :func:`whole_world_all_reduce`: the simulated fused AllReduce over one group of every
  device (``SimBackend._all_reduce_fused``): each member is reduced straight into its
  slice of one result row with the row reduction of ``_rows.pxd`` (one GIL-free pass
  over every member), and its result is a read-only stride-0 view of that slice made
  with the numpy C API. A stack stored once for every device has a view for a result
  when no pass is needed (its mean: itself; the sum of equal shares: their remembered
  total). The others (a deferred stack, the other ops on a stack stored once, a large
  stack whose totals are remembered or whose rows are strided) are handed to the
  backend's Python methods, as before.

Their pure-Python references are ``fusion_reference.check_stacks``,
``fusion_reference.fusion_offsets``, ``Backend._all_reduce_fused`` and
``SimBackend._all_reduce_fused_reference``;
tests/test_fused_all_reduce.py compares each pair (results bit for bit, views, errors).
"""
cimport numpy as cnp
from cpython.long cimport PyLong_FromVoidPtr
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from ._rows cimport (ROWS_MAX, ROWS_MIN, ROWS_PROD, ROWS_SUM, f32, f64, i32, i64,
                     reduce_rows, rows_t)

from ._views cimport view_of

import numpy as np

from ._dp import TOTALS
from ._tensor import Deferred

cnp.import_array()

cdef object _ndarray = np.ndarray
cdef object _empty = np.empty
cdef object _ascontiguousarray = np.ascontiguousarray
cdef dict _TOTALS = TOTALS
cdef dict _OP_CODE = {"sum": ROWS_SUM, "mean": ROWS_SUM, "max": ROWS_MAX, "min": ROWS_MIN,
                      "prod": ROWS_PROD}
cdef str _VALID_OPS = ", ".join([repr(o) for o in _OP_CODE])
cdef tuple _AXIS0 = (0,)

cdef enum:
    MAX_DIMS = 64        # numpy's NPY_MAXDIMS


# ---------------------------------------------------------------------------
# member checks and offsets
# ---------------------------------------------------------------------------
cpdef list check_stacks(str func, object stacks, Py_ssize_t rows, bint deferred):
    """`stacks` as a new list of stacks of one dtype, each with the leading (device)
    dim `rows`. A deferred stack (:class:`~dualmode._core._tensor.Deferred`) is kept as
    it is when `deferred`, else written. Errors name `func`, the stack and what is
    valid."""
    cdef list out = list(stacks)
    cdef Py_ssize_t i, k = len(out)
    cdef cnp.ndarray a
    cdef object first = None, dtype
    cdef bint ok
    for i in range(k):
        s = out[i]
        if not cnp.PyArray_Check(s):
            if not isinstance(s, Deferred):
                raise TypeError(f"{func}: stacks[{i}] must be a numpy array, got "
                                f"{type(s).__name__}")
            if not deferred:
                out[i] = s = s.materialize()
        if cnp.PyArray_Check(s):
            a = <cnp.ndarray>s
            dtype = <object>cnp.PyArray_DESCR(a)
            ok = cnp.PyArray_NDIM(a) >= 1 and cnp.PyArray_DIM(a, 0) == rows
        else:
            dtype = s.dtype
            ok = s.ndim >= 1 and s.shape[0] == rows
        if first is None:
            first = dtype
        elif dtype is not first and dtype != first:
            raise TypeError(f"{func}: stacks[{i}] has dtype {s.dtype} but stacks[0] has "
                            f"{first}; fuse buffers of one dtype per call")
        if not ok:
            raise ValueError(f"{func}: stacks[{i}] has shape {s.shape}; every stack needs "
                             f"the leading (device) dim {rows} (the devices this "
                             f"process holds)")
    return out


cdef inline Py_ssize_t _row_elems(object s) except -1:
    """Elements of one device's buffer of stack `s` (the product of its dims after the
    first)."""
    cdef Py_ssize_t m = 1, d
    cdef cnp.ndarray a
    if cnp.PyArray_Check(s):
        a = <cnp.ndarray>s
        for d in range(1, cnp.PyArray_NDIM(a)):
            m *= cnp.PyArray_DIM(a, d)
        return m
    for v in s.shape[1:]:
        m *= <Py_ssize_t>v
    return m


cpdef tuple fusion_offsets(object stacks):
    """Per-device element offsets of each stack in a fusion buffer, and its row length."""
    cdef list offsets = []
    cdef Py_ssize_t total = 0
    for s in stacks:
        offsets.append(total)
        total += _row_elems(s)
    return offsets, total


# ---------------------------------------------------------------------------
# the simulated fused AllReduce over the whole world
# ---------------------------------------------------------------------------
cdef struct _Job:
    char* src           # the member's (n, m) rows; NULL: its slice is already reduced
    char* dst           # its slice of the result row
    Py_ssize_t m        # elements per device


cdef void _run_jobs(rows_t* kind, const _Job* jobs, Py_ssize_t count, Py_ssize_t n,
                    int op, bint mean) noexcept nogil:
    """Each job's rows reduced into its slice (`kind` only selects the dtype), then a
    mean's slices divided by `n` while they are in cache."""
    cdef Py_ssize_t c, t, m
    cdef rows_t* dst
    cdef rows_t div = <rows_t>n
    for c in range(count):
        dst = <rows_t*>jobs[c].dst
        m = jobs[c].m
        if jobs[c].src != NULL:
            reduce_rows(<const rows_t*>jobs[c].src, dst, n, m, op)
        if rows_t is f32 or rows_t is f64:
            if mean:
                for t in range(m):
                    dst[t] = dst[t] / div


cdef object _slice_view(cnp.ndarray row, Py_ssize_t offset, cnp.ndarray like,
                        Py_ssize_t n, bint stack):
    """A view of `row` from element `offset`: `like`'s buffer shape, C-contiguous, as
    one writable buffer (`stack` False) or as the read-only stack ``(n, *shape)`` of
    every device seeing it (stride 0 on the device axis)."""
    cdef int nd = cnp.PyArray_NDIM(like), lead = 1 if stack else 0, d
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef cnp.npy_intp strides[MAX_DIMS]
    cdef cnp.npy_intp step = cnp.PyArray_ITEMSIZE(row)
    for d in range(nd - 1, 0, -1):
        dims[d - 1 + lead] = cnp.PyArray_DIM(like, d)
        strides[d - 1 + lead] = step
        step *= cnp.PyArray_DIM(like, d)
    if stack:
        dims[0] = n
        strides[0] = 0
    return view_of(row, nd - 1 + lead, dims, strides,
                   cnp.PyArray_BYTES(row) + offset * cnp.PyArray_ITEMSIZE(row), not stack)


cdef object _device_view(cnp.ndarray src, Py_ssize_t n):
    """The read-only stack ``(n, *src.shape[1:])`` of every device seeing ``src[0]``
    (stride 0 on the device axis, `src`'s other strides), a view of `src`."""
    cdef int nd = cnp.PyArray_NDIM(src), d
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef cnp.npy_intp strides[MAX_DIMS]
    dims[0] = n
    strides[0] = 0
    for d in range(1, nd):
        dims[d] = cnp.PyArray_DIM(src, d)
        strides[d] = cnp.PyArray_STRIDE(src, d)
    return view_of(src, nd, dims, strides, cnp.PyArray_BYTES(src), False)


cdef object _known_total(cnp.ndarray stack, tuple world):
    """The totals ``(1, *local)`` remembered for `stack` as pending sums over the whole
    world `world` ``(n,)`` (``totals.known_totals(stack, (n,), (0,))``), or None."""
    found = _TOTALS.get(PyLong_FromVoidPtr(<void*>stack))
    if found is None:
        return None
    entry = <tuple>found
    if entry[0]() is not stack or entry[3] != _AXIS0 or entry[2] != world:
        return None
    return entry[1]


cdef int _dtype_code(object dtype) except -1:
    """0..3 for native float32, float64, int32, int64 (the kernel's dtypes)."""
    cdef str kind = dtype.kind
    cdef Py_ssize_t size = dtype.itemsize
    if dtype.isnative:
        if kind == "f" and size == 4:
            return 0
        if kind == "f" and size == 8:
            return 1
        if kind == "i" and size == 4:
            return 2
        if kind == "i" and size == 8:
            return 3
    raise TypeError(f"whole_world_all_reduce: the row kernel takes float32, float64, "
                    f"int32 and int64 stacks, got dtype {dtype}")


cpdef list whole_world_all_reduce(list stacks, Py_ssize_t n, str op,
                                  Py_ssize_t pack_elems, object backend):
    """The AllReduce of every stack of `stacks` (checked, one kernel dtype, `n` > 1
    devices each) over one group of every device: per stack, a read-only view ``(n,
    *local)`` of its result, stride 0 on the device axis.

    Results of the stacks ``backend`` handles (its Python methods, as in
    ``SimBackend._all_reduce_fused_reference``): a deferred stack, whose known total
    (sum, mean: ``backend._deferred_result(s, op)``) needs no pass, else it is written;
    a stack stored once for every device (stride 0: a view of it for a mean, of its
    remembered total for a sum of equal shares, else ``backend._replicated_result(s,
    op)``). The others share one result row; each is reduced into its slice by the row
    kernel, except a stack of more than `pack_elems` elements per device whose totals
    are remembered or whose rows are not C-contiguous: ``backend._reduce_all(s, op,
    slice)`` reads it. A mean is the sum divided by `n` (as numpy divides)."""
    cdef Py_ssize_t k = len(stacks), i, c, count = 0, total = 0, m
    cdef int op_code
    cdef bint mean = op == "mean", sums = op == "sum" or op == "mean"
    cdef list outs = [None] * k, rowed = [], keep = []
    cdef cnp.ndarray a, row
    cdef Py_ssize_t* offsets = NULL
    cdef Py_ssize_t* where = NULL
    cdef _Job* jobs = NULL
    cdef char* base
    cdef Py_ssize_t isz
    cdef int code
    if op not in _OP_CODE:
        raise ValueError(f"whole_world_all_reduce: op={op!r} is not valid; expected one of "
                         f"{_VALID_OPS}")
    op_code = _OP_CODE[op]
    if n < 2:
        raise ValueError(f"whole_world_all_reduce: n={n} is not valid; the whole world "
                         "of a fused AllReduce here has at least 2 devices")
    world = (n,)
    try:
        offsets = <Py_ssize_t*>malloc(max(k, 1) * sizeof(Py_ssize_t))
        where = <Py_ssize_t*>malloc(max(k, 1) * sizeof(Py_ssize_t))
        jobs = <_Job*>malloc(max(k, 1) * sizeof(_Job))
        if offsets == NULL or where == NULL or jobs == NULL:
            raise MemoryError()
        # the members with a result of their own; the others' places in the row
        for i in range(k):
            s = stacks[i]
            if not cnp.PyArray_Check(s):                 # a deferred stack
                if sums:
                    res = backend._deferred_result(s, op)
                    if res is not None:
                        outs[i] = res
                        continue
                s = s.materialize()
                if not cnp.PyArray_Check(s):
                    raise TypeError(f"whole_world_all_reduce: stacks[{i}] (a "
                                    f"{type(stacks[i]).__name__}) was written as a "
                                    f"{type(s).__name__}, not a numpy array")
            a = <cnp.ndarray>s
            if cnp.PyArray_NDIM(a) < 1 or cnp.PyArray_DIM(a, 0) != n:
                raise ValueError(f"whole_world_all_reduce: stacks[{i}] has shape {s.shape};"
                                 f" expected the leading (device) dim {n}")
            if cnp.PyArray_STRIDE(a, 0) == 0:             # one buffer for every device
                if mean:                                  # the mean of equal buffers
                    outs[i] = _device_view(a, n)
                    continue
                if sums:                                  # equal shares: their total
                    totals = _known_total(a, world)
                    if totals is not None:
                        outs[i] = _device_view(<cnp.ndarray>totals, n)
                        continue
                outs[i] = backend._replicated_result(a, op)
                continue
            offsets[count] = total
            where[count] = i
            total += _row_elems(a)
            count += 1
            rowed.append(a)
        if count == 0:
            return outs
        row = <cnp.ndarray>_empty(total, dtype=rowed[0].dtype)
        code = _dtype_code(row.dtype)
        if mean and code >= 2:
            raise TypeError(f"whole_world_all_reduce: op='mean' needs a floating-point "
                            f"stack, got dtype {row.dtype}; use op='sum' for integer "
                            "buffers")
        base = cnp.PyArray_BYTES(row)
        isz = cnp.PyArray_ITEMSIZE(row)
        # each member's job: its rows, or its slice already reduced by the backend
        dtype = <object>cnp.PyArray_DESCR(row)
        for c in range(count):
            a = <cnp.ndarray>rowed[c]
            if <object>cnp.PyArray_DESCR(a) is not dtype and a.dtype != dtype:
                raise TypeError(f"whole_world_all_reduce: stacks[{where[c]}] has dtype "
                                f"{a.dtype} but the others {dtype}; fuse buffers of one "
                                "dtype per call")
            m = _row_elems(a)
            jobs[c].dst = base + offsets[c] * isz
            jobs[c].m = m
            if m > pack_elems and (not cnp.PyArray_IS_C_CONTIGUOUS(a) or
                                   _TOTALS.get(PyLong_FromVoidPtr(<void*>a)) is not None):
                backend._reduce_all(a, op, _slice_view(row, offsets[c], a, n, False))
                jobs[c].src = NULL
                continue
            if not cnp.PyArray_IS_C_CONTIGUOUS(a):       # a small stack's rows, packed
                a = <cnp.ndarray>_ascontiguousarray(a)
                keep.append(a)
            jobs[c].src = cnp.PyArray_BYTES(a)
        with nogil:
            if code == 0:
                _run_jobs(<f32*>NULL, jobs, count, n, op_code, mean)
            elif code == 1:
                _run_jobs(<f64*>NULL, jobs, count, n, op_code, mean)
            elif code == 2:
                _run_jobs(<i32*>NULL, jobs, count, n, op_code, mean)
            else:
                _run_jobs(<i64*>NULL, jobs, count, n, op_code, mean)
        for c in range(count):
            outs[where[c]] = _slice_view(row, offsets[c], <cnp.ndarray>rowed[c], n, True)
        return outs
    finally:
        free(offsets)
        free(where)
        free(jobs)


# ---------------------------------------------------------------------------
# the fused AllReduce over other groups: one packed buffer
# ---------------------------------------------------------------------------
cdef object _columns_view(object red, Py_ssize_t offset, cnp.ndarray like):
    """``red[:, offset:offset + m].reshape(like.shape)`` (m: elements of one of
    `like`'s buffers): the columns of the reduced buffer ``(rows, total)`` that hold
    one stack, a view (writable as `red` is), made with the numpy C API when `red`'s
    rows are contiguous."""
    cdef cnp.ndarray r
    cdef int nd = cnp.PyArray_NDIM(like), d
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef cnp.npy_intp strides[MAX_DIMS]
    cdef cnp.npy_intp step
    if type(red) is not _ndarray or cnp.PyArray_NDIM(<cnp.ndarray>red) != 2 or \
            cnp.PyArray_STRIDE(<cnp.ndarray>red, 1) != cnp.PyArray_ITEMSIZE(<cnp.ndarray>red):
        return red[:, offset:offset + _row_elems(like)].reshape((<object>like).shape)
    r = <cnp.ndarray>red
    step = cnp.PyArray_ITEMSIZE(r)
    for d in range(nd - 1, 0, -1):
        dims[d] = cnp.PyArray_DIM(like, d)
        strides[d] = step
        step *= cnp.PyArray_DIM(like, d)
    dims[0] = cnp.PyArray_DIM(r, 0)
    strides[0] = cnp.PyArray_STRIDE(r, 0)
    return view_of(r, nd, dims, strides,
                   cnp.PyArray_BYTES(r) + offset * cnp.PyArray_ITEMSIZE(r),
                   cnp.PyArray_ISWRITEABLE(r))


cpdef list grouped_all_reduce(list stacks, object plan, str op, object backend):
    """The AllReduce of every stack of `stacks` (checked: one dtype, the same leading
    dim) over the groups of `plan`, fused as ``Backend._all_reduce_fused`` fuses it:
    the stacks (deferred ones written) packed side by side into one buffer ``(rows,
    total)``, one ``backend._all_reduce(buffer, plan, op, "direct")``, and per stack a
    view ``(rows, *local)`` of its columns of the result."""
    cdef Py_ssize_t k = len(stacks), c, r, rows = -1, total = 0, isz, m
    cdef list arrays = [None] * k
    cdef object dtype = None
    cdef cnp.ndarray a, buf
    cdef Py_ssize_t* offsets = NULL
    cdef Py_ssize_t* nbytes = NULL
    cdef char** src = NULL
    cdef char* base
    if k == 0:
        return []
    try:
        offsets = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
        nbytes = <Py_ssize_t*>malloc(k * sizeof(Py_ssize_t))
        src = <char**>malloc(k * sizeof(char*))
        if offsets == NULL or nbytes == NULL or src == NULL:
            raise MemoryError()
        for c in range(k):
            s = stacks[c]
            if not cnp.PyArray_Check(s):                 # a deferred stack: written
                s = s.materialize()
            if not cnp.PyArray_Check(s) or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>s):
                s = _ascontiguousarray(s)
            a = <cnp.ndarray>s
            if c == 0:
                dtype = <object>cnp.PyArray_DESCR(a)
                rows = cnp.PyArray_DIM(a, 0) if cnp.PyArray_NDIM(a) else -1
            if cnp.PyArray_NDIM(a) < 1 or cnp.PyArray_DIM(a, 0) != rows:
                raise ValueError(f"grouped_all_reduce: stacks[{c}] has shape {(<object>a).shape}; "
                                 f"expected the leading (device) dim of stacks[0]")
            if <object>cnp.PyArray_DESCR(a) is not dtype and a.dtype != dtype:
                raise TypeError(f"grouped_all_reduce: stacks[{c}] has dtype {a.dtype} but "
                                f"stacks[0] has {dtype}; fuse buffers of one dtype per call")
            arrays[c] = a
            m = _row_elems(a)
            offsets[c] = total
            nbytes[c] = m * cnp.PyArray_ITEMSIZE(a)
            src[c] = cnp.PyArray_BYTES(a)
            total += m
        buf = <cnp.ndarray>_empty((rows, total), dtype=dtype)
        base = cnp.PyArray_BYTES(buf)
        isz = cnp.PyArray_ITEMSIZE(buf)
        with nogil:
            for c in range(k):
                if nbytes[c]:
                    for r in range(rows):
                        memcpy(base + (r * total + offsets[c]) * isz,
                               src[c] + r * nbytes[c], nbytes[c])
        red = backend._all_reduce(buf, plan, op, "direct")
        return [_columns_view(red, offsets[c], <cnp.ndarray>arrays[c]) for c in range(k)]
    finally:
        free(offsets)
        free(nbytes)
        free(src)
