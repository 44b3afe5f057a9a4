"""Optimizers on sharded parameters whose layouts repeat blocks over device axes
(strategies with repeated calculation): the update runs over the device grid,
broadcasting the gradient over the replicas, and must equal the single-device update."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport


class _Net(nn.Cell):
    def __init__(self, ws):
        super().__init__()
        self.w1, self.w2, self.w3 = (Parameter(Tensor(w.copy()), name=f"w{i}")
                                     for i, w in enumerate(ws, 1))
        self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))     # w1 repeated over 2
        self.relu1 = ops.ReLU().shard(((4, 1),))
        self.matmul2 = ops.MatMul().shard(((1, 8), (8, 1)))
        self.relu2 = ops.ReLU().shard(((8, 1),))
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.w1))
        x = self.relu2(self.matmul2(x, self.w2))
        return self.matmul3(x, self.w3)


_OPTIMIZERS = {
    "sgd": lambda p: nn.SGD(p, learning_rate=0.1),
    "sgd-momentum-decay": lambda p: nn.SGD(p, learning_rate=0.1, momentum=0.9,
                                           weight_decay=0.01, loss_scale=2.0),
    "momentum-nesterov": lambda p: nn.Momentum(p, 0.05, 0.9, use_nesterov=True),
    "adam": lambda p: nn.Adam(p, learning_rate=0.01, weight_decay=0.01),
}


def _train(devices, make_opt, steps=3):
    dm.reset_auto_parallel_context()
    if devices > 1:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=devices,
                                     gradients_mean=True)
    communication.init()
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal(s) * 0.3).astype(np.float32)
          for s in ((16, 32), (32, 32), (32, 10))]
    net = _Net(ws)
    opt = make_opt(net.trainable_params())
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses = []
    with CommReport() as rep:
        for _ in range(steps):
            x = rng.standard_normal((16, 16)).astype(np.float32)
            y = rng.integers(0, 10, 16).astype(np.int32)
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            losses.append(float(loss.asnumpy()))
    return net, losses, rep


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_sharded_update_equals_one_device(name):
    try:
        ref, ref_losses, _ = _train(1, _OPTIMIZERS[name])
        net, losses, rep = _train(8, _OPTIMIZERS[name])
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
        for p, q in zip(net.trainable_params(), ref.trainable_params()):
            np.testing.assert_allclose(p.asnumpy(), q.asnumpy(), rtol=1e-4, atol=1e-6)
        w1 = net.w1
        assert w1.layout.device_matrix == (2, 4) and w1.layout.replicated_axes == (0,)
        blocks = w1._data.reshape((2, 4) + w1.layout.local_shape)
        np.testing.assert_array_equal(blocks[0], blocks[1])       # replicas stay equal
        assert rep.count(reason="gradient") >= 1
    finally:
        dm.reset_auto_parallel_context()
        communication.init()
