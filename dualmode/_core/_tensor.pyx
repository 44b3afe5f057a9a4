# cython: language_level=3
"""The eager dispatch core: tensor storage, op definitions, the one dispatcher
(`apply`), tape recording and the reverse-mode walk.

Everything per-op lives in `OpDef` records (data, not code paths); this module
only knows how to run one: validate (infer), compute (kernel), wrap, record.
"""
import numpy as np

# ----------------------------------------------------------------------------
# op kinds: how the dispatcher calls an OpDef
# ----------------------------------------------------------------------------
KIND_GENERIC = 0   # infer(attrs, *xs) and kernel(attrs, *xs) are Python callables
KIND_UNARY = 1     # kernel is a numpy ufunc taking one array; infer checks dtype
KIND_BINARY = 2    # kernel is a numpy ufunc taking two arrays; C broadcast infer

cdef int _KIND_GENERIC = 0
cdef int _KIND_UNARY = 1
cdef int _KIND_BINARY = 2

# dtype kinds accepted by float-only ops
_FLOAT_KINDS = frozenset("f")
cdef object _FLOAT32 = np.dtype(np.float32)

# ----------------------------------------------------------------------------
# recording state (one per process; the context object owns user settings)
# ----------------------------------------------------------------------------
cdef int _record_depth = 0      # > 0 while a grad function's forward runs
cdef long _tape_id = 0          # id of the innermost active tape
cdef object _TensorCls = None   # the Python Tensor class outputs are made of
cdef object _DIST_APPLY = None  # parallel layer: runs an op when an input is distributed
cdef object _ASSEMBLE = None    # parallel layer: global value of a distributed tensor
cdef int _phase = 0             # 1 while run_backward runs backward rules


def set_dist_hooks(dist_apply, assemble):
    """Register the parallel layer's entry points (see dualmode.parallel.dtensor)."""
    global _DIST_APPLY, _ASSEMBLE
    _DIST_APPLY = dist_apply
    _ASSEMBLE = assemble


def get_dist_hooks():
    """The registered (dist_apply, assemble) pair (graph tracing swaps them for a while)."""
    return _DIST_APPLY, _ASSEMBLE


def in_backward():
    """True while backward rules run (collectives issued then are 'backward')."""
    return _phase == 1


def set_tensor_class(cls):
    """Register the Python Tensor subclass that ops return."""
    global _TensorCls
    if not (isinstance(cls, type) and issubclass(cls, TensorBase)):
        raise TypeError(f"set_tensor_class: expected a subclass of TensorBase, got {cls!r}")
    _TensorCls = cls


def recording():
    """True while a gradient tape records ops."""
    return _record_depth > 0


def current_tape():
    """Id of the active tape (0 when none)."""
    return _tape_id if _record_depth > 0 else 0


def begin_tape():
    """Start recording a new tape; returns its id. Nested tapes are refused."""
    global _record_depth, _tape_id
    if _record_depth > 0:
        raise RuntimeError(
            "grad: nested gradient computation (a grad/value_and_grad call inside the "
            "function being differentiated) is not supported; higher-order gradients "
            "would be silently wrong")
    _tape_id += 1
    _record_depth = 1
    return _tape_id


def end_tape():
    """Stop recording."""
    global _record_depth
    _record_depth = 0


class _PausedRecording:
    """Context manager that turns recording off (used for backward rules)."""

    def __enter__(self):
        global _record_depth
        self._saved = (_record_depth, _tape_id)
        _record_depth = 0
        return self

    def __exit__(self, *exc):
        global _record_depth, _tape_id
        _record_depth, _tape_id = self._saved
        return False


def paused_recording():
    """Context manager: ops inside it are not recorded on the tape."""
    return _PausedRecording()


