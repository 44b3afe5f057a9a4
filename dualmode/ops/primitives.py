"""Primitive classes (``ops.MatMul()``, ``ops.ReLU()``...), each running its functional
form with the attributes given at construction."""
from __future__ import annotations

import numpy as np

from . import functional as F
from ._conv import (AVG_POOL, MAX_POOL, assign_parameters, batch_norm_op, bn_count, check_pad,
                    check_pad_mode, conv2d, pair, pool_op, running_update)
from ._math import mat_mul
from ._nn import (DROPOUT, softmax_cross_entropy_pair, sparse_softmax_cross_entropy_grad,
                  sparse_softmax_cross_entropy_mean)
from . import interpreter
from ._array import (OUTPUT_STRATEGY_LAYOUTS, arg_reduce, assign_operand, assigned_value,
                     check_multiples, is_traced, tile, write_parameters)
from .._core._tensor import TensorBase
from ._registry import apply, const, remember
from .primitive import Primitive
from ._norm import l2_normalize, l2_normalize_axes, layer_norm_axes, layer_norm_op


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
NotEqual = _elementwise("NotEqual", F.not_equal, "x != y.")
GreaterEqual = _elementwise("GreaterEqual", F.greater_equal, "x >= y.")
LessEqual = _elementwise("LessEqual", F.less_equal, "x <= y.")
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
    """OneHot(axis)(indices, depth, on_value, off_value). Its strategy's first entry
    splits the indices (one entry per dim), or, as MindSpore writes it, the output (one
    entry more, the depth dim included: ``((1, 8), (), ())`` for rank-1 indices, the
    classes split 8 ways, each device holding its block of them)."""
    name = "OneHot"

    def __init__(self, axis=-1):
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"OneHot: axis={axis!r} must be an int (-1: a new last dim)")
        self.axis = axis

    def __call__(self, indices, depth, on_value, off_value):
        st = self.in_strategy
        if st is not None and isinstance(st[0], tuple) and \
                len(st[0]) == np.ndim(indices) + 1 and \
                not interpreter.base().ignores_strategies():
            return Primitive.__call__(self._over_output(tuple(np.shape(indices)), depth),
                                      indices, depth, on_value, off_value)
        return super().__call__(indices, depth, on_value, off_value)

    def _over_output(self, shape, depth):
        """For a strategy over the output's dims: a OneHot whose strategy splits the
        indices (of `shape`) alike and whose out_strategy (unless one is given) is that
        one."""
        st, ndim = self.in_strategy, len(shape)
        key = (st, self.out_strategy, shape, depth)
        cache = self.__dict__.setdefault("_over_outputs", {})
        inner = cache.get(key)
        if inner is not None:
            return inner
        s = st[0]
        pos = self.axis if self.axis >= 0 else ndim + 1 + self.axis
        if not 0 <= pos <= ndim:
            return self                         # F.one_hot names the bad axis
        if isinstance(depth, (int, np.integer)) and not isinstance(depth, bool) and \
                depth > 0 and depth % s[pos]:
            raise ValueError(f"OneHot: in_strategy[0][{pos}]={s[pos]} splits the depth dim "
                             f"(dim {pos} of the output) but does not divide depth={depth}")
        dims = tuple(d if d < pos else d + 1 for d in range(ndim))
        for d, o in enumerate(dims):
            if 0 < shape[d] < s[o]:
                raise ValueError(f"OneHot: in_strategy[0][{o}]={s[o]} exceeds dim {d} (size "
                                 f"{shape[d]}) of the indices: some devices would hold an "
                                 f"empty piece")
        inner = OneHot(self.axis)
        lay = OUTPUT_STRATEGY_LAYOUTS[0](self.name, s, dims) if OUTPUT_STRATEGY_LAYOUTS \
            else s[:pos] + s[pos + 1:]
        inner.in_strategy = (lay,) + tuple(st[1:])
        inner.out_strategy = self.out_strategy if self.out_strategy is not None else (s,)
        return remember(cache, key, inner)

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
    """StridedSlice(begin_mask, end_mask, ellipsis_mask, new_axis_mask,
    shrink_axis_mask)(x, begin, end, strides), as MindSpore's primitive. Its strategy has
    one entry per dim of x: a dim taken whole with stride 1 keeps its split, a sliced dim
    is gathered first (so the numbers equal one device's)."""
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
    """(logits (N, C), dense labels (N, C)) -> (loss, dlogits), as MindSpore's primitive:
    the per-sample loss -sum(labels * log_softmax(logits)) of shape (N,) and
    softmax(logits) - labels of shape (N, C). Its strategy covers both inputs (they share
    every dim); the classes dim is gathered when split."""
    name = "SoftmaxCrossEntropyWithLogits"

    def construct(self, logits, labels):
        return softmax_cross_entropy_pair(logits, labels)


