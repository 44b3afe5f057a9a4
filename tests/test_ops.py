"""Every op's forward, gradient and shape inference, through one helper (`check_op`).

Forward values are float32 and compared with numpy at rtol 1e-5; gradients are
computed in float64 and compared with central finite differences; the abstract
`infer` of every recorded op must agree with its kernel's real output.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dualmode as dm
from dualmode import Tensor, ops
from dualmode._core import reference
from dualmode.ops import functional as F

from _opcheck import NoGrad, check_infer, check_op

RNG = np.random.default_rng(1234)


def away_from_zero(shape, lo=0.2, hi=2.0, seed=0):
    """Random float32 values with |x| in [lo, hi) (for kinks and poles at 0)."""
    r = np.random.default_rng(seed)
    return (r.uniform(lo, hi, shape) * r.choice([-1.0, 1.0], shape)).astype(np.float32)


def positive(shape, lo=0.5, hi=2.0, seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def distinct(shape, seed=0):
    """Float32 values that are pairwise at least 0.01 apart (no ties for max/min)."""
    n = int(np.prod(shape))
    r = np.random.default_rng(seed)
    return (r.permutation(n) * 0.05 - n * 0.025).astype(np.float32).reshape(shape)


# ---------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------
def np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_log_softmax(x, axis):
    s = x - x.max(axis=axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=axis, keepdims=True))


def np_sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(x.dtype)


def np_mm(a, b, ta=False, tb=False):
    return np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)


def np_bias_add(x, b):
    return x + b.reshape((-1,) + (1,) * (x.ndim - 2))


def np_reduce(fn):
    def ref(x, axis=(), keep_dims=False):
        ax = None if axis == () else axis
        return np.asarray(fn(x, axis=ax, keepdims=keep_dims))
    return ref


# ---------------------------------------------------------------------------
# the case table: (id, dualmode fn, numpy ref, inputs, check_op keywords)
# ---------------------------------------------------------------------------
CASES = []
TESTED = set()          # functional names exercised here (checked against F.__all__)


def case(name, fn, ref, inputs, tested=(), **kw):
    CASES.append(pytest.param(fn, ref, inputs, kw, id=name))
    TESTED.update(tested)


BROADCAST_PAIRS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((4,), (3, 4)), ((3, 1), (1, 4)),
                   ((2, 1, 4), (3, 1)), ((3, 1), (2, 1, 4)), ((), (3, 4)), ((3, 4), ())]

for sa, sb in BROADCAST_PAIRS:
    tag = f"{sa}-{sb}"
    case(f"add{tag}", F.add, np.add, [sa, sb], ["add"])
    case(f"sub{tag}", F.sub, np.subtract, [sa, sb], ["sub"])
    case(f"mul{tag}", F.mul, np.multiply, [sa, sb], ["mul"])
    case(f"div{tag}", F.div, np.divide, [sa, away_from_zero(sb, 0.5)], ["div", "realdiv"])
    case(f"realdiv{tag}", F.realdiv, np.divide, [sa, away_from_zero(sb, 0.5, seed=1)])
    case(f"maximum{tag}", F.maximum, np.maximum, [distinct(sa), distinct(sb, 1) + 0.012],
         ["maximum"])
    case(f"minimum{tag}", F.minimum, np.minimum, [distinct(sa), distinct(sb, 1) + 0.012],
         ["minimum"])
    case(f"pow{tag}", F.pow, np.power, [positive(sa), positive(sb, -1.5, 1.5, 1)], ["pow"])
    for name, np_fn in [("equal", np.equal), ("not_equal", np.not_equal), ("less", np.less),
                        ("less_equal", np.less_equal), ("greater", np.greater),
                        ("greater_equal", np.greater_equal)]:
        a = np.round(RNG.uniform(-2, 2, sa)).astype(np.float32)
        b = np.round(RNG.uniform(-2, 2, sb)).astype(np.float32)
        case(f"{name}{tag}", getattr(F, name), np_fn, [a, b], [name])

for shape in [(3, 4), (), (2, 3, 2)]:
    tag = str(shape)
    case(f"neg{tag}", F.neg, np.negative, [shape], ["neg"])
    case(f"exp{tag}", F.exp, np.exp, [shape], ["exp"])
    case(f"log{tag}", F.log, np.log, [positive(shape, 0.2)], ["log"])
    case(f"sqrt{tag}", F.sqrt, np.sqrt, [positive(shape, 0.2)], ["sqrt"])
    case(f"square{tag}", F.square, np.square, [shape], ["square"])
    case(f"tanh{tag}", F.tanh, np.tanh, [shape], ["tanh"])
    case(f"sigmoid{tag}", F.sigmoid, np_sigmoid, [shape], ["sigmoid"])
    case(f"relu{tag}", F.relu, lambda x: np.maximum(x, 0), [away_from_zero(shape)], ["relu"])
    case(f"abs{tag}", F.abs, np.abs, [away_from_zero(shape)], ["abs"])
    case(f"sign{tag}", F.sign, np.sign, [away_from_zero(shape)], ["sign"])

# sigmoid stays finite and accurate far from 0
case("sigmoid-large", F.sigmoid, np_sigmoid,
     [np.array([-100.0, -30.0, 0.0, 30.0, 100.0], np.float32)], grad=False)

# MatMul: all four transpose combinations
for ta in (False, True):
    for tb in (False, True):
        sa = (4, 3) if ta else (3, 4)
        sb = (5, 4) if tb else (4, 5)
        case(f"matmul-ta{ta:d}-tb{tb:d}",
             lambda a, b, ta=ta, tb=tb: F.matmul(a, b, ta, tb),
             lambda a, b, ta=ta, tb=tb: np_mm(a, b, ta, tb), [sa, sb], ["matmul"])
        case(f"MatMul-prim-ta{ta:d}-tb{tb:d}",
             lambda a, b, ta=ta, tb=tb: ops.MatMul(transpose_a=ta, transpose_b=tb)(a, b),
             lambda a, b, ta=ta, tb=tb: np_mm(a, b, ta, tb), [sa, sb])

# functional matmul follows numpy's rules for 1-D and batched inputs (MindSpore 2.x)
for sa, sb in [((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (4, 5)),
               ((4,), (2, 4, 5)), ((2, 3, 4), (4,)), ((3, 4), (2, 4, 5))]:
    case(f"matmul-nd{sa}-{sb}", F.matmul, np.matmul, [sa, sb])

BMM_SHAPES = [((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (3, 4, 5)), ((3, 4), (2, 4, 5)),
              ((2, 3, 4), (4, 5)), ((1, 3, 4), (2, 4, 5))]
for sa, sb in BMM_SHAPES:
    case(f"batch_matmul{sa}-{sb}", F.batch_matmul, np_mm, [sa, sb], ["batch_matmul"])
for ta in (False, True):
    for tb in (False, True):
        sa = (2, 4, 3) if ta else (2, 3, 4)
        sb = (1, 5, 4) if tb else (1, 4, 5)
        case(f"BatchMatMul-prim-ta{ta:d}-tb{tb:d}",
             lambda a, b, ta=ta, tb=tb: ops.BatchMatMul(ta, tb)(a, b),
             lambda a, b, ta=ta, tb=tb: np_mm(a, b, ta, tb), [sa, sb])

# reductions over one axis, several, all; keep_dims both ways
for name, np_fn in [("reduce_sum", np.sum), ("reduce_mean", np.mean), ("reduce_max", np.max),
                    ("reduce_min", np.min)]:
    for axis in (0, 1, -1, (0, 2), (2, 0), [1, 2], ()):
        for keep in (False, True):
            case(f"{name}-axis{axis}-keep{keep:d}",
                 lambda x, f=getattr(F, name), axis=axis, keep=keep: f(x, axis, keep),
                 lambda x, f=np_fn, axis=axis, keep=keep: np_reduce(f)(
                     x, tuple(axis) if isinstance(axis, list) else axis, keep),
                 [distinct((2, 3, 4))], [name])
case("reduce_max-ties", lambda x: F.reduce_max(x, 1),
     lambda x: x.max(1), [np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)], grad=False)
case("mean-alias", lambda x: F.mean(x, 1), lambda x: x.mean(1), [(3, 4)], ["mean"])
case("sum-alias", lambda x: F.sum(x, 0, True), lambda x: x.sum(0, keepdims=True), [(3, 4)],
     ["sum"])
for cls, np_fn in [(ops.ReduceSum, np.sum), (ops.ReduceMean, np.mean), (ops.ReduceMax, np.max),
                   (ops.ReduceMin, np.min)]:
    for keep in (False, True):
        case(f"{cls.name}-prim-keep{keep:d}",
             lambda x, cls=cls, keep=keep: cls(keep_dims=keep)(x, 1),
             lambda x, f=np_fn, keep=keep: f(x, axis=1, keepdims=keep), [distinct((3, 4))])
        case(f"{cls.name}-prim-all-keep{keep:d}",
             lambda x, cls=cls, keep=keep: cls(keep)(x),
             lambda x, f=np_fn, keep=keep: np.asarray(f(x, keepdims=keep)),
             [distinct((3, 4))])

# Softmax / LogSoftmax over every axis
for axis in (0, 1, 2, -1, -3):
    case(f"softmax-axis{axis}", lambda x, a=axis: F.softmax(x, a),
         lambda x, a=axis: np_softmax(x, a), [(2, 3, 4)], ["softmax"])
    case(f"log_softmax-axis{axis}", lambda x, a=axis: F.log_softmax(x, a),
         lambda x, a=axis: np_log_softmax(x, a), [(2, 3, 4)], ["log_softmax"])
    case(f"Softmax-prim-axis{axis}", lambda x, a=axis: ops.Softmax(a)(x),
         lambda x, a=axis: np_softmax(x, a), [(2, 3, 4)])
    case(f"LogSoftmax-prim-axis{axis}", lambda x, a=axis: ops.LogSoftmax((a,))(x),
         lambda x, a=axis: np_log_softmax(x, a), [(2, 3, 4)])
case("softmax-1d", F.softmax, lambda x: np_softmax(x, -1), [(5,)])
case("softmax-large", F.softmax, lambda x: np_softmax(x, -1),
     [np.array([[1000.0, 0.0, -1000.0]], np.float32)], grad=False)
case("log_softmax-large", F.log_softmax, lambda x: np_log_softmax(x, -1),
     [np.array([[1000.0, 0.0, -1000.0]], np.float32)], grad=False)

# shape ops
case("reshape-minus1", lambda x: F.reshape(x, (-1, 6)), lambda x: x.reshape(-1, 6),
     [(2, 3, 4)], ["reshape"], expect_ops=["Reshape"])
case("reshape-int", lambda x: F.reshape(x, 24), lambda x: x.reshape(24), [(2, 3, 4)])
case("reshape-scalar", lambda x: F.reshape(x, ()), lambda x: x.reshape(()), [(1, 1)])
case("Reshape-prim", lambda x: ops.Reshape()(x, (4, -1)), lambda x: x.reshape(4, -1),
     [(2, 3, 4)])
# array and reduce ops for MindSpore scripts (every mode: tests/test_array_ops_more.py)
case("tile", lambda x: F.tile(x, (2, 1, 3)), lambda x: np.tile(x, (2, 1, 3)), [(2, 3)],
     ["tile"], expect_ops=["Tile"])
case("argmax", lambda x: F.argmax(x, 1), lambda x: x.argmax(1).astype(np.int32), [(3, 4)],
     ["argmax"])
case("argmin", lambda x: F.argmin(x), lambda x: x.argmin(-1).astype(np.int32), [(3, 4)],
     ["argmin"])
case("arg_max_with_value", lambda x: F.arg_max_with_value(x, 1),
     lambda x: (x.argmax(1).astype(np.int32), x.max(1)), [(3, 4)], ["arg_max_with_value"],
     expect_ops=["ArgMaxWithValue"])
case("arg_min_with_value", lambda x: F.arg_min_with_value(x, 0, True),
     lambda x: (x.argmin(0)[None].astype(np.int32), x.min(0, keepdims=True)), [(3, 4)],
     ["arg_min_with_value"], expect_ops=["ArgMinWithValue"])
case("assign", lambda x: F.assign(dm.Parameter(dm.Tensor(np.zeros((2, 3), np.float32)),
                                                name="p"), x),
     lambda x: x, [(2, 3)], ["assign"], grad=False)
case("assign_add", lambda x: F.assign_add(dm.Parameter(dm.Tensor(np.ones((2, 3), np.float32)),
                                                        name="p"), x),
     lambda x: np.broadcast_to(1 + x, (2, 3)), [(3,)], ["assign_add"], grad=False)
case("assign_sub", lambda x: F.assign_sub(dm.Parameter(dm.Tensor(np.ones((2, 3), np.float32)),
                                                        name="p"), x),
     lambda x: 1 - np.broadcast_to(x, (2, 3)), [(2, 1)], ["assign_sub"], grad=False)
case("flatten", F.flatten, lambda x: x.reshape(2, -1), [(2, 3, 4)], ["flatten"])
case("flatten-1d", F.flatten, lambda x: x.reshape(-1, 1), [(5,)])
case("Flatten-prim", ops.Flatten(), lambda x: x.reshape(3, -1), [(3, 2, 2, 2)])
for perm in [(1, 0, 2), (2, 0, 1), (0, 1, 2), (-1, 0, 1)]:
    case(f"transpose{perm}", lambda x, p=perm: F.transpose(x, p),
         lambda x, p=perm: np.transpose(x, p), [(2, 3, 4)], ["transpose"])
case("Transpose-prim", lambda x: ops.Transpose()(x, (1, 0)), lambda x: x.T, [(2, 3)])
for axis in (0, 1, 2, -1, -3):
    case(f"expand_dims{axis}", lambda x, a=axis: F.expand_dims(x, a),
         lambda x, a=axis: np.expand_dims(x, a), [(2, 3)], ["expand_dims"])
case("ExpandDims-prim", lambda x: ops.ExpandDims()(x, 0), lambda x: x[None], [(2, 3)])
case("squeeze-all", F.squeeze, np.squeeze, [(1, 3, 1, 2)], ["squeeze"])
case("squeeze-axis", lambda x: F.squeeze(x, 2), lambda x: np.squeeze(x, 2), [(1, 3, 1, 2)])
case("squeeze-axes", lambda x: F.squeeze(x, (0, -2)), lambda x: np.squeeze(x, (0, 2)),
     [(1, 3, 1, 2)])
case("Squeeze-prim", ops.Squeeze(0), lambda x: x[0], [(1, 3)])
case("broadcast_to", lambda x: F.broadcast_to(x, (2, 3, 4)),
     lambda x: np.broadcast_to(x, (2, 3, 4)), [(3, 1)], ["broadcast_to"])
case("broadcast_to-same", lambda x: F.broadcast_to(x, (3, 4)),
     lambda x: np.broadcast_to(x, (3, 4)), [(3, 4)])
case("broadcast_to-minus1", lambda x: F.broadcast_to(x, (2, -1, 4)),
     lambda x: np.broadcast_to(x, (2, 3, 4)), [(3, 1)])
case("broadcast_to-scalar", lambda x: F.broadcast_to(x, (2, 2)),
     lambda x: np.broadcast_to(x, (2, 2)), [()])

# Concat / Split
for axis in (0, 1, -1):
    case(f"concat-axis{axis}", lambda a, b, c, ax=axis: F.concat((a, b, c), ax),
         lambda a, b, c, ax=axis: np.concatenate((a, b, c), ax), [(2, 2), (2, 2), (2, 2)],
         ["concat"])
case("concat-uneven", lambda a, b: F.concat([a, b], 1), lambda a, b: np.concatenate((a, b), 1),
     [(2, 1, 3), (2, 4, 3)])
case("concat-const", lambda a, b: F.concat((a, b), 0), lambda a, b: np.concatenate((a, b)),
     [(2, 3), NoGrad(np.ones((1, 3), np.float32))])
case("Concat-prim", lambda a, b: ops.Concat(1)((a, b)), lambda a, b: np.concatenate((a, b), 1),
     [(2, 3), (2, 1)])
for axis, n in [(0, 2), (1, 3), (-1, 3), (0, 1)]:
    case(f"split-axis{axis}-n{n}", lambda x, a=axis, n=n: F.split(x, a, n),
         lambda x, a=axis, n=n: tuple(np.split(x, n, a)), [(6, 3, 3)], ["split"])
case("split-only-first", lambda x: F.split(x, 0, 3)[0], lambda x: np.split(x, 3)[0], [(6, 2)])
case("split-first-and-last", lambda x: (lambda p: (p[0], p[2]))(F.split(x, 1, 3)),
     lambda x: (lambda p: (p[0], p[2]))(np.split(x, 3, 1)), [(2, 6)])
case("split-combined", lambda x: (lambda p: p[0] * p[1])(F.split(x, 0, 2)),
     lambda x: x[:2] * x[2:], [(4, 3)])
case("split_sizes", lambda x: F.split_sizes(x, 1, [1, 3, 2]),
     lambda x: tuple(np.split(x, [1, 4], 1)), [(2, 6)], ["split_sizes"])
case("Split-prim", lambda x: ops.Split(1, 2)(x), lambda x: tuple(np.split(x, 2, 1)), [(3, 4)])

# StridedSlice with masks (begin_mask, end_mask, shrink_axis_mask; negative strides)
SS = [((1, 0, 0), (3, 4, 5), (1, 2, 2), {}, lambda x: x[1:3, 0:4:2, 0:5:2]),
      ((1, 1, 0), (3, 3, 5), (1, 1, 1), {"begin_mask": 0b010}, lambda x: x[1:3, :3, 0:5]),
      ((0, 1, 0), (2, 2, 1), (1, 1, 1), {"end_mask": 0b101}, lambda x: x[0:, 1:2, 0:]),
      ((1, 0, 0), (2, 4, 5), (1, 1, 1), {"shrink_axis_mask": 0b001}, lambda x: x[1, 0:4, 0:5]),
      ((3, 3, 0), (0, 0, 5), (-1, -2, 1), {}, lambda x: x[3:0:-1, 3:0:-2, 0:5]),
      ((0, 0, 0), (0, 0, 0), (-1, -1, -1), {"begin_mask": 7, "end_mask": 7},
       lambda x: x[::-1, ::-1, ::-1]),
      ((-2, 1), (4, -1), (1, 1), {}, lambda x: x[-2:4, 1:-1]),
      ((1,), (3,), (1,), {}, lambda x: x[1:3])]
for k, (b, e, s, masks, ref) in enumerate(SS):
    case(f"strided_slice{k}", lambda x, b=b, e=e, s=s, m=masks: F.strided_slice(x, b, e, s, **m),
         ref, [(4, 4, 5)], ["strided_slice"])
    case(f"StridedSlice-prim{k}",
         lambda x, b=b, e=e, s=s, m=masks: ops.StridedSlice(**m)(x, b, e, s), ref, [(4, 4, 5)])

# Tensor indexing (GetItem): ints, slices, negative steps, None, Ellipsis, int arrays
IDX = [1, -1, (1, 2), slice(1, 3), (slice(None), slice(None, None, -1)), (slice(3, None, -2),),
       (None, 1), (Ellipsis, 1), (1, Ellipsis, None), (slice(None), None, slice(1, 3)),
       np.array([0, 2, 2, 0]), (slice(None), np.array([3, 3, 0])), [0, 0, 1],
       (np.array([0, 1]), np.array([2, 2])), (np.array([[0, 1], [1, 1]]), slice(1, 3)),
       np.array([True, False, True, True]), (Ellipsis,), (), (-2, slice(-3, None))]
for k, index in enumerate(IDX):
    case(f"getitem{k}", lambda x, i=index: x[i], lambda x, i=index: x[i], [(4, 5, 2)],
         ["getitem"])
case("getitem-fn", lambda x: F.getitem(x, (0, slice(1, None))), lambda x: x[0, 1:], [(3, 4)])
case("getitem-tensor-index", lambda x: x[Tensor(np.array([1, 1, 0]))],
     lambda x: x[np.array([1, 1, 0])], [(3, 4)])

# Gather: axis 0 and 1, repeated indices, 2-D indices, int32 and int64
for axis in (0, 1, -1):
    for idx in (np.array([0, 2, 2, 1], np.int32), np.array([[1, 1], [0, 2]], np.int64)):
        case(f"gather-axis{axis}-{idx.dtype}-{idx.ndim}d",
             lambda x, i, a=axis: F.gather(x, i, a),
             lambda x, i, a=axis: np.take(x, i, axis=a), [(3, 3, 3), idx], ["gather"])
case("Gather-prim", lambda x, i: ops.Gather()(x, i, 1), lambda x, i: np.take(x, i, 1),
     [(2, 4), np.array([3, 3, 0])])
case("gather-scalar-index", lambda x: F.gather(x, 1, 0), lambda x: x[1], [(3, 2)])

# BiasAdd 2-D and 4-D
case("bias_add-2d", F.bias_add, np_bias_add, [(3, 4), (4,)], ["bias_add"])
case("bias_add-4d", F.bias_add, np_bias_add, [(2, 3, 2, 2), (3,)])
case("bias_add-3d", F.bias_add, np_bias_add, [(2, 3, 4), (3,)])
case("BiasAdd-prim", ops.BiasAdd(), np_bias_add, [(2, 3, 2, 2), (3,)])

# Cast
case("cast-f32-f64", lambda x: F.cast(x, dm.float64), lambda x: x.astype(np.float64), [(2, 3)],
     ["cast"])
# (finite differences through a float32 cast are meaningless: see the dedicated test)
case("cast-f64-f32", lambda x: F.cast(x, dm.float32), lambda x: x.astype(np.float32),
     [np.linspace(-1, 1, 6).reshape(2, 3)], grad=False)
case("cast-f32-int32", lambda x: F.cast(x, dm.int32), lambda x: x.astype(np.int32), [(2, 3)])
case("cast-int-f32", lambda x: F.cast(x, dm.float32), lambda x: x.astype(np.float32),
     [np.arange(6).reshape(2, 3)])
case("Cast-prim", lambda x: ops.Cast()(x, dm.float16), lambda x: x.astype(np.float16),
     [(2, 3)], grad=False)
case("astype", lambda x: x.astype(dm.float64), lambda x: x.astype(np.float64), [(2, 3)])

# softmax cross-entropy: sparse (fused Cython kernel) and dense
LABELS = np.array([0, 3, 3, 1, 2], np.int32)
case("sparse_xent-int32", F.sparse_softmax_cross_entropy,
     lambda x, y: reference.sparse_softmax_xent(x, y)[0], [(5, 4), LABELS],
     ["sparse_softmax_cross_entropy"])
case("sparse_xent-int64", F.sparse_softmax_cross_entropy,
     lambda x, y: reference.sparse_softmax_xent(x, y)[0], [(5, 4), LABELS.astype(np.int64)])
case("SparseSoftmaxCrossEntropyWithLogits-prim", ops.SparseSoftmaxCrossEntropyWithLogits(),
     lambda x, y: reference.sparse_softmax_xent(x, y)[0].mean(), [(5, 4), LABELS])
case("SparseSoftmaxCrossEntropyWithLogits-is_grad",
     ops.SparseSoftmaxCrossEntropyWithLogits(is_grad=True),
     lambda x, y: ((np_softmax(x, -1) - np.eye(4)[y]) / len(y)).astype(x.dtype),
     [(5, 4), LABELS])
DENSE = np_softmax(RNG.uniform(-1, 1, (5, 4)), -1).astype(np.float32)
case("softmax_xent", F.softmax_cross_entropy,
     lambda x, y: -(y * np_log_softmax(x, -1)).sum(-1), [(5, 4), DENSE],
     ["softmax_cross_entropy"])
case("softmax_xent-labels-const", F.softmax_cross_entropy,
     lambda x, y: -(y * np_log_softmax(x, -1)).sum(-1), [(5, 4), NoGrad(DENSE)])
case("SoftmaxCrossEntropyWithLogits-prim", ops.SoftmaxCrossEntropyWithLogits(),
     lambda x, y: (-(y * np_log_softmax(x, -1)).sum(-1), np_softmax(x, -1) - y),
     [(5, 4), DENSE])

# elementwise primitive classes
for cls, np_fn, n in [(ops.Add, np.add, 2), (ops.Sub, np.subtract, 2), (ops.Mul, np.multiply, 2),
                      (ops.Maximum, np.maximum, 2), (ops.Minimum, np.minimum, 2),
                      (ops.Neg, np.negative, 1), (ops.Exp, np.exp, 1), (ops.Square, np.square, 1),
                      (ops.Tanh, np.tanh, 1), (ops.Sigmoid, np_sigmoid, 1)]:
    case(f"{cls.name}-prim", cls(), np_fn, [distinct((3, 4), s) + 0.012 * s for s in range(n)])
case("RealDiv-prim", ops.RealDiv(), np.divide, [(3, 4), away_from_zero((4,))])
case("Div-prim", ops.Div(), np.divide, [(3, 4), away_from_zero((4,))])
case("Pow-prim", ops.Pow(), np.power, [positive((3, 4)), (4,)])
case("Log-prim", ops.Log(), np.log, [positive((3, 4))])
case("Sqrt-prim", ops.Sqrt(), np.sqrt, [positive((3, 4))])
case("ReLU-prim", ops.ReLU(), lambda x: np.maximum(x, 0), [away_from_zero((3, 4))])
case("Abs-prim", ops.Abs(), np.abs, [away_from_zero((3, 4))])
for cls, np_fn in [(ops.Equal, np.equal), (ops.Greater, np.greater), (ops.Less, np.less)]:
    case(f"{cls.name}-prim", cls(), np_fn, [np.arange(4.0, dtype=np.float32),
                                            np.array([3.0, 1.0, 2.0, 0.0], np.float32)])

# scalars and constants as operands of functional forms
case("add-scalar", lambda x: F.add(x, 2.0), lambda x: x + np.float32(2), [(3,)])
case("mul-scalar-left", lambda x: F.mul(3, x), lambda x: 3 * x, [(3,)])
case("pow-scalar", lambda x: F.pow(x, 2.0), lambda x: x ** 2, [(3,)])
case("pow-scalar-base", lambda x: F.pow(2.0, x), lambda x: np.float32(2) ** x, [(3,)])
case("sub-ndarray", lambda x: F.sub(np.ones(3, np.float32), x), lambda x: 1 - x, [(3,)])


@pytest.mark.parametrize("fn, ref, inputs, kw", CASES)
def test_op_forward_grad_infer(fn, ref, inputs, kw):
    check_op(fn, ref, inputs, **kw)


# ---------------------------------------------------------------------------
# ops without a backward rule: infer checked directly
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_one_hot_matches_numpy(axis, idx_dtype):
    idx = np.array([[0, 2], [1, 3]], idx_dtype)
    out = F.one_hot(Tensor(idx), 3, 1.0, 0.0, axis)
    ref = np.moveaxis(np.eye(3, dtype=np.float32)[np.clip(idx, 0, 2)] * (idx < 3)[..., None],
                      -1, axis)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.asnumpy(), ref)
    on, off = np.asarray(1.0, np.float32), np.asarray(0.0, np.float32)
    check_infer("OneHot", {"depth": 3, "axis": axis}, idx, on, off)


def test_one_hot_values_and_primitive():
    out = ops.OneHot()(Tensor([1, 0]), 2, Tensor(5.0), Tensor(-1.0))
    np.testing.assert_array_equal(out.asnumpy(), [[-1.0, 5.0], [5.0, -1.0]])
    out = F.one_hot(Tensor(np.array([2], np.int32)), 3, 2, 0)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out.asnumpy(), [[0, 0, 2]])


def test_one_hot_is_constant_under_grad():
    def f(x):
        return ops.reduce_sum(x * F.one_hot(Tensor([0, 1]), 2))
    g = dm.grad(f)(Tensor(np.ones((2, 2), np.float32)))
    np.testing.assert_array_equal(g.asnumpy(), np.eye(2))


@pytest.mark.parametrize("name", ["Equal", "NotEqual", "Less", "LessEqual", "Greater",
                                  "GreaterEqual"])
def test_comparison_infer(name):
    a, b = np.zeros((3, 1), np.float32), np.ones((4,), np.float32)
    out = check_infer(name, None, a, b)
    assert out.dtype == np.bool_ and out.shape == (3, 4)


@pytest.mark.parametrize("name", ["ReluGrad", "TanhGrad", "SigmoidGrad"])
def test_internal_grad_op_infer(name):
    check_infer(name, None, np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))


def test_gather_grad_and_index_add_infer():
    idx = np.array([1, 1, 0])
    g = np.ones((3, 4), np.float32)
    out = check_infer("GatherGrad", {"axis": 0, "shape": (2, 4)}, idx, g)
    np.testing.assert_array_equal(out.asnumpy(), [[1] * 4, [2] * 4])
    out = check_infer("IndexAdd", {"index": (idx,), "shape": (2, 4)}, g)
    np.testing.assert_array_equal(out.asnumpy(), [[1] * 4, [2] * 4])
    out = check_infer("SparseSoftmaxCrossEntropyGrad", None, np.full((2, 3), 1 / 3, np.float32),
                      np.array([0, 2]), np.ones(2, np.float32))
    np.testing.assert_allclose(out.asnumpy(), [[-2 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, -2 / 3]])


def test_zeros_ones_and_likes():
    z = F.zeros((2, 3), dm.int32)
    assert z.dtype == np.int32 and z.shape == (2, 3) and not z.asnumpy().any()
    check_infer("Zeros", {"shape": (2, 3), "dtype": np.dtype(np.float64)})
    o = F.ones([3], dm.float64)
    assert o.dtype == np.float64 and o.asnumpy().tolist() == [1.0, 1.0, 1.0]
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert F.zeros_like(x).shape == (2, 3) and F.zeros_like(x).dtype == np.float32
    np.testing.assert_array_equal(F.ones_like(x).asnumpy(), np.ones((2, 3)))
    np.testing.assert_array_equal(ops.ZerosLike()(x).asnumpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(ops.OnesLike()(x).asnumpy(), np.ones((2, 3)))


def test_shape_and_scalar_helpers():
    x = Tensor(np.zeros((2, 3), np.float32))
    assert F.shape(x) == (2, 3)
    s = F.scalar_to_tensor(2.5)
    assert s.dtype == np.float32 and s.shape == () and s.item() == 2.5
    assert F.scalar_to_array(3).dtype == np.int64
    assert F.scalar_to_array(3, dm.float64).dtype == np.float64


def test_stop_gradient_blocks_gradient():
    def f(x):
        return ops.reduce_sum(x * F.stop_gradient(x) + ops.StopGradient()(x))
    x = Tensor(np.array([1.0, 2.0], np.float32))
    np.testing.assert_allclose(dm.grad(f)(x).asnumpy(), [1.0, 2.0])


# ---------------------------------------------------------------------------
# gradient accumulation through repeated indices
# ---------------------------------------------------------------------------
def test_getitem_repeated_indices_accumulate():
    x = Tensor(np.arange(4, dtype=np.float32))
    g = dm.grad(lambda x: ops.reduce_sum(x[np.array([0, 2, 2, 2, 3])]))(x)
    np.testing.assert_array_equal(g.asnumpy(), [1, 0, 3, 1])
    g = dm.grad(lambda x: ops.reduce_sum(x[[1, 1]] * 2.0))(x)
    np.testing.assert_array_equal(g.asnumpy(), [0, 4, 0, 0])


def test_gather_repeated_indices_accumulate():
    x = Tensor(np.ones((3, 2), np.float32))
    g = dm.grad(lambda x: ops.reduce_sum(ops.gather(x, Tensor([2, 2, 0, 2]), 0)))(x)
    np.testing.assert_array_equal(g.asnumpy(), [[1, 1], [0, 0], [3, 3]])
    g = dm.grad(lambda x: ops.reduce_sum(ops.gather(x, Tensor([[1, 1], [1, 0]]), 1)))(x)
    np.testing.assert_array_equal(g.asnumpy(), [[1, 3]] * 3)


def test_split_gradient_of_unused_outputs_is_zero():
    x = Tensor(np.arange(6, dtype=np.float32))
    g = dm.grad(lambda x: ops.reduce_sum(ops.split(x, 0, 3)[1] * 2.0))(x)
    np.testing.assert_array_equal(g.asnumpy(), [0, 0, 2, 2, 0, 0])


# ---------------------------------------------------------------------------
# Cast gradient between float32 and float64
# ---------------------------------------------------------------------------
def test_cast_gradient_changes_dtype_back():
    x32 = Tensor(np.array([1.0, 2.0], np.float32))
    g = dm.grad(lambda x: ops.reduce_sum(ops.cast(x, dm.float64) * 3.0))(x32)
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g.asnumpy(), [3.0, 3.0])
    x64 = Tensor(np.array([1.0, 2.0], np.float64))
    g = dm.grad(lambda x: ops.reduce_sum(ops.square(ops.cast(x, dm.float32))))(x64)
    assert g.dtype == np.float64
    np.testing.assert_allclose(g.asnumpy(), [2.0, 4.0])


def test_cast_to_int_gives_no_gradient():
    x = Tensor(np.array([1.5, 2.5], np.float32))
    g = dm.grad(lambda x: ops.reduce_sum(ops.cast(ops.cast(x, dm.int32), dm.float32) + x))(x)
    np.testing.assert_array_equal(g.asnumpy(), [1.0, 1.0])


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------
def test_dropout_mask_statistics_and_scale():
    dm.set_seed(3)
    x = Tensor(np.ones((200, 100), np.float32))
    out, mask = ops.Dropout(keep_prob=0.8)(x)
    m = mask.asnumpy()
    assert mask.dtype == np.float32 and set(np.unique(m).tolist()) == {0.0, 1.0}
    kept = m.mean()
    assert abs(kept - 0.8) < 0.01          # 20000 draws: std of the mean is 0.003
    np.testing.assert_allclose(out.asnumpy(), m / 0.8, rtol=1e-6)
    y = F.dropout(x, p=0.3)
    frac = (y.asnumpy() > 0).mean()
    assert abs(frac - 0.7) < 0.015
    np.testing.assert_allclose(y.asnumpy()[y.asnumpy() > 0], 1 / 0.7, rtol=1e-6)


def test_dropout_gradient_is_mask_over_keep():
    dm.set_seed(5)
    x = Tensor(np.random.default_rng(0).normal(size=(30, 20)).astype(np.float32))
    seen = {}

    def f(x):
        out, mask = ops.Dropout(keep_prob=0.6)(x)
        seen["mask"] = mask.asnumpy()
        return ops.reduce_sum(out * 2.0)

    g = dm.grad(f)(x)
    mask = seen["mask"]
    assert set(np.unique(mask).tolist()) == {0.0, 1.0}
    np.testing.assert_allclose(g.asnumpy(), 2.0 * mask / 0.6, rtol=1e-6)


def test_dropout_identity_when_not_training_or_keep_one():
    x = Tensor(np.ones((3, 3), np.float32))
    assert F.dropout(x, 0.5, training=False) is x
    assert F.dropout(x, 0.0) is x
    out, mask = ops.Dropout(1.0)(x)
    np.testing.assert_array_equal(out.asnumpy(), x.asnumpy())
    np.testing.assert_array_equal(mask.asnumpy(), np.ones((3, 3)))


def test_dropout_is_seeded():
    x = Tensor(np.ones((10, 10), np.float32))
    dm.set_seed(7)
    a = F.dropout(x, 0.5).asnumpy()
    dm.set_seed(7)
    b = F.dropout(x, 0.5).asnumpy()
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# Tensor operators and dtype promotion
# ---------------------------------------------------------------------------
A = np.array([[1.5, -2.0, 3.0], [0.5, 4.0, -1.0]], np.float32)
B = np.array([2.0, -0.5, 1.25], np.float32)


@pytest.mark.parametrize("op", ["+", "-", "*", "/", "**"])
def test_tensor_binary_operators(op):
    fns = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b, "**": lambda a, b: a ** b}
    f = fns[op]
    base = np.abs(A) if op == "**" else A
    check_op(f, f, [base, B])
    check_op(lambda a: f(a, 2.0), lambda a: f(a, np.float32(2.0)), [base])
    if op != "**":
        check_op(lambda a: f(3.0, a), lambda a: f(np.float32(3.0), a), [B])
        check_op(lambda a: f(np.float32(3.0), a), lambda a: f(np.float32(3.0), a), [B])


def test_tensor_matmul_and_unary_operators():
    check_op(lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3), (3, 4)])
    check_op(lambda a: np.ones((4, 2), np.float32) @ a,
             lambda a: np.ones((4, 2), np.float32) @ a, [(2, 3)], grad=False)
    check_op(lambda a: -a, lambda a: -a, [(2, 3)])
    check_op(lambda a: +a, lambda a: +a, [(2, 3)], grad=False)
    check_op(lambda a: abs(a), np.abs, [away_from_zero((2, 3))])
    check_op(lambda a: a.T, lambda a: a.T, [(2, 3)])
    check_op(lambda a: a.transpose(1, 0, 2), lambda a: a.transpose(1, 0, 2), [(2, 3, 2)])
    check_op(lambda a: a.reshape(3, 2), lambda a: a.reshape(3, 2), [(2, 3)])
    check_op(lambda a: a.sum(1) + a.mean(0).sum() + a.max(), lambda a: a.sum(1) + a.mean(0).sum()
             + a.max(), [distinct((2, 3))])
    check_op(lambda a: a.exp().log(), lambda a: np.log(np.exp(a)), [(2, 3)])
    check_op(lambda a: a.flatten(), lambda a: a.reshape(-1), [(2, 3)])


@pytest.mark.parametrize("op", ["==", "!=", "<", "<=", ">", ">="])
def test_tensor_comparisons(op):
    f = eval(f"lambda a, b: a {op} b")
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([2.0, 2.0, 2.0], np.float32)
    out = f(Tensor(a), Tensor(b))
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out.asnumpy(), f(a, b))
    np.testing.assert_array_equal(f(Tensor(a), 2).asnumpy(), f(a, 2))
    np.testing.assert_array_equal(f(2.0, Tensor(a)).asnumpy(), f(2.0, a))


@pytest.mark.parametrize("x, y, want", [
    (np.float32(1) * np.ones(2, np.float32), np.ones(2, np.int32), np.float32),
    (np.ones(2, np.int32), np.ones(2, np.float32), np.float32),
    (np.ones(2, np.float32), np.ones(2, np.float64), np.float64),
    (np.ones(2, np.int32), np.ones(2, np.int64), np.int64),
    (np.ones(2, np.bool_), np.ones(2, np.int32), np.int32),
    (np.ones(2, np.float16), np.ones(2, np.int64), np.float16),
])
def test_operator_dtype_promotion(x, y, want):
    for f in (lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b):
        assert f(Tensor(x), Tensor(y)).dtype == want
        assert f(Tensor(y), Tensor(x)).dtype == want


def test_int_division_gives_float32():
    a, b = Tensor(np.array([1, 2, 3])), Tensor(np.array([2, 2, 2], np.int32))
    for out in (a / b, b / a, ops.div(a, b), ops.RealDiv()(a, b), 3 / b, a / 2):
        assert out.dtype == np.float32, out.dtype
    np.testing.assert_allclose((a / b).asnumpy(), [0.5, 1.0, 1.5])
    np.testing.assert_allclose((3 / b).asnumpy(), [1.5, 1.5, 1.5])


def test_python_scalars_are_weak():
    i = Tensor(np.array([1, 2], np.int32))
    f16 = Tensor(np.array([1, 2], np.float16))
    f64 = Tensor(np.array([1, 2], np.float64))
    assert (2.5 * i).dtype == np.float32 and (i * 2.5).dtype == np.float32
    np.testing.assert_allclose((2.5 * i).asnumpy(), [2.5, 5.0])
    assert (i + 1).dtype == np.int32 and (1 - i).dtype == np.int32
    assert (f16 * 2.0).dtype == np.float16 and (f64 + 1).dtype == np.float64
    assert (i + True).dtype == np.int32
    b = Tensor(np.array([True, False]))
    assert (b + 1).dtype == np.int64
    assert (b * 1.5).dtype == np.float32


def test_mixed_dtype_operator_gradient():
    x = Tensor(np.array([1.0, 2.0], np.float32))
    k = Tensor(np.array([3, 4], np.int32))
    g = dm.grad(lambda x: ops.reduce_sum(x * k + k / x))(x)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g.asnumpy(), [3 - 3 / 1, 4 - 4 / 4], rtol=1e-6)


def test_operators_between_non_tensors_in_functional_forms():
    out = ops.add(np.ones(2, np.float32), np.ones(2, np.float32))
    assert isinstance(out, Tensor) and out.asnumpy().tolist() == [2.0, 2.0]
    out = ops.mul(2.0, 3.0)
    assert isinstance(out, Tensor) and out.dtype == np.float32 and out.item() == 6.0


# ---------------------------------------------------------------------------
# property tests: broadcasting binary ops, reshape/transpose round trips
# ---------------------------------------------------------------------------
@st.composite
def broadcastable_pair(draw):
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=4))
    a = draw(hnp.arrays(np.float32, shapes.input_shapes[0],
                        elements=st.floats(-4, 4, width=32)))
    b = draw(hnp.arrays(np.float32, shapes.input_shapes[1],
                        elements=st.floats(0.25, 4, width=32)))
    return a, b


@settings(max_examples=60, deadline=None)
@given(broadcastable_pair(), st.sampled_from(["add", "sub", "mul", "div", "maximum",
                                               "minimum"]))
def test_broadcast_binary_property(pair, name):
    a, b = pair
    np_fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
             "maximum": np.maximum, "minimum": np.minimum}[name]
    out = getattr(F, name)(Tensor(a), Tensor(b))
    want = np_fn(a, b)
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)
    # the gradient of sum(out) w.r.t. each input has the input's shape
    ga, gb = dm.grad(lambda x, y: ops.reduce_sum(getattr(F, name)(x, y)), (0, 1))(
        Tensor(a), Tensor(b))
    assert ga.shape == a.shape and gb.shape == b.shape
    if name == "add":
        np.testing.assert_allclose(ga.asnumpy(), np.full(a.shape, want.size / max(a.size, 1)))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=4, max_side=4),
                  elements=st.floats(-10, 10, width=32)), st.data())
def test_reshape_transpose_round_trip_property(x, data):
    perm = tuple(data.draw(st.permutations(range(x.ndim))))
    t = Tensor(x)
    y = ops.transpose(t, perm)
    np.testing.assert_array_equal(y.asnumpy(), np.transpose(x, perm))
    back = ops.transpose(y, tuple(np.argsort(perm)))
    np.testing.assert_array_equal(back.asnumpy(), x)
    flat = ops.reshape(t, (-1,))
    np.testing.assert_array_equal(ops.reshape(flat, x.shape).asnumpy(), x)
    w = np.arange(x.size, dtype=np.float32).reshape(np.transpose(x, perm).shape)
    g = dm.grad(lambda v: ops.reduce_sum(ops.reshape(ops.transpose(v, perm), (-1,)) *
                                         Tensor(w.reshape(-1))))(t)
    np.testing.assert_array_equal(g.asnumpy(), np.transpose(w, np.argsort(perm)))


# ---------------------------------------------------------------------------
# coverage: every functional form and every SPEC primitive is exercised here
# ---------------------------------------------------------------------------
SPEC_PRIMITIVES = """MatMul BatchMatMul Add Sub Mul RealDiv Neg Exp Log Sqrt Square Tanh Sigmoid
ReLU Maximum Minimum ReduceSum ReduceMean ReduceMax Softmax LogSoftmax OneHot Flatten Reshape
Transpose ExpandDims Squeeze Concat Split StridedSlice Gather BiasAdd Cast""".split()


# image ops: conv2d, max_pool, avg_pool, batch_norm (direct references and every pad
# mode in tests/test_conv_ops.py; here one case each through the shared checker)
def _ref_pool(x, fn):
    return fn(x.reshape(x.shape[0], x.shape[1], x.shape[2] // 2, 2, x.shape[3] // 2, 2),
              axis=(3, 5))


case("conv2d-1x1", lambda x, w: F.conv2d(x, w),
     lambda x, w: np.einsum("nchw,oc->nohw", x, w[:, :, 0, 0]), [(2, 3, 4, 4), (5, 3, 1, 1)],
     ["conv2d"])
case("max_pool-2x2", lambda x: F.max_pool(x, 2, 2), lambda x: _ref_pool(x, np.max),
     [np.random.default_rng(8).permutation(64).reshape(1, 1, 8, 8).astype(np.float32)],
     ["max_pool"])
case("avg_pool-2x2", lambda x: F.avg_pool(x, 2, 2), lambda x: _ref_pool(x, np.mean),
     [(2, 3, 4, 4)], ["avg_pool"])
case("batch_norm-inference", lambda x, m, v, g, b: F.batch_norm(x, m, v, g, b),
     lambda x, m, v, g, b: ((x - m[:, None, None]) / np.sqrt(v[:, None, None] + 1e-5)
                            * g[:, None, None] + b[:, None, None]),
     [(2, 3, 4, 4), (3,), np.linspace(0.5, 1.5, 3).astype(np.float32), (3,), (3,)],
     ["batch_norm"], rtol=1e-5, atol=1e-5)

# normalisations (tests/test_norm_ops.py: every mode, sharded, errors)
case("layer_norm", lambda x, g, b: F.layer_norm(x, (3, 4), g, b, 1e-5),
     lambda x, g, b: ((x - x.mean((1, 2), keepdims=True))
                      / np.sqrt(x.var((1, 2), keepdims=True) + 1e-5) * g + b),
     [(2, 3, 4), (3, 4), (3, 4)], ["layer_norm"], rtol=1e-5, atol=1e-6)
case("l2_normalize", lambda x: F.l2_normalize(x, 1),
     lambda x: x / np.sqrt(np.maximum(np.square(x).sum(1, keepdims=True), 1e-4)),
     [(3, 4)], ["l2_normalize"])


def test_every_functional_form_is_tested():
    dedicated = {"one_hot", "zeros", "ones", "zeros_like", "ones_like", "shape",
                 "scalar_to_tensor", "scalar_to_array", "stop_gradient", "dropout"}
    untested = sorted(set(F.__all__) - TESTED - dedicated)
    assert not untested, f"functional forms without a test: {untested}"


def test_every_spec_primitive_exists():
    for name in SPEC_PRIMITIVES:
        cls = getattr(ops, name)
        assert isinstance(cls(), ops.Primitive) if name not in ("Dropout",) else True
    for name in ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll"):
        assert issubclass(getattr(ops, name), ops.Primitive)


# ---------------------------------------------------------------------------
# infer == kernel output for every registered op, across dtypes
# ---------------------------------------------------------------------------
def _arr(shape, dtype, seed=0):
    r = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "b":
        return r.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).kind in "iu":
        return r.integers(1, 4, shape).astype(dtype)
    return r.uniform(0.5, 2.0, shape).astype(dtype)


# op name -> (attrs, input builder(dtype)); None entries: the op refuses that dtype
_W = {"group": "hccl_world_group", "n": 1, "members": None}
INFER_TABLE = {
    "Redistribute": ({"dst": None}, lambda d: (_arr((2, 3), d),)),
    "PipelineTransfer": ({}, lambda d: (_arr((2, 3), d),)),
    "AllReduce": ({**_W, "op": "sum"}, lambda d: (_arr((2, 3), d),)),
    "AllGather": (dict(_W), lambda d: (_arr((2, 3), d),)),
    "ReduceScatter": ({**_W, "op": "sum"}, lambda d: (_arr((2, 3), d),)),
    "Broadcast": ({**_W, "root": 0}, lambda d: (_arr((2, 3), d),)),
    "AlltoAll": ({**_W, "split_count": 1, "split_dim": 0, "concat_dim": 1},
                 lambda d: (_arr((2, 3), d),)),
    "Add": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Sub": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Mul": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "RealDiv": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Maximum": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Minimum": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Pow": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Equal": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "GreaterEqual": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Neg": (None, lambda d: (_arr((2, 3), d),)),
    "StopGradient": (None, lambda d: (_arr((2, 3), d),)),
    "Exp": (None, lambda d: (_arr((2, 3), d),)),
    "Log": (None, lambda d: (_arr((2, 3), d),)),
    "Sqrt": (None, lambda d: (_arr((2, 3), d),)),
    "Square": (None, lambda d: (_arr((2, 3), d),)),
    "Tanh": (None, lambda d: (_arr((2, 3), d),)),
    "Sigmoid": (None, lambda d: (_arr((2, 3), d),)),
    "ReLU": (None, lambda d: (_arr((2, 3), d),)),
    "Abs": (None, lambda d: (_arr((2, 3), d),)),
    "Sign": (None, lambda d: (_arr((2, 3), d),)),
    "Cast": ({"dtype": np.dtype(np.float16)}, lambda d: (_arr((2, 3), d),)),
    "MatMul": ({"transpose_a": False, "transpose_b": True},
               lambda d: (_arr((2, 3), d), _arr((4, 3), d, 1))),
    "BatchMatMul": ({"transpose_a": True, "transpose_b": False},
                    lambda d: (_arr((2, 3, 2), d), _arr((3, 4), d, 1))),
    "ReduceSum": ({"axis": (1,), "keep_dims": False}, lambda d: (_arr((2, 3), d),)),
    "ReduceMean": ({"axis": (0, 1), "keep_dims": True}, lambda d: (_arr((2, 3), d),)),
    "ReduceMax": ({"axis": (0,), "keep_dims": False}, lambda d: (_arr((2, 3), d),)),
    "ReduceMin": ({"axis": (1,), "keep_dims": True}, lambda d: (_arr((2, 3), d),)),
    "BroadcastTo": ({"shape": (2, 2, 3)}, lambda d: (_arr((2, 1, 3), d),)),
    "BiasAdd": (None, lambda d: (_arr((2, 3, 2), d), _arr((3,), d, 1))),
    "Reshape": ({"shape": (3, 2)}, lambda d: (_arr((2, 3), d),)),
    "Transpose": ({"perm": (1, 0)}, lambda d: (_arr((2, 3), d),)),
    "GetItem": ({"index": (np.array([1, 1]), slice(None, None, -1))},
                lambda d: (_arr((2, 3), d),)),
    "IndexAdd": ({"index": (np.array([1, 1]),), "shape": (2, 3)}, lambda d: (_arr((2, 3), d),)),
    "Concat": ({"axis": 1}, lambda d: (_arr((2, 3), d), _arr((2, 1), d, 1))),
    "Split": ({"axis": 1, "sizes": (1, 2)}, lambda d: (_arr((2, 3), d),)),
    "Gather": ({"axis": 1}, lambda d: (_arr((2, 3), d), np.array([[0, 2]]))),
    "GatherGrad": ({"axis": 0, "shape": (3, 2)}, lambda d: (np.array([0, 0]), _arr((2, 2), d))),
    "OneHot": ({"depth": 3, "axis": 0}, lambda d: (np.array([0, 2]), _arr((), d), _arr((), d))),
    "Zeros": ({"shape": (2,), "dtype": np.dtype(np.int32)}, lambda d: ()),
    "Softmax": ({"axis": 0}, lambda d: (_arr((2, 3), d),)),
    "LogSoftmax": ({"axis": 1}, lambda d: (_arr((2, 3), d),)),
    "SparseSoftmaxCrossEntropyWithLogits": (None, lambda d: (_arr((2, 3), d), np.array([0, 2]))),
    "SparseSoftmaxCrossEntropyGrad": (None, lambda d: (_arr((2, 3), d), np.array([0, 2]),
                                                       _arr((2,), d))),
    "SoftmaxCrossEntropyWithLogits": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    "SoftmaxCrossEntropyGrad": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1),
                                                 _arr((2,), d, 2))),
    # array and reduce ops for MindSpore scripts (tests/test_array_ops_more.py)
    "Tile": ({"multiples": (2, 1, 2)}, lambda d: (_arr((2, 3), d),)),
    "Assign": (None, lambda d: (_arr((2, 3), d), _arr((3,), d, 1))),
    "ArgMaxWithValue": ({"name": "ArgMaxWithValue", "kind": "max", "axis": (1,),
                         "keep_dims": False, "with_value": True,
                         "index_dtype": np.dtype(np.int32)}, lambda d: (_arr((2, 3), d),)),
    "ArgMinWithValue": ({"name": "ArgMinWithValue", "kind": "min", "axis": (0,),
                         "keep_dims": True, "with_value": True,
                         "index_dtype": np.dtype(np.int32)}, lambda d: (_arr((2, 3), d),)),
    "Argmax": ({"name": "Argmax", "kind": "max", "axis": (1,), "keep_dims": False,
                "with_value": False, "index_dtype": np.dtype(np.int64)},
               lambda d: (_arr((2, 3), d),)),
    "Argmin": ({"name": "Argmin", "kind": "min", "axis": (0,), "keep_dims": False,
                "with_value": False, "index_dtype": np.dtype(np.int32)},
               lambda d: (_arr((2, 3), d),)),
    "Dropout": ({"keep_prob": 0.5}, lambda d: (_arr((2, 3), d),)),
    "ReluGrad": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    "TanhGrad": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    "SigmoidGrad": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    "NotEqual": (None, lambda d: (_arr((3,), d), _arr((3,), d, 1))),
    "Less": (None, lambda d: (_arr((3,), d), _arr((3,), d, 1))),
    "LessEqual": (None, lambda d: (_arr((3,), d), _arr((3,), d, 1))),
    "Greater": (None, lambda d: (_arr((3,), d), _arr((3,), d, 1))),
    # more elementwise ops (tests/test_ops_elementwise_more.py: every mode)
    "GeLU": (None, lambda d: (_arr((2, 3), d),)),
    "FastGeLU": (None, lambda d: (_arr((2, 3), d),)),
    "GeLUGrad": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    "FastGeLUGrad": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    "Erf": (None, lambda d: (_arr((2, 3), d),)),
    "Rsqrt": (None, lambda d: (_arr((2, 3), d),)),
    "Reciprocal": (None, lambda d: (_arr((2, 3), d),)),
    "Select": (None, lambda d: (_arr((3, 1), np.bool_), _arr((4,), d, 1), _arr((3, 4), d, 2))),
    "Mod": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "FloorMod": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "FloorDiv": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "TruncateDiv": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "SquaredDifference": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "LogicalAnd": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "LogicalOr": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "LogicalNot": (None, lambda d: (_arr((2, 3), d),)),
    "AddN": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1), _arr((2, 3), d, 2))),
    "PReLU": (None, lambda d: (_arr((2, 3, 2), d), _arr((3,), d, 1))),
    # guarded and two-argument binary ops (tests/test_ops_ms_more.py: every mode)
    "Atan2": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "DivNoNan": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "MulNoNan": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "TruncateMod": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Xdivy": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "Xlogy": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "BitwiseAnd": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "BitwiseOr": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "BitwiseXor": (None, lambda d: (_arr((3, 1), d), _arr((4,), d, 1))),
    "MaskedFill": (None, lambda d: (_arr((3, 1), d), _arr((4,), np.bool_, 1), _arr((), d, 2))),
    "Diag": (None, lambda d: (_arr((2, 3), d),)),
    "FillV2": ({"shape": (2, 3)}, lambda d: (_arr((), d),)),
    "SquareSumAll": (None, lambda d: (_arr((2, 3), d), _arr((2, 3), d, 1))),
    # image ops (tests/test_conv_ops.py checks them against direct references)
    "Conv2D": ({"out_channel": 4, "kernel_size": (3, 3), "stride": (2, 2), "dilation": (1, 1), "group": 1, "pads": (1, 1, 1, 1)}, lambda d: (_arr((2, 3, 5, 5), d), _arr((4, 3, 3, 3), d, 1))),
    "Conv2DBackpropInput": ({**{"out_channel": 4, "kernel_size": (3, 3), "stride": (2, 2), "dilation": (1, 1), "group": 1, "pads": (1, 1, 1, 1)}, "in_hw": (5, 5)},
                            lambda d: (_arr((2, 4, 3, 3), d), _arr((4, 3, 3, 3), d, 1))),
    "Conv2DBackpropFilter": ({"out_channel": 4, "kernel_size": (3, 3), "stride": (2, 2), "dilation": (1, 1), "group": 1, "pads": (1, 1, 1, 1)}, lambda d: (_arr((2, 4, 3, 3), d), _arr((2, 3, 5, 5), d, 1))),
    "MaxPool": ({"kernel_size": (3, 3), "strides": (2, 2), "pads": (0, 1, 0, 1)}, lambda d: (_arr((2, 3, 5, 5), d),)),
    "AvgPool": ({"kernel_size": (3, 3), "strides": (2, 2), "pads": (0, 1, 0, 1)}, lambda d: (_arr((2, 3, 5, 5), d),)),
    "MaxPoolGrad": ({"kernel_size": (3, 3), "strides": (2, 2), "pads": (0, 1, 0, 1)}, lambda d: (_arr((2, 3, 5, 5), d), _arr((2, 3, 3, 3), d, 1))),
    "AvgPoolGrad": ({"kernel_size": (3, 3), "strides": (2, 2), "pads": (0, 1, 0, 1)}, lambda d: (_arr((2, 3, 5, 5), d), _arr((2, 3, 3, 3), d, 1))),
    "MaxPoolSelect": ({"kernel_size": (3, 3), "strides": (2, 2), "pads": (0, 1, 0, 1)}, lambda d: (_arr((2, 3, 5, 5), d), _arr((2, 3, 5, 5), d, 1))),
    "BatchNorm": ({"is_training": True, "epsilon": 1e-5, "count": 32},
                  lambda d: (_arr((2, 3, 4, 4), d),) + tuple(_arr((3,), d, k) for k in range(4))),
    # normalisations (tests/test_norm_ops.py checks them against numpy)
    "LayerNorm": ({"begin_norm_axis": 1, "begin_params_axis": 2, "epsilon": 1e-7},
                  lambda d: (_arr((2, 3, 4), d), _arr((4,), d, 1), _arr((4,), d, 2))),
    "L2Normalize": ({"axis": (1,), "epsilon": 1e-4}, lambda d: (_arr((2, 3), d),)),
    "LayerNormGrad": ({"begin_norm_axis": 1, "begin_params_axis": 1, "epsilon": 1e-7},
                      lambda d: (_arr((2, 3, 4), d), _arr((2, 3, 4), d, 1),
                                 _arr((2, 1, 1), d, 2), _arr((2, 1, 1), d, 3),
                                 _arr((3, 4), d, 4))),
}
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]


def test_infer_table_covers_every_registered_op():
    missing = sorted(set(ops.REGISTRY) - set(INFER_TABLE))
    assert not missing, f"add an INFER_TABLE entry (attrs, inputs) for the new ops {missing}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(INFER_TABLE))
def test_infer_matches_kernel_across_dtypes(name, dtype):
    """Either infer refuses the dtype with a named TypeError (and so does the kernel path),
    or infer's (shape, dtype) is exactly what the kernel produces."""
    from dualmode._core import _tensor as core
    op = ops.REGISTRY[name]
    attrs, build = INFER_TABLE[name]
    inputs = build(dtype)
    try:
        want = core.infer(op, attrs, *inputs)
    except TypeError as e:
        assert str(e).startswith(f"{name}: "), str(e)
        with pytest.raises(TypeError, match=f"^{name}: "):
            core.apply(op, attrs, tuple(inputs))
        return
    out = core.apply(op, attrs, tuple(inputs))
    outs = out if isinstance(out, tuple) else (out,)
    got = tuple((tuple(o.shape), np.dtype(o.dtype)) for o in outs)
    want = tuple((tuple(s), np.dtype(d)) for s, d in want)
    assert got == want, f"{name}[{np.dtype(dtype)}]: infer {want}, kernel {got}"
    for o in outs:
        assert type(o._data) is np.ndarray


