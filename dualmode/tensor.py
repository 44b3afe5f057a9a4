"""Tensor and Parameter: the user-facing values.

A Tensor holds one logical (global) value. Its storage and tape link live in the
Cython base class (`dualmode._core._tensor.TensorBase`); every operation goes
through the one dispatcher `apply`, so this module only adds the Python API.
"""
from __future__ import annotations

import contextlib
import copy
import numbers
import weakref

import numpy as np

from ._core import _tensor as _core
from ._core._tensor import TensorBase
from .common import dtype as _dt

__all__ = ["Tensor", "Parameter", "ParameterTuple", "no_init_parameters", "live_parameters"]


def _default_array(data, dtype):
    """numpy value of `data` with MindSpore's default dtypes (float -> float32)."""
    if dtype is not None:
        dtype = _dt.as_dtype(dtype, "Tensor")
    if isinstance(data, TensorBase):
        arr = data._value()
        return np.array(arr, dtype=dtype if dtype is not None else arr.dtype)
    if isinstance(data, (np.ndarray, np.generic)):      # numpy values keep their dtype
        arr = np.array(data, dtype=dtype)
    elif isinstance(data, bool):
        arr = np.array(data, dtype=dtype or np.bool_)
    elif isinstance(data, numbers.Integral):
        arr = np.array(data, dtype=dtype or np.int64)
    elif isinstance(data, numbers.Real):
        arr = np.array(data, dtype=dtype or np.float32)
    elif isinstance(data, (list, tuple)):
        try:
            arr = np.array(data, dtype=dtype)
        except (ValueError, TypeError) as e:
            raise ValueError(f"Tensor: cannot build a tensor from the nested sequence given "
                             f"(ragged or mixed values?): {e}") from None
        if dtype is None and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
    else:
        raise TypeError(f"Tensor: input_data of type {type(data).__name__} is not supported; "
                        f"expected a numpy array, list, tuple, Python number or Tensor")
    if arr.dtype not in _dt.SUPPORTED:
        raise TypeError(f"Tensor: dtype {arr.dtype} is not supported; expected one of "
                        f"{', '.join(str(d) for d in _dt.SUPPORTED)}")
    return arr


