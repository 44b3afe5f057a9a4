"""A data set read per rank (``num_shards=get_group_size(), shard_id=get_rank()``) whose
last batch is short: 30 rows, each rank's shard 8 rows (the last ones wrap around to the
start), batches of 3 without dropping the remainder, so every rank's last batch has 2
rows. A data-parallel regression trained one epoch with a hand-written loop.

    mpiexec -n N python uneven_rank_dataset.py OUT.npz      # one rank per device
    python uneven_rank_dataset.py OUT.npz N                 # N simulated devices
    python uneven_rank_dataset.py OUT.npz N ref             # one device, the same global
                                                            # batches built by hand

Each writes the losses, the global batch sizes and the trained weights to OUT.npz."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn

ROWS, BATCH = 30, 3


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 6)).astype(np.float32)
    y = (x @ rng.standard_normal((6, 1)) + 0.1).astype(np.float32)
    return x, y


def _reference_batches(n):
    """Rank d's shard: positions d, d + n, ... of the rows (wrapping), ceil(ROWS / n) of
    them; the global batch b is the ranks' batches b in rank order."""
    x, y = _data()
    per = -(-ROWS // n)
    shards = [(np.arange(per) * n + d) % ROWS for d in range(n)]
    for b in range(0, per, BATCH):
        idx = np.concatenate([s[b:b + BATCH] for s in shards])
        yield x[idx], y[idx]


def main(out, devices=None, ref=False):
    if ref:
        communication.init("sim")
        n = devices
    elif devices:
        communication.init("sim")
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                     device_num=devices)
        n = devices
    else:
        communication.init()
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
        n = communication.get_group_size()
    net = nn.Dense(6, 1)
    w0 = np.random.default_rng(3).standard_normal((1, 6)).astype(np.float32) * 0.1
    net.weight.set_data(Tensor(w0))
    net.bias.set_data(Tensor(np.zeros(1, np.float32)))
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)
    grad_fn = dm.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None,
                                net.trainable_params())
    if ref:
        batches = ((Tensor(x), Tensor(y)) for x, y in _reference_batches(n))
    else:
        x, y = _data()
        ds = dm.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False,
                                           num_shards=n, shard_id=communication.get_rank())
        batches = ds.batch(BATCH).create_tuple_iterator(num_epochs=1)
    losses, sizes = [], []
    for x, y in batches:
        loss, grads = grad_fn(x, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
        sizes.append(int(x.shape[0]))
    weight, bias = net.weight.asnumpy(), net.bias.asnumpy()
    if communication.get_rank() == 0:
        np.savez(out, weight=weight, bias=bias, losses=np.array(losses),
                 sizes=np.array(sizes))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None,
         len(sys.argv) > 3 and sys.argv[3] == "ref")