# ---------------------------------------------------------------------------
# more elementwise ops (in every mode in tests/test_ops_elementwise_more.py)
# ---------------------------------------------------------------------------
import math  # noqa: E402

case("gelu-none", F.gelu, lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(
    x.astype(np.float64) / math.sqrt(2))), [(3, 4)], ["gelu"], out_dtype=np.float32)
case("fast_gelu", F.fast_gelu, lambda x: x * np_sigmoid(1.702 * x.astype(np.float64)),
     [(3, 4)], ["fast_gelu"], out_dtype=np.float32)
case("erf", F.erf, np.vectorize(math.erf, otypes=[np.float32]), [(3, 4)], ["erf"])
case("rsqrt", F.rsqrt, lambda x: 1 / np.sqrt(x), [positive((3, 4))], ["rsqrt"])
case("reciprocal", F.reciprocal, lambda x: 1 / x, [away_from_zero((3, 4))], ["reciprocal"])
case("select", lambda x, y: F.select(Tensor(np.array([True, False, True, False])), x, y),
     lambda x, y: np.where([True, False, True, False], x, y), [(3, 4), (3, 4)], ["select"])
case("fmod", F.fmod, np.fmod, [np.array([-7.5, 5.5, 2.25], np.float32),
                               np.array([2.0, -2.0, 1.0], np.float32)], ["fmod"])
