"""nn.LARS (MindSpore's layer-wise adaptive rate scaling around another optimizer):
updates equal a numpy LARS + Momentum, with weight decay, loss scale, use_clip and a
filter; sharded weights (MatMul strategies), data parallel and GRAPH_MODE steps equal
the stand-alone run."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel import CommReport

from _devices import devices

RTOL = 1e-5
TRAIN_RTOL = 1e-4


class _Net(nn.Cell):
    """x @ w1 (a strategy) + fc.bias -> tanh -> @ w2: a loss 0.5 * mean((h - t)^2)."""

    def __init__(self, s1=None, s2=None):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w1 = Parameter(Tensor((0.5 * rng.normal(size=(8, 16))).astype(np.float32)),
                            name="w1")
        self.bias = Parameter(Tensor((0.1 * rng.normal(size=16)).astype(np.float32)),
                              name="fc.bias")
        self.w2 = Parameter(Tensor((0.5 * rng.normal(size=(16, 4))).astype(np.float32)),
                            name="w2")
        self.mm1 = ops.MatMul()
        self.mm2 = ops.MatMul()
        if s1 is not None:
            self.mm1.shard(s1)
        if s2 is not None:
            self.mm2.shard(s2)

    def construct(self, x, t):
        h = self.mm2(ops.tanh(self.mm1(x, self.w1) + self.bias), self.w2)
        return 0.5 * ops.reduce_mean(ops.square(h - t))


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(
        np.float32)


def _np_grads(params, x, t):
    w1, b, w2 = (p.astype(np.float64) for p in params)
    a = x @ w1 + b
    z = np.tanh(a)
    h = z @ w2
    dh = (h - t) / h.size
    dw2 = z.T @ dh
    da = (dh @ w2.T) * (1 - z * z)
    return [x.T @ da, da.sum(0), dw2]


def _np_lars(params, grads_fn, steps, lr, momentum, wd, eps, coef, use_clip=False,
             loss_scale=1.0, lars=(True, False, True)):
    """numpy LARS around Momentum: weight decay and loss scale handled by LARS (decayed
    parameters: names without beta/gamma, i.e. all three here)."""
    params = [p.astype(np.float64) for p in params]
    v = [np.zeros_like(p) for p in params]
    for step in range(steps):
        grads = [g * loss_scale / loss_scale for g in grads_fn(params)]
        for i, (p, g) in enumerate(zip(params, grads)):
            if lars[i]:
                wn, gn = np.linalg.norm(p), np.linalg.norm(g)
                ratio = coef * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
                if use_clip:
                    ratio = min(ratio / lr(step), 1.0)
                g = ratio * (g + wd * p)
            v[i] = momentum * v[i] + g
            params[i] = p - lr(step) * v[i]
    return params


def _train(n=None, s1=None, s2=None, steps=3, graph=False, use_clip=False, loss_scale=1.0,
           lr=0.1, lars_filter=None, **ctx):
    x, t = _data()
    with devices(n, **(ctx or dict(full_batch=True))):
        if graph:
            dm.set_context(mode=dm.GRAPH_MODE)
        net = _Net(s1, s2)
        inner = nn.Momentum(net.trainable_params(), lr, 0.9, weight_decay=0.01,
                            loss_scale=loss_scale)
        kw = {} if lars_filter is None else {"lars_filter": lars_filter}
        opt = nn.LARS(inner, epsilon=1e-8, coefficient=0.02, use_clip=use_clip, **kw)
        g = dm.value_and_grad(net, None, opt.parameters)
        losses = []
        with CommReport() as rep:
            for _ in range(steps):
                loss, grads = g(Tensor(x), Tensor(t))
                if loss_scale != 1.0:
                    grads = tuple(ops.mul(gr, loss_scale) for gr in grads)
                opt(grads)
                losses.append(float(loss.asnumpy()))
        return losses, [p.asnumpy() for p in opt.parameters], opt, rep


def _start():
    net = _Net()
    return [p.asnumpy() for p in (net.w1, net.bias, net.w2)]


def test_lars_momentum_equals_numpy():
    """The default filter leaves fc.bias alone (no rescaling, no weight decay)."""
    x, t = _data()
    _, got, opt, _ = _train()
    want = _np_lars(_start(), lambda ps: _np_grads(ps, x, t), 3, lambda s: 0.1, 0.9, 0.01,
                    1e-8, 0.02)
    assert opt.lars_flag == (True, False, True)
    for a, b, name in zip(got, want, ["w1", "fc.bias", "w2"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7, err_msg=name)
    assert opt.global_step == opt.opt.global_step == 3
    # the wrapped optimizer's decay and loss scale moved to LARS
    assert opt.opt.weight_decay == 0.0 and opt.weight_decay == 0.01


def test_use_clip_loss_scale_and_filter_equal_numpy():
    x, t = _data()
    sched = [0.5, 0.2, 0.05]
    _, got, _, _ = _train(use_clip=True, loss_scale=8.0, lr=sched,
                          lars_filter=lambda p: p.name != "w2")
    want = _np_lars(_start(), lambda ps: _np_grads(ps, x, t), 3, lambda s: sched[s], 0.9,
                    0.01, 1e-8, 0.02, use_clip=True, lars=(True, True, False))
    for a, b, name in zip(got, want, ["w1", "fc.bias", "w2"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("s1,s2", [(((2, 1), (1, 4)), ((2, 4), (4, 1))),
                                   (((1, 2), (2, 4)), ((1, 8), (8, 1))),
                                   (((8, 1), (1, 1)), None)],
                         ids=["cols-then-rows", "contracted-splits", "batch"])
def test_sharded_weights_equal_stand_alone(s1, s2, graph):
    """Weights stored sharded by their MatMul strategies: each norm is the whole
    weight's (each device sums its shard, one scalar AllReduce), so the updates equal
    the stand-alone run."""
    ref_losses, ref, _, _ = _train()
    losses, got, opt, rep = _train(8, s1, s2, graph=graph)
    np.testing.assert_allclose(losses, ref_losses, rtol=TRAIN_RTOL)
    for a, b, name in zip(got, ref, ["w1", "fc.bias", "w2"]):
        np.testing.assert_allclose(a, b, rtol=TRAIN_RTOL, atol=1e-6, err_msg=name)
    if s2 is not None:          # w1 and w2 live sharded, their norms reduce scalars
        assert opt.parameters[0]._layout is not None and opt.parameters[2]._layout is not None


def test_data_parallel_equals_stand_alone():
    ref_losses, ref, _, _ = _train()
    losses, got, _, _ = _train(8, parallel_mode="data_parallel", gradients_mean=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=TRAIN_RTOL)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=TRAIN_RTOL, atol=1e-6)


def test_errors_are_named():
    net = _Net()
    inner = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    with pytest.raises(TypeError, match=r"LARS: optimizer must be an Optimizer \(e.g. "
                                        r"nn.Momentum\), got list"):
        nn.LARS(net.trainable_params())
    with pytest.raises(TypeError, match=r"LARS: epsilon must be a float, got 1"):
        nn.LARS(inner, epsilon=1)
    with pytest.raises(TypeError, match=r"LARS: use_clip must be a bool, got 'yes'"):
        nn.LARS(inner, use_clip="yes")
    opt = nn.LARS(nn.Momentum(net.trainable_params(), 0.1, 0.9))
    with pytest.raises(ValueError, match=r"LARS: got 2 gradients for 3 parameters"):
        opt((Tensor(np.zeros((8, 16), np.float32)), Tensor(np.zeros(16, np.float32))))
    with pytest.raises(ValueError, match=r"LARS: the gradient for parameter 'w2' has shape "
                                         r"\(4, 16\); the parameter has shape \(16, 4\)"):
        opt((Tensor(np.zeros((8, 16), np.float32)), Tensor(np.zeros(16, np.float32)),
             Tensor(np.zeros((4, 16), np.float32))))
    assert opt.global_step == 0 and np.all(opt.opt.moments[0].asnumpy() == 0)
