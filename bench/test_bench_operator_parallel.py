"""The seed-003 network's train step sharded on 8 simulated devices against a
hand-written numpy single-device step of the same network.

Targets (issue 17): <= 1.3x at (B=256, H=512) and <= 1.1x at (B=2048, H=2048), eager
and compiled (JAX jit with the same strategies on 8 simulated CPU devices: 1.62x and
1.43x). Each dualmode row's rounds alternate with numpy steps (the ``paired`` fixture),
so both see the machine at the same speed.
"""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel.auto_parallel import AutoParallel

from test_bench_mlp import softmax_xent

SIZES = [(256, 512, 1.3), (2048, 2048, 1.1)]
IMPLS = ("numpy", "dualmode-8dev", "dualmode-8dev-compiled")
CASES = [(b, h, t, impl) for b, h, t in SIZES for impl in IMPLS]
LR = 0.01


def _data(batch, hidden, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    ws = [(rng.standard_normal(s) * 0.02).astype(np.float32)
          for s in ((784, hidden), (hidden, hidden), (hidden, 10))]
    return x, y, ws


class NumpySeed:
    """x @ W1, ReLU, @ W2, ReLU, @ W3, softmax cross-entropy, SGD — by hand."""

    def __init__(self, ws):
        self.w1, self.w2, self.w3 = [w.copy() for w in ws]

    def step(self, x, y):
        h1 = x @ self.w1
        a1 = np.maximum(h1, 0)
        h2 = a1 @ self.w2
        a2 = np.maximum(h2, 0)
        logits = a2 @ self.w3
        loss, d = softmax_xent(logits, y)
        g3 = a2.T @ d
        da2 = d @ self.w3.T
        da2 *= h2 > 0
        g2 = a1.T @ da2
        da1 = da2 @ self.w2.T
        da1 *= h1 > 0
        g1 = x.T @ da1
        for w, g in ((self.w1, g1), (self.w2, g2), (self.w3, g3)):
            w -= LR * g
        return loss


#: the tutorial's strategies for matmul1, relu1, matmul2, relu2 on 8 devices
STRATEGIES_8 = (((2, 4), (4, 1)), ((4, 1),), ((1, 8), (8, 1)), ((8, 1),))


class SeedNet(nn.Cell):
    def __init__(self, ws, strategies=STRATEGIES_8):
        super().__init__()
        self.w1, self.w2, self.w3 = (Parameter(Tensor(w.copy())) for w in ws)
        s1, s2, s3, s4 = strategies
        self.matmul1 = ops.MatMul().shard(s1)
        self.relu1 = ops.ReLU().shard(s2)
        self.matmul2 = ops.MatMul().shard(s3)
        self.relu2 = ops.ReLU().shard(s4)
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.w1))
        x = self.relu2(self.matmul2(x, self.w2))
        return self.matmul3(x, self.w3)


def _dualmode_step(ws, strategies=STRATEGIES_8):
    net = SeedNet(ws, strategies)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return net, step


@pytest.mark.parametrize("batch,hidden,target,impl", CASES,
                         ids=[f"B{b}-H{h}-{i}" for b, h, _, i in CASES])
def test_seed_step(benchmark, record, paired, parallel_context, batch, hidden, target, impl):
    """The numpy row times numpy alone; each dualmode row alternates its rounds with
    numpy steps (``paired``) and its ratio is to those."""
    parallel_context("semi_auto_parallel", 8)
    benchmark.group = f"seed network sharded on 8 devices, B={batch} H={hidden}"
    x, y, ws = _data(batch, hidden)
    rounds = dict(rounds=20, warmup_rounds=2) if batch <= 256 else dict(rounds=5,
                                                                        warmup_rounds=1)
    if impl == "numpy":
        model = NumpySeed(ws)
        benchmark.pedantic(model.step, args=(x, y), iterations=1, **rounds)
        record(benchmark, f"numpy seed step B{batch} H{hidden}")
        return
    def make():
        net, step = _dualmode_step(ws)
        if impl.endswith("compiled"):
            step = AutoParallel(step, parallel_mode="semi_auto")
        return net, step

    ref = NumpySeed(ws)
    ref_loss = ref.step(x, y)
    net, step = make()
    loss = float(step(Tensor(x), Tensor(y)).asnumpy())
    benchmark.extra_info["correct"] = bool(
        np.isclose(loss, ref_loss, rtol=1e-4)
        and np.allclose(net.w1.asnumpy(), ref.w1, rtol=1e-4, atol=1e-6))
    net, step = make()
    xt, yt = Tensor(x), Tensor(y)
    paired(benchmark, step, (xt, yt), NumpySeed(ws).step, (x, y),
           f"{impl} seed step B{batch} H{hidden}",
           f"numpy seed step B{batch} H{hidden}, paired with {impl}", target=target, **rounds)