case("floor_mod", F.floor_mod, np.mod, [np.array([-7.5, 5.5, 2.25], np.float32),
                                        np.array([2.0, -2.0, 1.0], np.float32)], ["floor_mod"])
case("floor_div", F.floor_div, np.floor_divide, [(3, 4), away_from_zero((4,))], ["floor_div"],
     grad=False)
case("truncate_div", F.truncate_div, lambda a, b: np.trunc(a / b), [(3, 4), away_from_zero((4,))],
     ["truncate_div"], grad=False)
case("squared_difference", F.squared_difference, lambda a, b: (a - b) ** 2, [(3, 4), (4,)],
     ["squared_difference"])
case("logical_and", F.logical_and, np.logical_and, [np.array([True, False, True]),
                                                    np.array([True, True, False])],
     ["logical_and"], grad=False)
case("logical_or", F.logical_or, np.logical_or, [np.array([True, False, False]),
                                                  np.array([True, True, False])],
     ["logical_or"], grad=False)
case("logical_not", F.logical_not, np.logical_not, [np.array([True, False])], ["logical_not"],
     grad=False)
case("addn", lambda a, b: F.addn([a, b]), np.add, [(3, 4), (3, 4)], ["addn"])
case("prelu", F.prelu, lambda x, w: np.where(x > 0, x, x * w[:, None]),
     [away_from_zero((2, 3, 4)), (3,)], ["prelu"])


