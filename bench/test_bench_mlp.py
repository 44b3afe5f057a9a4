"""One training step of the 3-layer MLP (784-H-H-10, ReLU, softmax cross-entropy,
SGD) against a hand-written numpy forward/backward/SGD step.

Target: <= 1.1x the numpy step (issue 17; PyTorch eager autograd measures 1.17x here).
The dualmode row's rounds alternate with numpy steps (the ``paired`` fixture), so both
see the machine at the same speed; the numpy row times numpy alone.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn

SIZES = [(256, 512), (2048, 2048)]
LR = 0.01


def _data(batch, hidden, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=batch).astype(np.int32)
    shapes = [(hidden, 784), (hidden,), (hidden, hidden), (hidden,), (10, hidden), (10,)]
    params = [(rng.standard_normal(s) * 0.02).astype(np.float32) for s in shapes]
    return x, y, params


def softmax_xent(logits, y):
    """Mean softmax cross-entropy with int labels and its gradient, by hand in numpy."""
    n = logits.shape[0]
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    s = e.sum(axis=1, keepdims=True)
    loss = float(np.mean(np.log(s[:, 0]) + m[:, 0] - logits[np.arange(n), y]))
    d = e / s
    d[np.arange(n), y] -= 1.0
    d /= n
    return loss, d


class NumpyMLP:
    """The baseline: forward, backward and SGD written by hand in numpy."""

    def __init__(self, params):
        self.w1, self.b1, self.w2, self.b2, self.w3, self.b3 = [p.copy() for p in params]

    def step(self, x, y):
        h1 = x @ self.w1.T + self.b1
        a1 = np.maximum(h1, 0)
        h2 = a1 @ self.w2.T + self.b2
        a2 = np.maximum(h2, 0)
        logits = a2 @ self.w3.T + self.b3
        loss, d = softmax_xent(logits, y)
        gw3 = d.T @ a2
        gb3 = d.sum(axis=0)
        da2 = d @ self.w3
        da2 *= h2 > 0
        gw2 = da2.T @ a1
        gb2 = da2.sum(axis=0)
        da1 = da2 @ self.w2
        da1 *= h1 > 0
        gw1 = da1.T @ x
        gb1 = da1.sum(axis=0)
        for p, g in ((self.w1, gw1), (self.b1, gb1), (self.w2, gw2), (self.b2, gb2),
                     (self.w3, gw3), (self.b3, gb3)):
            p -= LR * g
        return loss


class Net(nn.Cell):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Dense(784, hidden)
        self.fc2 = nn.Dense(hidden, hidden)
        self.fc3 = nn.Dense(hidden, 10)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def _dualmode_step(params):
    net = Net(params[0].shape[0])
    for p, v in zip(net.trainable_params(), params):
        p.set_data(v.copy())
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = dm.value_and_grad(forward, None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return net, step


def step_matches_numpy(params, x, y):
    """One dualmode step (fresh net) equals one hand-written numpy step."""
    ref = NumpyMLP(params)
    ref_loss = ref.step(x, y)
    net, step = _dualmode_step(params)
    loss = float(step(Tensor(x), Tensor(y)).asnumpy())
    w1 = net.trainable_params()[0].asnumpy()
    return bool(np.isclose(loss, ref_loss, rtol=1e-4)
                and np.allclose(w1, ref.w1, rtol=1e-4, atol=1e-6))


def _rounds(batch):
    return dict(rounds=30, warmup_rounds=3) if batch <= 256 else dict(rounds=5, warmup_rounds=1)


CASES = [(b, h, impl) for b, h in SIZES for impl in ("numpy", "dualmode")]


@pytest.mark.parametrize("batch,hidden,impl", CASES,
                         ids=[f"B{b}-H{h}-{impl}" for b, h, impl in CASES])
def test_mlp_step(benchmark, record, paired, batch, hidden, impl):
    """The numpy row times numpy alone; the dualmode row alternates its rounds with
    numpy steps (``paired``) and its ratio is to those."""
    benchmark.group = f"mlp train step B={batch} H={hidden}"
    x, y, params = _data(batch, hidden)
    if impl == "numpy":
        model = NumpyMLP(params)
        benchmark.pedantic(model.step, args=(x, y), iterations=1, **_rounds(batch))
        record(benchmark, f"numpy mlp step B{batch} H{hidden}")
        return
    net, step = _dualmode_step(params)
    xt, yt = Tensor(x), Tensor(y)
    benchmark.extra_info["correct"] = step_matches_numpy(params, x, y)
    paired(benchmark, step, (xt, yt), NumpyMLP(params).step, (x, y),
           f"dualmode mlp step B{batch} H{hidden}",
           f"numpy mlp step B{batch} H{hidden}, paired", target=1.1, **_rounds(batch))
