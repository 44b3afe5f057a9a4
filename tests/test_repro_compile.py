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
from dualmode import Parameter, Tensor, nn, ops

from _devices import devices

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
    with devices(8 if mode != "stand_alone" else None):
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


# ---------------------------------------------------------------------------
# R5: AutoParallel over a train step; compiled cells inside a traced step
# ---------------------------------------------------------------------------
def _auto_step_run(strategy, opt_name, parallel, steps=2):
    from dualmode.parallel.auto_parallel import AutoParallel
    with devices(8 if parallel else None, gradients_mean=True):
        x, w0 = _rand(16, 8), _rand(8, 8, seed=1)

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.w = Parameter(Tensor(w0.copy()), name="w")
                self.mm = ops.MatMul().shard(strategy)

            def construct(self, t):
                return ops.reduce_sum(ops.square(self.mm(t, self.w)))

        net = Net()
        opt = {"sgd": lambda p: nn.SGD(p, learning_rate=0.1),
               "momentum": lambda p: nn.Momentum(p, learning_rate=0.1, momentum=0.9),
               "adam": lambda p: nn.Adam(p, learning_rate=0.1)}[opt_name](
            net.trainable_params())
        grad_fn = dm.value_and_grad(net, None, opt.parameters)

        def train_step(t):
            loss, grads = grad_fn(t)
            opt(grads)
            return loss

        step = AutoParallel(train_step, parallel_mode="semi_auto") if parallel else train_step
        losses = [float(step(Tensor(x)).asnumpy()) for _ in range(steps)]
        return losses, net.w.asnumpy()


@pytest.mark.parametrize("strategy", [((1, 4), (4, 2)), ((1, 2), (2, 4)), ((2, 1), (1, 4)),
                                      ((2, 2), (2, 2)), ((1, 8), (8, 1)), ((4, 2), (2, 1))])
@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "adam"])
def test_auto_parallel_train_step_moves_weights_as_stand_alone(strategy, opt_name):
    losses, w = _auto_step_run(strategy, opt_name, parallel=True)
    ref_losses, ref_w = _auto_step_run(strategy, opt_name, parallel=False)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["semi_auto", "sharding_propagation"])
def test_graph_mode_cell_inside_auto_parallel_step_is_inlined(how):
    """GRAPH_MODE compiles every top-level Cell call; inside AutoParallel's trace the
    cell's ops join the outer graph instead of being refused as a nested compile."""
    from dualmode.parallel.auto_parallel import AutoParallel
    from test_graph_mode import _batches, _train_step
    from test_operator_parallel import SeedNet

    def run(n, graph, mode):
        with devices(n if n > 1 else None, gradients_mean=True):
            dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
            dm.set_seed(7)
            net = SeedNet(False)
            opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
            step = _train_step(net, opt, nn.CrossEntropyLoss())
            if mode is not None:
                step = AutoParallel(step, parallel_mode=mode)
            losses = [float(step(x, y).asnumpy()) for x, y in _batches(2)]
            return losses, [p.asnumpy() for p in net.trainable_params()]

    ref_losses, ref_w = run(1, False, None)
    losses, w = run(8, True, how)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_shard_block_inside_another_keeps_its_strategies():
    x, w = _rand(16, 8), _rand(8, 4, seed=1)

    def run(parallel):
        with devices(8 if parallel else None):
            wp = Parameter(Tensor(w.copy()), name="w")
            inner = ops.shard(lambda t: ops.tanh(ops.matmul(t, wp)), in_strategy=((4, 1),),
                              out_strategy=((2, 1),))
            outer = ops.shard(lambda t: ops.reduce_sum(inner(t * 2.0)), in_strategy=((2, 1),))
            loss, (gx, (gw,)) = dm.value_and_grad(outer, 0, [wp])(Tensor(x))
            return loss.asnumpy(), gx.asnumpy(), gw.asnumpy()

    for a, e in zip(run(True), run(False)):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


def test_parameter_plan_inside_another_compiled_function_is_refused():
    from dualmode.parallel.graph.trace import TraceError
    with devices(8):
        w = Parameter(Tensor(_rand(8, 4)), name="w")
        inner = ops.shard(lambda t: ops.matmul(t, w), in_strategy=((2, 1),),
                          parameter_plan={"w": (1, 4)})
        outer = ops.shard(lambda t: inner(t), in_strategy=((2, 1),))
        with pytest.raises(TraceError, match=r"parameter_plan cannot be applied inside "
                                             r"another compiled function"):
            outer(Tensor(_rand(16, 8)))


# ---------------------------------------------------------------------------
# R4: strategies of ops with Python-number operands, the same in every mode
# ---------------------------------------------------------------------------
def _one_hot_run(mode, strategy):
    idx = np.array([0, 3, 1, 2, 3, 0, 1, 2], np.int32)
    w0 = _rand(4, 4, seed=3)
    with devices(8 if mode != "stand_alone" else None):
        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.w = Parameter(Tensor(w0.copy()), name="w")
                self.one_hot = ops.OneHot().shard(strategy)

            def construct(self, i):
                h = self.one_hot(i, 4, 1.0, 0.0)
                return ops.reduce_sum(ops.square(ops.matmul(h, self.w)))

        net = Net()
        f = net
        if mode == "ops.shard":
            f = ops.shard(lambda i: net(i), in_strategy=((2,),))
        elif mode == "GRAPH_MODE":
            dm.set_context(mode=dm.GRAPH_MODE)
        loss, (gw,) = dm.value_and_grad(f, None, [net.w])(Tensor(idx))
        return loss.asnumpy(), gw.asnumpy()


