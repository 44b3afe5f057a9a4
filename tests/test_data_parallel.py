"""Eager data parallelism on simulated devices: every run is compared with the
single-device run of the same program (the oracle)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, nn, ops
from dualmode.parallel import CommReport, local_shape


def _setup(devices, **kw):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=devices, **kw)
    communication.init()


class MLP(nn.Cell):
    def __init__(self, d_in=12, hidden=16, d_out=5):
        super().__init__()
        self.fc1 = nn.Dense(d_in, hidden)
        self.fc2 = nn.Dense(hidden, hidden)
        self.fc3 = nn.Dense(hidden, d_out)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def _data(steps=4, batch=32, d_in=12, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, d_in)).astype(np.float32),
             rng.integers(0, classes, batch).astype(np.int32)) for _ in range(steps)]


def _train(devices, opt_cls=nn.SGD, loss_fn=None, steps=4, **ctx):
    _setup(devices, **ctx)
    dm.set_seed(3)
    net = MLP()
    opt = opt_cls(net.trainable_params(), learning_rate=0.1) if opt_cls is not nn.Momentum \
        else nn.Momentum(net.trainable_params(), 0.1, 0.9)
    loss_fn = loss_fn or nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses = []
    for x, y in _data(steps):
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()]


@pytest.mark.parametrize("opt_cls", [nn.SGD, nn.Momentum, nn.Adam])
def test_dp_training_equals_single_device(opt_cls):
    ref_losses, ref_w = _train(1, opt_cls)
    losses, w = _train(8, opt_cls, gradients_mean=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # the weight gradient is summed per device then across devices (reordered float32
    # sums); Adam divides by sqrt(v), so on near-zero gradients that rounding reaches
    # ~1e-5 of lr=0.1 in absolute terms
    atol = 2e-5 if opt_cls is nn.Adam else 1e-6
    for a, b in zip(w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


def test_dp_mse_loss_equals_single_device():
    ref = _train(1, loss_fn=_MSEOnLogits())
    got = _train(4, loss_fn=_MSEOnLogits(), gradients_mean=True)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


class _MSEOnLogits(nn.Cell):
    """An MSE against a one-hot target, written with small ops."""

    def construct(self, logits, labels):
        target = ops.one_hot(labels, 5, 1.0, 0.0)
        return ops.reduce_mean(ops.square(logits - target))


def test_dp_gradients_sum_is_device_num_times_mean():
    _setup(8, gradients_mean=False)
    dm.set_seed(3)
    net = MLP()
    x, y = _data(1)[0]
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    params = net.trainable_params()
    _, grads = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None, params)(
        Tensor(x), Tensor(y))
    reduced = dm.parallel.reduce_gradients(grads, params)
    _setup(1)
    dm.set_seed(3)
    net1 = MLP()
    _, ref = dm.value_and_grad(lambda a, b: loss_fn(net1(a), b), None,
                               net1.trainable_params())(Tensor(x), Tensor(y))
    for g, r in zip(reduced, ref):
        np.testing.assert_allclose(g.asnumpy(), 8 * r.asnumpy(), rtol=1e-4, atol=1e-6)


def test_dp_inputs_are_split_and_partial_grads_read_globally():
    _setup(8, gradients_mean=True)
    dm.set_seed(3)
    net = MLP()
    x, y = _data(1)[0]
    params = net.trainable_params()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    seen = {}

    def fwd(a, b):
        logits = net(a)
        seen["logits"] = logits
        return loss_fn(logits, b)

    loss, grads = dm.value_and_grad(fwd, None, params)(Tensor(x), Tensor(y))
    assert local_shape(seen["logits"]) == (4, 5)          # 32 rows over 8 devices
    assert seen["logits"].shape == (32, 5)
    assert grads[0].layout is not None and grads[0].layout.partial == (0,)
    _setup(1)
    dm.set_seed(3)
    net1 = MLP()
    loss1, ref = dm.value_and_grad(lambda a, b: loss_fn(net1(a), b), None,
                                   net1.trainable_params())(Tensor(x), Tensor(y))
    np.testing.assert_allclose(loss.asnumpy(), loss1.asnumpy(), rtol=1e-5)
    for g, r in zip(grads, ref):                     # asnumpy of a partial = its sum
        np.testing.assert_allclose(g.asnumpy(), r.asnumpy(), rtol=1e-4, atol=1e-6)


def _grad_allreduce_count(devices=8, **ctx):
    _setup(devices, gradients_mean=True, **ctx)
    dm.set_seed(3)
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    x, y = _data(1)[0]
    with CommReport() as rep:
        _, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
    return rep


def test_gradient_allreduce_one_per_parameter_without_fusion():
    rep = _grad_allreduce_count()
    assert rep.count("AllReduce", "gradient") == 6
    # bytes: ring AllReduce moves 2 (n-1)/n of each gradient per device
    sizes = [16 * 12, 16, 16 * 16, 16, 5 * 16, 5]
    expected = sum(2 * 7 / 8 * s * 4 for s in sizes)
    assert rep.bytes("AllReduce", "gradient") == pytest.approx(expected)


@pytest.mark.parametrize("ctx,buckets", [
    ({"all_reduce_fusion_config": [2, 4]}, 3),
    ({"all_reduce_fusion_config": [1]}, 2),
    ({"comm_fusion": {"allreduce": {"mode": "index", "config": [3]}}}, 2),
    ({"comm_fusion": {"allreduce": {"mode": "auto", "config": None}}}, 1),
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": 0.0009}}}, 3),  # 832|1024|404 B
    ({"comm_fusion": {"allreduce": {"mode": "size", "config": 0.002}}}, 2),   # 1920|340 B
])
def test_gradient_fusion_buckets(ctx, buckets):
    rep = _grad_allreduce_count(**ctx)
    assert rep.count("AllReduce", "gradient") == buckets


def test_fused_training_equals_single_device():
    ref = _train(1)
    got = _train(8, gradients_mean=True, all_reduce_fusion_config=[2, 4])
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_full_batch_keeps_inputs_whole():
    _setup(8, gradients_mean=True, dataset_strategy="full_batch")
    x = Tensor(np.ones((3, 12), np.float32))
    seen = {}

    class Probe(nn.Cell):
        def construct(self, a):
            seen["a"] = a
            return a * 2.0

    out = Probe()(x)
    assert seen["a"].layout is None
    np.testing.assert_allclose(out.asnumpy(), 2.0)


def test_image_tiles_from_tuple_dataset_strategy():
    _setup(8, dataset_strategy=((1, 1, 2, 4),))
    rng = np.random.default_rng(0)
    img = rng.standard_normal((2, 3, 8, 16)).astype(np.float32)
    seen = {}

    class Net(nn.Cell):
        def construct(self, a):
            seen["a"] = a
            return ops.reduce_sum(ops.relu(a) * 3.0, (2, 3))

    out = Net()(Tensor(img))
    assert local_shape(seen["a"]) == (2, 3, 4, 4)
    # rank 5 = coords (1, 1) on the (2, 4) device matrix: rows 4:8, cols 4:8
    assert seen["a"].layout.device_slices()[5][2:] == (slice(4, 8), slice(4, 8))
    np.testing.assert_allclose(out.asnumpy(), (np.maximum(img, 0) * 3).sum((2, 3)), rtol=1e-5)


def test_ops_outside_the_batch_rules_gather_and_stay_correct():
    _setup(4)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 6)).astype(np.float32)
    seen = {}

    class Net(nn.Cell):
        def construct(self, x):
            t = ops.transpose(x, (1, 0))            # moves the split to dim 1: no traffic
            m = ops.reduce_max(x, 0)                # over the batch: AllReduce(max)
            s = ops.softmax(x, 0)                   # softmax over the batch: gathered
            seen["t"] = t
            return t, m, s

    with CommReport() as rep:
        t, m, s = Net()(Tensor(a))
    np.testing.assert_allclose(t.asnumpy(), a.T)
    np.testing.assert_allclose(m.asnumpy(), a.max(0))
    e = np.exp(a - a.max(0))
    np.testing.assert_allclose(s.asnumpy(), e / e.sum(0), rtol=1e-5)
    assert seen["t"].layout.tensor_map[1] and not seen["t"].layout.tensor_map[0]
    assert rep.count("AllGather") == 1
    assert rep.count("AllReduce") == 1


def test_batch_smaller_than_the_devices_is_a_named_error():
    # a batch that does not divide is split as numpy.array_split (tests/test_uneven_*);
    # one with fewer rows than devices would leave some devices none
    _setup(8)
    with pytest.raises(ValueError, match=r"input 0 has batch size 5 .*fewer rows than the 8 "
                                         r"devices"):
        MLP()(Tensor(np.ones((5, 12), np.float32)))


def test_model_train_data_parallel_equals_single_device():
    from dualmode.dataset import NumpySlicesDataset
    from dualmode.train import LossMonitor, Model

    def run(devices):
        _setup(devices, gradients_mean=True)
        dm.set_seed(5)
        net = MLP()
        data = _data(3)
        x = np.concatenate([d[0] for d in data])
        y = np.concatenate([d[1] for d in data])
        ds = NumpySlicesDataset((x, y), shuffle=False).batch(32)
        mon = LossMonitor(0)
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True),
              nn.Momentum(net.trainable_params(), 0.05, 0.9)).train(2, ds, callbacks=[mon])
        return mon.losses, [p.asnumpy() for p in net.trainable_params()]

    ref, got = run(1), run(8)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_parameter_broadcast_before_training():
    from dualmode.dataset import NumpySlicesDataset
    from dualmode.train import Model
    _setup(8, gradients_mean=True, parameter_broadcast=True)
    dm.set_seed(5)
    net = MLP()
    x, y = _data(1)[0]
    ds = NumpySlicesDataset((x, y), shuffle=False).batch(32)
    with CommReport() as rep:
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True),
              nn.SGD(net.trainable_params(), 0.1)).train(1, ds)
    assert rep.count("Broadcast", "parameter_broadcast") == 6
    assert rep.count("AllReduce", "gradient") == 6


def _train_rows(devices, rows, steps=2):
    _setup(devices, gradients_mean=True)
    dm.set_seed(3)
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    losses = []
    with CommReport() as rep:
        for x, y in _data(steps, batch=rows):
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()], rep


@pytest.mark.parametrize("devices", [64, 4096])
def test_many_devices_equal_one_device_and_account_bytes(devices):
    """64 devices, and 4096: under "sim" a batch split is a view and the gradients are
    kept as equal shares, so even 4096 devices run at single-device cost while the
    report accounts every device's traffic."""
    rows = devices                     # one row per device
    ref = _train_rows(1, rows)
    got = _train_rows(devices, rows)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    rep = got[2]
    assert rep.count("AllReduce", "gradient") == 2 * 6
    sizes = [16 * 12, 16, 16 * 16, 16, 5 * 16, 5]
    per_step = sum(2 * (devices - 1) / devices * s * 4 for s in sizes)
    assert rep.bytes("AllReduce", "gradient") == pytest.approx(2 * per_step)


