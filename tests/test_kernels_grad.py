"""The one-pass gradient kernels (ReluGrad, TanhGrad, SigmoidGrad, the sparse softmax
cross-entropy gradient) against their numpy references in dualmode/_core/reference.py:
bit-identical results, on plain arrays and on device stacks (stride 0 or strided along
the leading axis), and None (the numpy form then) for what they do not take."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, ops
from dualmode._core import _kernels, reference
from dualmode.ops._nn import SPARSE_XENT_GRAD
from dualmode.ops._registry import apply

OUTPUT_GRADS = ["relu_grad", "tanh_grad", "sigmoid_grad"]


def _pair(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    flat_y, flat_dy = y.reshape(-1), dy.reshape(-1)
    special = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0]
    k = min(len(special), flat_y.size)
    flat_y[:k] = special[:k]                      # signed zeros and NaN/inf in y ...
    flat_dy[k:2 * k] = special[:len(flat_dy[k:2 * k])]       # ... and in dy
    return y, dy


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", OUTPUT_GRADS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (16, 64), (3, 5, 9), (0, 4)])
def test_output_grad_matches_reference(name, dtype, shape):
    y, dy = _pair(shape, dtype)
    with np.errstate(all="ignore"):
        got = getattr(_kernels, name)(y, dy)
        want = getattr(reference, name)(y, dy)
    assert got is not None and _same_bits(got, np.asarray(want))


@pytest.mark.parametrize("name", OUTPUT_GRADS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_grad_on_device_stacks(name, dtype):
    """Stacks (n, rows, cols): one operand stored once (stride 0 along n), every other
    device's slice, reversed along n: each leading slice contiguous."""
    y, dy = _pair((4, 6, 5), dtype, seed=1)
    once = np.broadcast_to(y[0], y.shape)
    wide, _ = _pair((8, 6, 5), dtype, seed=2)
    cases = [(once, dy), (dy, once), (wide[::2], dy), (y[::-1], wide[1::2])]
    ref = getattr(reference, name)
    for a, b in cases:
        with np.errstate(all="ignore"):
            got = getattr(_kernels, name)(a, b)
            want = ref(a, b)
        assert got is not None and got.flags.c_contiguous and _same_bits(got, want)


@pytest.mark.parametrize("name", OUTPUT_GRADS)
def test_output_grad_declines_what_it_does_not_take(name):
    f = getattr(_kernels, name)
    y, dy = _pair((6, 8), np.float32)
    assert f(y[:, ::2], dy[:, ::2]) is None            # rows not contiguous
    assert f(y.T, dy.T) is None                        # Fortran order
    assert f(y, dy[:1]) is None                        # broadcasting shapes
    assert f(y, dy.astype(np.float64)) is None         # dtypes differ
    assert f(y.astype(np.float16), dy.astype(np.float16)) is None
    assert f(np.ones((6, 8), np.int32), np.ones((6, 8), np.int32)) is None
    assert f(y.tolist(), dy) is None                   # not arrays
    assert f(np.float32(1.0), np.float32(2.0)) is None


@pytest.mark.parametrize("fn,name", [(ops.relu, "relu_grad"), (ops.tanh, "tanh_grad"),
                                     (ops.sigmoid, "sigmoid_grad")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_activation_gradient_is_the_reference_formula(fn, name, dtype):
    """Through autograd (the kernel for float32/64, numpy for float16): the input
    gradient equals the reference formula applied to the forward output."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 7)).astype(dtype)
    w = rng.standard_normal((5, 7)).astype(dtype)
    g = dm.grad(lambda t: ops.reduce_sum(ops.mul(fn(t), Tensor(w))))(Tensor(x))
    y = fn(Tensor(x)).asnumpy()
    assert _same_bits(g.asnumpy(), getattr(reference, name)(y, w))


@pytest.mark.parametrize("fdtype", [np.float32, np.float64])
@pytest.mark.parametrize("ldtype", [np.int32, np.int64])
@pytest.mark.parametrize("n, c", [(1, 1), (5, 4), (64, 10), (0, 3)])
def test_sparse_xent_grad_matches_reference(fdtype, ldtype, n, c):
    rng = np.random.default_rng(4)
    probs = rng.random((n, c)).astype(fdtype)
    labels = rng.integers(0, c, n).astype(ldtype)
    g = rng.standard_normal(n).astype(fdtype)
    for gg in (g, np.broadcast_to(fdtype(0.25), (n,)), np.repeat(g, 2)[::2]):
        got = _kernels.sparse_xent_grad(probs, labels, gg)
        assert got is not None and _same_bits(got, reference.sparse_xent_grad(probs, labels, gg))


def test_sparse_xent_grad_declines_what_it_does_not_take():
    probs = np.full((3, 4), 0.25, np.float32)
    labels = np.array([0, 3, 1], np.int32)
    g = np.ones(3, np.float32)
    assert _kernels.sparse_xent_grad(probs, np.array([0, 4, 1], np.int32), g) is None
    assert _kernels.sparse_xent_grad(probs, np.array([0, -1, 1], np.int32), g) is None
    assert _kernels.sparse_xent_grad(probs, labels.astype(np.uint8), g) is None
    assert _kernels.sparse_xent_grad(probs, labels, g.astype(np.float64)) is None
    assert _kernels.sparse_xent_grad(probs.T.copy().T, labels, g) is None   # Fortran order
    assert _kernels.sparse_xent_grad(probs[:, :2], labels, g) is None
    assert _kernels.sparse_xent_grad(probs, labels[:2], g) is None
    assert _kernels.sparse_xent_grad(probs.astype(np.float16), labels,
                                     g.astype(np.float16)) is None


def test_sparse_xent_grad_op_takes_numpy_for_what_the_kernel_declines():
    """A negative label reaches the grad op directly only by apply; numpy's indexing
    then counts it from the end, as before the kernel."""
    probs = np.full((2, 3), 1 / 3, np.float32)
    g = np.array([1.0, 2.0], np.float32)
    got = apply(SPARSE_XENT_GRAD, None, (probs, np.array([0, -1], np.int64), g)).asnumpy()
    assert _same_bits(got, reference.sparse_xent_grad(probs, np.array([0, -1]), g))