# ----------------------------------------------------------------------------
# OpDef: one record per op
# ----------------------------------------------------------------------------
cdef class OpDef:
    """Everything the system knows about one op.

    name        the op's public name (used in every error message)
    kind        KIND_GENERIC / KIND_UNARY / KIND_BINARY
    infer       GENERIC: infer(attrs, *xs) -> tuple of (shape, dtype) per output,
                raising named errors; xs need only `.shape` and `.dtype`
    kernel      GENERIC: kernel(attrs, *arrays) -> array or tuple of arrays;
                UNARY/BINARY: a numpy ufunc
    backward    backward(node, *douts) -> tuple of input gradients (None where an
                input needs none), written with dualmode ops; None = not differentiable
    save_outputs  backward reads the op's outputs (node.outputs)
    reads_inputs  backward reads the values of the op's inputs (default True); when
                False the tape keeps only what the walk needs of them (their nodes,
                shapes, dtypes and layouts), so their arrays can be freed as soon as
                nothing else holds them (BiasAdd's input, ReLU's)
    float_only  UNARY/BINARY: inputs must have a floating dtype
    numeric_only  UNARY/BINARY: inputs must not be bool (numpy has no bool negative)
    out_dtype   UNARY/BINARY: output dtype when it differs from the inputs' (bool
                for comparisons)
    extras      later layers (sharding rules, cost models, graph lowering) attach here
    """
    cdef readonly str name
    cdef readonly int kind
    cdef readonly object infer
    cdef readonly object kernel
    cdef readonly object backward
    cdef readonly bint save_outputs
    cdef readonly bint reads_inputs
    cdef readonly bint float_only
    cdef readonly bint numeric_only
    cdef readonly bint multi_output
    cdef readonly object out_dtype
    cdef readonly dict extras

    def __init__(self, str name, *, int kind=0, infer=None, kernel=None, backward=None,
                 bint save_outputs=False, bint reads_inputs=True, bint float_only=False,
                 bint numeric_only=False, bint multi_output=False, out_dtype=None):
        if kernel is None:
            raise TypeError(f"OpDef {name}: a kernel is required")
        if kind == _KIND_GENERIC and infer is None:
            raise TypeError(f"OpDef {name}: generic ops need an infer function")
        self.name = name
        self.kind = kind
        self.infer = infer
        self.kernel = kernel
        self.backward = backward
        self.save_outputs = save_outputs
        self.reads_inputs = reads_inputs
        self.float_only = float_only
        self.numeric_only = numeric_only
        self.multi_output = multi_output
        self.out_dtype = None if out_dtype is None else np.dtype(out_dtype)
        self.extras = {}

    def __repr__(self):
        return f"OpDef({self.name})"


# ----------------------------------------------------------------------------
# Node: one recorded op application (or a watched leaf when op is None)
# ----------------------------------------------------------------------------
cdef class Node:
    """A tape entry: the op, its attrs, its inputs and (if needed) its outputs."""
    cdef readonly OpDef op
    cdef readonly object attrs
    cdef readonly tuple inputs
    cdef readonly tuple outputs      # detached output tensors if op.save_outputs
    cdef readonly tuple out_meta     # ((shape, dtype), ...) per output
    cdef readonly long slot          # leaves: index of the gradient slot
    cdef readonly long tape          # leaves: id of the tape that watches them
    cdef long _mark                  # the last _topo_order that reached this node

    def needs_grad(self, Py_ssize_t i):
        """Does input i need a gradient?"""
        x = self.inputs[i]
        return isinstance(x, TensorBase) and (<TensorBase>x)._node is not None

    @property
    def is_leaf(self):
        return self.op is None

    def __repr__(self):
        if self.op is None:
            return f"Leaf(slot={self.slot}, tape={self.tape})"
        return f"Node({self.op.name})"


def make_leaf(long slot, long tape):
    """A leaf node: gradients reaching it go to `slot` of tape `tape`."""
    cdef Node n = Node.__new__(Node)
    n.op = None
    n.slot = slot
    n.tape = tape
    n.inputs = ()
    return n


