"""copy.copy, copy.deepcopy and pickle of Tensor, Parameter and Cell.

A deep copy is independent (updating one, by ``set_data`` or an optimizer step, leaves
the other as it is) and equal: same values, dtype, shape, names and flags; a copied
network computes what the original computes, a delayed parameter stays delayed and
makes the same values, a sharded parameter keeps its layout and storage form. A
shallow copy shares the storage. Every value is checked against numpy."""
import copy
import pickle
import threading

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import set_layerwise_slices
from dualmode.parallel.replicas import ReplicaBlocks, replica_blocks
from dualmode.tensor import live_parameters, no_init_parameters

from _steps import mean_square_step

RNG = np.random.default_rng(11)
LR = 0.1


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _is_live(p):
    return any(q is p for q in live_parameters())


# ---------------------------------------------------------------------------
# Tensor
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", [_rand(3, 4), np.arange(6, dtype=np.int32).reshape(2, 3),
                                   np.float32(2.5)])
def test_tensor_deepcopy_and_pickle_are_equal_and_independent(value):
    t = Tensor(value)
    for c in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(c) is Tensor and c.dtype == value.dtype and c.shape == value.shape
        np.testing.assert_array_equal(c.asnumpy(), value)
        if value.ndim:
            c[0] = 7                                    # in place: only the copy changes
            np.testing.assert_array_equal(t.asnumpy(), value)
            assert (c.asnumpy()[0] == 7).all()


def test_tensor_shallow_copy_shares_the_storage():
    value = _rand(2, 3)
    t = Tensor(value)
    c = copy.copy(t)
    assert c is not t
    c[1] = 0.0
    np.testing.assert_array_equal(t.asnumpy(), np.concatenate([value[:1], np.zeros((1, 3))]))


def test_a_copy_made_while_differentiating_is_a_constant():
    """d/dx sum(copy(2x) * x) = copy(2x) = 2x (4x if the copy stayed on the tape)."""
    x = _rand(5)
    for cp in (copy.copy, copy.deepcopy):
        g = dm.grad(lambda t: ops.reduce_sum(cp(t * 2.0) * t))(Tensor(x))
        np.testing.assert_allclose(g.asnumpy(), 2.0 * x, rtol=1e-6)


# ---------------------------------------------------------------------------
# Parameter
# ---------------------------------------------------------------------------
def _param():
    p = Parameter(Tensor(_rand(4, 3)), name="w", requires_grad=False,
                  layerwise_parallel=True)
    return p.set_param_ps()


def _same_attributes(c, p):
    assert type(c) is Parameter and c is not p
    assert (c.name, c.requires_grad, c.layerwise_parallel, c.is_param_ps) == \
        (p.name, p.requires_grad, p.layerwise_parallel, p.is_param_ps)
    assert c.dtype == p.dtype and c.shape == p.shape and c.has_init == p.has_init


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_parameter_copy_keeps_attributes_and_is_independent_of_set_data(how):
    p = _param()
    value = p.asnumpy()
    c = copy.deepcopy(p) if how == "deepcopy" else pickle.loads(pickle.dumps(p))
    _same_attributes(c, p)
    assert _is_live(c)
    np.testing.assert_array_equal(c.asnumpy(), value)
    c.set_data(np.zeros((4, 3), np.float32))
    np.testing.assert_array_equal(p.asnumpy(), value)
    p.set_data(np.ones((4, 3), np.float32))
    np.testing.assert_array_equal(c.asnumpy(), np.zeros((4, 3)))


