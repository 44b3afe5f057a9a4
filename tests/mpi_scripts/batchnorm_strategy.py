"""Run under ``mpiexec -n 4``: ``ops.BatchNorm`` with strategies on the batch, batch and
channels, and H/W (one device per process: the statistics' AllReduce inside the op goes
through MPI) trains, in PyNative and GRAPH_MODE, like the stand-alone run in the same
process: losses, input gradients, gamma, beta and the running statistics. Rank 0 prints
"batchnorm ok: <count> checks"."""
import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport

N, C = 4, 4
CHECKS = [0]
STRATEGIES = [((4, 1, 1, 1), (1,), (1,), (1,), (1,)),
              ((2, 2, 1, 1), (2,), (2,), (2,), (2,)),
              ((1, 1, 2, 2), (1,), (1,), (1,), (1,))]


def _ctx(mode, **kw):
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode=mode, device_num=N, **kw)
    communication.init()


def _close(what, got, want, rtol=1e-4):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6,
                               err_msg=f"rank {communication.get_rank()}: {what}")
    CHECKS[0] += 1


class Net(nn.Cell):
    def __init__(self, training, strategy):
        super().__init__()
        rng = np.random.default_rng(3)
        self.bn = ops.BatchNorm(training, 1e-5, 0.1)
        if strategy is not None:
            self.bn.shard(strategy)
        self.gamma = Parameter(Tensor(rng.uniform(0.5, 1.5, C).astype(np.float32)), name="gamma")
        self.beta = Parameter(Tensor(rng.uniform(-1, 1, C).astype(np.float32)), name="beta")
        self.moving_mean = Parameter(Tensor(rng.normal(size=C).astype(np.float32)),
                                     name="moving_mean", requires_grad=False)
        self.moving_variance = Parameter(Tensor(rng.uniform(0.5, 2, C).astype(np.float32)),
                                         name="moving_variance", requires_grad=False)
        self.w = Tensor(rng.normal(size=(4, C, 4, 4)).astype(np.float32))

    def construct(self, x):
        y = self.bn(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)[0]
        return ops.reduce_mean(ops.mul(ops.square(y), self.w))


def run(training, strategy, mode):
    x = np.random.default_rng(0).normal(1.0, 2.0, (4, C, 4, 4)).astype(np.float32)
    dm.set_context(mode=mode)
    net = Net(training, strategy)
    opt = nn.SGD(net.trainable_params(), 0.1)
    g = dm.value_and_grad(net, 0, opt.parameters)
    out = []
    with CommReport() as rep:
        for _ in range(2):
            loss, (dx, grads) = g(Tensor(x))
            opt(grads)
            out += [loss.asnumpy(), dx.asnumpy()]
    dm.set_context(mode=dm.PYNATIVE_MODE)
    return out + [p.asnumpy() for p in net.get_parameters()], rep


def main():
    communication.init()
    assert communication.get_backend().name == "mpi"
    for training in (True, False):
        _ctx("stand_alone")
        ref, _ = run(training, None, dm.PYNATIVE_MODE)
        for strategy in STRATEGIES:
            for mode in (dm.PYNATIVE_MODE, dm.GRAPH_MODE):
                _ctx("semi_auto_parallel", full_batch=True)
                got, rep = run(training, strategy, mode)
                for k, (a, b) in enumerate(zip(got, ref)):
                    _close(f"training={training} {strategy} mode {mode} value {k}", a, b)
                fwd = [r for r in rep.records if r.op == "BatchNorm" and r.kind == "AllReduce"
                       and r.reason == "forward"]
                assert len(fwd) == (2 if training else 0), (training, strategy, rep)
    if communication.get_rank() == 0:
        print(f"batchnorm ok: {CHECKS[0]} checks", flush=True)


if __name__ == "__main__":
    main()
