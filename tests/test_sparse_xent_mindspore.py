"""``ops.SparseSoftmaxCrossEntropyWithLogits`` as MindSpore's primitive: ``is_grad=False``
gives the batch's mean loss (a scalar), ``is_grad=True`` its gradient with respect to
the logits, (softmax - onehot(labels)) / N. Both are differentiable (against numpy);
sharded with the rows split (a pending mean) or the classes split, in PyNative and
GRAPH_MODE, the values and gradients equal the stand-alone run's."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops

from _devices import devices

RTOL = 1e-5


def np_softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_loss_rows(x, y):
    return -np.log(np_softmax(x)[np.arange(len(y)), y])


def np_grad(x, y):
    return (np_softmax(x) - np.eye(x.shape[1])[y]) / len(y)


def _data(n=16, c=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, c)).astype(np.float32),
            rng.integers(0, c, n).astype(np.int32))


# ---------------------------------------------------------------------------
# one device
# ---------------------------------------------------------------------------
def test_mindspore_example():
    """MindSpore's documented example: the mean loss, then the gradient (divided by N)."""
    logits = Tensor(np.array([[2, 3, 1, 4, 5], [2, 1, 2, 4, 3]], np.float32))
    labels = Tensor(np.array([0, 1], np.int32))
    loss = ops.SparseSoftmaxCrossEntropyWithLogits()(logits, labels)
    assert loss.shape == () and loss.dtype == dm.float32
    np.testing.assert_allclose(loss.asnumpy(), 3.4878292, rtol=RTOL)
    grad = ops.SparseSoftmaxCrossEntropyWithLogits(is_grad=True)(logits, labels)
    assert grad.shape == (2, 5) and grad.dtype == dm.float32
    np.testing.assert_allclose(grad.asnumpy(),
                               [[-0.48415753, 0.04306427, 0.00582811, 0.11706084, 0.3182043],
                                [0.04007946, -0.4852556, 0.04007946, 0.2961494, 0.10894729]],
                               rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("ldtype", [np.int32, np.int64])
def test_values_and_gradients_equal_numpy(ldtype):
    x, y = _data(12, 7, seed=3)
    y = y.astype(ldtype)
    loss = ops.SparseSoftmaxCrossEntropyWithLogits()(Tensor(x), Tensor(y))
    np.testing.assert_allclose(loss.asnumpy(), np_loss_rows(x, y).mean(), rtol=RTOL)
    grad = ops.SparseSoftmaxCrossEntropyWithLogits(True)(Tensor(x), Tensor(y))
    np.testing.assert_allclose(grad.asnumpy(), np_grad(x, y), rtol=RTOL, atol=1e-8)
    # the loss's gradient is what is_grad=True returns
    g = dm.grad(lambda t: ops.SparseSoftmaxCrossEntropyWithLogits()(t, Tensor(y)))(Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), np_grad(x, y), rtol=RTOL, atol=1e-8)
    # through is_grad=True: d sum(w * (p - onehot) / N) = p * (w - sum(w * p)) / N
    w = np.random.default_rng(4).normal(size=x.shape).astype(np.float32)
    prim = ops.SparseSoftmaxCrossEntropyWithLogits(is_grad=True)
    g2 = dm.grad(lambda t: ops.reduce_sum(ops.mul(prim(t, Tensor(y)), Tensor(w))))(Tensor(x))
    p = np_softmax(x)
    np.testing.assert_allclose(g2.asnumpy(), p * (w - (w * p).sum(-1, keepdims=True)) / len(y),
                               rtol=1e-4, atol=1e-7)


def test_functional_and_nn_loss_keep_their_behaviour():
    x, y = _data()
    rows = ops.sparse_softmax_cross_entropy(Tensor(x), Tensor(y))
    assert rows.shape == (16,)
    np.testing.assert_allclose(rows.asnumpy(), np_loss_rows(x, y), rtol=RTOL)
    none = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")(Tensor(x), Tensor(y))
    summed = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="sum")(Tensor(x), Tensor(y))
    np.testing.assert_allclose(none.asnumpy(), np_loss_rows(x, y), rtol=RTOL)
    np.testing.assert_allclose(summed.asnumpy(), np_loss_rows(x, y).sum(), rtol=RTOL)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"SparseSoftmaxCrossEntropyWithLogits: is_grad must "
                                        r"be a bool, got 1"):
        ops.SparseSoftmaxCrossEntropyWithLogits(is_grad=1)
    x, y = _data(4, 3)
    for is_grad in (False, True):
        with pytest.raises(ValueError, match=r"SparseSoftmaxCrossEntropyWithLogits: logits "
                                             r"have shape \(4, 3\) and labels shape \(3,\)"):
            ops.SparseSoftmaxCrossEntropyWithLogits(is_grad)(Tensor(x), Tensor(y[:3]))
        with pytest.raises(ValueError, match=r"SparseSoftmaxCrossEntropyWithLogits: label 3 "
                                             r"at row 0 is out of range"):
            ops.SparseSoftmaxCrossEntropyWithLogits(is_grad)(
                Tensor(x), Tensor(np.array([3, 0, 0, 0], np.int32)))


