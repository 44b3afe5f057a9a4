"""Data parallel with a batch that does not divide (29 rows on 8 devices: pieces of 4,
4, 4, 4, 4, 3, 3, 3, pads after the short ones): ops whose kernel is exact on the
padded rows run it once over every device's rows, as for a dividing batch, instead of
their rule on the stacks; the others run their rule. Either way: numpy's numbers, the
rule's layouts, zero pads."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, nn, ops
from dualmode.parallel import dtensor
from dualmode.parallel.inputs import distribute_inputs

N, B = 8, 29


@pytest.fixture
def dp():
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=N,
                                 gradients_mean=True)
    communication.init()
    yield
    dm.reset_auto_parallel_context()
    communication.init()


@pytest.fixture
def rule_calls(monkeypatch):
    """The names of the ops that ran their sharding rule (not the kernel once)."""
    names = []
    real = dtensor.sharded_apply

    def spy(op, *a, **k):
        names.append(op.name)
        return real(op, *a, **k)
    monkeypatch.setattr(dtensor, "sharded_apply", spy)
    return names


def _arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, 12)).astype(np.float32)
    g = rng.standard_normal((B, 5)).astype(np.float32)
    w = rng.standard_normal((12, 5)).astype(np.float32)
    b = rng.standard_normal((5,)).astype(np.float32)
    return x, g, w, b


def _pads(t):
    """The pad rows of a distributed tensor's stack (devices 5-7, local row 3)."""
    assert t._layout is not None and not t._layout.even
    return t._data[5:, 3]


CASES = [
    ("matmul x @ w", lambda X, G, w, b: ops.matmul(X, Tensor(w)),
     lambda x, g, w, b: x @ w, True),
    ("matmul x^T g (a sum over the batch)",
     lambda X, G, w, b: ops.MatMul(transpose_a=True)(X, G), lambda x, g, w, b: x.T @ g, True),
    ("bias_add", lambda X, G, w, b: ops.bias_add(G, Tensor(b)), lambda x, g, w, b: g + b, True),
    ("exp", lambda X, G, w, b: ops.exp(X), lambda x, g, w, b: np.exp(x), True),
    ("sum over the batch", lambda X, G, w, b: ops.ReduceSum()(G, 0),
     lambda x, g, w, b: g.sum(axis=0), True),
    ("mean over the features", lambda X, G, w, b: ops.ReduceMean(keep_dims=True)(X, 1),
     lambda x, g, w, b: x.mean(axis=1, keepdims=True), True),
    # a mean counts the rows, a max lets the pads compete: their rules run
    ("mean over the batch", lambda X, G, w, b: ops.ReduceMean()(X, 0),
     lambda x, g, w, b: x.mean(axis=0), False),
    ("max over the batch", lambda X, G, w, b: ops.ReduceMax()(X, 0),
     lambda x, g, w, b: x.max(axis=0), False),
    ("softmax over the features", lambda X, G, w, b: ops.softmax(X, -1),
     lambda x, g, w, b: np.exp(x) / np.exp(x).sum(-1, keepdims=True), None),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_uneven_batch_ops_equal_numpy(dp, rule_calls, case):
    name, fn, ref, shortcut = CASES[case]
    x, g, w, b = _arrays()
    X, G = distribute_inputs((Tensor(x), Tensor(g)))
    assert not X._layout.even and [len(r) for r in np.array_split(x, N)] == \
        [4, 4, 4, 4, 4, 3, 3, 3]
    out = fn(X, G, w, b)
    np.testing.assert_allclose(out.asnumpy(), ref(x, g, w, b), rtol=1e-5, atol=1e-6,
                               err_msg=name)
    if out._layout is not None and out._layout.shape[:1] == (B,):
        assert not np.any(_pads(out)), f"{name}: pads not zero"
    if shortcut is True:
        assert rule_calls == [], name
    elif shortcut is False:
        assert rule_calls, name


def test_a_whole_value_with_the_batch_rows_runs_the_rule(dp, rule_calls):
    x, g, w, b = _arrays()
    X, = distribute_inputs((Tensor(x),))
    y = np.linspace(0, 1, B * 12, dtype=np.float32).reshape(B, 12)
    out = ops.add(X, Tensor(y))
    np.testing.assert_allclose(out.asnumpy(), x + y, rtol=1e-6)
    assert rule_calls == ["Add"]


class _MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.relu = nn.Dense(12, 16), nn.Dense(16, 5), nn.ReLU()

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def _train(devices, batch):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=devices,
                                     gradients_mean=True)
    communication.init()
    dm.set_seed(3)
    net = _MLP()
    opt = nn.SGD(net.trainable_params(), 0.1)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(3):
        x = rng.standard_normal((batch, 12)).astype(np.float32)
        y = rng.integers(0, 5, batch).astype(np.int32)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()]


@pytest.mark.parametrize("batch", [29, 2047])
def test_training_steps_equal_one_device(rule_calls, batch):
    try:
        ref_losses, ref_w = _train(1, batch)
        rule_calls.clear()
        losses, w = _train(N, batch)
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, e in zip(w, ref_w):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)
    # the products, biases and activations take the shortcut; the loss runs its rule
    assert not {"MatMul", "BiasAdd", "ReLU", "ReluGrad"} & set(rule_calls), set(rule_calls)
    assert "SparseSoftmaxCrossEntropyWithLogits" in rule_calls
