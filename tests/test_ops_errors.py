"""Bad input to every op: a ValueError / TypeError / RuntimeError naming the op and the
offending value, never an IndexError or AxisError from inside numpy."""
import re

import numpy as np
import pytest

from dualmode import Tensor, ops
from dualmode._core import _kernels

X = Tensor(np.ones((2, 3), np.float32))
X64 = Tensor(np.ones((2, 3), np.float64))
I32 = Tensor(np.array([1, 2], np.int32))
B = Tensor(np.array([True, False]))


def f32(*shape):
    return Tensor(np.ones(shape, np.float32))


E = re.escape
CASES = [
    # MatMul / BatchMatMul
    ("matmul-contract", lambda: ops.matmul(f32(3, 4), f32(5, 2)), ValueError,
     E("MatMul: input 0 has shape (3, 4) but input 1 has shape (5, 2); dim 1 of input 0 must "
       "equal dim 0 of input 1")),
    ("matmul-transpose-contract", lambda: ops.matmul(f32(3, 4), f32(5, 2), True, False),
     ValueError, E("dim 0 of input 0 must equal dim 0 of input 1")),
    ("matmul-rank", lambda: ops.MatMul()(f32(3), f32(3, 2)), ValueError,
     E("MatMul: input 0 has rank 1 (shape (3,)); MatMul takes 2-D inputs")),
    ("matmul-0d", lambda: ops.matmul(f32(3), X.sum()), ValueError,
     E("MatMul: input 1 is 0-d; matmul needs inputs of rank >= 1")),
    ("matmul-vector-transpose", lambda: ops.matmul(f32(3), f32(3, 2), True), ValueError,
     E("MatMul: transpose_a/transpose_b apply to inputs of rank >= 2")),
    ("matmul-dtype", lambda: ops.matmul(X, X64.T), TypeError,
     E("MatMul: input 0 has dtype float32 but input 1 has dtype float64")),
    ("MatMul-attr", lambda: ops.MatMul(transpose_a=1), TypeError,
     E("MatMul: transpose_a must be a bool, got 1")),
    ("bmm-batch", lambda: ops.batch_matmul(f32(2, 3, 4), f32(3, 4, 5)), ValueError,
     E("BatchMatMul: batch dims (2,) of input 0 and (3,) of input 1 cannot be broadcast")),
    ("bmm-rank", lambda: ops.batch_matmul(f32(4), f32(4, 5)), ValueError,
     E("BatchMatMul: input 0 has rank 1 (shape (4,)); expected rank >= 2")),
    ("bmm-contract", lambda: ops.batch_matmul(f32(2, 3, 4), f32(2, 5, 4)), ValueError,
     E("BatchMatMul: input 0 has shape (2, 3, 4) but input 1 has shape (2, 5, 4); dim 2 of "
       "input 0 must equal dim 1 of input 1")),
    # elementwise
    ("add-broadcast", lambda: ops.add(X, f32(3, 2)), ValueError,
     E("Add: input 0 has shape (2, 3) but input 1 has shape (3, 2); they cannot be broadcast")),
    ("mul-broadcast-op", lambda: X * f32(2), ValueError,
     E("Mul: input 0 has shape (2, 3) but input 1 has shape (2,)")),
    ("maximum-broadcast", lambda: ops.maximum(X, f32(4)), ValueError, E("Maximum: input 0")),
    ("add-operand-type", lambda: X + "a", TypeError,
     E("Add: unsupported operand of type str")),
    ("weak-int-overflow", lambda: Tensor(np.array([1], np.int8)) + 300, ValueError,
     E("Add: the Python int 300 does not fit in the tensor's dtype int8")),
    ("pow-int-negative", lambda: Tensor([2]) ** Tensor([-1]), ValueError,
     E("Pow: an integer tensor raised to a negative integer power (min exponent -1)")),
    ("sub-bool", lambda: B - B, TypeError,
     E("Sub: input 0 has dtype bool; supported dtypes: integer and floating")),
    ("neg-bool", lambda: -B, TypeError, E("Neg: input 0 has dtype bool")),
    ("square-bool", lambda: ops.square(B), TypeError, E("Square: input 0 has dtype bool")),
    ("exp-int", lambda: ops.exp(I32), TypeError,
     E("Exp: input 0 has dtype int32; supported dtypes: float16, float32, float64")),
    ("log-int", lambda: ops.log(I32), TypeError, E("Log: input 0 has dtype int32")),
    ("sqrt-int", lambda: ops.sqrt(I32), TypeError, E("Sqrt: input 0 has dtype int32")),
    ("tanh-int", lambda: ops.tanh(I32), TypeError, E("Tanh: input 0 has dtype int32")),
    ("sigmoid-bool", lambda: ops.sigmoid(B), TypeError, E("Sigmoid: input 0 has dtype bool")),
    ("relu-bool", lambda: ops.relu(B), TypeError, E("ReLU: input 0 has dtype bool")),
    ("unary-bad-input", lambda: ops.exp("x"), TypeError,
     E("Exp: unsupported input of type str")),
    # reductions
    ("reduce-axis-5", lambda: ops.reduce_sum(X, 5), ValueError,
     E("ReduceSum: axis=5 is out of range for an input of rank 2; expected -2 <= axis < 2")),
    ("reduce-axis-neg", lambda: ops.reduce_mean(X, -3), ValueError,
     E("ReduceMean: axis=-3 is out of range")),
    ("reduce-axis-tuple", lambda: ops.reduce_max(X, (0, 2)), ValueError,
     E("ReduceMax: axis=2 is out of range")),
    ("reduce-axis-repeat", lambda: ops.reduce_min(X, (1, -1)), ValueError,
     E("ReduceMin: axis=(1, -1) repeats an axis")),
    ("reduce-axis-float", lambda: ops.reduce_sum(X, 1.0), TypeError,
     E("ReduceSum: axis must be an int, got 1.0")),
    ("reduce-keep-dims", lambda: ops.reduce_sum(X, 1, 1), TypeError,
     E("ReduceSum: keep_dims must be a bool, got 1")),
    ("ReduceSum-attr", lambda: ops.ReduceSum(keep_dims="yes"), TypeError,
     E("ReduceSum: keep_dims must be a bool, got 'yes'")),
    ("reduce-mean-int", lambda: ops.reduce_mean(I32), TypeError,
     E("ReduceMean: input 0 has dtype int32")),
    ("reduce-sum-bool", lambda: ops.reduce_sum(B), TypeError,
     E("ReduceSum: input 0 has dtype bool")),
    ("reduce-max-empty", lambda: ops.reduce_max(f32(0, 3), 0), ValueError,
     E("ReduceMax: cannot reduce an empty dimension (shape (0, 3))")),
    # softmax family
    ("softmax-axis", lambda: ops.softmax(X, 2), ValueError,
     E("Softmax: axis=2 is out of range for an input of rank 2")),
    ("log-softmax-axis", lambda: ops.log_softmax(X, -3), ValueError,
     E("LogSoftmax: axis=-3 is out of range")),
    ("softmax-int", lambda: ops.softmax(I32), TypeError, E("Softmax: input 0 has dtype int32")),
    ("softmax-0d", lambda: ops.softmax(Tensor(1.0)), ValueError,
     E("Softmax: axis=-1 is out of range for an input of rank 0")),
    ("Softmax-axes", lambda: ops.Softmax((0, 1)), ValueError,
     E("Softmax: axis=(0, 1) must name one axis")),
    # shape ops
    ("reshape-size", lambda: ops.reshape(X, (4, 2)), ValueError,
     E("Reshape: cannot reshape input of shape (2, 3) (size 6) to (4, 2) (size 8)")),
    ("reshape-two-minus1", lambda: ops.reshape(X, (-1, -1)), ValueError,
     E("Reshape: shape (-1, -1) has more than one -1")),
    ("reshape-minus1-indivisible", lambda: ops.reshape(X, (4, -1)), ValueError,
     E("Reshape: cannot reshape input of shape (2, 3) (size 6) to (4, -1)")),
    ("reshape-negative", lambda: ops.reshape(X, (-2, -3)), ValueError,
     E("Reshape: shape (-2, -3) is invalid")),
    ("reshape-non-int", lambda: ops.reshape(X, (2.0, 3)), ValueError,
     E("Reshape: shape (2.0, 3) is invalid")),
    ("flatten-0d", lambda: ops.flatten(Tensor(1.0)), ValueError,
     E("Flatten: input 0 is 0-d; expected rank >= 1")),
    ("transpose-repeat", lambda: ops.transpose(X, (0, 0)), ValueError,
     E("Transpose: perm=(0, 0) is not a permutation of the 2 dims of input 0")),
    ("transpose-short", lambda: ops.transpose(X, (0,)), ValueError,
     E("Transpose: perm=(0,) is not a permutation")),
    ("transpose-out-of-range", lambda: ops.transpose(X, (0, 2)), ValueError,
     E("Transpose: perm=(0, 2) is not a permutation")),
    ("transpose-not-tuple", lambda: ops.transpose(X, 1), TypeError,
     E("Transpose: perm must be a tuple of ints, got 1")),
    ("expand-dims-axis", lambda: ops.expand_dims(X, 3), ValueError,
     E("ExpandDims: axis=3 is out of range for an input of rank 2; expected -3 <= axis < 3")),
    ("squeeze-non-1", lambda: ops.squeeze(X, 0), ValueError,
     E("Squeeze: axis=0 has size 2 in input of shape (2, 3); only dims of size 1")),
    ("squeeze-axis", lambda: ops.squeeze(X, 4), ValueError,
     E("Squeeze: axis=4 is out of range")),
    ("broadcast-to", lambda: ops.broadcast_to(X, (3, 3)), ValueError,
     E("BroadcastTo: cannot broadcast shape (2, 3) to (3, 3)")),
    ("broadcast-to-fewer", lambda: ops.broadcast_to(X, (3,)), ValueError,
     E("BroadcastTo: cannot broadcast shape (2, 3) to (3,): the target has fewer dims")),
    ("broadcast-to-minus1", lambda: ops.broadcast_to(X, (-1, 2, 3)), ValueError,
     E("BroadcastTo: shape (-1, 2, 3) has a -1 at a dim that input 0 (shape (2, 3)) does not "
       "have")),
    ("broadcast-to-type", lambda: ops.broadcast_to(X, 3), TypeError,
     E("BroadcastTo: shape must be a tuple of ints, got 3")),
    # Concat / Split
    ("concat-rank", lambda: ops.concat((X, f32(3))), ValueError,
     E("Concat: input 1 has rank 1 but input 0 has rank 2")),
    ("concat-shape", lambda: ops.concat((X, f32(2, 4))), ValueError,
     E("Concat: input 1 has shape (2, 4) but input 0 has shape (2, 3); all dims but axis 0")),
    ("concat-dtype", lambda: ops.concat((X, X64)), TypeError,
     E("Concat: input 0 has dtype float32 but input 1 has dtype float64")),
    ("concat-axis", lambda: ops.concat((X, X), 2), ValueError,
     E("Concat: axis=2 is out of range")),
    ("concat-empty", lambda: ops.concat(()), TypeError,
     E("Concat: expected a non-empty tuple or list of tensors, got tuple")),
    ("concat-not-seq", lambda: ops.concat(X), TypeError,
     E("Concat: expected a non-empty tuple or list of tensors, got Tensor")),
    ("split-indivisible", lambda: ops.split(X, 1, 2), ValueError,
     E("Split: output_num=2 does not divide dim 1 (size 3) of input 0")),
    ("split-axis", lambda: ops.split(X, 3, 1), ValueError, E("Split: axis=3 is out of range")),
    ("split-num", lambda: ops.split(X, 0, 0), ValueError,
     E("Split: output_num=0 must be a positive int")),
    ("split-sizes-sum", lambda: ops.split_sizes(X, 1, [1, 1]), ValueError,
     E("Split: sizes (1, 1) do not add up to dim 1 (size 3)")),
    ("split-sizes-axis", lambda: ops.split_sizes(X, 5, [1, 2]), ValueError,
     E("Split: axis=5 is out of range")),
    ("split-sizes-negative", lambda: ops.split_sizes(X, 1, [4, -1]), ValueError,
     E("Split: sizes=[4, -1] must be a non-empty list of ints >= 0")),
    # StridedSlice / indexing
    ("strided-lengths", lambda: ops.strided_slice(X, (0,), (1, 2), (1,)), ValueError,
     E("StridedSlice: begin (0,), end (1, 2) and strides (1,) must have the same length")),
    ("strided-rank", lambda: ops.strided_slice(X, (0, 0, 0), (1, 1, 1), (1, 1, 1)), ValueError,
     E("StridedSlice: begin has 3 entries but input 0 has rank 2")),
    ("strided-zero-stride", lambda: ops.strided_slice(X, (0,), (1,), (0,)), ValueError,
     E("StridedSlice: strides (0,) contain 0")),
    ("strided-ellipsis", lambda: ops.strided_slice(X, (0, 0), (1, 1), (1, 1), ellipsis_mask=3),
     ValueError, E("StridedSlice: ellipsis_mask=3 sets 2 bits; at most one entry")),
    ("strided-shrink-range", lambda: ops.strided_slice(X, (5,), (6,), (1,), shrink_axis_mask=1),
     ValueError, E("StridedSlice: begin[0]=5 is out of range for dim 0 (size 2)")),
    ("getitem-int-range", lambda: X[5], ValueError,
     E("GetItem: index (5,) is invalid for a tensor of shape (2, 3)")),
    ("getitem-too-many", lambda: X[0, 0, 0], ValueError,
     E("GetItem: index (0, 0, 0) is invalid for a tensor of shape (2, 3): too many indices")),
    ("getitem-array-range", lambda: X[np.array([0, 7])], ValueError,
     E("GetItem: index (array([0, 7]),) is invalid")),
    ("getitem-tensor-range", lambda: X[:, Tensor([3])], ValueError, E("GetItem: index")),
    ("getitem-float", lambda: X[1.5], TypeError,
     E("GetItem: index element 1.5 of type float is not supported")),
    ("getitem-str", lambda: X["a"], TypeError, E("GetItem: index element 'a' of type str")),
    ("getitem-float-array", lambda: X[np.array([0.5])], TypeError,
     E("GetItem: index arrays must be integer or bool, got dtype float64")),
    ("getitem-bool-shape", lambda: X[np.array([True, False, True])], ValueError,
     E("GetItem: index")),
    # Gather
    ("gather-index-range", lambda: ops.gather(X, Tensor([0, 5]), 1), ValueError,
     E("Gather: index 5 is out of range for dim 1 (size 3) of input 0; expected 0 <= index < 3")),
    ("gather-negative-index", lambda: ops.gather(X, Tensor([-1]), 0), ValueError,
     E("Gather: index -1 is out of range for dim 0 (size 2)")),
    ("gather-float-index", lambda: ops.gather(X, Tensor([0.0]), 0), TypeError,
     E("Gather: input 1 has dtype float32; expected an integer dtype")),
    ("gather-axis", lambda: ops.gather(X, Tensor([0]), 2), ValueError,
     E("Gather: axis=2 is out of range for an input of rank 2")),
    # OneHot
    ("onehot-depth", lambda: ops.one_hot(I32, -1), ValueError,
     E("OneHot: depth=-1 must be a non-negative int")),
    ("onehot-float-indices", lambda: ops.one_hot(Tensor([0.0]), 3), TypeError,
     E("OneHot: indices 0 has dtype float32; expected an integer dtype")),
    ("onehot-axis", lambda: ops.one_hot(I32, 3, 1.0, 0.0, 3), ValueError,
     E("OneHot: axis=3 is out of range; expected -2 <= axis <= 1")),
    ("onehot-on-shape", lambda: ops.one_hot(I32, 3, Tensor([1.0, 2.0]), 0.0), ValueError,
     E("OneHot: on_value and off_value must be scalars")),
    # BiasAdd
    ("bias-add-size", lambda: ops.bias_add(X, f32(2)), ValueError,
     E("BiasAdd: input 0 has shape (2, 3) but bias has shape (2,); the bias must be 1-D of "
       "size 3")),
    ("bias-add-rank", lambda: ops.bias_add(f32(3), f32(3)), ValueError,
     E("BiasAdd: input 0 has rank 1; expected rank >= 2")),
    ("bias-add-dtype", lambda: ops.bias_add(X, Tensor(np.ones(3))), TypeError,
     E("BiasAdd: input 0 has dtype float32 but input 1 has dtype float64")),
    # Cast
    ("cast-unknown", lambda: ops.cast(X, "foo"), TypeError,
     E("Cast: 'foo' is not a supported dtype; expected one of float16")),
    ("cast-complex", lambda: ops.cast(X, np.complex64), TypeError,
     E("is not a supported dtype")),
    # cross-entropy
    ("sparse-xent-label-range", lambda: ops.sparse_softmax_cross_entropy(X, Tensor([0, 7])),
     ValueError, E("SparseSoftmaxCrossEntropyWithLogits: label 7 at row 1 is out of range; "
                   "labels must be in [0, 3)")),
    ("sparse-xent-negative-label", lambda: ops.sparse_softmax_cross_entropy(X, Tensor([-1, 0])),
     ValueError, E("SparseSoftmaxCrossEntropyWithLogits: label -1 at row 0 is out of range")),
    ("sparse-xent-shapes", lambda: ops.sparse_softmax_cross_entropy(X, Tensor([0, 1, 2])),
     ValueError, E("SparseSoftmaxCrossEntropyWithLogits: logits have shape (2, 3) and labels "
                   "shape (3,); expected logits (N, C) and labels (N,)")),
    ("sparse-xent-float-labels",
     lambda: ops.sparse_softmax_cross_entropy(X, Tensor([0.0, 1.0])), TypeError,
     E("SparseSoftmaxCrossEntropyWithLogits: labels 1 has dtype float32")),
    ("sparse-xent-int-logits", lambda: ops.sparse_softmax_cross_entropy(I32, Tensor([0, 1])),
     TypeError, E("SparseSoftmaxCrossEntropyWithLogits: input 0 has dtype int32")),
    ("dense-xent-shapes", lambda: ops.softmax_cross_entropy(X, f32(2, 2)), ValueError,
     E("SoftmaxCrossEntropyWithLogits: logits have shape (2, 3) but labels have shape (2, 2)")),
    # Dropout
    ("dropout-p", lambda: ops.dropout(X, 1.0), ValueError,
     E("Dropout: p=1.0 must be a float in [0, 1)")),
    ("dropout-int", lambda: ops.dropout(I32, 0.5), TypeError,
     E("Dropout: input 0 has dtype int32")),
    ("Dropout-keep", lambda: ops.Dropout(0), ValueError,
     E("Dropout: keep_prob=0 must be a float in (0, 1]")),
    # constants
    ("zeros-negative", lambda: ops.zeros((-1, 2)), ValueError,
     E("Zeros: shape=(-1, 2) must be a tuple of ints >= 0")),
    ("ones-type", lambda: ops.ones("ab"), ValueError, E("Ones: shape='ab' must be")),
    ("zeros-dtype", lambda: ops.zeros((2,), "complex64"), TypeError,
     E("Zeros: 'complex64' is not a supported dtype")),
    # collectives: no parallel context in this process
    ("AllReduce-op", lambda: ops.AllReduce(op="foo"), ValueError,
     E("AllReduce: op='foo' is not valid; expected one of 'sum'")),
    ("ReduceScatter-op", lambda: ops.ReduceScatter(op="avg"), ValueError,
     E("ReduceScatter: op='avg' is not valid")),
    ("AllReduce-group", lambda: ops.AllReduce(group=3), TypeError,
     E("AllReduce: group must be a str, got 3")),
    ("Broadcast-root", lambda: ops.Broadcast(-1), ValueError,
     E("Broadcast: root_rank=-1 must be an int >= 0")),
]


