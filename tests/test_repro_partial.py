"""Repros R1 and R2 of issue 11: pending partial sums through linear ops.

A pending sum over some device axes of a layout that repeats over others must stay
pending over exactly those axes when it passes through a linear op (Reshape, Neg,
Cast, Mul by a replicated value, a reduction). Counting it over every device
over-counted the value by the number of replicas (2x, 4x). The gradient of a bias or
a weight used twice went through the same path in the backward pass (8/k too large
when the input was split k ways with copies on the other devices).

Every test runs the same program sharded on 8 simulated devices and stand-alone with
the same initial weights and compares the loss, every gradient and the weights after
one SGD step.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops

from _devices import devices

RTOL, ATOL = 1e-5, 1e-6


def _rand(*shape, seed=0):
    """Values in [-1, 1): squares of sums stay small, so float32 rounding stays far
    below the tolerance whatever order the devices add in."""
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32)


class _Net(nn.Cell):
    def __init__(self, body, weights):
        super().__init__()
        self.body = body
        self.ws = [Parameter(Tensor(w.copy()), name=f"w{i}") for i, w in enumerate(weights)]
        for i, p in enumerate(self.ws):
            setattr(self, f"w{i}", p)

    def construct(self, x):
        return self.body(x, *self.ws)


def _step(body, x, weights, parallel):
    """loss, input gradient, weight gradients, weights after one SGD step (lr 0.5)."""
    with devices(8 if parallel else None, gradients_mean=True):
        net = _Net(body, weights)
        opt = nn.SGD(net.ws, learning_rate=0.5)
        loss, (gx, gw) = dm.value_and_grad(net, 0, opt.parameters)(Tensor(x))
        out = (loss.asnumpy(), gx.asnumpy(), [g.asnumpy() for g in gw])
        opt(gw)
        return out + ([p.asnumpy() for p in net.ws],)


def _close(actual, desired):
    """float32 agreement; the absolute part scales with the array's largest value (an
    element that is a small difference of large sums carries their rounding)."""
    scale = max(1.0, float(np.max(np.abs(desired))))
    np.testing.assert_allclose(actual, desired, rtol=RTOL, atol=ATOL * scale)


def _check(body, x, weights):
    loss, gx, gw, w1 = _step(body, x, weights, parallel=True)
    loss0, gx0, gw0, w10 = _step(body, x, weights, parallel=False)
    for a, b in zip([loss, gx] + gw + w1, [loss0, gx0] + gw0 + w10):
        _close(a, b)


# ---------------------------------------------------------------------------
# R1: a pending sum through a linear op
# ---------------------------------------------------------------------------
def test_partial_matmul_reshape_square_equals_stand_alone():
    def body(x, w):
        h = ops.MatMul().shard(((1, 4), (4, 1)))(x, w)          # partial over 4, 2 copies
        h = ops.Reshape()(h, (32,))
        return ops.ReduceSum()(ops.Square()(h))
    _check(body, _rand(8, 16), [_rand(16, 4, seed=1)])


@pytest.mark.parametrize("linear", ["neg", "transpose", "reduce", "cast", "mul"])
def test_partial_matmul_then_linear_op_equals_stand_alone(linear):
    def body(x, w):
        h = ops.MatMul().shard(((1, 4), (4, 1)))(x, w)
        if linear == "neg":
            h = ops.Neg()(h)
        elif linear == "transpose":
            h = ops.Transpose()(h, (1, 0))
        elif linear == "reduce":
            h = ops.ReduceSum(keep_dims=True)(h, 1)
        elif linear == "cast":
            h = ops.Cast()(h, dm.float32)
        else:
            h = h * 3.0
        return ops.ReduceSum()(ops.Square()(h))
    _check(body, _rand(8, 16), [_rand(16, 4, seed=1)])


def test_partial_gather_neg_reduce_equals_stand_alone():
    idx = Tensor(np.array([0, 3, 5, 15, 7, 8, 1, 2], np.int32))

    def body(x, w):
        h = ops.Gather().shard(((4, 1), (1,)))(w, idx, 0)        # split table: partial
        return ops.ReduceSum()(ops.Neg()(h) * x)
    _check(body, _rand(8, 4), [_rand(16, 4, seed=1)])


def test_partial_matmul_transpose_b_then_tanh_gradient_equals_stand_alone():
    def body(x, w):
        h = ops.MatMul(transpose_b=True).shard(((1, 2), (4, 2)))(x, w)
        return ops.ReduceSum()(ops.Tanh().shard(((1, 2),))(h))
    _check(body, _rand(8, 16), [_rand(8, 16, seed=1)])


# ---------------------------------------------------------------------------
# R2: a bias (or a weight used twice) whose input is split k ways with copies
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_partial_bias_gradient_tanh_split_k_equals_stand_alone(k):
    def body(x, b):
        return ops.ReduceMean()(ops.Tanh().shard(((k, 1),))(x + b))
    _check(body, _rand(16, 8), [_rand(8, seed=1)])


def test_partial_bias_gradient_add_strategy_equals_stand_alone():
    def body(x, b):
        return ops.ReduceSum()(ops.Tanh()(ops.Add().shard(((2, 1), (1,)))(x, b)))
    _check(body, _rand(16, 8), [_rand(8, seed=1)])


def test_partial_bias_gradient_softmax_equals_stand_alone():
    def body(x, b):
        return ops.ReduceSum()(ops.Square()(ops.Softmax(axis=1).shard(((2, 4),))(x + b)))
    _check(body, _rand(16, 8), [_rand(8, seed=1)])


def test_partial_weight_used_twice_equals_stand_alone():
    def body(x, w):
        return ops.ReduceSum()(ops.Tanh().shard(((2, 1),))(x * w) * w)
    _check(body, _rand(16, 8), [_rand(8, seed=1)])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_partial_sum_over_batch_of_integers_is_exact(dtype):
    """A sum over the batch of a data-parallel input is a pending sum; integers cannot
    be split into n equal shares (7 / 8 == 0), so it must still add up exactly."""
    with devices(8, "data_parallel"):
        class Net(nn.Cell):
            def construct(self, x):
                return ops.ReduceSum()(x, 0) + ops.ReduceSum(keep_dims=True)(x, 0)[0]

        x = np.arange(64).reshape(16, 4).astype(dtype) + 7
        np.testing.assert_array_equal(Net()(Tensor(x)).asnumpy(), 2 * x.sum(0))


def test_partial_cast_to_int_resolves_the_sum_first(eight):
    """A cast into an integer dtype rounds each term, so it is not linear: the pending
    sum of a contracted MatMul is resolved before it (a cast to float keeps it)."""
    x = np.full((8, 16), 0.7, np.float32)
    w = np.full((16, 4), 1.0, np.float32)
    h = ops.MatMul().shard(((1, 4), (4, 1)))(Tensor(x), Tensor(w))   # 11.2, pending over 4
    assert h.layout.partial
    as_int = ops.Cast()(h, dm.int32)              # int(11.2), not 4 * int(2.8) = 8
    np.testing.assert_array_equal(as_int.asnumpy(), np.full((8, 4), 11, np.int32))
    as_float = ops.Cast()(h, dm.float64)
    assert as_float.layout.partial                                    # still pending
    np.testing.assert_allclose(as_float.asnumpy(), 11.2, rtol=1e-6)
