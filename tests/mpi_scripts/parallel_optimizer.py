"""The parallel optimizer on real ranks: ``mpiexec -n N python parallel_optimizer.py
OUT.npz`` trains a small network three steps per run of :data:`RUNS` (semi_auto_parallel
with a tensor-parallel MatMul, and data_parallel; PyNative and GRAPH_MODE; Momentum and
Adam with weight decay) with ``enable_parallel_optimizer=True``; rank 0 writes the
losses, the weights and the counts of the gradient ReduceScatters, the parallel
optimizer's AllGathers (the last update's at the read of the weights) and the gradient
AllReduces. Tests import the script and run
:func:`train` on simulated devices (and stand-alone) to compare."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport

RUNS = [(mode, graph, opt, False) for mode in ("semi_auto_parallel", "data_parallel")
        for graph in (False, True) for opt in ("momentum", "adam")]
# the ReduceScatters and the AllGathers fused (one collective per bucket)
RUNS += [("data_parallel", False, "adam", True), ("semi_auto_parallel", True, "momentum", True)]
FUSION = {"reducescatter": {"mode": "auto", "config": None},
          "allgather": {"mode": "auto", "config": None}}
STEPS = 3

_RNG = np.random.default_rng(11)
X = _RNG.standard_normal((8, 16)).astype(np.float32)
Y = _RNG.integers(0, 8, 8).astype(np.int32)
W = {"w1": (_RNG.standard_normal((16, 32)) * 0.3).astype(np.float32),
     "w2": (_RNG.standard_normal((32, 32)) * 0.3).astype(np.float32),
     "w3": (_RNG.standard_normal((32, 8)) * 0.3).astype(np.float32),
     "b": (_RNG.standard_normal(8) * 0.1).astype(np.float32)}


class Net(nn.Cell):
    """w1 split by columns over 2 devices (replicated over the others), w2 read by a
    batch-split MatMul, w3 by a plain one (both replicated on every device), a bias
    under the threshold."""

    def __init__(self, n, strategies):
        super().__init__()
        for name, value in W.items():
            setattr(self, name, Parameter(Tensor(value.copy()), name=name))
        self.mm1, self.mm2, self.mm3 = ops.MatMul(), ops.MatMul(), ops.MatMul()
        if strategies:
            self.mm1.shard(((1, 1), (1, 2)))
            self.mm2.shard(((n, 1), (1, 1)))

    def construct(self, x):
        h = ops.tanh(self.mm1(x, self.w1))
        h = ops.tanh(self.mm2(h, self.w2))
        return self.mm3(h, self.w3) + self.b


def train(mode, graph, opt_name, fused=False, n=None, backend=None):
    """(losses, weights, (ReduceScatters, AllGathers, AllReduces)) after STEPS steps in
    `mode` on the `n` devices of `backend` ("mpi": the launched ranks; "sim": `n`
    simulated devices), or stand-alone (mode None); `fused`: with :data:`FUSION`."""
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.PYNATIVE_MODE)
    communication.init(backend)
    if mode is not None:
        n = communication.get_group_size() if backend == "mpi" else n
        dm.set_auto_parallel_context(parallel_mode=mode, device_num=n, gradients_mean=True,
                                     enable_parallel_optimizer=True,
                                     parallel_optimizer_config={
                                         "parallel_optimizer_threshold": 1})
        if fused:
            dm.set_auto_parallel_context(comm_fusion=FUSION)
        communication.init(backend)
    if graph:
        dm.set_context(mode=dm.GRAPH_MODE)
    net = Net(n, mode == "semi_auto_parallel")
    params = net.trainable_params()
    opt = nn.Momentum(params, 0.1, 0.9, weight_decay=0.01) if opt_name == "momentum" \
        else nn.Adam(params, 0.01, weight_decay=0.01)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)
    with CommReport() as rep:
        losses = [float(step(Tensor(X), Tensor(Y)).asnumpy()) for _ in range(STEPS)]
        # a sharded weight is stored as its slices and gathered where it is read (the
        # next forward pass, or here: every rank reads the weights in the same order)
        weights = {p.name: p.asnumpy() for p in params}
    dm.set_context(mode=dm.PYNATIVE_MODE)
    counts = (rep.count("ReduceScatter", reason="gradient"),
              rep.count("AllGather", reason="parallel_optimizer"),
              rep.count("AllReduce", reason="gradient"))
    return losses, weights, counts


if __name__ == "__main__":
    found = {}
    for run in RUNS:
        losses, weights, counts = train(*run, backend="mpi")
        key = "-".join(map(str, run))
        found[f"{key}-losses"] = np.array(losses)
        found[f"{key}-counts"] = np.array(counts)
        for name, w in weights.items():
            found[f"{key}-{name}"] = w
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], **found)
