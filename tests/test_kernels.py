"""The Cython kernels against their numpy references (dualmode/_core/reference.py), and
the Cython helpers of the dispatch core against numpy."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dualmode as dm
from dualmode import Tensor, ops
from dualmode._core import _kernels, _tensor, reference

E = re.escape


@pytest.mark.parametrize("fdtype", [np.float32, np.float64])
@pytest.mark.parametrize("ldtype", [np.int32, np.int64, np.uint8, np.int16])
@pytest.mark.parametrize("n, c", [(1, 1), (5, 4), (64, 10), (3, 1000)])
def test_sparse_xent_matches_reference(fdtype, ldtype, n, c):
    rng = np.random.default_rng(n * c)
    logits = (rng.normal(size=(n, c)) * 3).astype(fdtype)
    labels = rng.integers(0, min(c, 200), n).astype(ldtype)
    loss, probs = _kernels.sparse_softmax_xent(logits, labels)
    want_loss, want_probs = reference.sparse_softmax_xent(logits, labels.astype(np.int64))
    assert loss.dtype == fdtype and probs.dtype == fdtype
    assert loss.shape == (n,) and probs.shape == (n, c)
    tol = 1e-5 if fdtype == np.float32 else 1e-12
    np.testing.assert_allclose(loss, want_loss, rtol=tol, atol=tol)
    np.testing.assert_allclose(probs, want_probs, rtol=tol, atol=tol)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=tol)


@pytest.mark.parametrize("fdtype", [np.float32, np.float64])
def test_sparse_xent_large_logits_are_stable(fdtype):
    logits = np.array([[1e4, 0.0, -1e4], [-5e3, -5e3, -5e3]], fdtype)
    loss, probs = _kernels.sparse_softmax_xent(logits, np.array([0, 2], np.int32))
    assert np.isfinite(loss).all() and np.isfinite(probs).all()
    np.testing.assert_allclose(loss, [0.0, np.log(3.0)], rtol=1e-6, atol=1e-6)
    loss, _ = _kernels.sparse_softmax_xent(logits, np.array([1, 0], np.int64))
    np.testing.assert_allclose(loss[0], 1e4, rtol=1e-6)


def test_sparse_xent_non_contiguous_inputs():
    rng = np.random.default_rng(0)
    big = rng.normal(size=(6, 8)).astype(np.float32)
    logits = big[::2, 1::2]                        # strided view
    labels = np.array([0, 1, 3, 2, 1, 0], np.int64)[::2]
    loss, probs = _kernels.sparse_softmax_xent(logits, labels)
    want_loss, want_probs = reference.sparse_softmax_xent(np.ascontiguousarray(logits), labels)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(probs, want_probs, rtol=1e-5)


@pytest.mark.parametrize("c", [1024, 1021, 7])
def test_sparse_xent_rows_give_the_same_bits_whatever_rows_come_with_them(c):
    """A device holding some of the rows computes them as one device holding all does
    (the exponentials are vectorised: a row's position must not change its bits)."""
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, (40, c)).astype(np.float32)
    labels = rng.integers(0, c, 40)
    loss, probs = _kernels.sparse_softmax_xent(logits, labels)
    for k in (1, 3, 5):
        parts = [_kernels.sparse_softmax_xent(logits[i:i + k], labels[i:i + k])
                 for i in range(0, 40, k)]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), loss)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), probs)


def test_sparse_xent_empty_batch():
    loss, probs = _kernels.sparse_softmax_xent(np.zeros((0, 3), np.float32),
                                               np.zeros(0, np.int32))
    assert loss.shape == (0,) and probs.shape == (0, 3)


@pytest.mark.parametrize("ldtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad, row", [(3, 1), (-1, 0), (100, 2)])
def test_sparse_xent_out_of_range_label(ldtype, bad, row):
    labels = np.zeros(3, ldtype)
    labels[row] = bad
    with pytest.raises(ValueError, match=E(f"SparseSoftmaxCrossEntropyWithLogits: label {bad} "
                                           f"at row {row} is out of range; labels must be in "
                                           f"[0, 3)")):
        _kernels.sparse_softmax_xent(np.zeros((3, 3), np.float32), labels)


def test_sparse_xent_reports_first_bad_row():
    labels = np.array([0, 5, -2], np.int64)
    with pytest.raises(ValueError, match=E("label 5 at row 1")):
        _kernels.sparse_softmax_xent(np.zeros((3, 2), np.float64), labels)


def test_sparse_xent_float16_goes_through_float32():
    logits = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float16)
    labels = np.array([0, 1, 2, 1])
    out = ops.sparse_softmax_cross_entropy(Tensor(logits), Tensor(labels))
    assert out.dtype == np.float16
    want, _ = reference.sparse_softmax_xent(logits.astype(np.float32), labels)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=2e-3)   # float16 has ~3 digits


def test_sparse_xent_op_gradient_matches_reference_formula():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 4))
    labels = rng.integers(0, 4, 5)
    g = dm.grad(lambda x: ops.reduce_sum(ops.sparse_softmax_cross_entropy(x, Tensor(labels))))(
        Tensor(logits))
    _, probs = reference.sparse_softmax_xent(logits, labels)
    want = probs.copy()
    want[np.arange(5), labels] -= 1
    np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------