# ----------------------------------------------------------------------------
# Deferred: a distributed op's output stack not written yet
# ----------------------------------------------------------------------------
cdef class Deferred:
    """A stack ``(devices, *local)`` that is described, not yet written. A kernel may
    return one instead of an array (the grouped MatMul's pending sums, whose totals
    are known); the Tensor wrapping it writes the stack on the first read of `_data`.
    Subclasses implement `_write()`; `shape`, `dtype` and `nbytes` describe the stack.
    Numpy functions given a Deferred read the written stack (``__array__``)."""
    cdef public tuple shape
    cdef public object dtype
    cdef object _stack

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._stack = None

    cpdef object materialize(self):
        """The written stack (written once; later calls return the same array)."""
        if self._stack is None:
            self._stack = self._write()
        return self._stack

    def _write(self):
        raise NotImplementedError(f"{type(self).__name__}: no _write")

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        cdef Py_ssize_t n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def __array__(self, dtype=None, copy=None):
        a = self.materialize()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, index):
        return self.materialize()[index]

    def __len__(self):
        return self.shape[0]


cdef class _Absent(Deferred):
    """The value of an input the tape does not keep (an op whose backward does not
    read it: ``OpDef.reads_inputs`` False): its shape and dtype only."""
    cdef str opname

    def _write(self):
        raise RuntimeError(f"{self.opname}: the tape does not keep the values of this op's "
                           f"inputs (its backward does not read them); record under "
                           f"dualmode._core._tensor.KEEPING_INPUTS to keep them")


cdef int _keep_inputs = 0       # > 0: every op's inputs stay on the tape as they are


cdef class Nesting:
    """A switch that is on while at least one ``with`` block of it is open (nests).
    The module's instances: :data:`DEFERRING`, :data:`KEEPING_INPUTS`."""
    cdef int* depth

    def __enter__(self):
        if self.depth == NULL:
            raise RuntimeError("Nesting: use the module's instances (DEFERRING, "
                               "KEEPING_INPUTS); a new one switches nothing")
        self.depth[0] += 1
        return self

    def __exit__(self, *exc):
        self.depth[0] -= 1
        return False


cdef Nesting _nesting(int* depth):
    cdef Nesting switch = Nesting.__new__(Nesting)
    switch.depth = depth
    return switch


#: while inside, the tape keeps the inputs of every op as they are, also of ops whose
#: backward does not read them (a program checker that reads every op's values from
#: the tape)
KEEPING_INPUTS = _nesting(&_keep_inputs)


cdef object _stand_in(object x, str opname):
    """What the tape keeps of the input `x` of an op whose backward does not read
    input values: a Tensor with `x`'s node, output index and layout, whose value is an
    :class:`_Absent` of `x`'s storage shape and dtype (reading it raises)."""
    cdef TensorBase t, s
    cdef _Absent a
    if not isinstance(x, TensorBase):
        return x
    t = <TensorBase>x
    store = t._lazy if t._lazy is not None else t._arr
    if store is None:
        return x                        # a delayed value: nothing held yet
    a = _Absent.__new__(_Absent)
    a.shape = store.shape
    a.dtype = store.dtype
    a.opname = opname
    s = TensorBase.__new__(_TensorCls)     # a plain Tensor (a Parameter's shape is its own)
    s._lazy = a
    s._node = t._node
    s._out_index = t._out_index
    s._layout = t._layout
    return s


cdef int _defer_depth = 0       # > 0 while kernels may return Deferred stacks


#: the context in which kernels may return a :class:`Deferred` instead of writing a
#: stack: entered where the results become Tensors, or steps that read deferred stacks
#: (see :mod:`dualmode.communication.totals`)
DEFERRING = _nesting(&_defer_depth)


cpdef bint deferral_on():
    """Whether a kernel may return a deferred stack now."""
    return _defer_depth > 0


cpdef list written(list xs):
    """`xs` with every :class:`Deferred` written (its stack in its place)."""
    cdef Py_ssize_t i
    cdef list out = xs
    for i in range(len(xs)):
        if isinstance(xs[i], Deferred):
            if out is xs:
                out = list(xs)
            out[i] = (<Deferred>xs[i]).materialize()
    return out