@pytest.mark.parametrize("strategy", [((4,),), ((4,), (), ())], ids=["indices", "mindspore"])
@pytest.mark.parametrize("mode", ["eager", "ops.shard", "GRAPH_MODE"])
def test_one_hot_strategy_with_python_on_off_values_in_every_mode(mode, strategy):
    got = _one_hot_run(mode, strategy)
    ref = _one_hot_run("stand_alone", strategy)
    for a, e in zip(got, ref):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("strategy,message", [
    (((3,),), r"OneHot: in_strategy\[0\]=\(3,\) needs 3 devices, which does not divide "
              r"device_num=8"),
    (((4,), (), (), ()), r"OneHot: in_strategy has 4 entries but the op got 1 tensor"),
    (((4,), (2,), ()), r"OneHot: in_strategy has 3 entries but the op got 1 tensor"),
])
def test_one_hot_invalid_strategy_is_refused_by_name(eight, strategy, message):
    idx = Tensor(np.zeros(8, np.int32))
    with pytest.raises(ValueError, match=message):
        ops.OneHot().shard(strategy)(idx, 4, 1.0, 0.0)


def test_mul_by_python_float_takes_an_empty_strategy_entry_or_none(eight):
    x = _rand(16, 4)
    for strategy in (((2, 1),), ((2, 1), ())):
        out = ops.Mul().shard(strategy)(Tensor(x), 3.0)
        np.testing.assert_allclose(out.asnumpy(), x * 3.0, rtol=1e-6)


# ---------------------------------------------------------------------------
# found by tests/test_fuzz_programs.py
# ---------------------------------------------------------------------------
def test_unused_parameter_of_a_compiled_train_step_gets_a_zero_gradient():
    """The zero gradient of a weight the loss does not use was built on the weight's
    abstract layout while tracing, so it WAS the weight: SGD moved it by lr * w."""
    from dualmode.parallel.auto_parallel import AutoParallel
    with devices(8):
        w0 = _rand(8, 8)
        used = Parameter(Tensor(_rand(8, seed=1)), name="used")
        unused = Parameter(Tensor(w0.copy()), name="unused")
        opt = nn.SGD([used, unused], learning_rate=0.1)
        grad_fn = dm.value_and_grad(lambda x: ops.reduce_sum(ops.square(x + used)), None,
                                    opt.parameters)

        def step(x):
            loss, grads = grad_fn(x)
            opt(grads)
            return loss

        AutoParallel(step, parallel_mode="semi_auto")(Tensor(_rand(16, 8, seed=2)))
        np.testing.assert_array_equal(unused.asnumpy(), w0)


@pytest.mark.parametrize("mode", ["ops.shard", "Cell.shard"])
def test_propagated_use_before_a_configured_strategy_does_not_fix_the_parameter(mode):
    """An op whose strategy propagation chose reads a parameter first; a later op with a
    configured strategy for it decides where it lives (before: 'a parameter used by
    several ops must get one consistent layout')."""
    def body(x, w, b):
        h = ops.pow(x, ops.sigmoid(b) + 0.5)
        return ops.Add().shard(((1, 2), (2,)))(h, b)

    x, b = _rand(16, 4) + 2.0, _rand(4, seed=2)

    def run(parallel):
        with devices(8 if parallel else None):
            net = _Net(body, _rand(8, 4, seed=1), b)
            f = net
            if parallel and mode == "ops.shard":
                f = ops.shard(lambda t: net(t), in_strategy=((1, 1),))
            elif parallel:
                net.shard(in_strategy=((1, 1),))
            loss, (gx, (gb,)) = dm.value_and_grad(
                lambda t: ops.reduce_sum(ops.square(f(t))), 0, [net.b])(Tensor(x))
            return loss.asnumpy(), gx.asnumpy(), gb.asnumpy()

    for a, e in zip(run(True), run(False)):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


def test_parameter_placed_alike_by_two_strategies_is_accepted(eight):
    """MatMul ((1, 1), (1, 2)) and ((2, 1), (1, 2)) put the same column blocks of w on the
    same devices over different device matrices ((4, 2) and (2, 2, 2)): one placement,
    not a conflict."""
    x, w0 = _rand(16, 8), _rand(8, 8, seed=1)
    w = Parameter(Tensor(w0.copy()), name="w")
    h = ops.MatMul().shard(((1, 1), (1, 2)))(Tensor(x), w)
    out = ops.MatMul().shard(((2, 1), (1, 2)))(h, w)
    np.testing.assert_allclose(out.asnumpy(), (x @ w0) @ w0, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"Parameter w: MatMul needs it in layout .* but it "
                                         r"is stored as .* one consistent layout"):
        ops.MatMul().shard(((1, 2), (2, 1)))(Tensor(x), w)
