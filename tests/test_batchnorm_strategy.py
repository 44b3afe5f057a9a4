"""``ops.BatchNorm`` is one op: its strategy (one entry per input: x, scale, bias, mean,
variance) applies to the op as a whole, in PyNative and GRAPH_MODE, training and
inference. Sharded on the batch (and H/W) the training statistics are those of the
global batch (one AllReduce of the per-channel sums inside the op), on the channels
each device normalises its own; the running mean and variance Parameters are updated in
place. Outputs, gradients, trained weights and running statistics equal the stand-alone
run and numpy."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops

from _devices import devices
from _steps import sgd_steps

RTOL = 1e-5          # one op
TRAIN_RTOL = 1e-4    # over training steps
EPS, MOMENTUM = 1e-5, 0.1
C = 4


def _x(seed=0, shape=(8, C, 4, 4)):
    return np.random.default_rng(seed).normal(1.0, 2.0, size=shape).astype(np.float32)


def np_batch_norm(x, gamma, beta, mean, var):
    b = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(b)) / np.sqrt(var.reshape(b) + EPS) * gamma.reshape(b) + \
        beta.reshape(b)


def np_batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    return x.astype(np.float64).mean(axis=axes), x.astype(np.float64).var(axis=axes)


class _Net(nn.Cell):
    """x -> BatchNorm (its strategy) -> a weighted square: the loss reaches every
    output (y, the batch mean and variance)."""

    def __init__(self, training, strategy=None):
        super().__init__()
        rng = np.random.default_rng(3)
        self.bn = ops.BatchNorm(training, EPS, MOMENTUM)
        if strategy is not None:
            self.bn.shard(strategy)
        self.gamma = Parameter(Tensor(rng.uniform(0.5, 1.5, C).astype(np.float32)), name="gamma")
        self.beta = Parameter(Tensor(rng.uniform(-1, 1, C).astype(np.float32)), name="beta")
        self.moving_mean = Parameter(Tensor(rng.normal(size=C).astype(np.float32)),
                                     name="moving_mean", requires_grad=False)
        self.moving_variance = Parameter(Tensor(rng.uniform(0.5, 2, C).astype(np.float32)),
                                         name="moving_variance", requires_grad=False)
        self.w = Tensor(rng.normal(size=(8, C, 4, 4)).astype(np.float32))
        self.a = Tensor(rng.normal(size=C).astype(np.float32))

    def construct(self, x):
        y, bm, bv, _, _ = self.bn(x, self.gamma, self.beta, self.moving_mean,
                                  self.moving_variance)
        return ops.reduce_mean(ops.mul(ops.square(y), self.w)) + \
            ops.reduce_sum(ops.mul(bm, self.a)) + ops.reduce_sum(ops.mul(bv, self.a))


def _train(n, training, strategy, mode, steps=2, **ctx):
    """Losses, input gradients, and every parameter after `steps` SGD steps."""
    x = _x()
    with devices(n, **(ctx or dict(full_batch=True))):
        dm.set_context(mode=mode)
        net = _Net(training, strategy)
        return sgd_steps(net, net, x, steps)


STRATEGIES = {
    "batch": ((8, 1, 1, 1), (1,), (1,), (1,), (1,)),
    "channels": ((1, 2, 1, 1), (2,), (2,), (2,), (2,)),
    "batch-channels-H": ((2, 2, 2, 1), (2,), (2,), (2,), (2,)),
    "HW": ((1, 1, 2, 4), (1,), (1,), (1,), (1,)),
}


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("split", list(STRATEGIES))
def test_sharded_equals_single_device(split, training, mode):
    ref_losses, ref_dx, ref, _ = _train(None, training, None, dm.PYNATIVE_MODE)
    losses, dxs, got, rep = _train(8, training, STRATEGIES[split], mode)
    np.testing.assert_allclose(losses, ref_losses, rtol=TRAIN_RTOL)
    for a, b in zip(dxs, ref_dx):
        np.testing.assert_allclose(a, b, rtol=TRAIN_RTOL, atol=1e-6, err_msg="gradient of x")
    for name, want in ref.items():      # gamma, beta and the running statistics
        np.testing.assert_allclose(got[name], want, rtol=TRAIN_RTOL, atol=1e-6, err_msg=name)
    # the forward statistics: one AllReduce of the (2, C) float64 sums per step when the
    # batch is split, none when only the channels are
    fwd = [r for r in rep.records if r.op == "BatchNorm" and r.kind == "AllReduce"
           and r.reason == "forward"]
    if not training or split == "channels":
        assert not fwd
    else:
        assert len(fwd) == 2


def test_one_device_equals_numpy():
    """Training: y, the batch statistics and the running update; then inference with
    the updated running statistics."""
    x = _x(1)
    rng = np.random.default_rng(2)
    gamma, beta = rng.uniform(0.5, 1.5, C).astype(np.float32), rng.normal(size=C).astype(
        np.float32)
    m0, v0 = rng.normal(size=C).astype(np.float32), rng.uniform(0.5, 2, C).astype(np.float32)
    mean = Parameter(Tensor(m0), name="mean", requires_grad=False)
    var = Parameter(Tensor(v0), name="var", requires_grad=False)
    y, bm, bv, r1, r2 = ops.BatchNorm(True, EPS, MOMENTUM)(Tensor(x), Tensor(gamma),
                                                           Tensor(beta), mean, var)
    want_m, want_v = np_batch_stats(x)
    np.testing.assert_allclose(y.asnumpy(), np_batch_norm(x, gamma, beta, want_m, want_v),
                               rtol=1e-4, atol=1e-5)
    for out, want in ((bm, want_m), (bv, want_v), (r1, want_m), (r2, want_v)):
        np.testing.assert_allclose(out.asnumpy(), want, rtol=RTOL, atol=1e-7)
    count = x.size // C
    np.testing.assert_allclose(mean.asnumpy(), 0.9 * m0 + 0.1 * want_m, rtol=RTOL)
    np.testing.assert_allclose(var.asnumpy(), 0.9 * v0 + 0.1 * want_v * count / (count - 1),
                               rtol=RTOL)
    y2, m2, v2, _, _ = ops.BatchNorm(False, EPS)(Tensor(x), Tensor(gamma), Tensor(beta),
                                                mean, var)
    np.testing.assert_allclose(y2.asnumpy(), np_batch_norm(x, gamma, beta, mean.asnumpy(),
                                                           var.asnumpy()), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(m2.asnumpy(), mean.asnumpy())
    np.testing.assert_array_equal(v2.asnumpy(), var.asnumpy())


def test_inference_gradients_equal_numpy():
    """Inference: y = k * (x - mean) + beta, k = gamma / sqrt(var + eps); the gradients
    of sum(w * y) to x, gamma, beta, mean and variance."""
    x = _x(2).astype(np.float64)
    rng = np.random.default_rng(5)
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.normal(size=C)
    mean, var = rng.normal(size=C), rng.uniform(0.5, 2, C)
    w = rng.normal(size=x.shape)
    prim = ops.BatchNorm(False, EPS)
    f = dm.grad(lambda *a: ops.reduce_sum(ops.mul(prim(*a)[0], Tensor(w))),
                grad_position=(0, 1, 2, 3, 4))
    got = f(*[Tensor(a) for a in (x, gamma, beta, mean, var)])
    b = (1, C, 1, 1)
    k = gamma / np.sqrt(var + EPS)
    axes = (0, 2, 3)
    want = [w * k.reshape(b),
            (w * (x - mean.reshape(b))).sum(axes) / np.sqrt(var + EPS),
            w.sum(axes),
            -w.sum(axes) * k,
            -0.5 * (w * (x - mean.reshape(b))).sum(axes) * gamma * (var + EPS) ** -1.5]
    for i, (a, e) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a.asnumpy(), e, rtol=1e-9, atol=1e-12,
                                   err_msg=f"gradient of input {i}")


@pytest.mark.parametrize("mode", [dm.PYNATIVE_MODE, dm.GRAPH_MODE], ids=["eager", "graph"])
def test_data_parallel_statistics_are_the_global_batch(mode):
    """No strategy, data parallel: each device holds 1 of the 8 images, and the
    statistics, gradients and running statistics are still the whole batch's."""
    ref_losses, ref_dx, ref, _ = _train(None, True, None, dm.PYNATIVE_MODE)
    losses, dxs, got, _ = _train(8, True, None, mode, parallel_mode="data_parallel",
                                 gradients_mean=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=TRAIN_RTOL)
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=TRAIN_RTOL, atol=1e-6, err_msg=name)