@pytest.mark.parametrize("fn, exc, match", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_op_error(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_errors_are_never_numpy_index_errors():
    """The classic numpy leaks: each must come out as a named ValueError/TypeError."""
    leaks = [lambda: ops.reduce_sum(X, 5), lambda: ops.gather(X, Tensor([9]), 0),
             lambda: ops.transpose(X, (1, 2)), lambda: ops.squeeze(X, 1),
             lambda: ops.concat((X, f32(2, 3, 1)), 0), lambda: X[3], lambda: X[:, 7],
             lambda: ops.split_sizes(X, 4, [3]), lambda: ops.softmax(X, 4),
             lambda: ops.expand_dims(X, -4), lambda: ops.gather(X, Tensor([0]), -3),
             lambda: ops.one_hot(I32, 3, 1.0, 0.0, -3)]
    for fn in leaks:
        with pytest.raises((ValueError, TypeError)) as info:
            fn()
        assert not isinstance(info.value, IndexError)
        assert type(info.value) in (ValueError, TypeError), type(info.value)
        assert re.match(r"[A-Z][A-Za-z]+: ", str(info.value)), str(info.value)


# ---------------------------------------------------------------------------
# Primitive.shard: form at shard time, sizes at call time
# ---------------------------------------------------------------------------
SHARD_FORM = [
    ([[1, 1], [1, 1]], TypeError,
     E("MatMul: in_strategy must be a non-empty tuple of tuples of ints, e.g. ((2, 4), (4, 1)); "
       "got [[1, 1], [1, 1]]")),
    ((), TypeError, E("MatMul: in_strategy must be a non-empty tuple")),
    ((2, 4), TypeError, E("MatMul: in_strategy[0]=2 must be a tuple of ints")),
    (((0, 1), (1, 1)), ValueError,
     E("MatMul: in_strategy[0][0]=0 must be a positive int (the number of parts dim 0 is "
       "split into)")),
    (((1, -2), (1, 1)), ValueError, E("MatMul: in_strategy[0][1]=-2 must be a positive int")),
    (((1.0, 2), (1, 1)), TypeError, E("MatMul: in_strategy[0]=(1.0, 2) must be a tuple of ints")),
    (([1, 2], (1, 1)), TypeError, E("MatMul: in_strategy[0]=[1, 2] must be a tuple of ints")),
    (((True, 1), (1, 1)), TypeError, E("MatMul: in_strategy[0]=(True, 1) must be a tuple")),
]


@pytest.mark.parametrize("strategy, exc, match", SHARD_FORM)
def test_shard_strategy_form(strategy, exc, match):
    with pytest.raises(exc, match=match):
        ops.MatMul().shard(strategy)


def test_shard_out_strategy_form():
    with pytest.raises(ValueError, match=E("MatMul: out_strategy[0][0]=0 must be a positive")):
        ops.MatMul().shard(((1, 1), (1, 1)), out_strategy=((0, 1),))


def test_shard_returns_primitive_and_keeps_result():
    a = Tensor(np.arange(12, dtype=np.float32).reshape(4, 3))
    b = Tensor(np.ones((3, 2), np.float32))
    prim = ops.MatMul()
    assert prim.shard(((2, 1), (1, 1))) is prim
    assert prim.in_strategy == ((2, 1), (1, 1))
    np.testing.assert_array_equal(prim(a, b).asnumpy(), a.asnumpy() @ b.asnumpy())
    relu = ops.ReLU().shard(((2, 1),))
    np.testing.assert_array_equal(relu(a).asnumpy(), a.asnumpy())
    cat = ops.Concat(0).shard(((1, 1), (1, 1)))
    assert cat((a, a)).shape == (8, 3)


SHARD_CALL = [
    # a split may not exceed the dim (one that does not divide it gives unequal pieces)
    (((2, 4), (4, 1)), (4, 3), (3, 4), ValueError,
     E("MatMul: in_strategy[0][1]=4 exceeds dim 1 (size 3) of input 0: some devices would "
       "hold an empty piece")),
    (((3, 1), (1, 1)), (2, 30), (30, 4), ValueError,
     E("MatMul: in_strategy[0][0]=3 exceeds dim 0 (size 2) of input 0")),
    (((1, 1), (1, 3)), (4, 30), (30, 2), ValueError,
     E("MatMul: in_strategy[1][1]=3 exceeds dim 1 (size 2) of input 1")),
    (((2,), (1, 1)), (4, 30), (30, 4), ValueError,
     E("MatMul: in_strategy[0]=(2,) has 1 entries but input 0 has rank 2 (shape (4, 30))")),
    (((1, 1),), (4, 30), (30, 4), ValueError,
     E("MatMul: in_strategy has 1 entries but the op got 2 tensor inputs")),
]


@pytest.mark.parametrize("strategy, sa, sb, exc, match", SHARD_CALL)
def test_shard_strategy_checked_at_call(strategy, sa, sb, exc, match, sim_devices):
    sim_devices(8)              # strategies run (and are checked) in semi-auto parallel
    prim = ops.MatMul().shard(strategy)
    with pytest.raises(exc, match=match):
        prim(f32(*sa), f32(*sb))


@pytest.mark.parametrize("mode", [None, "data_parallel", "hybrid_parallel"])
@pytest.mark.parametrize("strategy, sa, sb, exc, match", SHARD_CALL)
def test_strategies_are_ignored_outside_semi_auto_and_auto(strategy, sa, sb, exc, match,
                                                           mode, sim_devices):
    """As in MindSpore, a network written for 8 devices runs unchanged on one device (and
    under data or hybrid parallel): its strategies are not applied, nor checked."""
    if mode is None:
        sim_devices(None)
    else:
        sim_devices(8, mode=mode, full_batch=True)
    a, b = f32(*sa), f32(*sb)
    np.testing.assert_allclose(ops.MatMul().shard(strategy)(a, b).asnumpy(),
                               a.asnumpy() @ b.asnumpy(), rtol=1e-5)


def test_shard_checked_for_other_primitives(sim_devices):
    sim_devices(8)
    with pytest.raises(ValueError, match=E("ReLU: in_strategy[0][0]=4 exceeds dim 0 "
                                           "(size 2) of input 0")):
        ops.ReLU().shard(((4, 1),))(X)
    with pytest.raises(ValueError, match=E("ReduceSum: in_strategy[0]=(1,) has 1 entries but "
                                           "input 0 has rank 2")):
        ops.ReduceSum().shard(((1,),))(X, 1)
    with pytest.raises(ValueError, match=E("BiasAdd: in_strategy[1][0]=4 exceeds dim 0 "
                                           "(size 3) of input 1")):
        ops.BiasAdd().shard(((1, 1), (4,)))(X, f32(3))


# ---------------------------------------------------------------------------
# the Cython kernel's own entry checks
# ---------------------------------------------------------------------------
def test_kernel_entry_validates_arguments():
    with pytest.raises(ValueError, match=E("sparse_softmax_xent: logits have shape (3,) and "
                                           "labels shape (3,); expected logits (N, C)")):
        _kernels.sparse_softmax_xent(np.ones(3, np.float32), np.zeros(3, np.int32))
    with pytest.raises(TypeError, match=E("sparse_softmax_xent: labels have dtype float32")):
        _kernels.sparse_softmax_xent(np.ones((2, 3), np.float32), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=E("sparse_softmax_xent: logits dtype int64 is not "
                                          "supported")):
        _kernels.sparse_softmax_xent(np.ones((2, 3), np.int64), np.zeros(2, np.int32))


# ---------------------------------------------------------------------------
# Tensor construction errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("data, exc, match", [
    ("abc", TypeError, E("Tensor: input_data of type str is not supported")),
    (None, TypeError, E("Tensor: input_data is required")),
    (np.ones(2, np.complex64), TypeError, E("Tensor: dtype complex64 is not supported")),
    ([[1, 2], [3]], ValueError, E("Tensor: cannot build a tensor from the nested sequence")),
])
def test_tensor_constructor_errors(data, exc, match):
    with pytest.raises(exc, match=match):
        Tensor(data)


def test_tensor_dtype_argument_error():
    with pytest.raises(TypeError, match=E("Tensor: 'float128x' is not a supported dtype")):
        Tensor([1.0], "float128x")
