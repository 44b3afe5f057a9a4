# cython: language_level=3
"""The data-parallel fast path of distributed dispatch, in C.

When one process holds every device, an op whose distributed inputs are all split on
dim 0 runs its own kernel once over every device's rows (the stacks viewed as global
values) and its outputs are stored in its sharding rule's output layouts
(:mod:`dualmode.parallel.dtensor`, path 3). The parallel layer works out that route
once per call signature; this module keeps the routes and runs a signature seen
before without Python frames of its own:

* :class:`Dispatch` (the ``dist_apply`` hook): one pass over the inputs, the call
  signature (:func:`signature`), the route, the kernel, the outputs stored
  (:func:`stored`); anything else is handed to the parallel layer's Python code.
* the small helpers of that path: :func:`broadcast_view` (a stride-0 view made with
  the numpy C API), :func:`share_of`, :func:`equal_shares` and the registry of known
  totals (:func:`remember_totals`, :data:`TOTALS`), which
  :mod:`dualmode.communication.totals` documents and extends.

The pure-Python reference of a remembered route is the parallel layer's general path
(``dtensor._dist_apply``, which decides the route afresh and runs it once); the tests
(tests/test_dp_dispatch.py) compare the two and numpy. :func:`broadcast_view`'s
reference is ``np.broadcast_to``.
"""
cimport numpy as cnp

from ._views cimport view_of

import weakref

import numpy as np

from ._tensor import TensorBase, finish

cnp.import_array()

cdef object _ndarray = np.ndarray
cdef object _multiply = np.multiply
cdef object _true_divide = np.true_divide
cdef object _asarray = np.asarray
cdef object _broadcast_to = np.broadcast_to
cdef object _weakref = weakref.ref

DEF MAX_DIMS = 32


# ---------------------------------------------------------------------------
# stride-0 views and equal shares
# ---------------------------------------------------------------------------
cpdef object broadcast_view(object a, object shape):
    """``np.broadcast_to(a, shape)`` for an array `a` of ``len(shape)`` dims (each of
    its dims equal to the one in `shape`, or 1): a read-only view, stride 0 along the
    broadcast dims, made with the numpy C API for a C-contiguous `a` (others, and
    shapes that do not broadcast, go to numpy, whose error names the shapes)."""
    cdef tuple want = shape if type(shape) is tuple else tuple(shape)
    cdef cnp.ndarray arr
    cdef int nd, i
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef cnp.npy_intp strides[MAX_DIMS]
    cdef cnp.npy_intp have, w
    if type(a) is not _ndarray:
        return _broadcast_to(a, want)
    arr = <cnp.ndarray>a
    nd = cnp.PyArray_NDIM(arr)
    if nd != len(want) or nd > MAX_DIMS or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        return _broadcast_to(a, want)
    for i in range(nd):
        have = cnp.PyArray_DIM(arr, i)
        w = want[i]
        dims[i] = w
        if have == w:
            strides[i] = cnp.PyArray_STRIDE(arr, i)
        elif have == 1:
            strides[i] = 0
        else:
            return _broadcast_to(a, want)
    if not cnp.PyArray_ISWRITEABLE(arr) and a.shape == want:
        return a
    return view_of(arr, nd, dims, strides, cnp.PyArray_BYTES(arr), False)


cpdef object share_of(object total, long n, object out=None):
    """``total / n`` in `total`'s dtype (into `out` when given, broadcasting `total`).
    For a real float `total` and a power of two `n` it is one multiplication by
    ``1 / n`` (exactly the quotient: both are the correctly rounded value of the same
    real number, ``1 / n`` being exact), which costs less than half a division pass."""
    dtype = total.dtype
    if dtype.kind == "f" and n & (n - 1) == 0:
        return _multiply(total, 1.0 / n, out=out, dtype=dtype)
    return _true_divide(total, n, out=out, dtype=dtype)


#: id(stack) -> (weak reference to the stack, totals, device matrix, summed axes)
TOTALS = {}


cdef class _Forget:
    """The weak-reference callback that drops a stack's entry from :data:`TOTALS`."""
    cdef object key

    def __call__(self, ref):
        found = TOTALS.get(self.key)
        if found is not None and found[0] is ref:
            del TOTALS[self.key]


cdef object _record(object stack, object totals, tuple device_matrix, tuple axes):
    cdef _Forget forget = _Forget.__new__(_Forget)
    key = id(stack)
    forget.key = key
    TOTALS[key] = (_weakref(stack, forget), totals, device_matrix, axes)
    return stack


cdef inline void _read_only(object a) except *:
    if cnp.PyArray_ISWRITEABLE(<cnp.ndarray>a):
        cnp.PyArray_CLEARFLAGS(<cnp.ndarray>a, cnp.NPY_ARRAY_WRITEABLE)


