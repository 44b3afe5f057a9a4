"""A compiled (AutoParallel) train step with operator-level strategies: run under
mpiexec with backend "mpi", or in-process on "sim" with the same device count
(tests/test_graph_executor_mpi.py compares the two)."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel.auto_parallel import AutoParallel

STEPS = 3


class Net(nn.Cell):
    def __init__(self, n):
        super().__init__()
        rng = np.random.default_rng(5)
        self.w1 = Parameter(Tensor(rng.standard_normal((16, 32)).astype(np.float32) * 0.3),
                            name="w1")
        self.w2 = Parameter(Tensor(rng.standard_normal((32, 8)).astype(np.float32) * 0.3),
                            name="w2")
        self.mm1 = ops.MatMul().shard(((1, n), (n, 1)))       # contracted split: pending sums
        self.mm2 = ops.MatMul().shard(((n, 1), (1, 1)))
        self.relu = ops.ReLU().shard(((n, 1),))

    def construct(self, x):
        return self.mm2(self.relu(self.mm1(x, self.w1)), self.w2)


def train(devices=None):
    dm.reset_auto_parallel_context()
    if devices is None:
        communication.init("mpi")
        n = communication.get_group_size()
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                     gradients_mean=True)
    else:
        n = devices
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                     gradients_mean=True)
        communication.init("sim")
    net = Net(n)
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    loss_fn = nn.MSELoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    step = AutoParallel(step, parallel_mode="semi_auto")
    rng = np.random.default_rng(9)
    losses = []
    for _ in range(STEPS):
        x = Tensor(rng.standard_normal((8, 16)).astype(np.float32))
        y = Tensor(rng.standard_normal((8, 8)).astype(np.float32))
        losses.append(float(step(x, y).asnumpy()))
    return np.array(losses), [p.asnumpy() for p in net.trainable_params()]


if __name__ == "__main__":
    losses, weights = train()
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], losses=losses, *weights)
