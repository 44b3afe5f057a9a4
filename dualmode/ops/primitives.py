"""Primitive classes (``ops.MatMul()``, ``ops.ReLU()``...), each running its functional
form with the attributes given at construction."""
from __future__ import annotations

from . import functional as F
from ._math import mat_mul
from ._nn import DROPOUT
from ._registry import apply, const
from .primitive import Primitive


def _bool(opname, key, v):
    if not isinstance(v, bool):
        raise TypeError(f"{opname}: {key} must be a bool, got {v!r}")
    return v


class MatMul(Primitive):
    """op(x) @ op(w) for 2-D inputs."""
    name = "MatMul"

    def __init__(self, transpose_a=False, transpose_b=False):
        super().__init__()
        self.transpose_a = _bool(self.name, "transpose_a", transpose_a)
        self.transpose_b = _bool(self.name, "transpose_b", transpose_b)

    def construct(self, x, w):
        return mat_mul(x, w, self.transpose_a, self.transpose_b)


class BatchMatMul(MatMul):
    """Batched op(x) @ op(w) over the last two dims."""
    name = "BatchMatMul"

    def construct(self, x, w):
        return F.batch_matmul(x, w, self.transpose_a, self.transpose_b)


def _elementwise(name, fn, doc):
    cls = type(name, (Primitive,), {"name": name, "__doc__": doc,
                                    "construct": lambda self, *xs: fn(*xs)})
    return cls


Add = _elementwise("Add", F.add, "x + y.")
Sub = _elementwise("Sub", F.sub, "x - y.")
Mul = _elementwise("Mul", F.mul, "x * y.")
RealDiv = _elementwise("RealDiv", F.div, "x / y.")
Div = _elementwise("Div", F.div, "x / y.")
Maximum = _elementwise("Maximum", F.maximum, "Elementwise maximum.")
Minimum = _elementwise("Minimum", F.minimum, "Elementwise minimum.")
Pow = _elementwise("Pow", F.pow, "x ** y.")
Equal = _elementwise("Equal", F.equal, "x == y.")
Greater = _elementwise("Greater", F.greater, "x > y.")
Less = _elementwise("Less", F.less, "x < y.")
Neg = _elementwise("Neg", F.neg, "-x.")
Exp = _elementwise("Exp", F.exp, "e ** x.")
Log = _elementwise("Log", F.log, "Natural logarithm.")
Sqrt = _elementwise("Sqrt", F.sqrt, "Square root.")
Square = _elementwise("Square", F.square, "x * x.")
Tanh = _elementwise("Tanh", F.tanh, "Hyperbolic tangent.")
Sigmoid = _elementwise("Sigmoid", F.sigmoid, "Logistic sigmoid.")
ReLU = _elementwise("ReLU", F.relu, "max(x, 0).")
Abs = _elementwise("Abs", F.abs, "|x|.")
Flatten = _elementwise("Flatten", F.flatten, "(N, ...) -> (N, prod(...)).")
BiasAdd = _elementwise("BiasAdd", F.bias_add, "Add a 1-D bias along dim 1.")
ZerosLike = _elementwise("ZerosLike", F.zeros_like, "Zeros of x's shape and dtype.")
OnesLike = _elementwise("OnesLike", F.ones_like, "Ones of x's shape and dtype.")
StopGradient = _elementwise("StopGradient", F.stop_gradient, "Cut x off from the tape.")


class _Reduce(Primitive):
    fn = None

    def __init__(self, keep_dims=False):
        super().__init__()
        self.keep_dims = _bool(self.name, "keep_dims", keep_dims)

    def construct(self, x, axis=()):
        return type(self).fn(x, axis, self.keep_dims)


class ReduceSum(_Reduce):
    """Sum over `axis` (default: all)."""
    name = "ReduceSum"
    fn = staticmethod(F.reduce_sum)


class ReduceMean(_Reduce):
    """Mean over `axis` (default: all)."""
    name = "ReduceMean"
    fn = staticmethod(F.reduce_mean)


class ReduceMax(_Reduce):
    """Max over `axis` (default: all)."""
    name = "ReduceMax"
    fn = staticmethod(F.reduce_max)


class ReduceMin(_Reduce):
    """Min over `axis` (default: all)."""
    name = "ReduceMin"
    fn = staticmethod(F.reduce_min)


class Softmax(Primitive):
    """Softmax along `axis`."""
    name = "Softmax"

    def __init__(self, axis=-1):
        super().__init__()
        if isinstance(axis, tuple):
            if len(axis) != 1:
                raise ValueError(f"Softmax: axis={axis} must name one axis")
            axis = axis[0]
        self.axis = axis

    def construct(self, x):
        return F.softmax(x, self.axis)