# ----------------------------------------------------------------------------
# TensorBase: storage + tape link; the Python Tensor class adds the API
# ----------------------------------------------------------------------------
cdef class TensorBase:
    """Storage of a tensor and its tape node.

    `_layout` None: `_data` is the global value (one numpy array).
    `_layout` a TensorLayout: `_data` is the stack of this process's local shards
    (leading axis = local devices) and the layout says which slice each holds.

    A distributed op's output may be *deferred* (`_lazy`, a :class:`Deferred`): its
    stack is only written when something reads `_data`; readers that know the
    deferred form (the redistribution of a pending sum whose totals are known) use
    `_lazy` instead and the stack is never written.
    """
    cdef public object _arr
    cdef public object _lazy
    cdef public object _node
    cdef public int _out_index
    cdef public object _layout
    cdef object __weakref__

    @property
    def _data(self):
        """The storage: the global value, or the stack of local shards (a deferred
        stack is written on this first read)."""
        if self._lazy is not None:
            self._arr = (<Deferred>self._lazy).materialize()
            self._lazy = None
        return self._arr

    @_data.setter
    def _data(self, value):
        self._arr = value
        self._lazy = None

    @property
    def shape(self):
        if self._layout is not None:
            return self._layout.shape
        if self._lazy is not None:
            return (<Deferred>self._lazy).shape
        if self._data is None:
            self._materialize()
        return self._data.shape

    @property
    def dtype(self):
        if self._lazy is not None:
            return (<Deferred>self._lazy).dtype
        if self._data is None:
            self._materialize()
        return self._data.dtype

    @property
    def ndim(self):
        if self._layout is not None:
            return len(self._layout.shape)
        if self._lazy is not None:
            return len((<Deferred>self._lazy).shape)
        if self._data is None:
            self._materialize()
        return self._data.ndim

    @property
    def layout(self):
        """The tensor's sharding (a TensorLayout), or None for a plain global value."""
        return self._layout

    def _value(self):
        """The global numpy value (materialising a delayed parameter, assembling
        a distributed tensor from its shards)."""
        if self._layout is not None:
            return _ASSEMBLE(self)
        if self._data is None:
            self._materialize()
        return self._data

    def _materialize(self):
        raise RuntimeError("Tensor: has no value")

    # arithmetic fast paths: Tensor (op) Tensor / scalar
    def __add__(self, other):
        return binary(_BIN[0], self, other, False)

    def __radd__(self, other):
        return binary(_BIN[0], self, other, True)

    def __sub__(self, other):
        return binary(_BIN[1], self, other, False)

    def __rsub__(self, other):
        return binary(_BIN[1], self, other, True)

    def __mul__(self, other):
        return binary(_BIN[2], self, other, False)

    def __rmul__(self, other):
        return binary(_BIN[2], self, other, True)

    def __truediv__(self, other):
        return binary(_BIN[3], self, other, False)

    def __rtruediv__(self, other):
        return binary(_BIN[3], self, other, True)


# the binary ops behind the operators, registered by dualmode.ops at import
cdef list _BIN = [None, None, None, None]
cdef object _CAST = None
cdef object _promote = None


def set_operator_ops(add, sub, mul, div, cast, promote):
    """Register the OpDefs behind + - * / and the Cast op used for promotion."""
    global _CAST, _promote
    _BIN[0] = add
    _BIN[1] = sub
    _BIN[2] = mul
    _BIN[3] = div
    _CAST = cast
    _promote = promote


cdef object _as_operand(object x, object like_dtype, str opname):
    """Turn a Python scalar / list / array into a constant ndarray."""
    if isinstance(x, (bool, int, float)) and like_dtype is not None:
        # weak scalar: takes the tensor's dtype unless it cannot hold it
        if isinstance(x, float) and like_dtype.kind != "f":
            return np.asarray(x, dtype=np.float32)
        if isinstance(x, int) and not isinstance(x, bool) and like_dtype.kind == "b":
            return np.asarray(x, dtype=np.int64)
        try:
            return np.asarray(x, dtype=like_dtype)
        except OverflowError:
            raise ValueError(f"{opname}: the Python int {x} does not fit in the tensor's dtype "
                             f"{like_dtype}; cast the tensor to a wider dtype first") from None
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        x = np.asarray(x)
        if x.dtype == np.float64:
            x = x.astype(_FLOAT32)     # MindSpore's default float dtype, as Tensor(list)
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    raise TypeError(f"{opname}: unsupported operand of type {type(x).__name__}; "
                    f"expected a Tensor, a numpy array or a Python number")


