"""Train steps of weights stored sharded (``parameter_plan``) and read whole, fused per
``comm_fusion`` or not, in one of two modes:

* "compiled": the whole step under ``ops.shard`` (parameter AllGathers and gradient
  ReduceScatters in the graph, fused as configured);
* "eager": an ``ops.shard`` block differentiated by eager code, so each gradient arrives
  pending over every rank and the eager optimizer reduce-scatters it into its weight's
  layout, one by one or in one fused bucket.

Run under mpiexec with backend "mpi" (fused collectives go through the generic packed
implementation of Backend): ``fusion_step.py OUT.npz MODE``; or in-process stand-alone
(tests/test_graph_fusion_collectives.py and tests/test_eager_fusion.py compare the two)."""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport

STEPS = 3
FUSIONS = {"compiled": [None, {"allgather": {"mode": "auto"},
                               "reducescatter": {"mode": "auto"}}],
           "eager": [None, {"reducescatter": {"mode": "auto"}}]}


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


def train(mode, fusion=None, mpi=True):
    """(losses, weights, (AllGathers, ReduceScatters) of the last step -- of its update
    alone in "eager" mode) on every rank of the MPI world (`mpi`), or stand-alone."""
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
    plan = {"w0": (n, 1), "w1": (1, n)}
    f = ops.shard(net, in_strategy=((n, 1),), parameter_plan=plan) \
        if n and mode == "eager" else net
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    grad_fn = dm.value_and_grad(lambda x: ops.reduce_mean(ops.square(f(x))), None,
                                opt.parameters)

    def step(x):
        loss, grads = grad_fn(x)
        if mode == "eager":
            with CommReport() as rep:          # the update's collectives alone
                opt(grads)
            return loss, rep
        opt(grads)
        return loss

    if n and mode == "compiled":
        step = ops.shard(step, in_strategy=((n, 1),), parameter_plan=plan)
    rng = np.random.default_rng(9)
    losses = []
    for _ in range(STEPS):
        x = Tensor(rng.standard_normal((8, 16)).astype(np.float32))
        if mode == "eager":
            loss, rep = step(x)
        else:
            with CommReport() as rep:
                loss = step(x)
        losses.append(float(loss.asnumpy()))
    counts = (rep.count("AllGather"), rep.count("ReduceScatter"))
    return np.array(losses), [p.asnumpy() for p in net.trainable_params()], counts


if __name__ == "__main__":
    mode = sys.argv[2]
    out = {}
    for k, fusion in enumerate(FUSIONS[mode]):
        losses, weights, counts = train(mode, fusion)
        out[f"losses{k}"] = losses
        out[f"counts{k}"] = np.array(counts)
        for i, w in enumerate(weights):
            out[f"w{k}_{i}"] = w
    if communication.get_rank() == 0:
        np.savez(sys.argv[1], **out)
