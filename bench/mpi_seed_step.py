"""Times the seed network's train step on the current backend (run under mpiexec for
"mpi"; imported by bench/test_bench_mpi.py for "sim"). Prints the median step time of
rank 0 as JSON: {"median_s": ...}."""
import json
import sys
import time

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

LR = 0.01


def data(batch, hidden, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    ws = [(rng.standard_normal(s) * 0.02).astype(np.float32)
          for s in ((784, hidden), (hidden, hidden), (hidden, 10))]
    return x, y, ws


class SeedNet(nn.Cell):
    """The seed-003 network with its strategies scaled to 4 devices."""

    def __init__(self, ws):
        super().__init__()
        self.w1, self.w2, self.w3 = (Parameter(Tensor(w.copy()), name=f"w{i}")
                                     for i, w in enumerate(ws, 1))
        self.matmul1 = ops.MatMul().shard(((2, 2), (2, 1)))
        self.relu1 = ops.ReLU().shard(((2, 1),))
        self.matmul2 = ops.MatMul().shard(((1, 4), (4, 1)))
        self.relu2 = ops.ReLU().shard(((4, 1),))
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.w1))
        x = self.relu2(self.matmul2(x, self.w2))
        return self.matmul3(x, self.w3)


def make_step(batch, hidden, devices=None):
    dm.reset_auto_parallel_context()
    communication.init()
    n = devices or communication.get_group_size()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                 gradients_mean=True)
    communication.init()
    x, y, ws = data(batch, hidden)
    net = SeedNet(ws)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    xt, yt = Tensor(x), Tensor(y)

    def step():
        loss, grads = grad_fn(xt, yt)
        opt(grads)
        return loss

    return step


def median_step(step, rounds):
    step()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


if __name__ == "__main__":
    batch, hidden, rounds = map(int, sys.argv[1:4])
    med = median_step(make_step(batch, hidden), rounds)
    if communication.get_rank() == 0:
        print(json.dumps({"median_s": med}))
