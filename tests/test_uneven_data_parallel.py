"""Data parallel with a batch that does not divide over the devices (30 on 4, 2,047 on
8, the last batch of an epoch): each device takes its rows (numpy.array_split's), the
losses and the trained weights equal the single device's, and gradients_mean=True is
the mean over the global batch (not a mean of the devices' means) — in PyNative mode
and in GRAPH_MODE."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, nn, ops
from dualmode.parallel import CommReport


class MLP(nn.Cell):
    def __init__(self, d_in=12, hidden=16, d_out=5):
        super().__init__()
        self.fc1 = nn.Dense(d_in, hidden)
        self.fc2 = nn.Dense(hidden, d_out)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class _MSE(nn.Cell):
    def construct(self, logits, labels):
        return ops.reduce_mean(ops.square(logits - ops.one_hot(labels, 5, 1.0, 0.0)))


def _setup(devices, graph=False, **kw):
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.GRAPH_MODE if graph else dm.PYNATIVE_MODE)
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=devices, **kw)
    communication.init()


@pytest.fixture(autouse=True)
def _reset():
    yield
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)


def _batches(batch, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 12)).astype(np.float32),
             rng.integers(0, 5, batch).astype(np.int32)) for _ in range(steps)]


def _train(devices, batch, opt_cls=nn.SGD, loss=None, steps=3, graph=False, **ctx):
    _setup(devices, graph, **ctx)
    dm.set_seed(3)
    net = MLP()
    params = net.trainable_params()
    opt = nn.Momentum(params, 0.1, 0.9) if opt_cls is nn.Momentum else opt_cls(params, 0.1)
    loss_fn = loss or nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses = []
    with CommReport() as rep:
        for x, y in _batches(batch, steps):
            value, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            losses.append(float(value.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()], rep


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
@pytest.mark.parametrize("devices,batch,opt_cls", [
    (4, 30, nn.SGD), (4, 30, nn.Momentum), (4, 30, nn.Adam), (8, 2047, nn.SGD),
    (8, 9, nn.Momentum), (3, 32, nn.SGD)], ids=str)
def test_training_equals_single_device(devices, batch, opt_cls, graph):
    ref_losses, ref_w, _ = _train(1, batch, opt_cls)
    losses, w, rep = _train(devices, batch, opt_cls, graph=graph, gradients_mean=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    atol = 2e-5 if opt_cls is nn.Adam else 1e-6
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    # a data-parallel step: only the gradients' AllReduces, as for a batch that divides
    assert {(r.kind, r.reason) for r in rep.records} == {("AllReduce", "gradient")}


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
def test_mse_written_with_small_ops(graph):
    ref = _train(1, 30, loss=_MSE())
    got = _train(4, 30, loss=_MSE(), graph=graph, gradients_mean=True)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gradients_mean_is_over_the_global_batch():
    """30 rows on 4 devices (8, 8, 7, 7): the mean of the devices' means would weigh the
    rows of the short devices more; the update is the global batch's mean gradient, and
    without gradients_mean device_num times it."""
    x, y = _batches(30, 1)[0]
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)

    def grads(devices, **ctx):
        _setup(devices, **ctx)
        dm.set_seed(3)
        net = MLP()
        params = net.trainable_params()
        _, g = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None, params)(
            Tensor(x), Tensor(y))
        if devices > 1:
            g = dm.parallel.reduce_gradients(g, params)
        return [t.asnumpy() for t in g]

    ref = grads(1)
    mean = grads(4, gradients_mean=True)
    total = grads(4, gradients_mean=False)
    for m, t, r in zip(mean, total, ref):
        np.testing.assert_allclose(m, r, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(t, 4 * r, rtol=1e-4, atol=1e-6)
    # the mean of the devices' means differs (the test can tell the two apart)
    _setup(1)
    dm.set_seed(3)
    net = MLP()
    params = net.trainable_params()
    per_device = []
    for rows in np.array_split(np.arange(30), 4):
        _, g = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None, params)(
            Tensor(x[rows]), Tensor(y[rows]))
        per_device.append([t.asnumpy() for t in g])
    mean_of_means = [np.mean(gs, axis=0) for gs in zip(*per_device)]
    assert max(np.abs(a - b).max() for a, b in zip(mean_of_means, ref)) > 1e-4


def test_each_device_takes_its_rows():
    _setup(4)
    x = np.arange(30 * 12, dtype=np.float32).reshape(30, 12)

    class Keep(nn.Cell):
        def construct(self, t):
            return t * 1.0

    out = Keep()(Tensor(x))
    assert [dm.parallel.local_shape(out, rank=r) for r in range(4)] == [(8, 12)] * 2 + \
        [(7, 12)] * 2
    for r, piece in enumerate(np.array_split(x, 4)):
        np.testing.assert_array_equal(out._data[r][:len(piece)], piece)
        assert not out._data[r][len(piece):].any()
    np.testing.assert_array_equal(out.asnumpy(), x)


def test_model_train_with_a_short_last_batch():
    """70 samples in batches of 32: the last batch (6 rows) splits 2, 2, 1, 1."""
    from dualmode.dataset import NumpySlicesDataset
    from dualmode.train import LossMonitor, Model

    def run(devices):
        _setup(devices, gradients_mean=True)
        dm.set_seed(5)
        net = MLP()
        rng = np.random.default_rng(1)
        x = rng.standard_normal((70, 12)).astype(np.float32)
        y = rng.integers(0, 5, 70).astype(np.int32)
        ds = NumpySlicesDataset((x, y), shuffle=False).batch(32)
        mon = LossMonitor(0)
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True),
              nn.Momentum(net.trainable_params(), 0.05, 0.9)).train(2, ds, callbacks=[mon])
        return mon.losses, [p.asnumpy() for p in net.trainable_params()]

    ref, got = run(1), run(4)
    assert len(ref[0]) == 6
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_image_tiles_that_do_not_divide():
    """dataset_strategy ((1, 1, 2, 4),) on 9 x 10 images: rows 5, 4 and columns 3,
    3, 2, 2 per device; a convolution over them (whose halos need equal rows, so the
    rows are made whole for it) trains as on one device."""
    rng = np.random.default_rng(4)
    img = rng.standard_normal((4, 3, 9, 10)).astype(np.float32)
    target = Tensor(rng.standard_normal((4, 5)).astype(np.float32))
    seen = {}

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, pad_mode="same", weight_init="ones")
            self.fc = nn.Dense(4, 5, weight_init="ones")

        def construct(self, a):
            seen["a"] = a
            return self.fc(ops.reduce_mean(ops.relu(self.conv(a)), (2, 3)))

    def run(devices):
        _setup(devices, **({"dataset_strategy": ((1, 1, 2, 4),)} if devices > 1 else {}))
        dm.set_seed(2)
        net = Net()
        opt = nn.SGD(net.trainable_params(), 0.05)
        g = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(net(x) - target)), None,
                              opt.parameters)
        losses = []
        for _ in range(2):
            loss, grads = g(Tensor(img))
            opt(grads)
            losses.append(float(loss.asnumpy()))
        return losses, [p.asnumpy() for p in net.trainable_params()]

    ref = run(1)
    got = run(8)
    lay = seen["a"].layout
    assert [s[2:] for s in lay.device_slices()[:4]] == [
        (slice(0, 5), slice(0, 3)), (slice(0, 5), slice(3, 6)), (slice(0, 5), slice(6, 8)),
        (slice(0, 5), slice(8, 10))]
    assert lay.device_slices()[4][2] == slice(5, 9)
    assert dm.parallel.local_shape(seen["a"], rank=7) == (4, 3, 4, 2)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