def remember_totals(stack, totals, device_matrix, axes):
    """Record that `stack` ``(prod(device_matrix), *local)`` holds pending sums over the
    device `axes` whose totals are `totals`: a device grid ``device_matrix + local`` with
    size 1 along `axes` (the devices of one group share one total) and along any axis
    over which the totals repeat. Returns `stack`, now read-only (as are `totals`)."""
    cdef tuple dm = tuple(device_matrix)
    cdef tuple ax = tuple(sorted(axes))
    cdef Py_ssize_t k = len(dm), a
    tshape, sshape = totals.shape, stack.shape
    fits = tshape[k:] == sshape[1:]
    for a in range(min(k, len(tshape))):
        t, d = tshape[a], dm[a]
        fits = fits and (t == 1 or (t == d and a not in ax))
    if not fits:
        raise ValueError(f"remember_totals: totals of shape {tshape} do not fit a "
                         f"stack {sshape} summed over axes {ax} of device matrix {dm}")
    _read_only(stack)
    _read_only(totals)
    return _record(stack, totals, dm, ax)


cdef tuple _AXIS0 = (0,)


cpdef object equal_shares(object total, long n):
    """The stack of `n` equal shares ``total / n`` of a pending sum over the whole world
    (a float array `total`), stored once (a stride-0 view of one share), whose total is
    remembered (:func:`remember_totals`): the sum of its shares (an AllReduce, a
    ReduceScatter over the whole world) is then `total` itself, read without a pass
    over the shares, and exactly the single-device value (``n * (total / n)`` may
    differ from it by a rounding). `total` becomes read-only: it is handed out as such
    sums, so it must not change."""
    share = share_of(total, n)
    if type(share) is not _ndarray:
        share = _asarray(share)
    view = broadcast_view(share[None], (n,) + share.shape)
    _read_only(total)
    return _record(view, total[None], (n,), _AXIS0)