class LogSoftmax(Softmax):
    """Log-softmax along `axis`."""
    name = "LogSoftmax"

    def construct(self, x):
        return F.log_softmax(x, self.axis)


class OneHot(Primitive):
    """OneHot(axis)(indices, depth, on_value, off_value)."""
    name = "OneHot"

    def __init__(self, axis=-1):
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"OneHot: axis={axis!r} must be an int (-1: a new last dim)")
        self.axis = axis

    def construct(self, indices, depth, on_value, off_value):
        return F.one_hot(indices, depth, on_value, off_value, self.axis)


class Reshape(Primitive):
    """Reshape()(x, shape)."""
    name = "Reshape"

    def construct(self, x, shape):
        return F.reshape(x, shape)


class Transpose(Primitive):
    """Transpose()(x, perm)."""
    name = "Transpose"

    def construct(self, x, perm):
        return F.transpose(x, perm)


class ExpandDims(Primitive):
    """ExpandDims()(x, axis)."""
    name = "ExpandDims"

    def construct(self, x, axis):
        return F.expand_dims(x, axis)


class Squeeze(Primitive):
    """Squeeze(axis=())(x)."""
    name = "Squeeze"

    def __init__(self, axis=()):
        super().__init__()
        self.axis = axis

    def construct(self, x):
        return F.squeeze(x, self.axis)


class Concat(Primitive):
    """Concat(axis=0)((x1, x2, ...))."""
    name = "Concat"

    def __init__(self, axis=0):
        super().__init__()
        self.axis = axis

    def construct(self, tensors):
        return F.concat(tensors, self.axis)


class Split(Primitive):
    """Split(axis=0, output_num=1)(x) -> tuple."""
    name = "Split"

    def __init__(self, axis=0, output_num=1):
        super().__init__()
        self.axis, self.output_num = axis, output_num

    def construct(self, x):
        return F.split(x, self.axis, self.output_num)


class StridedSlice(Primitive):
    """StridedSlice(begin_mask, end_mask, ...)(x, begin, end, strides)."""
    name = "StridedSlice"

    def __init__(self, begin_mask=0, end_mask=0, ellipsis_mask=0, new_axis_mask=0,
                 shrink_axis_mask=0):
        super().__init__()
        self.masks = (begin_mask, end_mask, ellipsis_mask, new_axis_mask, shrink_axis_mask)

    def construct(self, x, begin, end, strides):
        return F.strided_slice(x, begin, end, strides, *self.masks)


class Gather(Primitive):
    """Gather()(params, indices, axis)."""
    name = "Gather"

    def construct(self, params, indices, axis=0):
        return F.gather(params, indices, axis)


class Cast(Primitive):
    """Cast()(x, dtype)."""
    name = "Cast"

    def construct(self, x, dtype):
        return F.cast(x, dtype)


class Dropout(Primitive):
    """Dropout(keep_prob)(x) -> (output, mask), as MindSpore's primitive."""
    name = "Dropout"

    def __init__(self, keep_prob=0.5):
        super().__init__()
        if not isinstance(keep_prob, float) or not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"Dropout: keep_prob={keep_prob!r} must be a float in (0, 1]")
        self.keep_prob = keep_prob

    def construct(self, x):
        x = const(x, self.name)
        if self.keep_prob == 1.0:
            return x, F.ones_like(x)
        return apply(DROPOUT, {"keep_prob": self.keep_prob}, (x,))


class SoftmaxCrossEntropyWithLogits(Primitive):
    """(logits, dense labels) -> per-sample loss."""
    name = "SoftmaxCrossEntropyWithLogits"

    @staticmethod
    def shared_dims(prim, xs):
        """Logits and dense labels are one array shape: every dim is shared (the op is
        made of other ops, so it declares this itself)."""
        if len(xs) != 2 or tuple(xs[0].shape) != tuple(xs[1].shape):
            return []
        return [(0, d, 1, d, f"dim {d}") for d in range(xs[0].ndim)]

    def construct(self, logits, labels):
        return F.softmax_cross_entropy(logits, labels)


class SparseSoftmaxCrossEntropyWithLogits(Primitive):
    """(logits, int labels) -> per-sample loss."""
    name = "SparseSoftmaxCrossEntropyWithLogits"

    def construct(self, logits, labels):
        return F.sparse_softmax_cross_entropy(logits, labels)
