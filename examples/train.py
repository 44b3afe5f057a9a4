"""The script docs/mpi.md launches: MindSpore-style data-parallel training.

Written as MindSpore's distributed training tutorial writes it: ``init()`` first, then
the parallel context, a data set sharded per rank (``num_shards=get_group_size(),
shard_id=get_rank()``), ``Model.train`` with ``LossMonitor``. The same script runs

    python -m dualmode.run --worker_num 4 examples/train.py --epochs 2   # 4 ranks
    mpiexec -n 4 python examples/train.py --epochs 2                      # the same
    python examples/train.py --epochs 2 [--device_num 8]                  # simulated

and trains the same numbers for the same device count: one simulated process feeds
device d with shard d, as rank d reads it. The device count is the launched world, or
``--device_num`` (default 8) on simulated devices. Rank 0 prints the losses and the
final accuracy.
"""
import argparse

import numpy as np

import dualmode as dm
from dualmode import communication, nn
from dualmode.communication import get_group_size, get_rank
from dualmode.dataset import NumpySlicesDataset
from dualmode.train import LossMonitor, Model


def make_data(n=4096, features=32, classes=10, seed=0):
    """Gaussian clusters: n samples (drawn with `seed`, the same on every rank) around
    one fixed center per class."""
    centers = np.random.default_rng(1234).standard_normal((classes, features)) * 1.5
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    x = centers[labels] + rng.standard_normal((n, features))
    return x.astype(np.float32), labels.astype(np.int32)


def create_dataset(batch_size):
    """This rank's shard of the data set, batched (the tutorial's ``create_dataset``)."""
    x, y = make_data()
    data = NumpySlicesDataset({"x": x, "y": y}, shuffle=True,
                              num_shards=get_group_size(), shard_id=get_rank())
    return data.batch(batch_size, drop_remainder=True)


class Net(nn.Cell):
    def __init__(self, features=32, hidden=64, classes=10):
        super().__init__()
        self.body = nn.SequentialCell([nn.Dense(features, hidden), nn.ReLU(),
                                       nn.Dense(hidden, classes)])

    def construct(self, x):
        return self.body(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32, help="per device")
    parser.add_argument("--device_num", type=int, default=8,
                        help="simulated devices when not launched under MPI")
    args = parser.parse_args(argv)

    dm.set_seed(1)
    communication.init()                         # "mpi" when launched, else "sim"
    launched = communication.get_backend().name == "mpi"
    dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                 device_num=None if launched else args.device_num)
    dataset = create_dataset(args.batch_size)
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = Model(net, loss_fn=nn.SoftmaxCrossEntropyWithLogits(sparse=True),
                  optimizer=opt, metrics={"accuracy"})
    # every rank records its losses; only rank 0 prints them (0: record, never print)
    every = max(1, dataset.get_dataset_size() // 2)
    monitor = LossMonitor(every if get_rank() == 0 else 0)
    model.train(args.epochs, dataset, callbacks=[monitor])
    x, y = make_data(512, seed=1)
    test = NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8 * get_group_size())
    accuracy = model.eval(test)["accuracy"]
    if get_rank() == 0:
        print(f"{get_group_size()} devices ({communication.get_backend().name}): "
              f"final loss {monitor.losses[-1]:.4f}, accuracy {accuracy:.3f}", flush=True)
    return monitor.losses, accuracy


if __name__ == "__main__":
    main()