cdef object _as_const(object x, str opname):
    """A constant operand when neither side is a Tensor (float -> float32, int -> int64)."""
    if isinstance(x, bool):
        return np.asarray(x, dtype=np.bool_)
    if isinstance(x, int):
        return np.asarray(x, dtype=np.int64)
    if isinstance(x, float):
        return np.asarray(x, dtype=_FLOAT32)
    return _as_operand(x, None, opname)


cdef inline object _dtype_source(TensorBase t):
    """`t`'s storage, or for a distributed tensor whose stack is not written yet (a
    :class:`Deferred`) the deferred stack itself: it has the dtype and shape, and the
    parallel layer reads the stacks it needs (equal shares may never be written)."""
    if t._lazy is not None and t._layout is not None:
        return t._lazy
    if _storage(t) is None:
        t._materialize()
    return _storage(t)


cpdef object binary(OpDef op, object a, object b, bint reflected):
    """a (op) b with promotion: the path behind Tensor operators.

    Operands that are not Tensors become constants (Python numbers are weak: they
    take the Tensor's dtype when it can hold them). Differing dtypes are promoted;
    float-only ops (RealDiv) compute integer operands in float32.
    """
    cdef object da, db, arr_a, arr_b, target
    cdef TensorBase ta, tb
    if op is None:
        raise RuntimeError("Tensor operators used before dualmode.ops was imported")
    if reflected:
        a, b = b, a
    if isinstance(a, TensorBase):
        ta = <TensorBase>a
        arr_a = _dtype_source(ta)
        da = arr_a.dtype
        if isinstance(b, TensorBase):
            tb = <TensorBase>b
            arr_b = _dtype_source(tb)
            db = arr_b.dtype
            # fast path: same dtype and shape, no promotion or broadcasting to check
            if da is db and op.kind == _KIND_BINARY and ta._layout is None \
                    and tb._layout is None and arr_a.shape == arr_b.shape \
                    and not (op.float_only and da.kind != "f") \
                    and not (op.numeric_only and da.kind == "b"):
                return _finish(op, None, (a, b), op.kernel(arr_a, arr_b),
                               ta._node is not None or tb._node is not None)
        else:
            b = _as_operand(b, da, op.name)
            db = b.dtype
    elif isinstance(b, TensorBase):
        db = (<TensorBase>b)._value().dtype
        a = _as_operand(a, db, op.name)
        da = a.dtype
    else:
        a = _as_const(a, op.name)
        b = _as_const(b, op.name)
        da = a.dtype
        db = b.dtype
    target = da if (da is db or da == db) else _promote(da, db)
    if op.float_only and target.kind != "f":
        target = _FLOAT32
    if da != target:
        a = _cast_to(a, target)
    if db != target:
        b = _cast_to(b, target)
    return apply(op, None, (a, b))


cdef object _cast_to(object x, object dtype):
    if isinstance(x, TensorBase):
        return apply(_CAST, {"dtype": dtype}, (x,))
    return x.astype(dtype)


# ----------------------------------------------------------------------------
# inference helpers implemented here for speed
# ----------------------------------------------------------------------------
cpdef tuple broadcast_shapes(str opname, tuple s0, tuple s1):
    """Broadcast two shapes numpy-style, or raise a ValueError naming the op."""
    if s0 == s1:
        return s0
    cdef Py_ssize_t n0 = len(s0), n1 = len(s1), n = max(n0, n1), i
    cdef list out = [0] * n
    cdef object d0, d1
    for i in range(n):
        d0 = s0[n0 - n + i] if n0 - n + i >= 0 else 1
        d1 = s1[n1 - n + i] if n1 - n + i >= 0 else 1
        if d0 == d1 or d1 == 1:
            out[i] = d0
        elif d0 == 1:
            out[i] = d1
        else:
            raise ValueError(
                f"{opname}: input 0 has shape {s0} but input 1 has shape {s1}; "
                f"they cannot be broadcast (dim {i - n} is {d0} vs {d1}; sizes must "
                f"match or one of them be 1)")
    return tuple(out)


