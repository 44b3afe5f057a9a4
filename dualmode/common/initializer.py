"""Weight initializers (``initializer("normal", shape, dtype)``) with delayed creation.

``initializer(...)`` returns a Tensor whose value is produced only when first
needed; a Parameter built from it inside ``no_init_parameters()`` stays
uncreated until then, and a parameter stored sharded then builds only its local
blocks (``Initializer.blocks``), never the whole tensor.

Random values come from a counter-based generator (Philox4x32-10, the Cython kernels
of ``dualmode/_core/_random.pyx``): element ``i`` (flat, C order) of a random tensor
is a function of ``(key, i)`` only, so every block of the tensor is computed on its own
and equals the same slice of the whole tensor bit for bit. The 64-bit **key** of a
tensor is fixed when ``initializer(...)`` binds it (``Initializer.bind``): the n-th
random initializer bound since ``dm.set_seed(seed)`` gets
``key = Philox4x32-10(counter=(n, "init"), key=seed mod 2**64)`` (seed 0 until one is
set). The same seed and the same order of parameter creation therefore give the same
values, whatever other code draws from ``context.rng()`` and whenever (or in how many
pieces) the values are finally made.
"""
from __future__ import annotations

import copy
import math
import numbers

import numpy as np

from .._core import _random
from .. import context
from .. import tensor as _tensor
from ..tensor import DeclaredShape, Tensor
from . import dtype as _dt

__all__ = ["initializer", "Initializer", "Normal", "Uniform", "Zero", "One", "Constant",
           "XavierUniform", "HeUniform", "HeNormal", "describe", "described"]

_MASK64 = (1 << 64) - 1
_KEY_TAG = 0x74696E69                   # "init": the key-derivation counter's high words


class _KeyStream:
    """Keys for random tensors: a counter that restarts whenever ``dm.set_seed`` (or a
    context reset) replaces the context's generator."""

    __slots__ = ("generator", "count")

    def __init__(self):
        self.generator, self.count = None, 0

    def next_key(self) -> int:
        gen = context.rng()
        if gen is not self.generator:       # a new seed: count from 0 again
            self.generator, self.count = gen, 0
        n = self.count
        self.count = n + 1
        seed = (context.get_seed() or 0) & _MASK64
        x0, x1, _, _ = _random.philox4x32_10(n & _MASK64, _KEY_TAG, seed)
        return x0 | (x1 << 32)


_KEYS = _KeyStream()


def next_key() -> int:
    """The key of the next random tensor (see the module docstring)."""
    return _KEYS.next_key()


def _fans(shape):
    if len(shape) < 2:
        raise ValueError(f"initializer: fan-in/fan-out need a shape of rank >= 2, got {shape}")
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    # MindSpore/PyTorch convention: weight (out, in, *kernel); an empty weight has no
    # values to scale, so its fans are taken as at least 1
    return max(shape[1] * receptive, 1), max(shape[0] * receptive, 1)


def _as_shape(shape, what="shape"):
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0
            for s in shape):
        raise ValueError(f"initializer: {what}={shape!r} must be a tuple/list of ints >= 0")
    return tuple(int(s) for s in shape)


def _index_blocks(shape, index):
    """(starts (1, ndim), steps, block shape) of `index`, a tuple of slices (one per
    leading dim; missing dims are whole)."""
    if isinstance(index, slice):
        index = (index,)
    if not isinstance(index, tuple) or not all(isinstance(s, slice) for s in index):
        raise TypeError(f"initializer: a block index must be a tuple of slices, got {index!r}")
    if len(index) > len(shape):
        raise ValueError(f"initializer: block index {index!r} has {len(index)} entries but the "
                         f"tensor has rank {len(shape)} (shape {shape})")
    starts, steps, bshape = [], [], []
    for s, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
        r = range(*s.indices(n))
        starts.append(r.start if len(r) else 0)
        steps.append(r.step)
        bshape.append(len(r))
    return np.array([starts], np.int64), tuple(steps), tuple(bshape)