class SparseSoftmaxCrossEntropyWithLogits(Primitive):
    """SparseSoftmaxCrossEntropyWithLogits(is_grad=False)(logits (N, C), int labels (N,)),
    as MindSpore's primitive: the mean over the batch of -log softmax(logits)[label] (a
    scalar), or with ``is_grad=True`` its gradient with respect to the logits,
    (softmax(logits) - onehot(labels)) / N of shape (N, C). Its strategy splits the rows
    of both inputs alike (the classes dim is gathered when split); with the rows split
    the mean is a pending sum, finished by one AllReduce where it is needed. (The
    functional ``ops.sparse_softmax_cross_entropy`` gives the per-sample losses.)"""
    name = "SparseSoftmaxCrossEntropyWithLogits"

    def __init__(self, is_grad=False):
        super().__init__()
        self.is_grad = _bool(self.name, "is_grad", is_grad)

    def construct(self, logits, labels):
        if self.is_grad:
            return sparse_softmax_cross_entropy_grad(logits, labels)
        return sparse_softmax_cross_entropy_mean(logits, labels)


class Conv2D(Primitive):
    """Conv2D(out_channel, kernel_size, pad_mode="valid", pad=0, stride=1, dilation=1,
    group=1)(x, weight): 2-D convolution of NCHW x with weight (out_channel, C / group,
    kh, kw), as MindSpore's primitive (``mode`` and ``data_format`` other than 1 and
    "NCHW" are refused)."""
    name = "Conv2D"

    def __init__(self, out_channel, kernel_size, mode=1, pad_mode="valid", pad=0, stride=1,
                 dilation=1, group=1, data_format="NCHW"):
        super().__init__()
        if isinstance(out_channel, bool) or not isinstance(out_channel, int) or out_channel < 1:
            raise ValueError(f"Conv2D: out_channel={out_channel!r} is not valid; expected an "
                             f"int >= 1")
        if mode != 1 or data_format != "NCHW":
            raise ValueError(f"Conv2D: mode={mode!r}, data_format={data_format!r} are not "
                             f"supported; only mode=1 (cross-correlation) and 'NCHW'")
        self.out_channel = out_channel
        self.kernel_size = pair(self.name, "kernel_size", kernel_size)
        self.pad_mode = check_pad_mode(self.name, pad_mode)
        self.pad = check_pad(self.name, pad, self.pad_mode)
        self.stride = pair(self.name, "stride", stride)
        self.dilation = pair(self.name, "dilation", dilation)
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"Conv2D: group={group!r} is not valid; expected an int >= 1")
        self.group = group

    def construct(self, x, weight):
        return conv2d(x, weight, self.pad_mode, self.pad, self.stride, self.dilation,
                      self.group, out_channel=self.out_channel, kernel_size=self.kernel_size)


class _Pool(Primitive):
    _op = None

    def __init__(self, kernel_size=1, strides=1, pad_mode="valid", data_format="NCHW"):
        super().__init__()
        if data_format != "NCHW":
            raise ValueError(f"{self.name}: data_format={data_format!r} is not supported; "
                             f"only 'NCHW'")
        self.kernel_size = pair(self.name, "kernel_size", kernel_size)
        self.strides = pair(self.name, "strides", strides)
        self.pad_mode = check_pad_mode(self.name, pad_mode, ("valid", "same"))

    def construct(self, x):
        return pool_op(self._op, x, self.kernel_size, self.strides, self.pad_mode)


class MaxPool(_Pool):
    """MaxPool(kernel_size=1, strides=1, pad_mode="valid")(x) over NCHW x."""
    name = "MaxPool"
    _op = MAX_POOL