cdef inline void _check_float(OpDef op, object dt, int i) except *:
    if dt.kind != "f":
        raise TypeError(f"{op.name}: input {i} has dtype {dt}; supported dtypes: "
                        f"float16, float32, float64")


cdef inline void _check_numeric(OpDef op, object dt, int i) except *:
    if dt.kind == "b":
        raise TypeError(f"{op.name}: input {i} has dtype bool; supported dtypes: integer and "
                        f"floating dtypes (use ops.cast)")


cdef tuple _infer_fast(OpDef op, tuple arrays):
    """Validate UNARY/BINARY inputs, returning ((shape, dtype),)."""
    cdef object a = arrays[0], b
    if op.kind == _KIND_UNARY:
        if len(arrays) != 1:
            raise TypeError(f"{op.name}: takes 1 input, got {len(arrays)}")
        if op.float_only:
            _check_float(op, a.dtype, 0)
        elif op.numeric_only:
            _check_numeric(op, a.dtype, 0)
        return ((a.shape, a.dtype if op.out_dtype is None else op.out_dtype),)
    if len(arrays) != 2:
        raise TypeError(f"{op.name}: takes 2 inputs, got {len(arrays)}")
    b = arrays[1]
    da = a.dtype
    db = b.dtype
    if da is not db and da != db:
        raise TypeError(f"{op.name}: input 0 has dtype {da} but input 1 has dtype {db}; "
                        f"both inputs must have the same dtype (use ops.cast)")
    if op.float_only:
        _check_float(op, da, 0)
    elif op.numeric_only:
        _check_numeric(op, da, 0)
    return ((broadcast_shapes(op.name, a.shape, b.shape),
             da if op.out_dtype is None else op.out_dtype),)


def infer(OpDef op, attrs, *xs):
    """Abstract evaluation: output (shape, dtype) pairs of `op` on inputs `xs`."""
    if op.kind == _KIND_GENERIC:
        return op.infer(attrs, *xs)
    return _infer_fast(op, xs)


# ----------------------------------------------------------------------------
# the dispatcher
# ----------------------------------------------------------------------------
cdef object _ndarray = np.ndarray


cdef inline object _storage(TensorBase t):
    """`t._data` without the property lookup (a deferred stack is written)."""
    if t._lazy is not None:
        return t._data
    return t._arr


cdef inline TensorBase _wrap(object arr):
    cdef TensorBase t = TensorBase.__new__(_TensorCls)
    if type(arr) is not _ndarray:
        if isinstance(arr, Deferred):
            t._lazy = arr
            return t
        arr = np.asarray(arr)      # ufuncs on 0-d arrays return numpy scalars
    t._arr = arr
    return t


def wrap(arr):
    """A Tensor holding the numpy value `arr` (no copy); Tensors are returned as they are."""
    if isinstance(arr, TensorBase):
        return arr
    return _wrap(arr)


cpdef object apply(OpDef op, object attrs, tuple inputs):
    """Run `op` eagerly on `inputs` (Tensors or constant ndarrays).

    Validates with the op's infer rule, runs its kernel and, while a tape records
    and some input is on it, records a Node. Returns a Tensor, or a tuple of
    Tensors for multi-output ops.
    """
    cdef Py_ssize_t n = len(inputs), i
    cdef bint rec = False, dist = False
    cdef object x, out
    cdef TensorBase t
    cdef list arrs = [None] * n
    for i in range(n):
        x = inputs[i]
        if isinstance(x, TensorBase):
            t = <TensorBase>x
            if t._node is not None:
                rec = True
            if t._layout is not None:
                dist = True          # the parallel layer reads the stacks it needs
                continue
            if _storage(t) is None:
                t._materialize()
            arrs[i] = _storage(t)
        else:
            arrs[i] = x
    if dist:
        return _DIST_APPLY(op, attrs, inputs, rec)
    cdef tuple arrays = tuple(arrs)
    if op.kind == _KIND_GENERIC:
        op.infer(attrs, *arrays)
        out = op.kernel(attrs, *arrays)
    else:
        _infer_fast(op, arrays)
        if n == 1:
            out = op.kernel(arrays[0])
        else:
            out = op.kernel(arrays[0], arrays[1])
    return _finish(op, attrs, inputs, out, rec)


