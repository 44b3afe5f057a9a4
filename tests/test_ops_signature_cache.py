"""The per-signature caches of the op layer (ops/_registry.remember): a signature is
stored only after it passed its checks, so a bad call meets the same error before and
after a good call of a look-alike signature (1.0 == 1, same shapes other dtypes)."""
import re

import numpy as np
import pytest

from dualmode import Tensor, ops
from dualmode.ops import _registry

E = re.escape


def test_reduce_axis_float_refused_after_the_int_axis_ran():
    x = Tensor(np.ones((2, 3), np.float32))
    assert ops.reduce_sum(x, 1).asnumpy().tolist() == [3.0, 3.0]
    for _ in range(2):
        with pytest.raises(TypeError, match=E("ReduceSum: axis must be an int, got 1.0")):
            ops.reduce_sum(x, 1.0)
        with pytest.raises(TypeError, match=E("ReduceSum: axis must be an int, got 1.0")):
            ops.reduce_sum(x, (1.0,))
    assert ops.reduce_sum(x, (1,)).asnumpy().tolist() == [3.0, 3.0]


def test_matmul_dtype_mismatch_refused_after_the_same_shapes_ran():
    a, b = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    assert ops.matmul(Tensor(a), Tensor(b)).shape == (2, 4)
    for _ in range(2):
        with pytest.raises(TypeError, match=E("MatMul: input 0 has dtype float32 but input "
                                              "1 has dtype float64")):
            ops.matmul(Tensor(a), Tensor(b.astype(np.float64)))
        with pytest.raises(ValueError, match=E("MatMul: input 0 has shape (2, 3) but input 1 "
                                               "has shape (4, 4)")):
            ops.matmul(Tensor(a), Tensor(np.ones((4, 4), np.float32)))
    np.testing.assert_array_equal(ops.matmul(Tensor(a), Tensor(b)).asnumpy(), a @ b)


def test_bias_add_and_sparse_xent_refusals_survive_good_calls():
    x, b = np.ones((2, 3), np.float32), np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(ops.bias_add(Tensor(x), Tensor(b)).asnumpy(), x + b)
    with pytest.raises(TypeError, match=E("BiasAdd: input 0 has dtype float32 but input 1 "
                                          "has dtype float64")):
        ops.bias_add(Tensor(x), Tensor(b.astype(np.float64)))
    logits, labels = np.zeros((2, 3), np.float32), np.array([0, 2], np.int32)
    loss = ops.sparse_softmax_cross_entropy(Tensor(logits), Tensor(labels))
    np.testing.assert_allclose(loss.asnumpy(), np.log(3.0) * np.ones(2), rtol=1e-6)
    with pytest.raises(TypeError, match="labels 1 has dtype float32; expected an integer"):
        ops.sparse_softmax_cross_entropy(Tensor(logits), Tensor(labels.astype(np.float32)))


def test_remember_is_bounded_and_skips_unhashable_keys(monkeypatch):
    monkeypatch.setattr(_registry, "_SEEN_MAX", 3)
    cache = {}
    for k in range(3):
        assert _registry.remember(cache, k, k * 10) == k * 10
    assert cache == {0: 0, 1: 10, 2: 20}
    assert _registry.remember(cache, 3, 30) == 30          # full: starts over
    assert cache == {3: 30}
    assert _registry.remember(cache, ([1],), "v") == "v"   # unhashable: not stored
    assert cache == {3: 30}