class Tensor(TensorBase):
    """A numpy-backed tensor (one logical value).

    Parameters
    ----------
    input_data : numpy.ndarray, list, tuple, Python number or Tensor
        The value; copied. Python floats default to float32, ints to int64.
    dtype : numpy dtype, optional
        Convert to this dtype (``dm.float32``, ``dm.int32``, ...).
    """

    __slots__ = ()

    # numpy's binary operators defer to ours (ndarray + Tensor -> Tensor.__radd__), while
    # numpy functions (np.exp(t), np.mean(t)) still see the value through __array__
    __array_priority__ = 1000

    def __init__(self, input_data=None, dtype=None):
        if input_data is None:
            raise TypeError("Tensor: input_data is required (a numpy array, list or number)")
        self._data = _default_array(input_data, dtype)
        self._node = None

    @classmethod
    def _from_array(cls, arr):
        """Wrap a numpy array without copying (internal fast constructor)."""
        t = TensorBase.__new__(cls)
        t._data = arr
        return t

    # ---- conversion ---------------------------------------------------------
    def asnumpy(self) -> np.ndarray:
        """The global value as a new numpy array."""
        return np.array(self._value())

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self._value())      # a resolved 0-d sum can be a numpy scalar
        if dtype is not None:
            return arr.astype(dtype)
        return np.array(arr) if copy else arr

    def item(self):
        """The value of a one-element tensor as a Python scalar."""
        arr = self._value()
        if arr.size != 1:
            raise ValueError(f"Tensor.item: only one-element tensors convert to a Python "
                             f"scalar; this tensor has shape {arr.shape}")
        return arr.item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        return bool(self.item())

    def __len__(self):
        shape = self.shape
        if not shape:
            raise TypeError("len() of a 0-d Tensor")
        return shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, value=\n{self._value()!r})"

    def __str__(self):
        return str(self._value())

    __hash__ = object.__hash__

    # ---- operators (+ - * / live in the Cython base) ---------------------------
    def __neg__(self):
        return _F.neg(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _F.abs(self)

    def __pow__(self, exponent):
        return _F.pow(self, exponent)

    def __rpow__(self, base):
        return _F.pow(base, self)

    def __matmul__(self, other):
        return _F.matmul(self, other)

    def __rmatmul__(self, other):
        return _F.matmul(other, self)

    def __floordiv__(self, other):
        return _F.floor_div(self, other)

    def __rfloordiv__(self, other):
        return _F.floor_div(other, self)

    def __mod__(self, other):
        return _F.floor_mod(self, other)

    def __rmod__(self, other):
        return _F.floor_mod(other, self)

    def __eq__(self, other):
        if other is None:
            return False
        return _F.equal(self, other)

    def __ne__(self, other):
        if other is None:
            return True
        return _F.not_equal(self, other)

    def __lt__(self, other):
        return _F.less(self, other)

    def __le__(self, other):
        return _F.less_equal(self, other)

    def __gt__(self, other):
        return _F.greater(self, other)

    def __ge__(self, other):
        return _F.greater_equal(self, other)

    def __getitem__(self, index):
        return _F.getitem(self, index)

    def __setitem__(self, index, value):
        if self._node is not None and _core.recording():
            raise RuntimeError("Tensor.__setitem__: cannot assign in place into a tensor that "
                               "is being differentiated; build a new tensor instead")
        if self._layout is not None:
            raise RuntimeError("Tensor.__setitem__: in-place assignment into a distributed "
                               f"tensor (layout {self._layout!r}) is not supported; build a new "
                               "tensor (e.g. with ops.concat or arithmetic) instead")
        arr = self._value()
        arr[index] = value._value() if isinstance(value, TensorBase) else value

    # ---- methods --------------------------------------------------------------
    def astype(self, dtype):
        """A copy converted to `dtype` (differentiable)."""
        return _F.cast(self, dtype)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _F.reshape(self, shape)

    def transpose(self, *perm):
        if not perm:
            perm = tuple(range(self.ndim))[::-1]
        elif len(perm) == 1 and isinstance(perm[0], (tuple, list)):
            perm = tuple(perm[0])
        return _F.transpose(self, perm)

    @property
    def T(self):
        return self.transpose()

    # reductions: MindSpore's names; also called by numpy (np.sum(t) -> t.sum(axis=, out=))
    def _reduce(self, fn, axis, dtype, keepdims, out, name):
        if out is not None:
            raise TypeError(f"Tensor.{name}: out= is not supported (tensors are immutable "
                            f"values)")
        x = self if dtype is None else _F.cast(self, dtype)
        return fn(x, axis if axis is not None else (), bool(keepdims))

    def sum(self, axis=None, dtype=None, keepdims=False, out=None):
        """Sum over `axis` (None: all axes)."""
        return self._reduce(_F.reduce_sum, axis, dtype, keepdims, out, "sum")

    def mean(self, axis=None, keep_dims=False, dtype=None, out=None, keepdims=None):
        """Mean over `axis` (None: all axes)."""
        keep = keep_dims if keepdims is None else keepdims
        return self._reduce(_F.reduce_mean, axis, dtype, keep, out, "mean")

    def max(self, axis=None, keepdims=False, out=None):
        """Max over `axis` (None: all axes)."""
        return self._reduce(_F.reduce_max, axis, None, keepdims, out, "max")

    def min(self, axis=None, keepdims=False, out=None):
        """Min over `axis` (None: all axes)."""
        return self._reduce(_F.reduce_min, axis, None, keepdims, out, "min")

    def exp(self):
        return _F.exp(self)

    def log(self):
        return _F.log(self)

    def flatten(self):
        return _F.reshape(self, (-1,))

    def copy(self):
        """A new tensor with the same value (differentiable, like any op)."""
        return _F.cast(self, self.dtype)

    # ---- copy.copy, copy.deepcopy, pickle ----------------------------------------
    def __copy__(self):
        """``copy.copy``: a new tensor object over the same storage (a value updated in
        place, as an optimizer updates a Parameter, shows in both) and the same
        attributes; off the tape (a constant, like a detached tensor)."""
        new = TensorBase.__new__(type(self))
        self._copy_to(new, None)
        return new

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: an independent tensor with an equal value, the same dtype,
        shape and layout, and deep copies of its other attributes; off the tape.

        A distributed tensor's storage is copied as it is stored, with no communication:
        this process's stack of local shards (a deferred stack, such as a Parameter's
        replicas stored once, stays deferred), in the same layout. A delayed value
        (``no_init_parameters``) stays delayed, with a copy of its initializer, which
        makes the same values."""
        new = TensorBase.__new__(type(self))
        memo[id(self)] = new
        self._copy_to(new, memo)
        return new

    def _copy_to(self, new, memo):
        """Give `new` (a bare instance of this class) this tensor's storage and
        attributes: shared when `memo` is None (``copy.copy``), else deep-copied through
        `memo` (arrays held elsewhere in the copied objects stay one array). The layout,
        an immutable description, is shared; the tape node is not copied."""
        def dup(v):
            return v if memo is None else copy.deepcopy(v, memo)
        lay = self._layout
        if lay is not None and memo is not None:
            memo.setdefault(id(lay), lay)   # also shared where the copied objects hold it
        new._layout = lay
        if self._lazy is not None:
            new._lazy = dup(self._lazy)
        else:
            new._arr = dup(self._arr)
        for name in _extra_slots(type(self)):
            if hasattr(self, name):
                setattr(new, name, dup(getattr(self, name)))
        attrs = getattr(self, "__dict__", None)
        if attrs:
            new.__dict__.update(dup(attrs))

    def __reduce_ex__(self, protocol):
        """``pickle``: the global value (read as ``asnumpy`` reads it: under "mpi" an
        AllGather, so every rank pickles the tensor, in the same order) or a delayed
        value's initializer, and the other attributes. It loads as a plain global value
        (no layout: the devices it was split over need not exist where it is loaded),
        off the tape. A tensor with one value per device and no global value (a
        ``layerwise_parallel`` weight given its devices' slices) cannot be pickled."""
        delayed = self._layout is None and self._lazy is None and self._arr is None
        value = None if delayed else np.asarray(self._value())
        if value is not None and value.shape != tuple(self.shape):
            what = " ".join(str(w) for w in (type(self).__name__, getattr(self, "name", None))
                            if w is not None)
            raise TypeError(f"{what}: cannot be pickled: it holds one value per device "
                            f"({self._layout!r}), read as a whole a stack of shape "
                            f"{value.shape}, not a global value of its shape {self.shape}; "
                            f"copy.deepcopy copies it within this process")
        slots = {name: getattr(self, name) for name in _extra_slots(type(self))
                 if hasattr(self, name)}
        return _unpickle, (type(self), value, slots, getattr(self, "__dict__", None))


def _extra_slots(cls) -> list:
    """The instance attributes the subclass `cls` of Tensor declares in ``__slots__``
    (its own and its bases'; the storage slots of TensorBase are not among them)."""
    names = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return names


def _unpickle(cls, value, slots, attrs):
    """A tensor of class `cls` rebuilt from ``Tensor.__reduce_ex__``'s parts."""
    t = TensorBase.__new__(cls)
    t._data = value
    for name, v in slots.items():
        setattr(t, name, v)
    if attrs:
        t.__dict__.update(attrs)
    if isinstance(t, Parameter):
        _track(t)
    return t


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------
class _InitState:
    """Whether parameters created now delay their initialisation."""

    delay = 0


@contextlib.contextmanager
def no_init_parameters():
    """Parameters created inside get their values only when first needed."""
    _InitState.delay += 1
    try:
        yield
    finally:
        _InitState.delay -= 1


# every Parameter alive in the process (by id, weakly): CommReport's per-device memory
# reads their storage
_LIVE = {}


def _forget(key, ref):
    if _LIVE.get(key) is ref:
        del _LIVE[key]


def _track(param) -> None:
    """Count `param` among the live parameters (:func:`live_parameters`)."""
    key = id(param)
    _LIVE[key] = weakref.ref(param, lambda r, key=key: _forget(key, r))


def live_parameters() -> list:
    """The Parameters alive in this process (in creation order)."""
    return [p for p in (r() for r in list(_LIVE.values())) if p is not None]


class DeclaredShape:
    """Mixin for tensors whose shape and dtype are known before their value exists
    (delayed creation): reads `_shape` / `_dtype` instead of the data."""

    __slots__ = ()

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    @property
    def ndim(self):
        return len(self._shape)


class Parameter(DeclaredShape, Tensor):
    """A trainable tensor owned by a Cell.

    Parameters
    ----------
    default_input : Tensor, numpy array, number, or ``initializer(...)`` result
    name : str, optional
        Set from the attribute path when a Cell registers it and none is given.
    requires_grad : bool
        Whether optimizers update it (``Cell.trainable_params``).
    layerwise_parallel : bool
        Hybrid parallel: the value is this device's slice; no automatic communication.
    """

    __slots__ = ("name", "requires_grad", "layerwise_parallel", "_init", "_shape",
                 "_dtype", "__dict__")

    def __init__(self, default_input, name=None, requires_grad=True, layerwise_parallel=False):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Parameter: name must be a str, got {type(name).__name__}")
        if not isinstance(requires_grad, bool):
            raise TypeError(f"Parameter {name}: requires_grad must be a bool, "
                            f"got {requires_grad!r}")
        if not isinstance(layerwise_parallel, bool):
            raise TypeError(f"Parameter {name}: layerwise_parallel must be a bool, "
                            f"got {layerwise_parallel!r}")
        self.name = name
        self.requires_grad = requires_grad
        self.layerwise_parallel = layerwise_parallel
        self._node = None
        _track(self)
        init = getattr(default_input, "_init", None) if isinstance(default_input, TensorBase) \
            else None
        if init is not None and default_input._data is None:
            self._init = init
            self._shape = default_input._shape
            self._dtype = default_input._dtype
            self._data = None
            if not _InitState.delay:
                self._materialize()
        else:
            self._init = None
            self._data = _default_array(default_input, None)
            self._shape = self._data.shape
            self._dtype = self._data.dtype
        if layerwise_parallel and _LAYERWISE and self._data is not None:
            _LAYERWISE[0](self)

    @property
    def has_init(self) -> bool:
        """True while the value is delayed (not yet created); a deferred value (e.g. a
        weight stored as its optimizer slices) is not read."""
        return self._arr is None and self._lazy is None

    def _materialize(self):
        if self._init is None:
            raise RuntimeError(f"Parameter {self.name}: has no value and no initializer")
        self._data = self._init(self._shape, self._dtype)
        self._init = None

    def _init_blocks(self, starts, block_shape):
        """The stack ``(len(starts), *block_shape)`` of the blocks of the delayed value
        starting at the rows of `starts`, made by the initializer without building the
        whole tensor (the caller stores them; the parameter stays delayed)."""
        if self._init is None:
            raise RuntimeError(f"Parameter {self.name}: has no value and no initializer")
        try:
            return self._init.blocks(self._shape, self._dtype, starts, block_shape)
        except (ValueError, TypeError) as e:
            raise type(e)(f"Parameter {self.name}: {e}") from None

    def _current(self):
        """The value for a reader (``asnumpy``, numpy, checkpoints): a copy that a
        parameter server worker marked stale (the servers hold the weight and changed
        it since) is first made equal to the servers' value."""
        if _READ_HOOKS and self.__dict__.get("ps_stale"):
            _READ_HOOKS[0](self)
        return self._value()

    def asnumpy(self) -> np.ndarray:
        """The global value as a new numpy array."""
        return np.array(self._current())

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self._current())
        if dtype is not None:
            return arr.astype(dtype)
        return np.array(arr) if copy else arr

    def init_data(self):
        """Create the value now (no-op when it exists). Returns self."""
        if self._data is None:
            self._materialize()
        return self

    def set_data(self, data):
        """Replace the value; the shape must stay the same (dtype is converted)."""
        arr = _default_array(data, None)
        if arr.shape != self._shape:
            raise ValueError(f"Parameter {self.name}: set_data got shape {arr.shape}; "
                             f"the parameter has shape {self._shape}")
        self._data = np.ascontiguousarray(arr, dtype=self._dtype)
        self._layout = None             # a new global value (per-device slices are reset)
        self._init = None
        if self.layerwise_parallel and _LAYERWISE:
            _LAYERWISE[0](self)
        return self

    @property
    def is_param_ps(self) -> bool:
        """Whether :meth:`set_param_ps` marked this weight as held by the parameter
        servers."""
        return bool(self.__dict__.get("_ps", False))

    def _check_param_ps(self, init_in_server) -> None:
        """The errors of ``set_param_ps(init_in_server)``, raised before anything is
        marked."""
        if not isinstance(init_in_server, bool):
            raise TypeError(f"Parameter {self.name}: set_param_ps(init_in_server="
                            f"{init_in_server!r}) needs a bool")
        if init_in_server and not self.__dict__.get("ps_sparse", False):
            raise ValueError(f"Parameter {self.name}: set_param_ps(init_in_server=True) is "
                             "supported for the embedding_table of an nn.EmbeddingLookup "
                             "with sparse=True only; other weights are initialised on the "
                             "workers (init_in_server=False)")

    def set_param_ps(self, init_in_server: bool = False):
        """Hold this weight on the parameter servers (parameter server mode):
        workers push its gradient and pull its new value at each optimizer call.
        Without ``set_ps_context(enable_ps=True)`` the mark changes nothing, so the same
        script also runs on one device.

        Parameters
        ----------
        init_in_server : bool
            False: the value is initialised on the workers (all alike, from the same
            seed) and sent to the servers at the first optimizer call. True (as in
            MindSpore, only for the ``embedding_table`` of an ``nn.EmbeddingLookup``
            with ``sparse=True``): each server makes its rows from the table's
            initializer, the same values bit for bit, and a worker never makes or holds
            the whole table, only the rows it looks up.
        """
        self._check_param_ps(init_in_server)
        self.__dict__["ps_init_in_server"] = init_in_server
        self.__dict__["_ps"] = True
        return self

    def clone(self, prefix="clone", init="same"):
        """A new parameter named `prefix.name`: a copy, or filled by `init` ("zeros", ...)."""
        if init == "same":
            value = Tensor._from_array(np.array(self._value()))
        else:
            if not _INITIALIZER:
                raise RuntimeError(f"Parameter {self.name}: clone(init={init!r}) needs "
                                   f"dualmode.common.initializer; import dualmode")
            value = _INITIALIZER[0](init, self._shape, self._dtype)
        # a clone of a delayed parameter (an optimizer state) stays delayed as well, so
        # it too can be made in the layout its parameter ends up in
        with no_init_parameters() if self._data is None else contextlib.nullcontext():
            return Parameter(value, name=f"{prefix}.{self.name}",
                             requires_grad=self.requires_grad,
                             layerwise_parallel=self.layerwise_parallel)

    def _copy_to(self, new, memo):
        """As :meth:`Tensor._copy_to`; the copy is a live parameter too."""
        super()._copy_to(new, memo)
        _track(new)

    def __repr__(self):
        return (f"Parameter(name={self.name}, shape={self._shape}, dtype={self._dtype}, "
                f"requires_grad={self.requires_grad})")

    __hash__ = object.__hash__