cdef object _finish(OpDef op, object attrs, tuple inputs, object out, bint rec,
                    object layouts=None):
    """Wrap kernel output(s) as Tensors (with `layouts` for distributed outputs:
    one per output, None for a plain global value) and record a Node when taping."""
    cdef tuple outs
    cdef object result, x, lay
    cdef TensorBase t
    cdef Node node
    cdef Py_ssize_t i
    if op.multi_output:
        outs = tuple([_wrap(o) for o in out])
        for i in range(len(outs)):
            (<TensorBase>outs[i])._out_index = i
            if layouts is not None:
                (<TensorBase>outs[i])._layout = layouts[i]
        result = outs
    else:
        t = _wrap(out)
        if layouts is not None:
            t._layout = layouts[0]
        if not (rec and _record_depth > 0 and op.backward is not None):
            return t
        outs = (t,)
        result = t
    if rec and _record_depth > 0 and op.backward is not None:
        node = Node.__new__(Node)
        node.op = op
        node.attrs = attrs
        if op.reads_inputs or _keep_inputs > 0:
            node.inputs = inputs
        else:
            node.inputs = tuple([_stand_in(x, op.name) for x in inputs])
        node.out_meta = tuple([_meta(<TensorBase>o) for o in outs])
        if op.save_outputs:
            node.outputs = tuple([_detached(<TensorBase>o) for o in outs])
        for x in outs:
            (<TensorBase>x)._node = node
    return result


cdef inline object _shape(object x):
    """`x.shape`, read from a Tensor's array directly when it is a plain written value
    (no property dispatch: a Parameter's shape is a Python property)."""
    cdef TensorBase t
    if isinstance(x, TensorBase):
        t = <TensorBase>x
        if t._layout is None and t._lazy is None and type(t._arr) is _ndarray:
            return (<object>t._arr).shape
    return x.shape


cdef inline tuple _meta(TensorBase t):
    """(shape, dtype) of a Tensor just made by `_wrap` (its array read directly when it
    is a plain written value)."""
    cdef object a
    if t._layout is None and t._lazy is None and type(t._arr) is _ndarray:
        a = t._arr
        return (a.shape, a.dtype)
    return (t.shape, t.dtype)


cdef TensorBase _detached(TensorBase o):
    cdef TensorBase t = _wrap(o._lazy if o._lazy is not None else o._arr)
    t._layout = o._layout
    return t


def detached(TensorBase t):
    """A Tensor over `t`'s storage and layout, off the tape (a deferred stack stays
    deferred, shared with `t`)."""
    return _detached(t)


def finish(OpDef op, attrs, tuple inputs, out, bint rec, layouts=None):
    """Wrap outputs computed by the parallel layer and record them on the tape."""
    return _finish(op, attrs, inputs, out, rec, layouts)


def wrap_dist(stack, layout):
    """A Tensor over a local stack with `layout` (None: a plain global value)."""
    cdef TensorBase t = _wrap(stack)
    t._layout = layout
    return t


# ----------------------------------------------------------------------------
# reverse-mode walk
# ----------------------------------------------------------------------------
cdef long _topo_walks = 0        # counts _topo_order calls: a node's _mark == this: seen