class AvgPool(_Pool):
    """AvgPool(kernel_size=1, strides=1, pad_mode="valid")(x) over NCHW x ("same": border
    windows average the pixels inside the input)."""
    name = "AvgPool"
    _op = AVG_POOL


class BatchNorm(Primitive):
    """BatchNorm(is_training=False, epsilon=1e-5, momentum=0.1)(x, scale, bias, mean,
    variance) -> (y, batch_mean, batch_variance, reserve_space_1, reserve_space_2), as
    MindSpore's primitive, one op. Training: x (N, C, ...) is normalised with its batch's
    per-channel mean and biased variance (of the global batch when the batch is split
    over devices), and `mean`/`variance` (Parameters) become ``(1 - momentum) * old +
    momentum * batch`` (the variance unbiased) in place; inference: `mean`/`variance`
    are used and returned. Its strategy has one entry per input, e.g. ((8, 1, 1, 1), (1,),
    (1,), (1,), (1,)) for the batch or ((1, 2, 1, 1), (2,), (2,), (2,), (2,)) for the
    channels (x's channel split and the other inputs' must agree)."""
    name = "BatchNorm"

    def __init__(self, is_training=False, epsilon=1e-5, momentum=0.1, data_format="NCHW"):
        super().__init__()
        self.is_training = _bool(self.name, "is_training", is_training)
        for key, v, lo in (("epsilon", epsilon, 0.0), ("momentum", momentum, 0.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= 1.0:
                raise ValueError(f"BatchNorm: {key}={v!r} must be a float in [0, 1]")
        if data_format != "NCHW":
            raise ValueError(f"BatchNorm: data_format={data_format!r} is not supported; "
                             f"only 'NCHW'")
        self.epsilon, self.momentum = float(epsilon), float(momentum)

    def __call__(self, x, scale, bias, mean, variance):
        if self.is_training:
            for key, p in (("mean", mean), ("variance", variance)):
                if not callable(getattr(p, "set_data", None)):     # not a Parameter
                    raise TypeError(f"BatchNorm: with is_training=True, {key} must be a "
                                    f"Parameter (it is updated in place), got "
                                    f"{type(p).__name__}")
        # the op runs on the inputs as the strategy (or a graph trace) moved them; the
        # running statistics are updated here, on the Parameters themselves
        out = super().__call__(x, scale, bias, mean, variance)
        if self.is_training:
            new_mean, new_var = running_update(mean, variance, out[1], out[2],
                                               bn_count(tuple(x.shape)), 1.0 - self.momentum)
            assign_parameters("BatchNorm.update", (mean, variance), new_mean, new_var)
        return out

    def construct(self, x, scale, bias, mean, variance):
        y, m, v = batch_norm_op(x, scale, bias, mean, variance, self.is_training,
                                self.epsilon)
        return y, m, v, m, v


# ---------------------------------------------------------------------------
# Tile, and the strategy form MindSpore gives it
# ---------------------------------------------------------------------------
class Tile(Primitive):
    """Tile()(input_x, multiples): `input_x` repeated `multiples[d]` times along dim d
    (extra leading entries tile new leading dims), as MindSpore's primitive. Its strategy
    has one entry per dim of the output, as MindSpore's: a dim with multiple 1 is split
    as the input's dim; a tiled dim's entry splits its multiple (it must divide it): that
    input dim stays whole and each device makes its share of the copies, so the output
    is in the strategy's layout with no communication; e.g. ``Tile().shard(((2, 4),))``
    with multiples (2, 1) on a (3, 8) input: dim 1 split 4 ways, each device making one
    of the two copies of dim 0. An ``out_strategy`` moves the output further."""
    name = "Tile"

    def __call__(self, input_x, multiples):
        if self.in_strategy is None or interpreter.base().ignores_strategies():
            return super().__call__(input_x, multiples)
        x = const(input_x, self.name)
        return Primitive.__call__(self._on_input(x, multiples), x, multiples)

    def _on_input(self, x, multiples):
        """A Tile whose in_strategy places the input on this strategy's device matrix
        (its tiled dims whole) and whose out_strategy is this strategy (unless one is
        given): a local cut."""
        st, mult = self.in_strategy, check_multiples(multiples, x.ndim)
        if len(st) != 1 or not isinstance(st[0], tuple):
            raise ValueError(f"Tile: in_strategy={st} must have one tuple entry, for "
                             f"input_x, with one entry per dim of the output, e.g. "
                             f"{((1,) * len(mult),)}")
        s = st[0]
        if len(s) != len(mult):
            raise ValueError(f"Tile: in_strategy[0]={s} has {len(s)} entries but "
                             f"multiples={mult} has {len(mult)}; give one entry per dim of "
                             f"the output")
        off = len(mult) - x.ndim
        for j, (k, m) in enumerate(zip(s, mult)):
            if m > 1 and m % k:
                raise ValueError(f"Tile: in_strategy[0][{j}]={k} does not divide "
                                 f"multiples[{j}]={m}; a tiled dim's entry splits its "
                                 f"multiple (each device makes multiples[{j}] / parts of "
                                 f"the copies)")
            if m == 1 and j < off and k != 1:
                raise ValueError(f"Tile: in_strategy[0][{j}]={k} splits a new dim of size "
                                 f"1 (multiples[{j}]=1); valid: 1")
            if m == 1 and j >= off and 0 < x.shape[j - off] < k:
                raise ValueError(f"Tile: in_strategy[0][{j}]={k} exceeds dim {j - off} "
                                 f"(size {x.shape[j - off]}) of input 0: some devices would "
                                 f"hold an empty piece")
        dims = tuple(d + off if mult[d + off] == 1 else None for d in range(x.ndim))
        lay = OUTPUT_STRATEGY_LAYOUTS[0](self.name, s, dims) if OUTPUT_STRATEGY_LAYOUTS \
            else None
        key = (st, self.out_strategy, tuple(x.shape), mult, lay)
        cache = self.__dict__.setdefault("_on_inputs", {})
        inner = cache.get(key)
        if inner is None:
            inner = Tile()
            if lay is None:          # no parallel layer: the input's entries only
                inner.in_strategy = (tuple(k if m == 1 else 1
                                           for k, m in zip(s[off:], mult[off:])),)
                inner.out_strategy = self.out_strategy
            else:
                inner.in_strategy = (lay,)
                inner.out_strategy = self.out_strategy if self.out_strategy is not None \
                    else (s,)
            remember(cache, key, inner)
        return inner

    def construct(self, input_x, multiples):
        return tile(input_x, multiples)


# ---------------------------------------------------------------------------
# normalisations: LayerNorm, L2Normalize
# ---------------------------------------------------------------------------
def _parts(entry, d):
    """How many parts strategy entry `entry` (a tuple or an applied Layout) splits dim `d`
    into."""
    if isinstance(entry, tuple):
        return entry[d]
    sizes = dict(zip(entry.alias_name, entry.device_matrix))
    return int(np.prod([sizes[a] for a in entry.spec[d]]))


def _whole_dims(prim, entry, x, dims, what):
    """Refuse a strategy entry for input 0 that splits one of `dims` (MindSpore refuses
    such strategies too)."""
    if not isinstance(entry, tuple) and not hasattr(entry, "spec"):
        return
    for d in dims:
        if d < len(x.shape) and _parts(entry, d) != 1:
            raise ValueError(f"{prim.name}: in_strategy[0][{d}]={_parts(entry, d)} splits dim "
                             f"{d} of input 0, {what}; it must be 1 (keep dim {d} whole, "
                             f"{_whole_example(entry, dims)})")


def _whole_example(entry, dims):
    if not isinstance(entry, tuple):
        return "'None' for it in the layout"
    return f"e.g. in_strategy[0]={tuple(1 if d in dims else v for d, v in enumerate(entry))}"


class LayerNorm(Primitive):
    """LayerNorm(begin_norm_axis=1, begin_params_axis=1, epsilon=1e-7)(input_x, gamma,
    beta) -> (y, mean, variance), as MindSpore's primitive, one op: x normalised over its
    dims from begin_norm_axis with their mean and biased variance, times gamma plus beta
    (both of x's shape from begin_params_axis); mean and variance keep the normalised
    dims as 1s. Its strategy has one entry per input and may split only the dims before
    begin_norm_axis, e.g. ((8, 1), (1,), (1,)) for rows of a 2-d input; gamma and beta
    follow x's split of their dims."""
    name = "LayerNorm"

    def __init__(self, begin_norm_axis=1, begin_params_axis=1, epsilon=1e-7):
        super().__init__()
        for key, v in (("begin_norm_axis", begin_norm_axis),
                       ("begin_params_axis", begin_params_axis)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"LayerNorm: {key} must be an int, got {v!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or \
                not epsilon >= 0:
            raise TypeError(f"LayerNorm: epsilon must be a non-negative float, got "
                            f"{epsilon!r}")
        self.begin_norm_axis = int(begin_norm_axis)
        self.begin_params_axis = int(begin_params_axis)
        self.epsilon = float(epsilon)

    def _check_inputs(self, tensors, st):
        super()._check_inputs(tensors, st)
        x = tensors[0]
        bna, _ = layer_norm_axes(self.name, self.begin_norm_axis, self.begin_params_axis,
                                 len(x.shape))
        _whole_dims(self, st[0], x, range(bna, len(x.shape)),
                    f"a normalised dim (begin_norm_axis={self.begin_norm_axis})")

    def construct(self, input_x, gamma, beta):
        return layer_norm_op(input_x, gamma, beta, self.begin_norm_axis,
                             self.begin_params_axis, self.epsilon)


class L2Normalize(Primitive):
    """L2Normalize(axis=0, epsilon=1e-4)(x) = x / sqrt(max(sum(x^2, axis), epsilon)), as
    MindSpore's primitive; `axis` an int or a tuple/list of ints. Its strategy may split
    every dim but the normalised ones, e.g. ((1, 8),) with axis=0."""
    name = "L2Normalize"

    def __init__(self, axis=0, epsilon=1e-4):
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer, tuple, list)):
            raise TypeError(f"L2Normalize: axis must be an int or a tuple/list of ints, got "
                            f"{axis!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
            raise TypeError(f"L2Normalize: epsilon must be a float, got {epsilon!r}")
        self.axis = tuple(axis) if isinstance(axis, list) else axis
        self.epsilon = float(epsilon)

    def _check_inputs(self, tensors, st):
        super()._check_inputs(tensors, st)
        x = tensors[0]
        axes = l2_normalize_axes(self.axis, len(x.shape))
        _whole_dims(self, st[0], x, axes, f"a normalised dim (axis={self.axis})")

    def construct(self, x):
        return l2_normalize(x, self.axis, self.epsilon)


# more elementwise ops
GeLU = _elementwise("GeLU", lambda x: F.gelu(x, "tanh"),
                    "Gaussian error linear unit as MindSpore's GeLU computes it: 0.5 x (1 + "
                    "tanh(sqrt(2/pi) (x + 0.044715 x^3))).")
FastGeLU = _elementwise("FastGeLU", F.fast_gelu,
                        "x / (1 + exp(-1.702 |x|)) * exp(0.851 (x - |x|)).")
Erf = _elementwise("Erf", F.erf, "The Gauss error function.")
Rsqrt = _elementwise("Rsqrt", F.rsqrt, "1 / sqrt(x).")
Reciprocal = _elementwise("Reciprocal", F.reciprocal, "1 / x.")
Select = _elementwise("Select", F.select,
                      "Select()(cond, x, y): x where cond, else y (broadcast together).")
Mod = _elementwise("Mod", F.fmod, "The remainder of x / y with the sign of x.")
FloorMod = _elementwise("FloorMod", F.floor_mod, "x - floor(x / y) * y.")
FloorDiv = _elementwise("FloorDiv", F.floor_div, "floor(x / y).")
TruncateDiv = _elementwise("TruncateDiv", F.truncate_div, "x / y rounded towards zero.")
SquaredDifference = _elementwise("SquaredDifference", F.squared_difference, "(x - y) ** 2.")
LogicalAnd = _elementwise("LogicalAnd", F.logical_and, "x and y (bool).")
LogicalOr = _elementwise("LogicalOr", F.logical_or, "x or y (bool).")
LogicalNot = _elementwise("LogicalNot", F.logical_not, "not x (bool).")
AddN = _elementwise("AddN", F.addn, "AddN()((x1, x2, ...)): the sum of tensors of one shape.")
PReLU = _elementwise("PReLU", F.prelu,
                     "PReLU()(x, weight): x where x > 0, else weight * x, the 1-D weight "
                     "(size 1 or C) per channel along dim 1; its strategy splits x's "
                     "channels and the weight alike, e.g. ((2, 4, 1, 1), (4,)).")


# ---------------------------------------------------------------------------
# ArgMaxWithValue / ArgMinWithValue / Argmax / Argmin
# ---------------------------------------------------------------------------
class ArgMaxWithValue(Primitive):
    """ArgMaxWithValue(axis=0, keep_dims=False)(x) -> (index, value), as MindSpore's
    primitive: the index (int32) of the largest element along `axis` (the first of
    ties) and that element. Its strategy has one entry for x; with `axis` split, each
    device's best element and its global index are combined by one AllReduce of 8-byte
    keys (so the numbers equal one device's; values wider than 32 bits gather the axis
    instead), other dims keep their splits. The value's gradient goes to the index's
    position."""
    name = "ArgMaxWithValue"

    def __init__(self, axis=0, keep_dims=False):
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"{self.name}: axis={axis!r} must be an int")
        self.axis = axis
        self.keep_dims = _bool(self.name, "keep_dims", keep_dims)

    def construct(self, x):
        return arg_reduce(self.name, x, self.axis, self.keep_dims)


class ArgMinWithValue(ArgMaxWithValue):
    """ArgMinWithValue(axis=0, keep_dims=False)(x) -> (index, value) of the smallest
    element along `axis`, as ArgMaxWithValue."""
    name = "ArgMinWithValue"


class Argmax(Primitive):
    """Argmax(axis=-1, output_type=int32)(x): the index of the largest element along
    `axis` (the first of ties), as MindSpore's primitive; a split `axis` is combined
    as ArgMaxWithValue's."""
    name = "Argmax"

    def __init__(self, axis=-1, output_type=np.int32):
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"{self.name}: axis={axis!r} must be an int")
        self.axis = axis
        self.output_type = output_type

    def construct(self, x):
        return arg_reduce(self.name, x, self.axis, False, self.output_type)


