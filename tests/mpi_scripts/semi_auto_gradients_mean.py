"""Run under ``mpiexec -n 4 python semi_auto_gradients_mean.py OUT.npz``: a Conv2D whose
input is cut along W over the ranks (its weight replicated on every rank) trained two
SGD steps with TrainOneStepCell in semi_auto_parallel with and without
``gradients_mean``, and in data_parallel without it. Rank 0 writes the weights to
OUT.npz; tests import the script and run :func:`train` stand-alone to compare."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

RUNS = [("semi_auto_parallel", False), ("semi_auto_parallel", True),
        ("data_parallel", False)]
LR = 0.1
STEPS = 2

_RNG = np.random.default_rng(5)
X = _RNG.standard_normal((8, 3, 8, 16)).astype(np.float32)
Y = _RNG.standard_normal((8, 8, 8, 16)).astype(np.float32)
W = (_RNG.standard_normal((8, 3, 2, 2)) * 0.3).astype(np.float32)


class ConvNet(nn.Cell):
    def __init__(self, n):
        super().__init__()
        self.weight = Parameter(Tensor(W.copy()), name="weight")
        self.conv = ops.Conv2D(8, 2, pad_mode="same").shard(((1, 1, 1, n), (1, 1, 1, 1)))

    def construct(self, x):
        return self.conv(x, self.weight)


def train(mode=None, mean=False, lr=LR):
    """The weight after STEPS steps: in `mode` with `mean` on every device of the
    backend, or stand-alone (mode None)."""
    dm.reset_auto_parallel_context()
    communication.init()
    n = communication.get_group_size()
    if mode is not None:
        dm.set_auto_parallel_context(parallel_mode=mode, device_num=n, gradients_mean=mean)
        communication.init()
    net = ConvNet(n)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                               nn.SGD(net.trainable_params(), learning_rate=lr))
    for _ in range(STEPS):
        step(Tensor(X), Tensor(Y))
    return net.weight.asnumpy()


if __name__ == "__main__":
    found = {f"{mode}-{mean}": train(mode, mean) for mode, mean in RUNS}
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], **found)
