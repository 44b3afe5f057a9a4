"""``ops.SoftmaxCrossEntropyWithLogits`` returns ``(loss, dlogits)`` as MindSpore's
primitive: the per-sample loss (N,) and softmax(logits) - labels (N, C), so
``self.loss(logits, labels)[0]`` is the loss vector. Both outputs are differentiable
(against numpy), and the op is one op with one rule: its strategy covers both inputs in
PyNative and GRAPH_MODE, sharded results and gradients equal the stand-alone run's."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices

RTOL = 1e-5


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_log_softmax(x):
    s = x - x.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


def _data(n=16, c=8, seed=0, soft=False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, c)).astype(np.float32)
    if soft:
        labels = np_softmax(rng.normal(size=(n, c))).astype(np.float32)
    else:
        labels = np.eye(c, dtype=np.float32)[rng.integers(0, c, n)]
    return logits, labels


# ---------------------------------------------------------------------------
# the pair, one device
# ---------------------------------------------------------------------------
def test_primitive_returns_loss_and_dlogits():
    """MindSpore's documented example, then random soft labels against numpy."""
    logits = np.array([[2, 4, 1, 4, 5], [2, 1, 2, 4, 3]], np.float32)
    labels = np.array([[0, 0, 0, 0, 1], [0, 0, 0, 1, 0]], np.float32)
    out = ops.SoftmaxCrossEntropyWithLogits()(Tensor(logits), Tensor(labels))
    assert isinstance(out, tuple) and len(out) == 2
    loss, dlogits = out
    assert loss.shape == (2,) and dlogits.shape == (2, 5)
    assert loss.dtype == dm.float32 and dlogits.dtype == dm.float32
    np.testing.assert_allclose(loss.asnumpy(), [0.5899297, 0.52374405], rtol=RTOL)
    np.testing.assert_allclose(dlogits.asnumpy(),
                               [[0.02760027, 0.20393994, 0.01015357, 0.20393994, -0.44563377],
                                [0.08015892, 0.02948882, 0.08015892, -0.4077012, 0.21789455]],
                               rtol=RTOL, atol=1e-7)
    x, y = _data(soft=True)
    loss, dlogits = ops.SoftmaxCrossEntropyWithLogits()(Tensor(x), Tensor(y))
    np.testing.assert_allclose(loss.asnumpy(), -(y * np_log_softmax(x)).sum(-1), rtol=RTOL)
    np.testing.assert_allclose(dlogits.asnumpy(), np_softmax(x) - y, rtol=RTOL, atol=1e-7)


def test_index_0_is_the_loss_vector_in_a_cell():
    """MindSpore code: ``self.loss(logits, labels)[0]`` then a mean -- every sample's
    loss, not sample 0's."""
    class Head(nn.Cell):
        def __init__(self):
            super().__init__()
            self.loss = ops.SoftmaxCrossEntropyWithLogits()
            self.mean = ops.ReduceMean()

        def construct(self, logits, labels):
            return self.mean(self.loss(logits, labels)[0])

    x, y = _data()
    got = Head()(Tensor(x), Tensor(y))
    assert got.shape == ()
    np.testing.assert_allclose(got.asnumpy(), -(y * np_log_softmax(x)).sum(-1).mean(),
                               rtol=RTOL)


def test_float16_and_errors():
    x, y = _data(4, 3)
    loss, d = ops.SoftmaxCrossEntropyWithLogits()(Tensor(x.astype(np.float16)),
                                                  Tensor(y.astype(np.float16)))
    assert loss.dtype == dm.float16 and d.dtype == dm.float16
    np.testing.assert_allclose(loss.asnumpy(), -(y * np_log_softmax(x)).sum(-1), rtol=2e-3)
    prim = ops.SoftmaxCrossEntropyWithLogits()
    with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: logits have shape "
                                         r"\(4, 3\) but labels have shape \(4, 2\)"):
        prim(Tensor(x), Tensor(y[:, :2]))
    with pytest.raises(TypeError, match=r"SoftmaxCrossEntropyWithLogits: input 0 has dtype "
                                        r"float32 but input 1 has dtype float64"):
        prim(Tensor(x), Tensor(y.astype(np.float64)))
    with pytest.raises(TypeError, match=r"SoftmaxCrossEntropyWithLogits: input 1 has dtype "
                                        r"int32"):
        prim(Tensor(x), Tensor(y.astype(np.int32)))


def test_gradients_through_loss_and_dlogits_equal_numpy():
    """d sum(a * loss + b * dlogits): to the logits a * (p * sum(y) - y) + p * (b -
    sum(b * p)); to the labels -a * log_softmax(x) - b. Soft labels that do not sum to 1
    check the loss's gradient exactly, not its one-hot shortcut."""
    x, y = _data(6, 5, seed=3, soft=True)
    y = (y * np.linspace(0.5, 1.5, 6)[:, None]).astype(np.float32)      # sums 0.5 .. 1.5
    rng = np.random.default_rng(4)
    a = rng.normal(size=(6,)).astype(np.float32)
    b = rng.normal(size=(6, 5)).astype(np.float32)
    prim = ops.SoftmaxCrossEntropyWithLogits()

    def f(lg, lb):
        loss, d = prim(lg, lb)
        return ops.reduce_sum(ops.mul(loss, Tensor(a))) + ops.reduce_sum(ops.mul(d, Tensor(b)))

    gx, gy = dm.grad(f, grad_position=(0, 1))(Tensor(x), Tensor(y))
    p = np_softmax(x.astype(np.float64))
    want_x = a[:, None] * (p * y.sum(-1, keepdims=True) - y) + \
        p * (b - (b * p).sum(-1, keepdims=True))
    want_y = -a[:, None] * np_log_softmax(x.astype(np.float64)) - b
    np.testing.assert_allclose(gx.asnumpy(), want_x, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gy.asnumpy(), want_y, rtol=1e-4, atol=1e-6)
    # the loss alone (dlogits unused): one-hot labels give exactly g * dlogits
    x, y = _data(6, 5, seed=5)
    g = dm.grad(lambda lg: ops.reduce_sum(prim(lg, Tensor(y))[0]))(Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), np_softmax(x) - y, rtol=RTOL, atol=1e-7)


