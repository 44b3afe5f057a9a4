"""Weights stored as their optimizer slices on real ranks: ``mpiexec -n N python
parallel_optimizer_slices.py OUT_DIR`` trains a small network two Adam steps under
data_parallel with the parallel optimizer (one device per rank), then each rank writes
``OUT_DIR/rank_<r>.npz``: the shape of the slices it stores between steps, its
parameter storage, the weights (read in the same order on every rank: each read
gathers that weight over the ranks), the AllGathers those reads made and the losses.
Tests import the script and run :func:`train` on simulated devices to compare."""
import os
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport
from dualmode.parallel.optimizer_shard import stored_slices
from dualmode.parallel.report import parameter_bytes_per_device

_RNG = np.random.default_rng(17)
X = _RNG.standard_normal((8, 16)).astype(np.float32)
Y = _RNG.integers(0, 8, 8).astype(np.int32)
W = {"w1": (_RNG.standard_normal((16, 32)) * 0.3).astype(np.float32),
     "w2": (_RNG.standard_normal((32, 8)) * 0.3).astype(np.float32)}
STEPS = 2


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        for name, value in W.items():
            setattr(self, name, Parameter(Tensor(value.copy()), name=name))

    def construct(self, x):
        return ops.matmul(ops.tanh(ops.matmul(x, self.w1)), self.w2)


def train(n=None, backend=None):
    """On the `n` devices of `backend` ("mpi": the launched ranks; "sim": `n` simulated
    devices; None: stand-alone): a dict of the figures the module docstring lists."""
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)
    communication.init(backend)
    if backend is not None:
        n = communication.get_group_size() if backend == "mpi" else n
        dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=n,
                                     gradients_mean=True, enable_parallel_optimizer=True,
                                     parallel_optimizer_config={
                                         "parallel_optimizer_threshold": 0})
        communication.init(backend)
    net = Net()
    params = net.trainable_params()
    opt = nn.Adam(params, 0.01, weight_decay=0.01)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(
        sparse=True, reduction="mean")), opt)
    losses = [float(step(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(STEPS)]
    out = {"losses": np.array(losses)}
    if backend is not None:
        for p in params:
            layout, stack = stored_slices(p)
            out[f"{p.name}-slices"] = np.array(stack.shape)
            out[f"{p.name}-slice-layout"] = np.array(layout.local_shape)
        out["stored"] = np.array(parameter_bytes_per_device(params))
    with CommReport() as report:
        for p in params:
            out[p.name] = p.asnumpy()
    out["gathers"] = np.array(report.count("AllGather", reason="parallel_optimizer"))
    return out


if __name__ == "__main__":
    found = train(backend="mpi")
    np.savez(os.path.join(sys.argv[1], f"rank_{communication.get_rank()}.npz"), **found)