class Argmin(Argmax):
    """Argmin(axis=-1, output_type=int32)(x): the index of the smallest element."""
    name = "Argmin"


# ---------------------------------------------------------------------------
# Assign / AssignAdd / AssignSub: a Parameter updated in place
# ---------------------------------------------------------------------------
class Assign(Primitive):
    """Assign()(variable, value): the Parameter `variable` set to `value` (same shape;
    converted to its dtype) in place, as MindSpore's primitive; returns `variable`. In a
    compiled graph (GRAPH_MODE, ops.shard) the write happens each time the graph runs
    and the call returns the new value. A sharded `variable` keeps its layout; a
    strategy has one entry per input, e.g. ((2, 4), (2, 4))."""
    name = "Assign"

    def __call__(self, variable, value):
        value = assign_operand(self.name, variable, value)
        new = super().__call__(variable, value)
        write_parameters(self.name, (variable,), new)
        return new if is_traced() else variable

    def construct(self, variable, value):
        return assigned_value(self.name, variable, value)


class AssignAdd(Assign):
    """AssignAdd()(variable, value): ``variable += value`` in place (value the same
    shape or broadcasting to it), as MindSpore's primitive; returns `variable` (the new
    value in a compiled graph)."""
    name = "AssignAdd"


class AssignSub(Assign):
    """AssignSub()(variable, value): ``variable -= value`` in place, as AssignAdd."""
    name = "AssignSub"


