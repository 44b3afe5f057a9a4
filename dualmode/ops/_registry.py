"""The op registry: one `OpDef` per op, looked up by name.

Every layer reads the same record: eager execution (`apply`), autograd (the
backward rule), and, from later issues, sharding rules and graph lowering attach
to `OpDef.extras`. This module also holds the small validation helpers the op
definitions share, so every error message has the same shape.
"""
from __future__ import annotations

import numpy as np

from .._core._tensor import (KIND_BINARY, KIND_GENERIC, KIND_UNARY, OpDef, TensorBase,
                             apply, binary, broadcast_shapes, wrap)

__all__ = ["REGISTRY", "register", "get_op", "linearity", "apply", "binary", "OpDef", "KIND_BINARY",
           "KIND_GENERIC", "KIND_UNARY", "broadcast_shapes", "const", "norm_axis",
           "norm_axes", "wrap", "same_as_input", "check_nin", "check_float", "check_same_dtype", "check_int_dtype",
           "remember", "checked_once"]

REGISTRY: dict[str, OpDef] = {}


def register(name, *, linear=None, family=None, **kw) -> OpDef:
    """Create and register the OpDef for `name` (names are unique).

    ``linear`` declares how the op treats values that are pending sums (a sharded
    value whose devices hold terms that add up to it): ``"sum"`` when it is linear in
    all its inputs jointly (``a + b``: pending sums over the same devices stay
    pending), or the positions of the inputs it is linear in when the others are
    fixed (``a * c``: ``(0, 1)``; ``a / c``: ``(0,)``; a reshape: ``(0,)``), or a
    function of the op's attrs giving one of those (or None). Other ops need their
    inputs' sums resolved first. Stored as ``extras["linear"]``; read it with
    :func:`linearity`.

    ``family`` names the sharding-rule family the op belongs to, with its parameter:
    ``("reduce", "sum")``, ``("along_axis",)``, ``("elementwise",)`` (unary and binary
    ops are elementwise by their kind). The parallel layer builds the op's rule from
    it, so a new op of a known family needs this one declaration. Stored as
    ``extras["family"]``."""
    if name in REGISTRY:
        raise ValueError(f"register: an op named {name!r} is already registered")
    op = OpDef(name, **kw)
    if linear is not None:
        op.extras["linear"] = linear
    if family is not None:
        op.extras["family"] = tuple(family)
    REGISTRY[name] = op
    return op


def linearity(op, attrs):
    """`op`'s declared linearity for these attrs ("sum", positions, or None)."""
    lin = op.extras.get("linear")
    return lin(attrs) if callable(lin) else lin


def get_op(name) -> OpDef:
    """The OpDef registered under `name`."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"get_op: no op named {name!r}; registered ops: "
                         f"{', '.join(sorted(REGISTRY))}") from None


# ---------------------------------------------------------------------------
# per-signature caches: what depends only on shapes, dtypes and attrs is worked out
# (and validated) once per signature; a signature that failed is never stored, so
# bad inputs meet the same checks and errors every time
# ---------------------------------------------------------------------------
_SEEN_MAX = 4096     # entries per cache; a full cache starts over


def checked_once(cache, key, check, *args):
    """``cache[key]``, or ``check(*args)`` (which raises on bad input) stored under
    `key` and returned: a signature's checks run until it passes once."""
    try:
        return cache[key]
    except (KeyError, TypeError):     # a new (or unhashable) signature
        pass
    return remember(cache, key, check(*args))


def remember(cache, key, value):
    """Store `value` under `key` in a per-signature cache (a dict looked up with
    ``cache[key]``; a key that is not hashable is not stored) and return it."""
    if len(cache) >= _SEEN_MAX:
        cache.clear()
    try:
        cache[key] = value
    except TypeError:        # unhashable: worked out again next time
        pass
    return value


# ---------------------------------------------------------------------------
# operands
# ---------------------------------------------------------------------------
def const(x, opname, dtype=None):
    """A Tensor stays as is; anything else becomes a constant ndarray."""
    if isinstance(x, TensorBase):
        return x
    if isinstance(x, np.ndarray):
        return x if dtype is None else x.astype(dtype, copy=False)
    if isinstance(x, (bool, int, float, list, tuple, np.generic)):
        if dtype is None and isinstance(x, float):
            dtype = np.float32
        arr = np.asarray(x, dtype=dtype)
        if dtype is None and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        return arr
    raise TypeError(f"{opname}: unsupported input of type {type(x).__name__}; expected a "
                    f"Tensor, a numpy array or a Python number")


# ---------------------------------------------------------------------------
# validation helpers (each raises a named error)
# ---------------------------------------------------------------------------
def same_as_input(attrs, x, *rest):
    """Infer rule of ops whose output has input 0's shape and dtype."""
    return ((tuple(x.shape), x.dtype),)


def check_nin(opname, xs, n):
    if len(xs) != n:
        raise TypeError(f"{opname}: takes {n} tensor input(s), got {len(xs)}")


def check_float(opname, x, i=0):
    if x.dtype.kind != "f":
        raise TypeError(f"{opname}: input {i} has dtype {x.dtype}; supported dtypes: "
                        f"float16, float32, float64")


def check_int_dtype(opname, x, i, what="input"):
    if x.dtype.kind not in "iu":
        raise TypeError(f"{opname}: {what} {i} has dtype {x.dtype}; expected an integer "
                        f"dtype (int32 or int64)")


def check_same_dtype(opname, xs):
    d0 = xs[0].dtype
    for i, x in enumerate(xs[1:], 1):
        if x.dtype != d0:
            raise TypeError(f"{opname}: input 0 has dtype {d0} but input {i} has dtype "
                            f"{x.dtype}; all inputs must have the same dtype (use ops.cast)")


def norm_axis(opname, axis, ndim, param="axis", extra=0):
    """One axis in [-ndim-extra, ndim+extra) -> non-negative int."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{opname}: {param} must be an int, got {axis!r}")
    lim = ndim + extra
    if not -lim <= axis < lim:
        raise ValueError(f"{opname}: {param}={axis} is out of range for an input of rank "
                         f"{ndim}; expected {-lim} <= {param} < {lim}")
    return int(axis) % lim if lim else 0


def norm_axes(opname, axis, ndim, param="axis"):
    """An int, tuple/list of ints, or ()/None (= all axes) -> sorted tuple of axes."""
    if axis is None or axis == ():
        return tuple(range(ndim))
    if isinstance(axis, (list, tuple)):
        out = tuple(norm_axis(opname, a, ndim, param) for a in axis)
        if len(set(out)) != len(out):
            raise ValueError(f"{opname}: {param}={tuple(axis)} repeats an axis")
        return tuple(sorted(out))
    return (norm_axis(opname, axis, ndim, param),)
