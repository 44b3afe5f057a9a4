"""Checkpoints under any backend. Under mpiexec (backend "mpi", one device per rank):

    mpiexec -n N python checkpoint.py save DIR      # 3 steps, save integrated + sliced, 3 more
    mpiexec -n N python checkpoint.py resume DIR    # fresh net + optimizer from full.safetensors
    mpiexec -n N python checkpoint.py resume_sliced DIR   # each rank from its own slice file

rank 0 writes DIR/<mode>.npy (the losses). Tests import `run` to compute the same on "sim".
"""
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops


class Net(nn.Cell):
    def __init__(self, n, seed=3):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w1 = Parameter(Tensor((rng.standard_normal((16, 32)) * 0.3).astype(np.float32)),
                            name="w1")
        self.w2 = Parameter(Tensor((rng.standard_normal((32, 8)) * 0.3).astype(np.float32)),
                            name="w2")
        self.m1 = ops.MatMul().shard(((n // 2, 2), (2, 1)))
        self.m2 = ops.MatMul().shard(((1, n), (n, 1)))
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.m2(self.relu(self.m1(x, self.w1)), self.w2)


def _batches(start, stop):
    for step in range(start, stop):
        rng = np.random.default_rng(step)
        yield (rng.standard_normal((16, 16)).astype(np.float32),
               rng.integers(0, 8, 16).astype(np.int32))


def _train(net, opt, batches):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    out = []
    for x, y in batches:
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        out.append(float(loss.asnumpy()))
    return out


def run(mode, directory, devices=None):
    dm.reset_auto_parallel_context()
    communication.init()
    n = devices or communication.get_group_size()
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                 gradients_mean=True)
    communication.init()
    if mode == "save":
        net = Net(n)
        opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
        losses = _train(net, opt, _batches(0, 3))
        dm.save_checkpoint([net, opt], os.path.join(directory, "full.safetensors"))
        dm.save_checkpoint([net, opt], os.path.join(directory, "s.safetensors"),
                           integrated_save=False)
        return losses + _train(net, opt, _batches(3, 6))
    net = Net(n, seed=50)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    if mode == "resume":
        params = dm.load_checkpoint(os.path.join(directory, "full.safetensors"))
    else:
        rank = communication.get_rank()
        params = dm.load_checkpoint(os.path.join(directory, f"rank_{rank}", "s.safetensors"))
    dm.load_param_into_net(net, params)
    dm.load_param_into_net(opt, params)
    return _train(net, opt, _batches(3, 6))


if __name__ == "__main__":
    mode, directory = sys.argv[1], sys.argv[2]
    losses = run(mode, directory)
    if communication.get_rank() == 0:
        np.save(os.path.join(directory, f"{mode}.npy"), np.array(losses))