# Cython helpers of the dispatch core
# ---------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=5, max_side=5))
def test_broadcast_shapes_matches_numpy(shapes):
    s0, s1 = shapes.input_shapes
    assert _tensor.broadcast_shapes("Add", s0, s1) == np.broadcast_shapes(s0, s1)


@settings(max_examples=100, deadline=None)
@given(hnp.array_shapes(min_dims=1, max_dims=4, min_side=2, max_side=5), st.data())
def test_broadcast_shapes_rejects_incompatible(s0, data):
    i = data.draw(st.integers(0, len(s0) - 1))
    s1 = list(s0)
    s1[i] = s0[i] + 1
    s1 = tuple(s1)
    with pytest.raises(ValueError, match=E(f"Mul: input 0 has shape {s0} but input 1 has shape "
                                           f"{s1}; they cannot be broadcast")):
        _tensor.broadcast_shapes("Mul", s0, s1)


def test_infer_agrees_with_fast_kernels():
    a = np.ones((3, 1), np.float32)
    b = np.ones((4,), np.float32)
    for name in ("Add", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Pow", "Less"):
        op = ops.REGISTRY[name]
        (shape, dtype), = _tensor.infer(op, None, a, b)
        out = _tensor.apply(op, None, (a, b))
        assert out.shape == shape == (3, 4) and out.dtype == dtype
    for name in ("Neg", "Exp", "Log", "Sqrt", "Square", "Tanh", "Sigmoid", "ReLU", "Abs", "Sign"):
        op = ops.REGISTRY[name]
        (shape, dtype), = _tensor.infer(op, None, a)
        out = _tensor.apply(op, None, (a,))
        assert out.shape == shape and out.dtype == dtype


def test_zero_dim_kernel_outputs_are_arrays():
    x = Tensor(np.float32(0.5))
    for out in (x + x, ops.exp(x), ops.sigmoid(x), -x, ops.relu(x), x * 2.0):
        assert type(out._data) is np.ndarray and out.shape == ()


def test_opdef_requires_kernel_and_infer():
    with pytest.raises(TypeError, match=E("OpDef Foo: a kernel is required")):
        _tensor.OpDef("Foo")
    with pytest.raises(TypeError, match=E("OpDef Foo: generic ops need an infer function")):
        _tensor.OpDef("Foo", kernel=lambda at, x: x)
    with pytest.raises(ValueError, match=E("register: an op named 'Add' is already registered")):
        from dualmode.ops._registry import register
        register("Add", kernel=np.add, kind=_tensor.KIND_BINARY)
    with pytest.raises(ValueError, match=E("get_op: no op named 'Nope'")):
        ops.get_op("Nope")
    assert ops.get_op("MatMul") is ops.REGISTRY["MatMul"]


def test_backward_rule_shape_mismatch_is_reported():
    # an unregistered OpDef (the registry is shared by every layer; keep it clean)
    op = _tensor.OpDef("BadGradForTest", infer=lambda at, x: ((x.shape, x.dtype),),
                       kernel=lambda at, x: x * 1.0,
                       backward=lambda node, g: (ops.reduce_sum(g),))
    with pytest.raises(RuntimeError, match=E("BadGradForTest: backward rule gave input 0 a "
                                             "gradient of shape (); the input has shape (3,)")):
        dm.grad(lambda x: ops.reduce_sum(_tensor.apply(op, None, (x,))))(Tensor(np.ones(3)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sub_scaled_equals_numpy_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal(10007).astype(dtype)
    g = rng.standard_normal(10007).astype(dtype)
    want = w.copy()
    reference.sub_scaled(want, g, 0.0137)
    assert _kernels.sub_scaled(w, g, 0.0137) is True
    assert np.array_equal(w, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("w_shape, g_shape", [
    ((2, 4, 196, 52), (1, 4, 196, 52)),     # a sharded weight's two replicas, one block
    ((3, 10007), (10007,)),                 # more replicas than chunks line up with
    ((2, 2, 5000), (1, 1, 5000)),
])
def test_sub_scaled_over_replicas_equals_numpy_bit_for_bit(dtype, w_shape, g_shape):
    rng = np.random.default_rng(4)
    w = rng.standard_normal(w_shape).astype(dtype)
    g = rng.standard_normal(g_shape).astype(dtype)
    want = w.copy()
    reference.sub_scaled(want, g, 0.0137)               # numpy broadcasts g
    assert _kernels.sub_scaled(w, g, 0.0137) is True
    assert np.array_equal(w, want)


def test_sub_scaled_declines_what_it_cannot_do_in_place():
    w = np.ones((4, 4), np.float32)
    before = w.copy()
    assert _kernels.sub_scaled(w, np.ones((4, 4), np.float64), 0.1) is False   # dtypes
    assert _kernels.sub_scaled(w, np.ones((2, 4), np.float32), 0.1) is False   # shapes
    assert _kernels.sub_scaled(w, np.ones((4, 1), np.float32), 0.1) is False   # not trailing
    assert _kernels.sub_scaled(w[:1], np.ones((4, 4), np.float32), 0.1) is False
    assert _kernels.sub_scaled(w[:, ::2], np.ones((4, 2), np.float32), 0.1) is False
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    assert _kernels.sub_scaled(ro, np.ones(3, np.float32), 0.1) is False
    assert _kernels.sub_scaled(np.ones(3, np.float16), np.ones(3, np.float16), 0.1) is False
    assert np.array_equal(w, before)