_core.set_tensor_class(Tensor)

#: ``initializer(init, shape, dtype)`` for ``Parameter.clone(init=...)``: the initializer
#: module builds on Tensor, so it registers itself here when imported
_INITIALIZER = []


def register_initializer(fn) -> None:
    """Install the function ``Parameter.clone`` makes a filled copy with."""
    _INITIALIZER[:] = [fn]


class ParameterTuple(tuple):
    """A tuple of Parameters, as MindSpore's (``ParameterTuple(net.trainable_params())``
    for ``GradOperation(get_by_list=True)`` and optimizers)."""

    def __new__(cls, iterable=()):
        items = tuple(iterable)
        for i, p in enumerate(items):
            if not isinstance(p, Parameter):
                raise TypeError(f"ParameterTuple: item {i} is a {type(p).__name__}; every "
                                f"item must be a Parameter")
        return super().__new__(cls, items)


#: ``hook(param)`` run when a ``layerwise_parallel`` Parameter gets a value (created or
#: ``set_data``): when several devices run the program it makes the value each device's own
#: (the parallel layer builds on Tensor, so it registers itself here when imported)
_LAYERWISE = []


def register_layerwise_hook(fn) -> None:
    """Install the function a ``layerwise_parallel`` Parameter given a value calls."""
    _LAYERWISE[:] = [fn]


#: ``hook(param)`` run before a reader sees a Parameter marked ``ps_stale``: the
#: parameter server worker pulls the servers' value (it builds on Tensor, so it
#: registers itself here when imported)
_READ_HOOKS = []


def register_read_hook(fn) -> None:
    """Install the function that makes a stale Parameter current before it is read."""
    _READ_HOOKS[:] = [fn]


from .ops import functional as _F  # noqa: E402  (ops needs Tensor defined first)