def test_nn_loss_keeps_its_reduction():
    x, y = _data()
    want = -(y * np_log_softmax(x)).sum(-1)
    mean = nn.SoftmaxCrossEntropyWithLogits()(Tensor(x), Tensor(y))
    none = nn.SoftmaxCrossEntropyWithLogits(reduction="none")(Tensor(x), Tensor(y))
    assert mean.shape == () and none.shape == (16,)
    np.testing.assert_allclose(mean.asnumpy(), want.mean(), rtol=RTOL)
    np.testing.assert_allclose(none.asnumpy(), want, rtol=RTOL)
    g = dm.grad(lambda lg: nn.SoftmaxCrossEntropyWithLogits(reduction="sum")(lg, Tensor(y)))(
        Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), np_softmax(x) - y, rtol=RTOL, atol=1e-7)


# ---------------------------------------------------------------------------
# sharded: PyNative and GRAPH_MODE against the stand-alone run
# ---------------------------------------------------------------------------
class _Net(nn.Cell):
    """Dense(12, 8), then the primitive with `strategy`; the loss uses both outputs."""

    def __init__(self, strategy):
        super().__init__()
        self.fc = nn.Dense(12, 8)
        self.xent = ops.SoftmaxCrossEntropyWithLogits()
        if strategy is not None:
            self.xent.shard(strategy)
        self.w = Tensor(np.random.default_rng(7).normal(size=(16, 8)).astype(np.float32))

    def construct(self, x, y):
        loss, dlogits = self.xent(self.fc(x), y)
        return ops.reduce_mean(loss) + ops.reduce_sum(ops.mul(dlogits, self.w))


def _sharded_vs_single(strategy, mode):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    y = np_softmax(rng.normal(size=(16, 8))).astype(np.float32)
    dm.set_seed(0)
    net = _Net(strategy)
    f = dm.value_and_grad(net, (0, 1), net.trainable_params())
    with devices(None):
        ref = f(Tensor(x), Tensor(y))
    with devices(8, full_batch=True):
        dm.set_context(mode=mode)
        with CommReport() as rep:
            got = f(Tensor(x), Tensor(y))
    np.testing.assert_allclose(got[0].asnumpy(), ref[0].asnumpy(), rtol=RTOL)
    (gi, gw), (ri, rw) = got[1], ref[1]
    for what, a, b in [("x", gi[0], ri[0]), ("labels", gi[1], ri[1]),
                       ("weight", gw[0], rw[0]), ("bias", gw[1], rw[1])]:
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=RTOL, atol=1e-6,
                                   err_msg=f"gradient of the {what}")
    return rep


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
@pytest.mark.parametrize("strategy", [((8, 1), (8, 1)), ((2, 4), (2, 4)), ((4, 1), (4, 1))],
                         ids=["rows8", "rows2-classes4", "rows4"])
def test_sharded_pair_equals_single_device(strategy, mode):
    _sharded_vs_single(strategy, mode)


def test_pair_outputs_sharded_in_graph_mode():
    """The values of both outputs, returned from a compiled Cell whose primitive splits
    the rows over 8 devices; the rows split moves nothing for the op itself."""
    class Head(nn.Cell):
        def __init__(self):
            super().__init__()
            self.xent = ops.SoftmaxCrossEntropyWithLogits().shard(((8, 1), (8, 1)))

        def construct(self, logits, labels):
            return self.xent(logits, labels)

    x, y = _data()
    with devices(8, full_batch=True):
        dm.set_context(mode=dm.GRAPH_MODE)
        with CommReport() as rep:
            loss, d = Head()(Tensor(x), Tensor(y))
        np.testing.assert_allclose(loss.asnumpy(), -(y * np_log_softmax(x)).sum(-1),
                                   rtol=RTOL)
        np.testing.assert_allclose(d.asnumpy(), np_softmax(x) - y, rtol=RTOL, atol=1e-7)
    assert not [r for r in rep.records if r.op == "SoftmaxCrossEntropyWithLogits"]


def test_strategies_of_logits_and_labels_must_agree():
    x, y = _data()
    prim = ops.SoftmaxCrossEntropyWithLogits().shard(((8, 1), (4, 1)))
    with devices(8, full_batch=True):
        with pytest.raises(ValueError, match=r"SoftmaxCrossEntropyWithLogits: "
                                             r"in_strategy\[0\]\[0\]=8 and in_strategy\[1\]"
                                             r"\[0\]=4 split the batch dim differently"):
            prim(Tensor(x), Tensor(y))
