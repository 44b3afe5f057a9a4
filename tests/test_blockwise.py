"""Chained elementwise kernels computed block by block (ops._math.blockwise): the same
array, bit for bit, as the chain run on whole arrays (its reference), for sizes that are
and are not a multiple of the block, and run whole for inputs it does not cut."""
import numpy as np
import pytest

from dualmode.ops import _math as M

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("n", [2 * M.BLOCK, 3 * M.BLOCK + 17, 2 * M.BLOCK - 1, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_and_its_gradient_equal_the_whole_array_chain(n, dtype):
    x = (RNG.standard_normal(n) * 4).astype(dtype)
    dy = RNG.standard_normal(n).astype(dtype)
    assert np.array_equal(M._gelu_kernel(x), M._gelu_chain(x))
    assert np.array_equal(M._gelu_grad_kernel(x, dy), M._gelu_grad_chain(x, dy))
    # and they are GeLU: x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) in float64
    x64 = x.astype(np.float64)
    ref = x64 / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    np.testing.assert_allclose(M._gelu_kernel(x), ref, rtol=1e-5, atol=1e-6)


def test_blocks_keep_the_shape_and_cut_only_contiguous_equal_inputs():
    x = RNG.standard_normal((4, 256, 300)).astype(np.float32)
    dy = RNG.standard_normal((4, 256, 300)).astype(np.float32)
    seen = []

    def chain(a, b):
        seen.append(a.shape)
        return a * b + 1

    out = M.blockwise(chain, x, dy)
    assert out.shape == x.shape and np.array_equal(out, x * dy + 1)
    assert seen[0] == (M.BLOCK,) and len(seen) == -(-x.size // M.BLOCK)
    seen.clear()
    strided = x.transpose(0, 2, 1)                 # not C-contiguous: run whole
    out = M.blockwise(chain, strided, dy.transpose(0, 2, 1))
    assert seen == [strided.shape] and np.array_equal(out, strided * dy.transpose(0, 2, 1) + 1)
    seen.clear()
    M.blockwise(chain, x, dy[:, :, :1])             # shapes differ (broadcast): whole
    assert seen == [x.shape]