def _check_blocks(shape, starts, block_shape, steps):
    """Validated (starts (nb, ndim) int64, block shape, steps) for `Initializer.blocks`."""
    nd = len(shape)
    block_shape = _as_shape(block_shape, "block_shape")
    st = np.asarray(starts)
    if st.dtype.kind not in "iu" or st.ndim != 2 or st.shape[1] != nd:
        raise ValueError(f"initializer: starts must be an int array (num_blocks, {nd}) for "
                         f"shape {shape}, got {st.dtype} {st.shape}")
    st = np.ascontiguousarray(st, np.int64)
    steps = (1,) * nd if steps is None else tuple(int(s) for s in steps)
    if len(block_shape) != nd or len(steps) != nd or 0 in steps:
        raise ValueError(f"initializer: block_shape={block_shape} and steps={steps} need one "
                         f"entry per dim of shape {shape} (steps nonzero)")
    if st.size and math.prod(block_shape):
        last = st + (np.array(block_shape, np.int64) - 1) * np.array(steps, np.int64)
        bad = (np.minimum(st, last) < 0) | (np.maximum(st, last) >= np.array(shape, np.int64))
        if bad.any():
            k = int(np.argwhere(bad)[0][0])
            raise ValueError(f"initializer: block {k} (start {tuple(st[k].tolist())}, shape "
                             f"{block_shape}, steps {steps}) lies outside shape {shape}")
    return st, block_shape, steps


class Initializer:
    """Base class: ``init(shape, dtype) -> numpy array``, and any of its blocks.

    Subclasses define ``_blocks(shape, dtype, starts, block_shape, steps)`` returning the
    stack ``(len(starts), *block_shape)`` of the blocks starting at the rows of
    ``starts`` (already validated); an older subclass defining only ``_make(shape)``
    (or ``__call__``) still works, building the whole tensor to cut blocks from it.
    """

    _random = False     # draws random numbers (needs a key)
    _key = None         # the key fixed by bind(); None: a fresh key per call

    def __call__(self, shape, dtype):
        shape = _as_shape(tuple(shape))
        return self.blocks(shape, dtype, np.zeros((1, len(shape)), np.int64), shape)[0]

    def bind(self, key=None) -> "Initializer":
        """A copy whose random values are fixed by `key` (the next key when None), so
        its whole tensor and its blocks agree; wrapped initializers are bound too."""
        c = copy.copy(self)
        for name, value in vars(c).items():
            if isinstance(value, Initializer):
                setattr(c, name, value.bind())
        if self._random:
            c._key = next_key() if key is None else int(key) & _MASK64
        return c

    def block(self, shape, dtype, index):
        """The values of block `index` (a tuple of slices) of the tensor of `shape`:
        equal to ``init(shape, dtype)[index]`` for a bound initializer."""
        shape = _as_shape(tuple(shape))
        starts, steps, bshape = _index_blocks(shape, index)
        return self.blocks(shape, dtype, starts, bshape, steps)[0]

    def blocks(self, shape, dtype, starts, block_shape, steps=None):
        """The stack ``(len(starts), *block_shape)`` of equally shaped blocks of the tensor
        of `shape`: block k holds the elements ``starts[k][d] + j * steps[d]``,
        ``0 <= j < block_shape[d]``, along each dim d (steps default to 1)."""
        shape = _as_shape(tuple(shape))
        dtype = np.dtype(_dt.as_dtype(dtype, "initializer"))
        self.check_shape(shape)
        starts, block_shape, steps = _check_blocks(shape, starts, block_shape, steps)
        return self._blocks(shape, dtype, starts, block_shape, steps)

    def check_shape(self, shape):
        """Raise a ValueError now if `shape` cannot be filled (values are made later)."""

    def _blocks(self, shape, dtype, starts, block_shape, steps):
        # an older subclass: only the whole tensor can be made, so cut the blocks from it
        if type(self).__call__ is not Initializer.__call__:
            full = np.asarray(self(shape, dtype), dtype=dtype)
        else:
            full = np.asarray(self._make(shape), dtype=dtype)
        return _cut_blocks(full, starts, block_shape, steps)

    def _make(self, shape):
        raise NotImplementedError(f"{type(self).__name__}: an Initializer defines _blocks "
                                  f"(or _make)")

    def __repr__(self):
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def _cut_blocks(full, starts, block_shape, steps):
    """Blocks of an existing whole tensor (the fallback for make-only initializers)."""
    nb = starts.shape[0]
    out = np.empty((nb,) + tuple(block_shape), full.dtype)
    for k in range(nb):     # a fallback path: one slice per block
        out[k] = full[tuple(slice(s, s + n * t if s + n * t >= 0 else None, t) if n else
                            slice(0, 0) for s, n, t in zip(starts[k].tolist(), block_shape,
                                                          steps))]
    return out


