"""Repro R3 of issue 11: compiling a block where the output of a MatMul, Transpose or
keep_dims ReduceSum is multiplied or divided by a 1-D parameter.

The backward pass of such a block starts from a constant (the ones of the output's
gradient); the static planner took the constant for a scalar and gave the product the
parameter's shape, and the next rule indexed dims that did not exist (IndexError at
compile in ops.shard, Cell.shard and GRAPH_MODE). Every test compares the forward
value and the gradients of the input and of both parameters with the stand-alone run.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

RTOL, ATOL = 1e-5, 1e-5


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32)


def _body(kind, op):
    """h -> (h's producer)(h) <op> b."""
    combine = {"mul": lambda a, b: a * b, "div": lambda a, b: a / b,
               "rmul": lambda a, b: b * a}[op]

    def body(x, w, b):
        if kind == "matmul":
            h = ops.matmul(x, w)                                  # (16, 4)
        elif kind == "transpose":
            h = ops.transpose(ops.matmul(x, w), (1, 0))          # (4, 16)
        else:
            h = ops.ReduceSum(keep_dims=True)(ops.matmul(x, w), 0)   # (1, 4)
        return combine(h, b)
    return body


def _b_shape(kind):
    return (16,) if kind == "transpose" else (4,)


class _Net(nn.Cell):
    def __init__(self, body, w, b):
        super().__init__()
        self.w = Parameter(Tensor(w.copy()), name="w")
        self.b = Parameter(Tensor(b.copy()), name="b")
        self.body = body

    def construct(self, x):
        return self.body(x, self.w, self.b)


def _run(mode, body, x, w, b):
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)
    communication.init()
    if mode != "stand_alone":
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
        communication.init()
    try:
        net = _Net(body, w, b)
        if mode == "ops.shard":
            f = ops.shard(lambda t: body(t, net.w, net.b), in_strategy=((2, 1),))
        elif mode == "Cell.shard":
            net.shard(in_strategy=((2, 1),))
            f = net
        elif mode == "GRAPH_MODE":
            dm.set_context(mode=dm.GRAPH_MODE)
            f = net
        else:
            f = net
        loss, (gx, (gw, gb)) = dm.value_and_grad(
            lambda t: ops.reduce_sum(ops.square(f(t))), 0, [net.w, net.b])(Tensor(x))
        return [loss.asnumpy(), gx.asnumpy(), gw.asnumpy(), gb.asnumpy()]
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
        dm.reset_auto_parallel_context()
        communication.init()


@pytest.mark.parametrize("mode", ["ops.shard", "Cell.shard", "GRAPH_MODE"])
@pytest.mark.parametrize("kind", ["matmul", "transpose", "reduce_keepdims"])
@pytest.mark.parametrize("op", ["mul", "div", "rmul"])
def test_compiled_product_with_1d_parameter_equals_stand_alone(mode, kind, op):
    x, w = _rand(16, 8), _rand(8, 4, seed=1)
    b = _rand(*_b_shape(kind), seed=2) + 2.0          # away from 0: also a divisor
    body = _body(kind, op)
    got = _run(mode, body, x, w, b)
    ref = _run("stand_alone", body, x, w, b)
    for a, e in zip(got, ref):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("b_shape", [(1, 4), ()])
def test_compiled_product_with_broadcast_parameter_equals_stand_alone(b_shape):
    """A (1, n) parameter broadcast on dim 0, and a 0-d one."""
    x, w = _rand(16, 8), _rand(8, 4, seed=1)
    b = _rand(*b_shape, seed=2) + 2.0
    body = _body("matmul", "mul")
    for mode in ("ops.shard", "GRAPH_MODE"):
        got = _run(mode, body, x, w, b)
        ref = _run("stand_alone", body, x, w, b)
        for a, e in zip(got, ref):
            np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)