def test_errors_are_named():
    x = Tensor(_x())
    p = [Parameter(Tensor(np.ones(C, np.float32)), name=f"p{i}", requires_grad=False)
         for i in range(4)]
    with pytest.raises(TypeError, match=r"BatchNorm: with is_training=True, mean must be a "
                                        r"Parameter \(it is updated in place\), got Tensor"):
        ops.BatchNorm(True)(x, p[0], p[1], Tensor(np.zeros(C, np.float32)), p[3])
    bad = Parameter(Tensor(np.ones(3, np.float32)), name="bad", requires_grad=False)
    with pytest.raises(ValueError, match=r"BatchNorm: variance has shape \(3,\); expected "
                                         r"\(4,\), one value per channel of x \(8, 4, 4, 4\)"):
        ops.BatchNorm(True)(x, p[0], p[1], p[2], bad)
    np.testing.assert_array_equal(p[2].asnumpy(), 1)          # nothing was updated
    with devices(8, full_batch=True):
        with pytest.raises(ValueError, match=r"BatchNorm: in_strategy\[0\]\[1\]=2 and "
                                             r"in_strategy\[1\]\[0\]=4 split the channel dim "
                                             r"differently"):
            ops.BatchNorm(True).shard(((1, 2, 1, 1), (4,), (4,), (4,), (4,)))(x, *p)
        with pytest.raises(ValueError, match=r"BatchNorm: in_strategy has 2 entries but the "
                                             r"op got 5 tensor inputs"):
            ops.BatchNorm(False).shard(((8, 1, 1, 1), (1,)))(x, *p)