def _strides(shape):
    """Element strides of a C-ordered tensor of `shape` (int64)."""
    out = np.ones(len(shape), np.int64)
    if len(shape) > 1:
        out[:-1] = np.cumprod(np.asarray(shape[:0:-1], np.int64))[::-1]
    return out


class _Random(Initializer):
    """Initializers whose values come from the Philox generator: U(a, b) or N(a, b²)."""

    _random = True

    def _dist(self, shape):
        """(kind, a, b): ``_random.UNIFORM`` with bounds, or ``_random.NORMAL`` with mean
        and standard deviation, for a tensor of `shape`."""
        raise NotImplementedError

    def _blocks(self, shape, dtype, starts, block_shape, steps):
        kind, a, b = self._dist(shape)
        key = self._key if self._key is not None else next_key()
        work = np.float32 if dtype == np.float32 else np.float64
        out = np.empty((starts.shape[0],) + block_shape, work)
        _random.fill_blocks(key, _strides(shape), starts, np.asarray(steps, np.int64),
                            np.asarray(block_shape, np.int64), out.reshape(-1), kind,
                            float(a), float(b))
        return out.astype(dtype, copy=False)


class _Filled(Initializer):
    """Initializers filling every element with one value."""

    value = 0

    def _blocks(self, shape, dtype, starts, block_shape, steps):
        return np.full((starts.shape[0],) + block_shape, self.value, dtype=dtype)


class Normal(_Random):
    """N(mean, sigma²); MindSpore's default sigma is 0.01."""

    def __init__(self, sigma=0.01, mean=0.0):
        self.sigma, self.mean = float(sigma), float(mean)

    def _dist(self, shape):
        return _random.NORMAL, self.mean, self.sigma


class Uniform(_Random):
    """U(-scale, scale); MindSpore's default scale is 0.07."""

    def __init__(self, scale=0.07):
        self.scale = float(scale)

    def _dist(self, shape):
        return _random.UNIFORM, -self.scale, self.scale


class Zero(_Filled):
    value = 0


class One(_Filled):
    value = 1


class Constant(_Filled):
    def __init__(self, value):
        self.value = value


class _FanBased(_Random):
    """Initializers whose scale depends on fan-in/fan-out (rank >= 2 shapes)."""

    def check_shape(self, shape):
        _fans(shape)


class XavierUniform(_FanBased):
    """U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""

    def __init__(self, gain=1.0):
        self.gain = float(gain)

    def _dist(self, shape):
        fan_in, fan_out = _fans(shape)
        bound = self.gain * math.sqrt(6.0 / (fan_in + fan_out))
        return _random.UNIFORM, -bound, bound


def _gain(nonlinearity, a):
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1 + a * a))
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    return 1.0


class HeUniform(_FanBased):
    """Kaiming uniform: U(-b, b), b = gain * sqrt(3 / fan_in) (Dense's default weight)."""

    def __init__(self, negative_slope=0.0, mode="fan_in", nonlinearity="leaky_relu"):
        self.negative_slope, self.mode, self.nonlinearity = negative_slope, mode, nonlinearity

    def _fan(self, shape):
        fan_in, fan_out = _fans(shape)
        return fan_in if self.mode == "fan_in" else fan_out

    def _dist(self, shape):
        bound = _gain(self.nonlinearity, self.negative_slope) * math.sqrt(3.0 / self._fan(shape))
        return _random.UNIFORM, -bound, bound


class HeNormal(HeUniform):
    """Kaiming normal: N(0, (gain / sqrt(fan))²)."""

    def _dist(self, shape):
        std = _gain(self.nonlinearity, self.negative_slope) / math.sqrt(self._fan(shape))
        return _random.NORMAL, 0.0, std


_NAMED = {
    "normal": Normal, "uniform": Uniform, "zeros": Zero, "zero": Zero, "ones": One,
    "one": One, "xavier_uniform": XavierUniform, "he_uniform": HeUniform,
    "he_normal": HeNormal,
}


#: the initializers that can be described to another process (describe / described)
_DESCRIBABLE = {cls.__name__: cls for cls in (Normal, Uniform, Zero, One, Constant,
                                              XavierUniform, HeUniform, HeNormal)}


def describe(init: Initializer) -> dict:
    """A JSON-able description of the bound initializer `init` (its class, arguments and
    key), from which :func:`described` rebuilds it in another process, where any block
    of its tensor is the same bit for bit. ValueError naming the initializer when it
    cannot be described (a user subclass, an unbound random one, a non-scalar
    argument)."""
    name = type(init).__name__
    if _DESCRIBABLE.get(name) is not type(init):
        raise ValueError(f"{name} cannot be described to another process; expected one of "
                         + ", ".join(_DESCRIBABLE))
    if init._random and init._key is None:
        raise ValueError(f"{name} is not bound to a key (Initializer.bind); its values would "
                         "differ between processes")
    args = {}
    for k, v in vars(init).items():
        if k.startswith("_"):
            continue
        if isinstance(v, np.generic):
            v = v.item()
        if not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"{name}: argument {k}={v!r} cannot be described to another "
                             "process; expected a number or a string")
        args[k] = v
    return {"cls": name, "args": args, "key": init._key}


