"""Eager updates of weights stored sharded (``parameter_plan`` of an ``ops.shard`` block
differentiated by eager code): each gradient arrives pending over every rank and the
optimizer reduce-scatters it into its weight's layout, one by one or in one fused
bucket (``comm_fusion["reducescatter"]``). Run under mpiexec with backend "mpi" (the
fused ReduceScatter goes through the generic packed implementation of Backend), or
in-process stand-alone (tests/test_eager_fusion.py compares the two)."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport

STEPS = 3
FUSIONS = [None, {"reducescatter": {"mode": "auto"}}]


class Net(nn.Cell):
    def __init__(self, n):
        super().__init__()
        rng = np.random.default_rng(5)
        self.w0 = Parameter(Tensor(rng.standard_normal((16, 32)).astype(np.float32) * 0.3),
                            name="w0")
        self.w1 = Parameter(Tensor(rng.standard_normal((32, 8)).astype(np.float32) * 0.3),
                            name="w1")
        self.mm0, self.mm1 = ops.MatMul(), ops.MatMul()
        if n:
            self.mm0.shard(((n, 1), (1, 1)))
            self.mm1.shard(((n, 1), (1, 1)))

    def construct(self, x):
        return self.mm1(ops.tanh(self.mm0(x, self.w0)), self.w1)


def train(fusion=None, mpi=True):
    """(losses, weights, gradient ReduceScatters of the last update) on every rank of
    the MPI world (`mpi`), or stand-alone."""
    dm.reset_auto_parallel_context()
    n = None
    if mpi:
        communication.init("mpi")
        n = communication.get_group_size()
        dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n,
                                     gradients_mean=True)
        if fusion is not None:
            dm.set_auto_parallel_context(comm_fusion=fusion)
    else:
        communication.init("sim")
    net = Net(n)
    f = ops.shard(net, in_strategy=((n, 1),), parameter_plan={"w0": (n, 1), "w1": (1, n)}) \
        if n else net
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(f(x))), None,
                                opt.parameters)
    rng = np.random.default_rng(9)
    losses, count = [], 0
    for _ in range(STEPS):
        x = Tensor(rng.standard_normal((8, 16)).astype(np.float32))
        loss, grads = grad_fn(x)
        with CommReport() as rep:
            opt(grads)
        losses.append(float(loss.asnumpy()))
        count = rep.count("ReduceScatter", "gradient")
    return np.array(losses), [p.asnumpy() for p in net.trainable_params()], count


if __name__ == "__main__":
    out = {}
    for k, fusion in enumerate(FUSIONS):
        losses, weights, count = train(fusion)
        out[f"losses{k}"] = losses
        out[f"count{k}"] = np.array(count)
        for i, w in enumerate(weights):
            out[f"w{k}_{i}"] = w
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], **out)