# ---------------------------------------------------------------------------
# sharded: PyNative and GRAPH_MODE against the stand-alone run
# ---------------------------------------------------------------------------
class _Net(nn.Cell):
    """Dense(12, 8), then both forms of the primitive with `strategy`; the loss uses
    the mean loss and the gradient output."""

    def __init__(self, strategy):
        super().__init__()
        self.fc = nn.Dense(12, 8)
        self.loss = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.grad = ops.SparseSoftmaxCrossEntropyWithLogits(is_grad=True)
        if strategy is not None:
            self.loss.shard(strategy)
            self.grad.shard(strategy)
        self.w = Tensor(np.random.default_rng(7).normal(size=(16, 8)).astype(np.float32))

    def construct(self, x, y):
        h = self.fc(x)
        return self.loss(h, y) + ops.reduce_sum(ops.mul(self.grad(h, y), self.w))


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
@pytest.mark.parametrize("strategy", [((8, 1), (8,)), ((4, 1), (4,)), ((2, 4), (2,))],
                         ids=["rows8", "rows4", "rows2-classes4"])
def test_sharded_equals_single_device(strategy, mode):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    y = rng.integers(0, 8, 16).astype(np.int32)
    dm.set_seed(0)
    net = _Net(strategy)
    f = dm.value_and_grad(net, 0, net.trainable_params())
    with devices(None):
        ref = f(Tensor(x), Tensor(y))
    with devices(8, full_batch=True):
        dm.set_context(mode=mode)
        got = f(Tensor(x), Tensor(y))
    np.testing.assert_allclose(got[0].asnumpy(), ref[0].asnumpy(), rtol=RTOL)
    (gi, gw), (ri, rw) = got[1], ref[1]
    for what, a, b in [("x", gi, ri), ("weight", gw[0], rw[0]), ("bias", gw[1], rw[1])]:
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=RTOL, atol=1e-6,
                                   err_msg=f"gradient of the {what}")


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
def test_outputs_sharded_on_rows(mode):
    """Both outputs returned from a Cell whose primitives split the rows over 8
    devices: the mean of every sample (each device's rows summed, then all of them),
    not one device's share nor sample 0's loss."""
    class Head(nn.Cell):
        def __init__(self):
            super().__init__()
            self.loss = ops.SparseSoftmaxCrossEntropyWithLogits().shard(((8, 1), (8,)))
            self.grad = ops.SparseSoftmaxCrossEntropyWithLogits(True).shard(((8, 1), (8,)))

        def construct(self, logits, labels):
            return self.loss(logits, labels), self.grad(logits, labels)

    x, y = _data()
    with devices(8, full_batch=True):
        dm.set_context(mode=mode)
        loss, grad = Head()(Tensor(x), Tensor(y))
        np.testing.assert_allclose(loss.asnumpy(), np_loss_rows(x, y).mean(), rtol=RTOL)
        np.testing.assert_allclose(grad.asnumpy(), np_grad(x, y), rtol=RTOL, atol=1e-8)


class _Loss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.xent = ops.SparseSoftmaxCrossEntropyWithLogits()

    def construct(self, logits, labels):
        return self.xent(logits, labels)


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
def test_data_parallel_mean_is_the_global_batch_mean(mode):
    """Under data parallel (each device holds 2 of the 16 rows) the primitive's scalar
    is the mean over the global batch, and training steps equal one device's."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    y = rng.integers(0, 8, 16).astype(np.int32)

    def run(n):
        ctx = dict(parallel_mode="data_parallel", gradients_mean=True) if n else {}
        with devices(n, **ctx):
            dm.set_context(mode=mode)
            dm.set_seed(0)
            net = nn.Dense(12, 8)
            xent = _Loss()
            opt = nn.SGD(net.trainable_params(), 0.5)
            step = nn.TrainOneStepCell(nn.WithLossCell(net, xent), opt)
            losses = [float(step(Tensor(x), Tensor(y)).asnumpy()) for _ in range(3)]
            return losses, [p.asnumpy() for p in net.trainable_params()]

    ref_losses, ref_params = run(None)
    losses, params = run(8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for a, b in zip(params, ref_params):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