def test_data_parallel_example_matches_one_device(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "examples" / "data_parallel.py"
    spec = importlib.util.spec_from_file_location("data_parallel_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loss_err, w_err, report = mod.main(["--devices", "8", "--steps", "4", "--batch", "32"])
    assert loss_err < 1e-5 and w_err < 1e-5
    assert report.count("AllReduce", "gradient") == 3 * 4     # fusion [2, 4]: 3 buckets
    assert "3 fused gradient AllReduce(s)" in capsys.readouterr().out


def test_dataset_strategy_errors_name_the_input():
    _setup(8, dataset_strategy=((1, 1, 2, 4),))
    with pytest.raises(ValueError, match=r"dataset_strategy.*in_strategy\[0\].*rank|"
                                         r"dataset_strategy.*4 entries.*rank 3"):
        MLP()(Tensor(np.ones((2, 3, 8), np.float32)))
    # (tiles that do not divide are numpy.array_split's: tests/test_uneven_data_parallel)
    with pytest.raises(ValueError, match=r"dataset_strategy: in_strategy\[0\]\[3\]=4 exceeds "
                                         r"dim 3 \(size 3\) of input 0: 1 device would hold "
                                         r"an empty piece"):
        MLP()(Tensor(np.ones((2, 3, 8, 3), np.float32)))
    with pytest.raises(ValueError, match=r"gives 1 strategies but the network got more "
                                         r"tensor inputs \(input 1\)"):
        class Two(nn.Cell):
            def construct(self, a, b):
                return a
        Two()(Tensor(np.ones((2, 3, 8, 8), np.float32)), Tensor(np.ones((2, 3, 8, 8),
                                                                         np.float32)))


def test_setitem_into_a_distributed_tensor_is_refused():
    _setup(8)
    seen = {}

    class Probe(nn.Cell):
        def construct(self, a):
            seen["a"] = a
            return a

    Probe()(Tensor(np.zeros((8, 2), np.float32)))
    with pytest.raises(RuntimeError, match="in-place assignment into a distributed tensor"):
        seen["a"][0] = 1.0
    np.testing.assert_array_equal(seen["a"].asnumpy(), 0.0)


def test_numpy_reads_a_pending_scalar_loss():
    """np.asarray / float of a 0-d loss pending over the devices give its sum."""
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    communication.init()
    try:
        class Sum(nn.Cell):
            def construct(self, x):
                return ops.reduce_sum(x)

        loss = Sum()(Tensor(np.arange(16, dtype=np.float32).reshape(8, 2)))  # batch split
        assert loss.layout is not None and loss.layout.partial
        assert np.asarray(loss).shape == () and float(np.asarray(loss)) == 120.0
        assert np.asarray(loss, dtype=np.float64).dtype == np.float64
        assert float(loss) == 120.0 and loss.item() == 120.0
    finally:
        dm.reset_auto_parallel_context()
        communication.init()


def test_repeated_calls_take_the_remembered_route_with_the_same_numbers():
    """A call signature seen before runs its remembered one-kernel route: the results
    stay equal to numpy for repeated calls, for attrs that differ only in value (each its
    own route), and after the backend changes to another device count."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    for devices in (8, 4, 8):
        _setup(devices)
        (a,) = dm.parallel.inputs.distribute_inputs((Tensor(x),))
        for _ in range(3):
            out = ops.relu(ops.matmul(a, Tensor(w)))
            assert out.layout is not None and local_shape(out) == (16 // devices, 3)
            np.testing.assert_allclose(out.asnumpy(), np.maximum(x @ w, 0), rtol=1e-5,
                                       atol=1e-6)
            for axis in (0, 1):                      # same op, attrs differ in value
                np.testing.assert_allclose(ops.ReduceSum(keep_dims=True)(a, axis).asnumpy(),
                                           x.sum(axis=axis, keepdims=True), rtol=1e-5,
                                           atol=1e-5)
    _setup(1)
