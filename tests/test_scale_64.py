"""The seed network (seed 003) on 64 simulated devices: its train step, run eagerly
with Primitive.shard strategies and compiled with AutoParallel, equals the
single-device step (losses and weights after two SGD steps)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.parallel.auto_parallel import AutoParallel

from _devices import devices

B, D, H, C = 128, 784, 128, 10
RNG = np.random.default_rng(64)
X = RNG.standard_normal((B, D)).astype(np.float32)
Y = RNG.integers(0, C, B).astype(np.int32)
WS = [(RNG.standard_normal(s) * 0.05).astype(np.float32) for s in ((D, H), (H, H), (H, C))]
#: matmul1 splits rows 8 ways and the contracted dim 8 ways; relu1 and relu2 split rows
#: 64 ways; matmul2 contracts over all 64 devices (pending sums)
STRATEGIES_64 = (((8, 8), (8, 1)), ((64, 1),), ((1, 64), (64, 1)), ((64, 1),))


class SeedNet(nn.Cell):
    def __init__(self, strategies):
        super().__init__()
        self.w1, self.w2, self.w3 = (Parameter(Tensor(w.copy()), name=f"w{k}")
                                     for k, w in enumerate(WS, 1))
        self.matmul1, self.relu1 = ops.MatMul(), ops.ReLU()
        self.matmul2, self.relu2 = ops.MatMul(), ops.ReLU()
        self.matmul3 = ops.MatMul()
        if strategies:
            for op, st in zip((self.matmul1, self.relu1, self.matmul2, self.relu2),
                              strategies):
                op.shard(st)

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.w1))
        x = self.relu2(self.matmul2(x, self.w2))
        return self.matmul3(x, self.w3)


def _train(n, compiled):
    with devices(n, gradients_mean=True) if n else devices(None):
        net = SeedNet(STRATEGIES_64 if n else None)
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
        grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

        def step(x, y):
            loss, grads = grad_fn(x, y)
            opt(grads)
            return loss
        run = AutoParallel(step, parallel_mode="semi_auto") if compiled else step
        losses = [float(run(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(2)]
        if n:        # the contracted weight lives as 64 row blocks, one per device
            assert net.w2.layout.device_num == 64 and net.w2.layout.local_shape == (H // 64, H)
        return losses, [p.asnumpy() for p in (net.w1, net.w2, net.w3)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "AutoParallel"])
def test_seed_network_on_64_devices_equals_one_device(compiled):
    ref_losses, ref_ws = _train(None, False)
    losses, ws = _train(64, compiled)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for w, r in zip(ws, ref_ws):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-6)