def test_an_optimizer_step_on_the_deep_copy_leaves_the_original():
    w0, x = _rand(3, 2), _rand(6, 3)
    p = Parameter(Tensor(w0.copy()), name="w")
    c = copy.deepcopy(p)
    opt = nn.SGD([c], learning_rate=LR)
    step = mean_square_step(lambda t: ops.matmul(t, c), opt)
    step(Tensor(x))                                   # in place, on c's storage
    g = x.T @ (2.0 * (x @ w0) / (6 * 2))
    np.testing.assert_allclose(c.asnumpy(), w0 - LR * g, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(p.asnumpy(), w0)


def test_a_shallow_copy_of_a_parameter_shares_its_storage():
    w0, x = _rand(3, 2), _rand(6, 3)
    p = Parameter(Tensor(w0.copy()), name="w")
    c = copy.copy(p)
    _same_attributes(c, p)
    assert _is_live(c)
    step = mean_square_step(lambda t: ops.matmul(t, p), nn.SGD([p], learning_rate=LR))
    step(Tensor(x))                               # the original's update shows in the copy
    g = x.T @ (2.0 * (x @ w0) / (6 * 2))
    np.testing.assert_allclose(c.asnumpy(), w0 - LR * g, rtol=1e-5, atol=1e-6)
    c.set_data(np.zeros((3, 2), np.float32))      # a new value: the copy's own
    np.testing.assert_allclose(p.asnumpy(), w0 - LR * g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_delayed_parameter_copy_stays_delayed_and_makes_the_same_values(how):
    with no_init_parameters():
        p = Parameter(dm.common.initializer.initializer("normal", (5, 4)), name="w")
    c = {"copy": copy.copy, "deepcopy": copy.deepcopy,
         "pickle": lambda q: pickle.loads(pickle.dumps(q))}[how](p)
    assert p.has_init and c.has_init
    made = c.asnumpy()                          # the copy first: the order does not matter
    assert not c.has_init and p.has_init
    np.testing.assert_array_equal(p.asnumpy(), made)
    assert made.std() > 0.001                   # random values, not an empty fill
    dm.set_seed(0)                              # the same initializer, made again
    again = dm.common.initializer.initializer("normal", (5, 4)).asnumpy()
    np.testing.assert_array_equal(made, again)


def test_a_copy_of_an_initializer_tensor_stays_delayed():
    t = dm.common.initializer.initializer("uniform", (3, 4))
    for c in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(c) is type(t) and c._data is None and c.shape == (3, 4)
        np.testing.assert_array_equal(c.asnumpy(), t.asnumpy())


# ---------------------------------------------------------------------------
# Cell
# ---------------------------------------------------------------------------
class Tied(nn.Cell):
    """Two layers sharing one weight."""

    def __init__(self):
        super().__init__()
        self.a = nn.Dense(4, 4)
        self.b = nn.Dense(4, 4)
        self.b.weight = self.a.weight

    def construct(self, x):
        return self.b(ops.relu(self.a(x)))


def _dense_np(net, x):
    return x @ net.weight.asnumpy().T + net.bias.asnumpy()


def test_a_deep_copied_dense_computes_the_same_and_is_independent():
    net = nn.Dense(3, 4)
    x = _rand(5, 3)
    want = _dense_np(net, x)
    c = copy.deepcopy(net)
    assert [p.name for p in c.get_parameters()] == ["weight", "bias"]
    assert all(a is not b for a, b in zip(c.get_parameters(), net.get_parameters()))
    np.testing.assert_allclose(c(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-6)
    c.weight.set_data(np.zeros((4, 3), np.float32))
    np.testing.assert_allclose(c(Tensor(x)).asnumpy(), np.broadcast_to(net.bias.asnumpy(),
                                                                       (5, 4)), rtol=1e-6)
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-6)


def test_a_deep_copy_keeps_shared_parameters_shared_and_names():
    net = Tied()
    c = copy.deepcopy(net)
    assert c.b.weight is c.a.weight and c.a.weight is not net.a.weight
    assert [p.name for p in c.get_parameters()] == [p.name for p in net.get_parameters()] \
        == ["a.weight", "a.bias", "b.bias"]
    x = _rand(3, 4)
    h = np.maximum(_dense_np(c.a, x), 0)
    np.testing.assert_allclose(c(Tensor(x)).asnumpy(), _dense_np(c.b, h), rtol=1e-5,
                               atol=1e-6)


def test_a_deep_copied_train_step_trains_the_copy_as_the_original_trains():
    """TrainOneStepCell holds a value_and_grad of its network: the copy's works on the
    copied network and optimizer (with its momentum), never on the original's."""
    x, y = Tensor(_rand(8, 3)), Tensor(_rand(8, 2))

    def build():
        dm.set_seed(3)
        net = nn.SequentialCell([nn.Dense(3, 4), nn.ReLU(), nn.Dense(4, 2)])
        opt = nn.Momentum(net.trainable_params(), LR, 0.9)
        return net, nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)

    net, step = build()
    step(x, y)                                        # momentum is set
    twin = copy.deepcopy(step)
    before = [p.asnumpy() for p in net.get_parameters()]
    twin_losses = [float(twin(x, y).asnumpy()) for _ in range(3)]
    for p, b in zip(net.get_parameters(), before):
        np.testing.assert_array_equal(p.asnumpy(), b)
    losses = [float(step(x, y).asnumpy()) for _ in range(3)]
    np.testing.assert_allclose(twin_losses, losses, rtol=1e-6)
    for a, b in zip(twin.get_parameters(), net.get_parameters()):
        assert a.name == b.name
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6)


