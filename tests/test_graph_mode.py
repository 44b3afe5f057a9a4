"""Graph mode (ops.shard, Cell.shard, AutoParallel, GRAPH_MODE) against the
single-device run of the same program."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport, compile_count
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.parallel.graph.trace import TraceError

from test_operator_parallel import SeedNet, _setup


@pytest.fixture(autouse=True)
def _pynative_after():
    yield
    dm.set_context(mode=dm.PYNATIVE_MODE)
    dm.reset_auto_parallel_context()


def _train_step(net, opt, loss_fn):
    """forward, value_and_grad and the optimizer update: one training step function."""
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return train_step


def _batches(steps, batch=16):
    rng = np.random.default_rng(0)
    for _ in range(steps):
        yield (Tensor(rng.standard_normal((batch, 3, 4, 4)).astype(np.float32)),
               Tensor(rng.integers(0, 10, batch).astype(np.int32)))


# ---------------------------------------------------------------------------
# AutoParallel over a whole training step; GRAPH_MODE
# ---------------------------------------------------------------------------
def _train_step_run(devices, how, layouts=False, steps=3):
    _setup(devices)
    dm.set_seed(7)
    net = SeedNet(layouts)
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    train_step = _train_step(net, opt, nn.CrossEntropyLoss())
    step = AutoParallel(train_step, parallel_mode="semi_auto") if how == "auto" else train_step
    before = compile_count()
    losses = [float(step(x, y).asnumpy()) for x, y in _batches(steps)]
    return losses, [p.asnumpy() for p in net.trainable_params()], compile_count() - before, net


@pytest.mark.parametrize("layouts", [False, True], ids=["strategies", "layouts"])
def test_autoparallel_train_step_equals_single_device(layouts):
    ref_losses, ref_w, _, _ = _train_step_run(1, "eager", layouts)
    losses, w, compiles, net = _train_step_run(8, "auto", layouts)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert compiles == 1                       # three steps, one compile
    # the update landed in the sharded parameters: fc1 stays split as matmul1 wants
    assert dm.parallel.local_shape(net.fc1_weight) != tuple(net.fc1_weight.shape)


def _graph_mode_run(devices, graph, steps=3):
    _setup(devices)
    dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
    dm.set_seed(7)
    net = SeedNet(False)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses, grads_seen = [], None
    for x, y in _batches(steps):
        loss, grads = grad_fn(x, y)
        grads_seen = [g.asnumpy() for g in grads]
        opt(grads)
        losses.append(float(loss.asnumpy()))
    dm.set_context(mode=dm.PYNATIVE_MODE)
    return losses, grads_seen, [p.asnumpy() for p in net.trainable_params()], net


def test_graph_mode_cells_equal_single_device():
    ref_losses, ref_g, ref_w, _ = _graph_mode_run(1, False)
    before = compile_count()
    losses, g, w, net = _graph_mode_run(8, True)
    assert compile_count() - before == 2        # the network and the loss cell, once each
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(g + w, ref_g + ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    matmul1 = net.__dict__["_graph_fn"].strategies()["MatMul-0"]
    assert matmul1["strategy"] == ((2, 4), (4, 1))
    assert matmul1["configured"] and not matmul1["backward"]


# ---------------------------------------------------------------------------
# ops.shard / Cell.shard inside eager code, with propagation
# ---------------------------------------------------------------------------
class Block(nn.Cell):
    """Two dense layers without strategies: propagation chooses them."""

    def __init__(self, d=16, h=32):
        super().__init__()
        rng = np.random.default_rng(3)
        self.w1 = Parameter(Tensor(rng.standard_normal((d, h)).astype(np.float32) * 0.3),
                            name="w1")
        self.w2 = Parameter(Tensor(rng.standard_normal((h, d)).astype(np.float32) * 0.3),
                            name="w2")

    def construct(self, x):
        return ops.matmul(ops.tanh(ops.matmul(x, self.w1)), self.w2)


class Outer(nn.Cell):
    def __init__(self, shard=None):
        super().__init__()
        self.block = Block()
        self.head = nn.Dense(16, 4)
        if shard == "cell":
            self.block.shard(in_strategy=((2, 1),), out_strategy=((8, 1),))
            self.call_block = self.block
        elif shard == "ops":
            self.call_block = ops.shard(self.block, in_strategy=((4, 1),),
                                        out_strategy=((8, 1),))
        else:
            self.call_block = self.block

    def construct(self, x):
        return self.head(ops.relu(self.call_block(x)))


def _outer_run(devices, shard, steps=3, mode="auto_parallel"):
    _setup(devices, mode)
    dm.set_seed(5)
    net = Outer(shard if devices > 1 else None)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    loss_fn = nn.MSELoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), 0, opt.parameters)
    rng = np.random.default_rng(1)
    losses, gx = [], None
    for _ in range(steps):
        x = Tensor(rng.standard_normal((32, 16)).astype(np.float32))
        y = Tensor(rng.standard_normal((32, 4)).astype(np.float32))
        loss, (dx, grads) = grad_fn(x, y)
        gx = dx.asnumpy()
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, gx, [p.asnumpy() for p in net.trainable_params()], net


@pytest.mark.parametrize("shard", ["ops", "cell"])
def test_shard_block_in_eager_code_equals_single_device(shard):
    ref_losses, ref_gx, ref_w, _ = _outer_run(1, None)
    before = compile_count()
    losses, gx, w, net = _outer_run(8, shard)
    assert compile_count() - before == 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-6)   # input gradient
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    fn = net.call_block if shard == "ops" else net.block.__dict__["_shard_fn"]
    chosen = fn.strategies()
    # only in/out strategies were given: propagation picked the inner ops' strategies
    assert {k for k, v in chosen.items() if not v["backward"]} >= {"MatMul-0", "Tanh-0",
                                                                   "MatMul-1"}
    assert all(chosen[k]["strategy"] is not None and not chosen[k]["configured"]
               for k in ("MatMul-0", "Tanh-0", "MatMul-1"))


def test_shard_function_with_parameter_plan_and_comm_report():
    _setup(8, "auto_parallel")
    rng = np.random.default_rng(0)
    w = Parameter(Tensor(rng.standard_normal((8, 16)).astype(np.float32)), name="w")

    def fn(x):
        return ops.relu(ops.matmul(x, w))

    f = ops.shard(fn, in_strategy=((2, 4),), parameter_plan={"w": (4, 2)})
    x = rng.standard_normal((8, 8)).astype(np.float32)
    with CommReport() as rep:
        out = f(Tensor(x))
    np.testing.assert_allclose(out.asnumpy(), np.maximum(x @ w.asnumpy(), 0), rtol=1e-5)
    assert dm.parallel.local_shape(w) == (2, 8)       # lives as parameter_plan says
    assert rep.count() >= 1
    dot = f.dump()
    assert dot.startswith('digraph "fn"') and "MatMul-0" in dot and "color=red" in dot


# ---------------------------------------------------------------------------
# caching and re-tracing
# ---------------------------------------------------------------------------
def test_cache_retraces_on_shape_dtype_and_strategy_changes():
    _setup(4)
    calls = []

    def fn(x):
        calls.append(1)
        return ops.relu(x) * 2.0

    f = ops.shard(fn, in_strategy=((2, 1),))
    x = np.arange(-8, 8, dtype=np.float32).reshape(4, 4)
    before = compile_count()
    for _ in range(3):
        np.testing.assert_allclose(f(Tensor(x)).asnumpy(), np.maximum(x, 0) * 2)
    assert compile_count() - before == 1 and len(calls) == 1
    f(Tensor(x[:2]))                                         # new shape
    f(Tensor(x.astype(np.float64)))                          # new dtype
    assert compile_count() - before == 3
    ops.ReLU().shard(((1, 2),))                              # any strategy change
    f(Tensor(x))
    assert compile_count() - before == 4


def test_reading_a_traced_value_raises():
    _setup(4)

    def fn(x):
        if float(ops.reduce_sum(x)) > 0:
            return x
        return -x

    with pytest.raises(TraceError, match="value of an abstract tensor"):
        ops.shard(fn, in_strategy=((2, 1),))(Tensor(np.ones((4, 4), np.float32)))


def test_python_control_flow_on_shapes_unrolls():
    _setup(4)

    def fn(x):
        for _ in range(x.shape[0] // 2):
            x = ops.tanh(x)
        return x

    f = ops.shard(fn, in_strategy=((4, 1),))
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(f(Tensor(x)).asnumpy(), np.tanh(np.tanh(x)), rtol=1e-6)
    assert sum(1 for n in f.compiled.graph.nodes if n.op_name == "Tanh") == 2


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_in_strategy_length_must_match_inputs():
    _setup(4)
    f = ops.shard(lambda a, b: a + b, in_strategy=((2, 1),))
    x = Tensor(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match=r"in_strategy has 1 entries but fn got 2 inputs"):
        f(x, x)


def test_parameter_plan_unknown_name_warns_and_bad_split_raises():
    _setup(4)
    w = Parameter(Tensor(np.ones((6, 4), np.float32)), name="w")
    x = Tensor(np.ones((4, 6), np.float32))
    f = ops.shard(lambda x: ops.matmul(x, w), in_strategy=((2, 1),),
                  parameter_plan={"nope": (2, 1)})
    with pytest.warns(UserWarning, match=r"parameter_plan names 'nope'"):
        f(x)
    w2 = Parameter(Tensor(np.ones((6, 3), np.float32)), name="w2")
    g = ops.shard(lambda x: ops.matmul(x, w2), in_strategy=((2, 1),),
                  parameter_plan={"w2": (1, 4)})
    with pytest.raises(ValueError, match=r"parameter_plan\['w2'\]\[1\]=4 exceeds dim 1 "
                                         r"\(size 3\) of parameter w2: some devices would "
                                         r"hold an empty piece"):
        g(x)
    assert w2._layout is None                    # nothing moved


def test_op_without_sharding_rule_is_named():
    _setup(4)
    f = ops.shard(lambda x: ops.AllReduce()(x), in_strategy=((2, 1),))
    with pytest.raises(ValueError, match=r"op AllReduce .*has no sharding rule"):
        f(Tensor(np.ones((4, 4), np.float32)))


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "TPU"}, r"device='TPU' is not supported"),
    ({"level": 1}, r"level=1 is not supported"),
    ({"in_strategy": [(2, 1)]}, r"in_strategy must be a tuple"),
    ({"in_strategy": ((2, 0),)}, r"in_strategy\[0\]=\(2, 0\) is not a strategy"),
    ({"parameter_plan": ["w"]}, r"parameter_plan must be a dict"),
])
def test_shard_argument_errors(kwargs, match):
    args = {"in_strategy": ((2, 1),), **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        ops.shard(lambda x: x, **args)


def test_autoparallel_mode_and_introspection_errors():
    with pytest.raises(ValueError, match=r"parallel_mode='full' is not valid"):
        AutoParallel(lambda x: x, parallel_mode="full")
    f = ops.shard(lambda x: x, in_strategy=((2, 1),))
    with pytest.raises(RuntimeError, match=r"nothing compiled yet"):
        f.strategies()
    with pytest.raises(TypeError, match=r"passed by keyword"):
        f(x=Tensor(np.ones((2, 2), np.float32)))


def _whole_step_run(devices, parallel_mode, steps=3):
    _setup(devices, "auto_parallel")
    dm.set_seed(5)
    net = Outer(None)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    train_step = _train_step(net, opt, nn.MSELoss())
    step = AutoParallel(train_step, parallel_mode=parallel_mode) if devices > 1 else train_step
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = Tensor(rng.standard_normal((32, 16)).astype(np.float32))
        y = Tensor(rng.standard_normal((32, 4)).astype(np.float32))
        losses.append(float(step(x, y).asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()], step


@pytest.mark.parametrize("parallel_mode", ["sharding_propagation", "recursive_programming"])
def test_autoparallel_propagation_whole_step_equals_single_device(parallel_mode):
    ref_losses, ref_w, _ = _whole_step_run(1, None)
    losses, w, step = _whole_step_run(8, parallel_mode)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    chosen = step.strategies()
    forward = [k for k, v in chosen.items() if not v["backward"]]
    assert forward and all(chosen[k]["strategy"] is not None for k in forward)


def test_graph_mode_auto_parallel_propagates():
    ref = _outer_run(1, None)
    _setup(8, "auto_parallel")
    dm.set_context(mode=dm.GRAPH_MODE)
    got = _outer_run(8, None)          # _outer_run keeps the mode: every top-level call compiles
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-6)
    fn = got[3].__dict__["_graph_fn"]
    assert any(not v["configured"] and v["strategy"] is not None
               for v in fn.strategies().values())


def test_data_parallel_input_gradient_equals_single_device():
    """The gradient of a network input split over the batch reaches the input."""
    ref = _outer_run(1, None)
    got = _outer_run(8, None, mode="data_parallel")
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-6)


def _model_run(graph, devices):
    _setup(devices, "data_parallel")
    dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
    dm.set_seed(1)
    net = nn.SequentialCell([nn.Dense(8, 16), nn.ReLU(), nn.Dense(16, 3)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = rng.integers(0, 3, 64).astype(np.int32)
    ds = dm.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(16)
    model = dm.train.Model(net, nn.CrossEntropyLoss(), nn.SGD(net.trainable_params(), 0.1),
                           metrics={"accuracy"})
    model.train(2, ds)
    acc = model.eval(ds)["accuracy"]
    dm.set_context(mode=dm.PYNATIVE_MODE)
    return [p.asnumpy() for p in net.trainable_params()], acc


def test_model_train_in_graph_mode_data_parallel_equals_single_device():
    ref_w, ref_acc = _model_run(False, 1)
    w, acc = _model_run(True, 8)
    assert acc == ref_acc
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_backward_pass_is_derived_at_compile_time():
    _setup(8, "auto_parallel")
    rng = np.random.default_rng(0)
    w = Parameter(Tensor(rng.standard_normal((8, 16)).astype(np.float32)), name="w")
    f = ops.shard(lambda x: ops.tanh(ops.matmul(x, w)), in_strategy=((2, 4),))
    x = rng.standard_normal((8, 8)).astype(np.float32)
    f(Tensor(x))
    bw = f.compiled.backward_graph
    names = [n.op_name for n in bw.nodes if n.backward]
    assert names.count("MatMul") == 2 and "TanhGrad" in names     # dx and dw, tanh'
    dot = f.dump(backward=True)
    assert 'style=dashed' in dot and "pending sum" in dot
    # what the derived backward computes is what the tape computes at run time
    gx, gw = dm.grad(lambda x: ops.reduce_sum(f(x)), 0, [w])(Tensor(x))
    t = np.tanh(x @ w.asnumpy())
    np.testing.assert_allclose(gx.asnumpy(), (1 - t * t) @ w.asnumpy().T, rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(gw[0].asnumpy(), x.T @ (1 - t * t), rtol=1e-4, atol=1e-5)
    g = ops.shard(lambda x: ops.cast(x, dm.int32), in_strategy=((2, 1),))
    g(Tensor(np.ones((4, 4), np.float32)))
    with pytest.raises(ValueError, match=r"dump: backward=True but this graph has no derived"):
        g.dump(backward=True)
