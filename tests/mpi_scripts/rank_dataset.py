"""Seed 004's data loading (``num_shards=get_group_size(), shard_id=get_rank()``) and a
MindSpore-style script: ``init()`` first, then the context (no ``device_num``: taken from
the world under "mpi"), a data-parallel regression trained by ``Model.train`` with a
features column and a labels column from one per-rank data set.

    mpiexec -n N python rank_dataset.py OUT.npz      # one rank per device
    python rank_dataset.py OUT.npz N                 # N simulated devices, one process

Both write the trained weights and the losses (rank 0 under MPI) to OUT.npz; the test
compares them.
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn
from dualmode.train import Callback, Model


class Recorder(Callback):
    """Collects the loss of every step (a Model.train callback)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs))


def create_dataset(batch_size=4):
    rank_id = communication.get_rank()
    rank_size = communication.get_group_size()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = (x @ rng.standard_normal((6, 1)) + 0.1).astype(np.float32)
    data = dm.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=True,
                                         num_shards=rank_size, shard_id=rank_id)
    return data.batch(batch_size, drop_remainder=True)


def main(out, sim_devices=None):
    dm.set_seed(1)
    if sim_devices:
        communication.init("sim")
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                     device_num=sim_devices)
    else:
        communication.init()
        dm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    w0 = np.random.default_rng(3).standard_normal((6, 1)).astype(np.float32) * 0.1
    net = nn.Dense(6, 1)
    net.weight.set_data(Tensor(w0.T.copy()))
    net.bias.set_data(Tensor(np.zeros(1, np.float32)))
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=opt)
    rec = Recorder()
    model.train(2, create_dataset(), callbacks=[rec])
    # a hand-written loop: the labels meet the network's output outside any Cell
    loop = []
    grad_fn = dm.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None,
                                net.trainable_params())
    for x, y in create_dataset().create_tuple_iterator(num_epochs=1):
        loss, grads = grad_fn(x, y)
        opt(grads)
        loop.append(float(loss.asnumpy()))
    weight, bias = net.weight.asnumpy(), net.bias.asnumpy()
    if communication.get_rank() == 0:
        np.savez(out, weight=weight, bias=bias, losses=np.array(rec.losses),
                 loop=np.array(loop), devices=communication.get_group_size())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