# ---------------------------------------------------------------------------
# guarded and two-argument binary ops (every mode in tests/test_ops_ms_more.py)
# ---------------------------------------------------------------------------
case("atan2", F.atan2, np.arctan2, [away_from_zero((3, 4)), away_from_zero((4,), seed=1)],
     ["atan2"])
case("div_no_nan", F.div_no_nan, np.divide, [(3, 4), away_from_zero((4,))], ["div_no_nan"])
case("mul_no_nan", F.mul_no_nan, np.multiply, [(3, 4), (4,)], ["mul_no_nan"])
case("truncate_mod", F.truncate_mod, np.fmod, [np.array([-7.5, 5.5, 2.25], np.float32),
                                               np.array([2.0, -2.0, 1.0], np.float32)],
     ["truncate_mod"])
case("xdivy", F.xdivy, lambda a, b: a / b, [(3, 4), away_from_zero((4,))], ["xdivy"])
case("xlogy", F.xlogy, lambda a, b: a * np.log(b), [(3, 4), positive((4,))], ["xlogy"])
for _name, _ref in (("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or),
                   ("bitwise_xor", np.bitwise_xor)):
    case(_name, getattr(F, _name), _ref, [np.array([[5, -3, 12]], np.int32),
                                          np.array([[3], [-8]], np.int32)], [_name],
         grad=False)
case("masked_fill", lambda x: F.masked_fill(x, Tensor(np.array([True, False, False, True])), 0.5),
     lambda x: np.where([True, False, False, True], np.float32(0.5), x), [(3, 4)],
     ["masked_fill"])
case("diag", F.diag, lambda x: np.diag(x.reshape(-1)).reshape(x.shape * 2), [(2, 3)], ["diag"])
case("fill_v2", lambda v: F.fill_v2((2, 3), v), lambda v: np.full((2, 3), v),
     [np.array(0.5, np.float32)], ["fill_v2"])
case("square_sum_all", F.square_sum_all, lambda a, b: (np.sum(a * a), np.sum(b * b)),
     [(3, 4), (3, 4)], ["square_sum_all"])