def test_a_function_attribute_that_cannot_be_copied_is_named():
    lock = threading.Lock()
    net = nn.Dense(2, 2)
    net.hook = lambda: lock
    with pytest.raises(TypeError, match=r"Dense: copy.deepcopy cannot copy attribute "
                                        r"'hook'.*closing over values"):
        copy.deepcopy(net)


def test_a_shallow_copied_cell_shares_parameters_but_not_its_registry():
    net = nn.SequentialCell([nn.Dense(3, 4), nn.Dense(4, 2)])
    c = copy.copy(net)
    assert list(c.get_parameters()) and all(
        a is b for a, b in zip(c.get_parameters(), net.get_parameters()))
    c.extra = nn.Dense(2, 2)                     # registered in the copy only
    assert len(list(c.get_parameters())) == 6 and len(list(net.get_parameters())) == 4


def test_a_graph_mode_cell_copy_compiles_its_own_graph():
    dm.set_context(mode=dm.GRAPH_MODE)
    net = nn.Dense(3, 4)
    x = _rand(5, 3)
    want = _dense_np(net, x)
    net(Tensor(x))                               # compiled and cached on net
    for c in (copy.deepcopy(net), copy.copy(net)):
        c.weight = Parameter(Tensor(np.zeros((4, 3), np.float32)), name="weight")
        np.testing.assert_allclose(c(Tensor(x)).asnumpy(),
                                   np.broadcast_to(net.bias.asnumpy(), (5, 4)), rtol=1e-6)
        assert c.__dict__["_graph_fn"] is not net.__dict__["_graph_fn"]
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# sharded parameters (8 simulated devices)
# ---------------------------------------------------------------------------
#: x (2, 4) @ W (4, 1): W's 4 row blocks, each held by 2 devices
STRATEGY = ((2, 4), (4, 1))


def _numpy_sgd(x, w, steps):
    """SGD on w for the loss mean(relu(x @ w)^2), by hand."""
    w = w.copy()
    for _ in range(steps):
        h = x @ w
        a = np.maximum(h, 0)
        w -= LR * (x.T @ (2.0 * a * (h > 0) / a.size))
    return w


def _sharded_step(w):
    mm, relu = ops.MatMul().shard(STRATEGY), ops.ReLU()
    return mean_square_step(lambda t: relu(mm(t, w)), nn.SGD([w], learning_rate=LR))