@pytest.mark.parametrize("form", ["primitive", "functional"])
def test_running_statistics_in_graph_mode_without_strategy(form):
    """GRAPH_MODE on one device: the running statistics are updated each time the
    compiled Cell runs, as in PyNative mode (the update is an opaque call of the graph)."""
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn = ops.BatchNorm(True, EPS, MOMENTUM)
            self.g = Parameter(Tensor(np.ones(C, np.float32)), name="g")
            self.b = Parameter(Tensor(np.zeros(C, np.float32)), name="b")
            self.m = Parameter(Tensor(np.zeros(C, np.float32)), name="m", requires_grad=False)
            self.v = Parameter(Tensor(np.ones(C, np.float32)), name="v", requires_grad=False)

        def construct(self, x):
            if form == "primitive":
                return self.bn(x, self.g, self.b, self.m, self.v)[0]
            return ops.batch_norm(x, self.m, self.v, self.g, self.b, training=True,
                                  momentum=MOMENTUM, eps=EPS)

    xs = [_x(s) for s in range(3)]
    got = {}
    for mode in (dm.PYNATIVE_MODE, dm.GRAPH_MODE):
        with devices(None):
            dm.set_context(mode=mode)
            net = Net()
            ys = [net(Tensor(x)).asnumpy() for x in xs]
            got[mode] = ys, net.m.asnumpy(), net.v.asnumpy()
    m, v = np.zeros(C), np.ones(C)
    for x in xs:
        bm, bv = np_batch_stats(x)
        count = x.size // C
        m, v = 0.9 * m + 0.1 * bm, 0.9 * v + 0.1 * bv * count / (count - 1)
    for mode, (ys, gm, gv) in got.items():
        np.testing.assert_allclose(gm, m, rtol=RTOL, err_msg=f"mode {mode}")
        np.testing.assert_allclose(gv, v, rtol=RTOL, err_msg=f"mode {mode}")
        for y, x in zip(ys, xs):
            np.testing.assert_allclose(y, np_batch_norm(x, np.ones(C), np.zeros(C),
                                                        *np_batch_stats(x)),
                                       rtol=1e-4, atol=1e-5)


def test_training_gradients_equal_finite_differences():
    """Training, float64: the gradients of sum(w * y) + sum(a * mean) + sum(b * var) (the
    batch statistics' outputs included) to x, gamma and beta against central finite
    differences of a numpy forward."""
    rng = np.random.default_rng(9)
    x = rng.normal(1.0, 2.0, size=(3, 2, 2, 2))
    gamma, beta = rng.uniform(0.5, 1.5, 2), rng.normal(size=2)
    w, a, b = rng.normal(size=x.shape), rng.normal(size=2), rng.normal(size=2)

    def np_f(x, gamma, beta):
        m, v = np_batch_stats(x)
        return (w * np_batch_norm(x, gamma, beta, m, v)).sum() + (a * m).sum() + (b * v).sum()

    def f(x, gamma, beta):
        mean = Parameter(Tensor(np.zeros(2)), name="m", requires_grad=False)
        var = Parameter(Tensor(np.ones(2)), name="v", requires_grad=False)
        y, m, v, _, _ = ops.BatchNorm(True, EPS)(x, gamma, beta, mean, var)
        return ops.reduce_sum(ops.mul(y, Tensor(w))) + ops.reduce_sum(ops.mul(m, Tensor(a))) + \
            ops.reduce_sum(ops.mul(v, Tensor(b)))

    got = dm.grad(f, grad_position=(0, 1, 2))(Tensor(x), Tensor(gamma), Tensor(beta))
    args = [x, gamma, beta]
    for i, g in enumerate(got):
        want = np.zeros_like(args[i])
        for j in np.ndindex(args[i].shape):
            hi = [p.copy() for p in args]
            lo = [p.copy() for p in args]
            hi[i][j] += 1e-6
            lo[i][j] -= 1e-6
            want[j] = (np_f(*hi) - np_f(*lo)) / 2e-6
        np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"gradient of input {i}")