# guarded and two-argument binary ops
Atan2 = _elementwise("Atan2", F.atan2, "Atan2()(x, y): arctan(x / y) in the quadrant of the "
                     "point (y, x), in [-pi, pi].")
DivNoNan = _elementwise("DivNoNan", F.div_no_nan, "x / y, and 0 where y == 0.")
MulNoNan = _elementwise("MulNoNan", F.mul_no_nan, "x * y, and 0 where y == 0.")
TruncateMod = _elementwise("TruncateMod", F.truncate_mod,
                           "x - trunc(x / y) * y: the remainder with the sign of x.")
Xdivy = _elementwise("Xdivy", F.xdivy, "x / y, and 0 where x == 0.")
Xlogy = _elementwise("Xlogy", F.xlogy, "x * log(y), and 0 where x == 0.")

# bitwise ops
BitwiseAnd = _elementwise("BitwiseAnd", F.bitwise_and, "x & y (integer or bool tensors).")
BitwiseOr = _elementwise("BitwiseOr", F.bitwise_or, "x | y (integer or bool tensors).")
BitwiseXor = _elementwise("BitwiseXor", F.bitwise_xor, "x ^ y (integer or bool tensors).")


class MaskedFill(Primitive):
    """MaskedFill()(input_x, mask, value): value where mask, else input_x (input_x and
    the bool mask broadcast together; value a Python number or a 0-d Tensor). A strategy
    has entries for input_x and mask, and may have an entry ``()`` for the value."""
    name = "MaskedFill"

    def _tensor_strategy(self, args):
        st = self.in_strategy
        if len(args) == 3 and len(st) == 2 and isinstance(args[2], TensorBase) \
                and not args[2].shape:
            return st + ((),), [a for a in args if isinstance(a, (TensorBase, np.ndarray))]
        return super()._tensor_strategy(args)

    def construct(self, input_x, mask, value):
        return F.masked_fill(input_x, mask, value)


