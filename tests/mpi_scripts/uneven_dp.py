"""Data parallel with a batch that does not divide over the ranks, under any backend:
run under mpiexec (backend "mpi", one device per rank) it writes rank 0's losses and
weights to OUT.npz; tests import it and run the same program stand-alone to compare.

    mpiexec -n 3 python uneven_dp.py OUT.npz BATCH
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn

STEPS = 3


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(12, 16)
        self.fc2 = nn.Dense(16, 5)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def train(batch, parallel):
    """(losses, weights) of STEPS steps on the global batches of `batch` rows."""
    dm.reset_auto_parallel_context()
    communication.init()
    if parallel:
        dm.set_auto_parallel_context(parallel_mode="data_parallel",
                                     device_num=communication.get_group_size(),
                                     gradients_mean=True)
        communication.init()
    dm.set_seed(3)
    net = MLP()
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        x = rng.standard_normal((batch, 12)).astype(np.float32)
        y = rng.integers(0, 5, batch).astype(np.int32)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return np.array(losses), [p.asnumpy() for p in net.trainable_params()]


if __name__ == "__main__":
    out, batch = sys.argv[1], int(sys.argv[2])
    losses, weights = train(batch, parallel=True)
    if communication.get_rank() == 0:
        np.savez(out, losses, *weights)