# ---------------------------------------------------------------------------
# the dispatch of a signature seen before
# ---------------------------------------------------------------------------
cdef class Dispatch:
    """``dist_apply(op, attrs, inputs, rec)`` with the data-parallel routes in C.

    Made once by the parallel layer, which hands it its Python parts:

    routes       signature -> route (see :meth:`run_route`), or `moves`
    moves        the marker of a signature whose sharding rule moves data
    layout_cls   the TensorLayout class (inputs with other layouts go to `layout_kinds`)
    layout_kinds layout class -> the function that runs ops on such inputs
    rule         ``rule(op, attrs, inputs, rec, layouts)``: the op's sharding rule, or
                 None when it has none (run for `moves` signatures)
    general      ``general(op, attrs, inputs, rec, layouts, key, batch, partial)``: the
                 general path, which adds the routes it finds to `routes`
    is_batch     ``is_batch(layout)``: a split on dim 0 only
    backend_state  the object whose ``backend`` is the live backend (or None), read
                 for the backend's part of a signature
    deferred     ``deferred(totals, device_matrix, axes, parts)``: unwritten shares
    shares       ``shares(total, n)``: equal shares of a value that is not fresh

    Eager equal shares of at least `defer_bytes` (64 KiB) are left unwritten
    (see :meth:`stored`).
    """
    cdef readonly dict routes
    cdef object moves, layout_cls, rule, general, is_batch, backend_state, deferred, shares
    cdef object _backend_ref, _backend_key
    cdef dict layout_kinds
    cdef public Py_ssize_t defer_bytes

    def __init__(self, dict routes, moves, layout_cls, dict layout_kinds, rule, general,
                 is_batch, backend_state, deferred, shares):
        self.routes, self.moves, self.layout_cls = routes, moves, layout_cls
        self.layout_kinds, self.rule, self.general = layout_kinds, rule, general
        self.is_batch, self.backend_state = is_batch, backend_state
        self._backend_ref = self._backend_key = None
        self.deferred, self.shares = deferred, shares
        self.defer_bytes = 64 * 1024

    def __call__(self, op, attrs, tuple inputs, rec):
        cdef list layouts = []
        cdef bint batch = True, partial = False
        cdef dict d
        for x in inputs:
            lay = x._layout if isinstance(x, TensorBase) else None
            layouts.append(lay)
            if lay is None:
                continue
            if type(lay) is not self.layout_cls:
                kind = self.layout_kinds.get(type(lay))
                if kind is not None:                # another layout kind
                    return kind(op, attrs, inputs, rec)
                batch = False
            elif lay.partial:
                partial, batch = True, False
            elif batch:
                d = lay.__dict__
                found = d.get("_is_batch_split")
                if found is None:
                    found = d["_is_batch_split"] = self.is_batch(lay)
                batch = found
        key = None
        if batch:
            key = self.signature(op, attrs, inputs, layouts)
            route = self.routes.get(key) if key is not None else None
            if route is self.moves:        # the rule moves data: run it
                out = self.rule(op, attrs, inputs, rec, layouts)
                if out is not None:
                    return out
            elif route is not None:
                return self.run_route(op, attrs, inputs, rec, route)
        return self.general(op, attrs, inputs, rec, layouts, key, batch, partial)

    cpdef object signature(self, op, attrs, tuple inputs, list layouts):
        """A key for this call that fixes its data-parallel route: the op, its attrs,
        the live backend and per input its layout (by identity: the route keeps it
        alive) and dtype, or the dtype and shape of a whole value. None when an
        attribute is unhashable or a value has no dtype."""
        cdef list key = [op, tuple(attrs.items()) if attrs else None, self.backend_key()]
        cdef Py_ssize_t i
        try:
            for i in range(len(inputs)):
                x, lay = inputs[i], layouts[i]
                if lay is not None:
                    key.append(id(lay))
                    key.append(x._data.dtype)
                elif isinstance(x, TensorBase):
                    data = x._data
                    key.append(data.dtype)
                    key.append(data.shape)
                else:
                    key.append(np.result_type(x))
                    key.append(np.shape(x))
            t = tuple(key)
            hash(t)
        except (TypeError, AttributeError):   # an unhashable attribute; a lazy value
            return None
        return t

    cdef object backend_key(self):
        """The live backend's part of a signature: its identity, world size and the
        number of devices this process holds (made once per backend)."""
        b = self.backend_state.backend
        if b is None:
            return None
        ref = self._backend_ref
        if ref is None or ref() is not b:
            self._backend_key = (id(b), b.world_size, len(b.local_ranks))
            self._backend_ref = _weakref(b)
        return self._backend_key

    cpdef object run_route(self, op, attrs, tuple inputs, rec, tuple route):
        """A call whose signature took the data-parallel route before (`route`: per
        input the global shape its stack is viewed with, or None for a whole value;
        whether the kernel takes the attrs; the outputs' kinds and layouts): the stacks
        viewed as global values, the kernel, the outputs stored."""
        cdef tuple shapes = route[0], kinds = route[2]
        cdef Py_ssize_t i, n = len(inputs)
        cdef list merged = [None] * n
        for i in range(n):
            x, shape = inputs[i], shapes[i]
            if shape is not None:
                merged[i] = x._data.reshape(shape)
            elif isinstance(x, TensorBase):
                merged[i] = x._value()
            else:
                merged[i] = x
        out = op.kernel(attrs, *merged) if route[1] else op.kernel(*merged)
        return finish(op, attrs, inputs, self.stored_outputs(out, op, kinds, merged),
                      rec, route[3])

    cpdef object stored_outputs(self, out, op, tuple kinds, list merged):
        """The kernel's output(s) `out` stored per `kinds` for eager Tensors: one stack,
        or a tuple of them for a multi-output op."""
        if op.multi_output:
            return tuple([self.stored(o, kinds[i][0], kinds[i][1], merged, True)
                          for i, o in enumerate(out)])
        kind = kinds[0]
        return self.stored(out, kind[0], kind[1], merged, True)

    cpdef object stored(self, o, str kind, n, list merged, bint defer=False):
        """One output `o` of a kernel run on global values, stored as `kind` says:
        "batch" (a view split over `n` devices on dim 0), "whole" (one plain value),
        "partial" (`n` equal shares of a pending sum) or "blocks" (cut into the blocks
        of layout `n`); `merged`: the kernel's inputs (an output that is one of them is
        not fresh); `defer`: the stack becomes a Tensor's, so large equal shares may
        be left unwritten."""
        cdef long parts
        if type(o) is not _ndarray:
            o = _asarray(o)                 # ufuncs on 0-d arrays give numpy scalars
        if kind == "batch":
            parts = n
            shape = o.shape
            return o.reshape((parts, shape[0] // parts) + shape[1:])
        if kind == "whole":
            return o
        if kind == "partial":
            parts = n
            if parts > 1 and o.dtype.kind == "f" and _fresh(<cnp.ndarray>o, merged):
                # a fresh result: n equal shares that remember it, so the AllReduce of
                # this pending sum (a data-parallel gradient's) reads it without a
                # pass; in eager execution large shares are not even written unless
                # something reads them (small ones are: a loss is read, and writing
                # costs less than deferring)
                if defer and cnp.PyArray_NBYTES(<cnp.ndarray>o) >= self.defer_bytes:
                    _read_only(o)
                    return self.deferred(o[None], (parts,), _AXIS0, parts)
                return equal_shares(o, parts)
            return self.shares(o, parts)
        return n.local_blocks(o)


cdef bint _fresh(cnp.ndarray o, list merged):
    """`o` owns its writable data and is none of the kernel's inputs."""
    if not cnp.PyArray_CHKFLAGS(o, cnp.NPY_ARRAY_OWNDATA) or not cnp.PyArray_ISWRITEABLE(o):
        return False
    for m in merged:
        if m is o:
            return False
    return True