# ---------------------------------------------------------------------------
# Diag and FillV2
# ---------------------------------------------------------------------------
from ._array import fill_shape  # noqa: E402


class Diag(Primitive):
    """Diag()(input_x): `input_x` on the diagonal of a tensor of shape
    ``input_x.shape * 2``, zeros elsewhere. It runs whole on every device (its output
    replicated), as MindSpore, which has no parallel implementation of it; so it takes
    no strategy."""
    name = "Diag"

    def shard(self, in_strategy, out_strategy=None):
        raise ValueError(f"Diag: shard(in_strategy={in_strategy!r}) is not supported: Diag "
                         f"has no sharding rule (MindSpore has no parallel implementation of "
                         f"it); it runs whole on every device. Remove .shard(...) and shard "
                         f"the ops that use its output")

    def construct(self, input_x):
        return F.diag(input_x)


class FillV2(Primitive):
    """FillV2()(shape, value): a tensor of `shape` (a tuple of ints or a 1-D int Tensor)
    filled with the 0-d tensor `value`. Its strategy, as MindSpore's, has one entry per
    dim of the output and an entry ``()`` for the value (which may be left out), e.g.
    ``FillV2().shard(((2, 2, 1), ()))``: each device makes its block of the output (cut
    locally, no communication)."""
    name = "FillV2"

    def __call__(self, shape, value):
        if self.in_strategy is None or interpreter.base().ignores_strategies():
            return super().__call__(shape, value)
        return Primitive.__call__(self._on_output(fill_shape(shape)), shape, value)

    def _on_output(self, shape):
        """A FillV2 without an in_strategy whose out_strategy is this strategy's output
        entry (unless an out_strategy is given)."""
        st = self.in_strategy
        if not 1 <= len(st) <= 2 or (len(st) == 2 and st[1] != ()):
            raise ValueError(f"FillV2: in_strategy={st} must be (output entry, ()) or "
                             f"(output entry,), one entry per dim of the output and () for "
                             f"the value, e.g. {((1,) * len(shape), ())}")
        s = st[0]
        if not isinstance(s, tuple) or len(s) != len(shape):
            raise ValueError(f"FillV2: in_strategy[0]={s} must have one entry per dim of the "
                             f"output (shape {shape}), e.g. {(1,) * len(shape)}")
        for j, (k, d) in enumerate(zip(s, shape)):
            if 0 < d < k:
                raise ValueError(f"FillV2: in_strategy[0][{j}]={k} exceeds dim {j} (size {d}) "
                                 f"of the output: some devices would hold an empty piece")
        if OUTPUT_STRATEGY_LAYOUTS:      # the parallel layer checks the device count
            OUTPUT_STRATEGY_LAYOUTS[0](self.name, s, ())
        key = (st, self.out_strategy)
        cache = self.__dict__.setdefault("_on_outputs", {})
        inner = cache.get(key)
        if inner is None:
            inner = FillV2()
            inner.out_strategy = self.out_strategy if self.out_strategy is not None else (s,)
            remember(cache, key, inner)
        return inner

    def construct(self, shape, value):
        return F.fill_v2(shape, value)


SquareSumAll = _elementwise("SquareSumAll", F.square_sum_all,
                            "SquareSumAll()(x, y): (sum(x ** 2), sum(y ** 2)) over all dims; "
                            "a split input's sum is finished by an AllReduce over the devices "
                            "that split it when the value is needed.")
