"""Operator strategies that do not divide the shapes, under any backend: run under
mpiexec (backend "mpi", one device per rank) it writes rank 0's losses and weights to
OUT.npz; tests import it and run the same program stand-alone to compare.

    mpiexec -n 3 python uneven_strategies.py OUT.npz
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

STEPS = 3


class Net(nn.Cell):
    """w1 (12, 5): its columns over the n ranks (2, 2, 1 on 3); the second product
    contracts them (pending sums of unequal pieces); the rows of x over the ranks."""

    def __init__(self, n):
        super().__init__()
        rng = np.random.default_rng(5)
        self.w1 = Parameter(Tensor(rng.standard_normal((12, 5)).astype(np.float32) * 0.3),
                            name="w1")
        self.w2 = Parameter(Tensor(rng.standard_normal((5, 4)).astype(np.float32) * 0.3),
                            name="w2")
        self.mm1 = ops.MatMul().shard(((1, 1), (1, n)))
        self.mm2 = ops.MatMul().shard(((1, n), (n, 1)))
        self.act = ops.Tanh().shard(((n, 1),))

    def construct(self, x):
        return self.act(self.mm2(ops.tanh(self.mm1(x, self.w1)), self.w2))


def train(parallel):
    """(losses, weights) of STEPS Momentum steps of the mean square of Net(x)."""
    dm.reset_auto_parallel_context()
    communication.init()
    n = communication.get_group_size() if parallel else 1
    if parallel:
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n)
        communication.init()
    net = Net(max(n, 3))
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    g = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(net(x))), None,
                          opt.parameters)
    x = Tensor(np.random.default_rng(6).standard_normal((10, 12)).astype(np.float32))
    losses = []
    for _ in range(STEPS):
        loss, grads = g(x)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return np.array(losses), [p.asnumpy() for p in net.trainable_params()]


if __name__ == "__main__":
    losses, weights = train(parallel=True)
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], losses, *weights)
