"""Functional forms of every op (snake_case, as ``mindspore.ops``)."""
from ._registry import const, wrap
from ._array import (concat, expand_dims, flatten, gather, getitem, one_hot, ones, ones_like,
                     reshape, split, split_sizes, squeeze, stop_gradient, strided_slice,
                     transpose, zeros, zeros_like)
from ._math import (abs, add, batch_matmul, bias_add, broadcast_to, cast, div, equal, exp,
                    greater, greater_equal, less, less_equal, log, matmul, maximum, minimum,
                    mul, neg, not_equal, pow, realdiv, reduce_max, reduce_mean, reduce_min,
                    reduce_sum, relu, sigmoid, sign, sqrt, square, sub, tanh)
from ._conv import avg_pool, batch_norm, conv2d, max_pool
from ._nn import (dropout, log_softmax, softmax, softmax_cross_entropy,
                  sparse_softmax_cross_entropy)

__all__ = [
    "abs", "add", "batch_matmul", "bias_add", "broadcast_to", "cast", "concat", "div",
    "dropout", "equal", "exp", "expand_dims", "flatten", "gather", "getitem", "greater",
    "greater_equal", "less", "less_equal", "log", "log_softmax", "matmul", "maximum",
    "minimum", "mul", "neg", "not_equal", "one_hot", "ones", "ones_like", "pow", "realdiv",
    "reduce_max", "reduce_mean", "reduce_min", "reduce_sum", "relu", "reshape", "shape",
    "sigmoid", "sign", "softmax", "softmax_cross_entropy", "sparse_softmax_cross_entropy",
    "split", "split_sizes", "sqrt", "square", "squeeze", "stop_gradient", "strided_slice",
    "sub", "tanh", "transpose", "zeros", "zeros_like", "scalar_to_array", "scalar_to_tensor",
    "mean", "sum", "matmul", "conv2d", "max_pool", "avg_pool", "batch_norm",
]

mean = reduce_mean
sum = reduce_sum  # noqa: A001


def shape(x):
    """The shape of `x` as a tuple of ints."""
    return tuple(x.shape)


def scalar_to_array(x, dtype=None):
    """A 0-d tensor holding the Python number `x` (float32 for floats)."""
    return wrap(const(x, "scalar_to_array", dtype))


scalar_to_tensor = scalar_to_array

# array and reduce ops for MindSpore scripts: Tile, ArgMax / ArgMaxWithValue /
# ArgMinWithValue, Assign / AssignAdd / AssignSub
from ._array import (arg_max_with_value, arg_min_with_value, argmax, argmin,  # noqa: E402
                     assign, assign_add, assign_sub, tile)

__all__ += ["tile", "argmax", "argmin", "arg_max_with_value", "arg_min_with_value", "assign",
            "assign_add", "assign_sub"]

# normalisations: LayerNorm, L2Normalize
from ._norm import l2_normalize, layer_norm  # noqa: E402

__all__ += ["layer_norm", "l2_normalize"]

# more elementwise ops: GeLU, FastGeLU, Erf, Rsqrt, Reciprocal, Select, the remainder and
# floor ops, SquaredDifference, the logical ops, AddN, PReLU
from ._math import (addn, erf, fast_gelu, floor_div, floor_mod, gelu,  # noqa: E402
                    logical_and, logical_not, logical_or, prelu, reciprocal, rsqrt, select,
                    squared_difference, truncate_div)
from ._math import mod as fmod  # noqa: E402

__all__ += ["addn", "erf", "fast_gelu", "floor_div", "floor_mod", "fmod", "gelu",
            "logical_and", "logical_not", "logical_or", "prelu", "reciprocal", "rsqrt",
            "select", "squared_difference", "truncate_div"]

# guarded and two-argument binary ops: Atan2, DivNoNan, MulNoNan, TruncateMod, Xdivy,
# Xlogy
from ._math import atan2, div_no_nan, mul_no_nan, truncate_mod, xdivy, xlogy  # noqa: E402

__all__ += ["atan2", "div_no_nan", "mul_no_nan", "truncate_mod", "xdivy", "xlogy"]

# bitwise ops
from ._math import bitwise_and, bitwise_or, bitwise_xor  # noqa: E402

__all__ += ["bitwise_and", "bitwise_or", "bitwise_xor"]

# MaskedFill
from ._math import masked_fill  # noqa: E402

__all__ += ["masked_fill"]

# Diag and FillV2
from ._array import diag, fill_v2  # noqa: E402

__all__ += ["diag", "fill_v2"]

# SquareSumAll
from ._math import square_sum_all  # noqa: E402

__all__ += ["square_sum_all"]
