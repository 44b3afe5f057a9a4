"""dualmode.ops: primitives (``ops.MatMul()``), functional forms (``ops.matmul``),
collectives, and the op registry every layer reads."""
from .._core import _tensor as _core
from ..common.dtype import promote as _promote
from . import _math
from . import interpreter as _interpreter
from ._registry import REGISTRY, get_op
from .collectives import AllGather, AllReduce, AlltoAll, Broadcast, ReduceOp, ReduceScatter
from .functional import *  # noqa: F401,F403
from .functional import __all__ as _functional_names
from .primitive import Primitive
from .primitives import AvgPool, BatchNorm, Conv2D, MaxPool
from .primitives import (Abs, Add, BatchMatMul, BiasAdd, Cast, Concat, Div, Dropout, Equal,
                         Exp, ExpandDims, Flatten, Gather, Greater, GreaterEqual, Less,
                         LessEqual, Log, LogSoftmax, NotEqual,
                         MatMul, Maximum, Minimum, Mul, Neg, OneHot, OnesLike, Pow, RealDiv,
                         ReduceMax, ReduceMean, ReduceMin, ReduceSum, ReLU, Reshape, Sigmoid,
                         Softmax, SoftmaxCrossEntropyWithLogits,
                         SparseSoftmaxCrossEntropyWithLogits, Split, Sqrt, Square, Squeeze,
                         StopGradient, StridedSlice, Sub, Tanh, Transpose, ZerosLike)
# normalisations
from .primitives import L2Normalize, LayerNorm  # noqa: E402

# array and reduce ops for MindSpore scripts
from .primitives import (Argmax, ArgMaxWithValue, Argmin, ArgMinWithValue,  # noqa: E402
                         Assign, AssignAdd, AssignSub, Tile)

# more elementwise ops
from .primitives import (AddN, Erf, FastGeLU, FloorDiv, FloorMod, GeLU,  # noqa: E402
                         LogicalAnd, LogicalNot, LogicalOr, Mod, PReLU, Reciprocal, Rsqrt,
                         Select, SquaredDifference, TruncateDiv)

# guarded and two-argument binary ops
from .primitives import (Atan2, DivNoNan, MulNoNan, TruncateMod, Xdivy,  # noqa: E402
                         Xlogy)
from .primitives import BitwiseAnd, BitwiseOr, BitwiseXor  # noqa: E402
from .primitives import MaskedFill  # noqa: E402
from .primitives import Diag, FillV2  # noqa: E402
from .primitives import SquareSumAll  # noqa: E402

_core.set_operator_ops(_math.ADD, _math.SUB, _math.MUL, _math.REALDIV, _math.CAST, _promote)

__all__ = list(_functional_names) + ["shard", 
    "REGISTRY", "get_op", "Primitive", "AllGather", "AllReduce", "AlltoAll", "Broadcast",
    "ReduceScatter", "ReduceOp", "Abs", "Add", "BatchMatMul", "BiasAdd", "Cast", "Concat", "Div",
    "Dropout", "Equal", "Exp", "ExpandDims", "Flatten", "Gather", "Greater", "GreaterEqual", "Less", "LessEqual", "NotEqual", "Log",
    "LogSoftmax", "MatMul", "Maximum", "Minimum", "Mul", "Neg", "OneHot", "OnesLike", "Pow",
    "RealDiv", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceSum", "ReLU", "Reshape",
    "Sigmoid", "Softmax", "SoftmaxCrossEntropyWithLogits",
    "SparseSoftmaxCrossEntropyWithLogits", "Split", "Sqrt", "Square", "Squeeze",
    "StopGradient", "StridedSlice", "Sub", "Tanh", "Transpose", "ZerosLike",
    "Conv2D", "MaxPool", "AvgPool", "BatchNorm",
]
__all__ += ["LayerNorm", "L2Normalize"]
__all__ += ["Tile", "Argmax", "Argmin", "ArgMaxWithValue", "ArgMinWithValue", "Assign",
            "AssignAdd", "AssignSub"]
__all__ += ["AddN", "Erf", "FastGeLU", "FloorDiv", "FloorMod", "GeLU", "LogicalAnd",
            "LogicalNot", "LogicalOr", "Mod", "PReLU", "Reciprocal", "Rsqrt", "Select",
            "SquaredDifference", "TruncateDiv"]
__all__ += ["Atan2", "DivNoNan", "MulNoNan", "TruncateMod", "Xdivy", "Xlogy"]
__all__ += ["BitwiseAnd", "BitwiseOr", "BitwiseXor"]
__all__ += ["MaskedFill"]
__all__ += ["Diag", "FillV2"]
__all__ += ["SquareSumAll"]


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device="CPU", level=0):
    """Compile `fn` (a function or a Cell) to graph mode with operator-level parallelism:
    inputs moved into `in_strategy`, outputs into `out_strategy`, parameters into
    `parameter_plan`, the other ops' strategies chosen by sharding propagation. Returns a
    callable; the code around it stays eager (see dualmode.parallel.graph)."""
    return _interpreter.base().shard(fn, in_strategy, out_strategy, parameter_plan, device,
                                     level)