cdef list _topo_order(list roots):
    """Nodes reachable from `roots`, each before every node it consumes
    (iterative post-order DFS, reversed; traced graphs are deep).

    A node is appended only after all of its inputs' nodes have been appended:
    the DFS descends into one unvisited input at a time, so a node marked seen
    is either finished or on the current path (impossible in a DAG). Seen nodes
    carry this walk's number in `_mark` (no set of ids to build)."""
    global _topo_walks
    _topo_walks += 1
    cdef long walk = _topo_walks
    cdef list order = []
    cdef list nodes = []           # the current DFS path
    cdef list next_input = []      # per path entry: index of the next input to visit
    cdef Node node
    cdef object x, p
    cdef Py_ssize_t k, top, n_in
    for r in roots:
        if r is None or (<Node>r)._mark == walk:
            continue
        (<Node>r)._mark = walk
        nodes.append(r)
        next_input.append(0)
        while nodes:
            top = len(nodes) - 1
            node = <Node>nodes[top]
            k = next_input[top]
            n_in = len(node.inputs)
            p = None
            while k < n_in:
                x = node.inputs[k]
                k += 1
                if isinstance(x, TensorBase):
                    p = (<TensorBase>x)._node
                    if p is not None and (<Node>p)._mark != walk:
                        break
                p = None
            next_input[top] = k
            if p is not None:
                (<Node>p)._mark = walk
                nodes.append(p)
                next_input.append(0)
            else:
                nodes.pop()
                next_input.pop()
                order.append(node)
    order.reverse()   # consumers first
    return order


def run_backward(tuple roots, tuple seeds, long tape, long nslots, add_op, zeros_like):
    """Propagate `seeds` (one gradient Tensor per root) back to the leaves of `tape`.

    Returns a list of `nslots` gradients (None where no path reached a slot).
    `add_op` accumulates gradients; `zeros_like(shape, dtype)` builds zero
    gradients for unused outputs of multi-output ops.
    """
    cdef dict pending = {}    # id(node) -> list of output grads
    cdef list results = [None] * nslots
    cdef list root_nodes = []
    cdef Node node, pn
    cdef TensorBase r
    cdef Py_ssize_t i, k
    for k in range(len(roots)):
        r = <TensorBase>roots[k]
        if r._node is None:
            continue
        node = <Node>r._node
        _accumulate(pending, node, r._out_index, seeds[k], add_op)
        root_nodes.append(node)
    cdef list order = _topo_order(root_nodes)
    global _phase
    _phase = 1
    try:
        _walk(order, pending, results, tape, nslots, add_op, zeros_like)
    finally:
        _phase = 0
    return results


cdef _walk(list order, dict pending, list results, long tape, long nslots, add_op,
           zeros_like):
    cdef Node node
    cdef Py_ssize_t i
    with paused_recording():
        for node in order:
            glist = pending.pop(id(node), None)
            if glist is None:
                continue
            if node.op is None:
                if node.tape == tape and 0 <= node.slot < nslots:
                    g = glist[0]
                    if results[node.slot] is None:
                        results[node.slot] = g
                    else:
                        results[node.slot] = apply(add_op, None, (results[node.slot], g))
                continue
            douts = []
            for i in range(len(node.out_meta)):
                g = glist[i]
                if g is None:
                    shape, dt = node.out_meta[i]
                    g = zeros_like(shape, dt)
                douts.append(g)
            grads = node.op.backward(node, *douts)
            if not isinstance(grads, tuple) or len(grads) != len(node.inputs):
                raise RuntimeError(
                    f"{node.op.name}: backward rule returned {type(grads).__name__} of "
                    f"length {len(grads) if isinstance(grads, tuple) else '?'}; expected a "
                    f"tuple of {len(node.inputs)} gradients")
            for i in range(len(node.inputs)):
                x = node.inputs[i]
                g = grads[i]
                if g is None or not isinstance(x, TensorBase):
                    continue
                p = (<TensorBase>x)._node
                if p is None:
                    continue
                if _shape(g) != _shape(x):
                    raise RuntimeError(
                        f"{node.op.name}: backward rule gave input {i} a gradient of shape "
                        f"{g.shape}; the input has shape {x.shape}")
                _accumulate(pending, <Node>p, (<TensorBase>x)._out_index, g, add_op)


cdef void _accumulate(dict pending, Node node, int index, object g, object add_op) except *:
    key = id(node)
    glist = pending.get(key)
    if glist is None:
        glist = [None] * (len(node.out_meta) if node.op is not None else 1)
        pending[key] = glist
    if glist[index] is None:
        glist[index] = g
    else:
        glist[index] = apply(add_op, None, (glist[index], g))
