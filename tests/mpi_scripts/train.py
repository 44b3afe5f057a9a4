"""The same training programs under any backend: run as a script under mpiexec
(backend "mpi") it writes rank 0's results to OUT.npz; tests import it and run the
programs on the "sim" backend in-process to compare.

    mpiexec -n 4 python train.py {dp|seed|shard|shards} OUT.npz
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops

STEPS = 3


def _setup(mode, devices=None):
    dm.reset_auto_parallel_context()
    communication.init()
    n = devices or communication.get_group_size()
    dm.set_auto_parallel_context(parallel_mode=mode, device_num=n, gradients_mean=True)
    communication.init()


def _data(step, batch=16, features=48):
    rng = np.random.default_rng(step)
    return (rng.standard_normal((batch, features)).astype(np.float32),
            rng.integers(0, 10, batch).astype(np.int32))


class Seed(nn.Cell):
    """The seed-003 network (strategies scaled to the device count)."""

    def __init__(self, n, hidden=64, strategies=True):
        super().__init__()
        rng = np.random.default_rng(7)
        self.w1 = Parameter(Tensor((rng.standard_normal((48, hidden)) * 0.1).astype(np.float32)),
                            name="w1")
        self.w2 = Parameter(Tensor((rng.standard_normal((hidden, hidden)) * 0.1)
                                   .astype(np.float32)), name="w2")
        self.w3 = Parameter(Tensor((rng.standard_normal((hidden, 10)) * 0.1).astype(np.float32)),
                            name="w3")
        half = max(n // 2, 1)
        self.matmul1 = ops.MatMul()
        self.matmul2 = ops.MatMul()
        self.relu1, self.relu2 = ops.ReLU(), ops.ReLU()
        if strategies and n > 1:
            self.matmul1.shard(((n // half, half), (half, 1)))
            self.relu1.shard(((half, 1),))
            self.matmul2.shard(((1, n), (n, 1)))
            self.relu2.shard(((n, 1),))
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.w1))
        block = self.__dict__.get("block")
        x = block(x) if block is not None else self.relu2(self.matmul2(x, self.w2))
        return self.matmul3(x, self.w3)


def _shard_batches(n, devices, local=4):
    """STEPS batches of the "shards" program: under mpi each rank reads its own shard of
    a data set (num_shards = ranks, shard_id = rank; rows dealt in turn) in batches of
    `local`; on sim (`devices` given) the same global batches, ranks' rows in rank order."""
    rng = np.random.default_rng(11)
    rows = STEPS * local * n
    xs = rng.standard_normal((rows, 48)).astype(np.float32)
    ys = rng.integers(0, 10, rows).astype(np.int32)
    if devices is None:
        ds = dm.dataset.NumpySlicesDataset({"x": xs, "y": ys}, shuffle=False, num_shards=n,
                                           shard_id=communication.get_rank()).batch(local)
        yield from ds
        return
    for step in range(STEPS):
        idx = [(step * local + j) * n + r for r in range(n) for j in range(local)]
        yield Tensor(xs[idx]), Tensor(ys[idx])


def train(program, devices=None):
    """Returns (losses, weights) of STEPS training steps of `program`."""
    mode = "data_parallel" if program in ("dp", "shards") else "semi_auto_parallel"
    _setup(mode if program != "shard" else "auto_parallel", devices)
    n = communication.get_group_size() if devices is None else devices
    net = Seed(n, strategies=program == "seed")
    if program == "shard":
        # a compiled block: only its input and output strategies are given
        net.__dict__["block"] = ops.shard(lambda x: ops.relu(ops.matmul(x, net.w2)),
                                          in_strategy=((n, 1),), out_strategy=((n, 1),))
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses = []
    batches = _shard_batches(n, devices) if program == "shards" else \
        ((Tensor(x), Tensor(y)) for x, y in map(_data, range(STEPS)))
    for x, y in batches:
        loss, grads = grad_fn(x, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return np.array(losses), [p.asnumpy() for p in net.trainable_params()]


if __name__ == "__main__":
    program, out = sys.argv[1], sys.argv[2]
    losses, weights = train(program)
    if communication.get_rank() == 0:
        np.savez(out, losses=losses, *weights)
