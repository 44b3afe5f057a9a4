"""The fused ReluGrad kernel (_kernels.relu_grad) against its numpy reference."""
import numpy as np
import pytest

from dualmode._core import _kernels


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_grad_kernel_equals_reference(dtype):
    from dualmode.ops._math import relu_grad_reference
    rng = np.random.default_rng(3)
    y = rng.standard_normal((7, 33)).astype(dtype)
    y[0, :3] = 0.0
    dy = rng.standard_normal((7, 33)).astype(dtype)
    dy[1, 0], dy[1, 1], y[1, :2] = np.inf, np.nan, -1.0       # 0 * inf, 0 * nan -> nan
    y.flags.writeable = False                                 # read-only inputs are fine
    out = _kernels.relu_grad(y, dy)
    with np.errstate(invalid="ignore"):
        ref = relu_grad_reference(y, dy)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, ref)


def test_relu_grad_kernel_rejects_mismatched_arrays():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="relu_grad: expected two C-contiguous float32/float64"):
        _kernels.relu_grad(a, np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match="relu_grad"):
        _kernels.relu_grad(a, a.T.copy().T)