def described(desc: dict) -> Initializer:
    """The initializer :func:`describe` described (ValueError for an unknown class)."""
    cls = _DESCRIBABLE.get(desc.get("cls"))
    if cls is None:
        raise ValueError(f"initializer class {desc.get('cls')!r} is not known; expected one "
                         f"of {', '.join(_DESCRIBABLE)}")
    init = cls.__new__(cls)
    vars(init).update(desc["args"])
    if desc.get("key") is not None:
        init._key = int(desc["key"])
    return init


class _DelayedTensor(DeclaredShape, Tensor):
    """A tensor whose value is made by an initializer when first needed."""

    __slots__ = ("_init", "_shape", "_dtype")

    def _materialize(self):
        self._data = self._init(self._shape, self._dtype)

    def init_data(self):
        if self._data is None:
            self._materialize()
        return self


def _as_init(init):
    if isinstance(init, Initializer):
        return init
    if isinstance(init, str):
        cls = _NAMED.get(init.lower())
        if cls is None:
            raise ValueError(f"initializer: init={init!r} is not a known initializer; expected "
                             f"one of {', '.join(repr(k) for k in _NAMED)}, an Initializer, a "
                             f"number or a Tensor")
        return cls()
    if isinstance(init, numbers.Number) and not isinstance(init, bool):
        return Constant(init)
    raise TypeError(f"initializer: init of type {type(init).__name__} is not supported; "
                    f"expected a str, an Initializer, a number or a Tensor")


def initializer(init, shape=None, dtype=np.float32):
    """A delayed tensor of `shape` and `dtype` filled by `init`.

    Parameters
    ----------
    init : str ("normal", "uniform", "zeros", "ones", "xavier_uniform", "he_uniform",
        "he_normal"), Initializer, number, or Tensor (returned as a copy; shape checked)
    shape : tuple/list of ints
    dtype : numpy dtype (default float32)

    A random initializer is bound to its key here (see the module docstring), so the
    tensor's whole value and any block of it (``t._init.block(shape, dtype, index)``)
    agree bit for bit.
    """
    dt = _dt.as_dtype(dtype, "initializer")
    if isinstance(init, Tensor):
        if shape is not None and tuple(shape) != tuple(init.shape):
            raise ValueError(f"initializer: the Tensor init has shape {tuple(init.shape)} but "
                             f"shape={tuple(shape)}")
        return Tensor(init, dt)
    if shape is None:
        raise ValueError("initializer: shape is required unless init is a Tensor")
    shape = _as_shape(shape)
    fn = _as_init(init)
    fn.check_shape(shape)
    t = _DelayedTensor.__new__(_DelayedTensor)
    t._data = None
    t._init = fn.bind()         # the key is fixed now: values do not depend on when
    t._shape = shape            # (or in how many blocks) they are made
    t._dtype = dt
    return t


_tensor.register_initializer(initializer)