@pytest.mark.parametrize("k, n", [(16, 8), (256, 96)], ids=["stack", "replicas_once"])
def test_a_sharded_parameter_deep_copy_keeps_its_layout_and_trains_alone(eight, k, n):
    x = _rand(16, k)
    w0 = (_rand(k, n) / np.sqrt(k)).astype(np.float32)
    w = Parameter(Tensor(w0.copy()), name="w")
    _sharded_step(w)(Tensor(x))
    once = n == 96
    assert w._layout is not None and isinstance(w._lazy, ReplicaBlocks) == once
    c = copy.deepcopy(w)
    assert c._layout is w._layout and c.name == "w"
    if once:          # still stored once, in a grid of its own; the original's unwritten
        assert replica_blocks(c) is not None and replica_blocks(w) is not None
        assert not np.shares_memory(replica_blocks(c), replica_blocks(w))
    else:
        assert c._data.shape == (8, k // 4, n) and not np.shares_memory(c._data, w._data)
    w1 = _numpy_sgd(x, w0, 1)
    np.testing.assert_allclose(c.asnumpy(), w1, rtol=1e-5, atol=1e-6)
    step = _sharded_step(c)
    for _ in range(2):
        step(Tensor(x))
    assert c._layout is w._layout and isinstance(c._lazy, ReplicaBlocks) == once
    np.testing.assert_allclose(c.asnumpy(), _numpy_sgd(x, w0, 3), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.asnumpy(), w1, rtol=1e-5, atol=1e-6)


def test_a_sharded_parameter_pickles_its_global_value(eight):
    x = _rand(16, 256)
    w0 = (_rand(256, 96) / 16).astype(np.float32)
    w = Parameter(Tensor(w0.copy()), name="w")
    _sharded_step(w)(Tensor(x))
    c = pickle.loads(pickle.dumps(w))
    assert c._layout is None and c.name == "w" and c.shape == (256, 96)
    np.testing.assert_allclose(c.asnumpy(), _numpy_sgd(x, w0, 1), rtol=1e-5, atol=1e-6)
    assert isinstance(w._lazy, ReplicaBlocks)        # read from the grid, not written


class TwoLayers(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = Parameter(Tensor(_rand(16, 32) * 0.3), name="w1")
        self.w2 = Parameter(Tensor(_rand(32, 16) * 0.3), name="w2")

    def construct(self, x):
        return ops.matmul(ops.tanh(ops.matmul(x, self.w1)), self.w2)


def _two_np(net, x):
    return np.tanh(x @ net.w1.asnumpy()) @ net.w2.asnumpy()


def test_a_copy_of_a_sharded_cell_runs_its_own_graph_with_the_same_strategies(eight):
    net = TwoLayers()
    net.shard(in_strategy=((2, 1),), out_strategy=((8, 1),))
    x = _rand(32, 16)
    want = _two_np(net, x)
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)
    for c in (copy.deepcopy(net), copy.copy(net)):
        c.w2 = Parameter(Tensor(_rand(32, 16)), name="w2")
        np.testing.assert_allclose(c(Tensor(x)).asnumpy(), _two_np(c, x), rtol=1e-5,
                                   atol=1e-5)
        fn = c.__dict__["_shard_fn"]
        assert fn._cell is c and (fn.in_strategy, fn.out_strategy) == (((2, 1),), ((8, 1),))
    np.testing.assert_allclose(net(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_a_deep_copied_shard_function_compiles_its_own_graph(eight):
    """An ``ops.shard`` function kept beside its cell: the deep copy holds the copied
    cell, starts with no compiled graph (the original's are bound to its parameters),
    and computes with the copy's weights; the original is left as it was."""
    net = TwoLayers()
    holder = {"net": net, "fn": ops.shard(net, in_strategy=((2, 1),), out_strategy=((8, 1),))}
    x = _rand(32, 16)
    want = _two_np(net, x)
    np.testing.assert_allclose(holder["fn"](Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)
    assert holder["fn"].compiled is not None
    c = copy.deepcopy(holder)
    fn = c["fn"]
    assert fn.fn is c["net"] and fn._cell is c["net"] and fn._cache == {} and fn.compiled is None
    assert (fn.in_strategy, fn.out_strategy) == (((2, 1),), ((8, 1),))
    c["net"].w1.set_data(Tensor(_rand(16, 32)))
    np.testing.assert_allclose(fn(Tensor(x)).asnumpy(), _two_np(c["net"], x), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(holder["fn"](Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_a_layerwise_parameter_with_per_device_values_deep_copies_but_never_pickles():
    dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=2,
                                 dataset_strategy="full_batch")
    dm.communication.init()
    try:
        w = Parameter(Tensor(np.zeros((3, 2), np.float32)), name="w",
                      layerwise_parallel=True)
        whole = np.arange(12, dtype=np.float32).reshape(3, 4)
        set_layerwise_slices(w, whole, dim=1)         # device d holds whole[:, 2d:2d+2]
        c = copy.deepcopy(w)
        assert c._layout is w._layout and c.shape == (3, 2) and c.layerwise_parallel
        np.testing.assert_array_equal(c._data, [whole[:, :2], whole[:, 2:]])
        c._data[0] = -1.0
        np.testing.assert_array_equal(w._data, [whole[:, :2], whole[:, 2:]])
        with pytest.raises(TypeError, match=r"Parameter w: cannot be pickled: it holds one "
                                            r"value per device .* stack of shape \(2, 3, 2\)"):
            pickle.dumps(w)
    finally:
        dm.reset_auto_parallel_context()
        dm.communication.init()
