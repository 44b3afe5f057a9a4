"""Run under ``mpiexec -n N``: the user-facing collectives (``ops.AllReduce`` & co.) and a
hybrid-parallel network give the same numbers under backend "mpi" as under "sim" with N
devices, forward and backward.

Every rank runs the same program twice, first on the MPI world (one device per rank),
then in the same process on N simulated devices, and compares every value read with
``asnumpy()`` (for device-local values the stack of every device's value). Inputs: a
batch-split network input (device d contributes its rows), a replicated value and a
``layerwise_parallel`` weight given per-device slices. Groups: the world and a
``create_group`` group of every device in another order (and, for AllReduce and
Broadcast, a group of some devices). A mismatch raises, which aborts the job. Rank 0
prints "user collectives ok: <count> checks on <N> ranks".
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import set_layerwise_slices

N = int(sys.argv[1])


def _setup(backend):
    dm.reset_auto_parallel_context()
    dm.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=N)
    communication.init(backend)
    communication.create_group("reversed", list(range(N))[::-1])
    communication.create_group("some", [0, N - 1])


def _f32(seed, *shape):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)


class Wrap(nn.Cell):
    """prim applied to the network input (batch-split: device d contributes its rows)
    times a layerwise weight (device d's own slice) plus a replicated bias."""

    def __init__(self, prim):
        super().__init__()
        self.prim = prim
        self.w = Parameter(Tensor(np.ones((1, 6), np.float32)), name="w",
                           layerwise_parallel=True)
        self.b = Parameter(Tensor(_f32(3, 6)), name="b")

    def construct(self, x):
        return self.prim(x * self.w + self.b)


def _prims():
    out = []
    for group in ("hccl_world_group", "reversed"):
        for op in ("sum", "max", "min", "prod", "mean"):
            out.append((f"AllReduce({op}, {group})", lambda g=group, o=op: ops.AllReduce(o, g)))
        out.append((f"AllGather({group})", lambda g=group: ops.AllGather(g)))
        out.append((f"ReduceScatter({group})", lambda g=group: ops.ReduceScatter("sum", g)))
        out.append((f"Broadcast({group})", lambda g=group: ops.Broadcast(1, g)))
        out.append((f"AlltoAll({group})", lambda g=group: ops.AlltoAll(N, 0, 1, g)))
    out.append(("AllReduce(sum, some)", lambda: ops.AllReduce("sum", "some")))
    out.append(("AllReduce(max, some)", lambda: ops.AllReduce("max", "some")))
    out.append(("Broadcast(some)", lambda: ops.Broadcast(1, "some")))
    return out


def collectives(backend):
    _setup(backend)
    x = _f32(1, 2 * N, 6)
    slices = _f32(2, 1, 6 * N)
    res = {}
    for name, make in _prims():
        net = Wrap(make())
        set_layerwise_slices(net.w, slices, dim=1)
        params = net.trainable_params()
        res[name] = net(Tensor(x)).asnumpy()
        coef = _f32(4, *res[name].shape[-2:])

        def loss(inp):
            return ops.reduce_sum(net(inp) * Tensor(coef))

        _, (gx, (gw, gb)) = dm.value_and_grad(loss, 0, params)(Tensor(x))
        res[name + " dx"] = gx.asnumpy()
        res[name + " dw"] = gw.asnumpy()
        res[name + " db"] = gb.asnumpy()
    return res


class HybridParallelNet(nn.Cell):
    """Seed 004's network: a column-sliced layerwise weight, per-device MatMul and
    ReduceSum, the user's AllReduce of the partial sums."""

    def __init__(self, cols):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((16, cols), np.float32)), name="weight",
                                layerwise_parallel=True)
        self.scale = Parameter(Tensor(np.float32(1.5)), name="scale")
        self.fc = ops.MatMul()
        self.reduce = ops.ReduceSum()
        self.allreduce = ops.AllReduce(op="sum")

    def construct(self, x):
        return self.allreduce(self.reduce(self.fc(x, self.weight) * self.scale, -1))


def hybrid(backend):
    _setup(backend)
    dm.set_auto_parallel_context(gradients_mean=True, dataset_strategy="full_batch")
    W, x = _f32(5, 16, 4 * N), _f32(6, 6, 16)
    net = HybridParallelNet(4)
    set_layerwise_slices(net.weight, W, dim=1)
    params = net.trainable_params()
    opt = nn.Momentum(params, learning_rate=0.001, momentum=0.9)
    res = {}

    def loss(inp):
        return ops.reduce_sum(ops.square(net(inp)))

    for step in range(3):
        value, grads = dm.value_and_grad(loss, None, params)(Tensor(x))
        res[f"loss {step}"] = value.asnumpy()
        res[f"dweight {step}"] = grads[0].asnumpy()
        opt(grads)
    res["weight"] = net.weight.asnumpy()
    res["scale"] = net.scale.asnumpy()
    return res


def main():
    checks = 0
    rank = None
    # one op: rtol 1e-5; the hybrid program is a training run (3 steps) whose AllReduce of
    # float partial sums MPI adds in another order than sim: rtol 1e-4 (SPEC §1)
    for program, rtol in ((collectives, 1e-5), (hybrid, 1e-4)):
        got = program(None)
        rank = communication.get_rank()
        assert communication.get_backend().name == "mpi"
        want = program("sim")
        assert list(got) == list(want)
        for key in want:
            g, w = np.asarray(got[key]), np.asarray(want[key])
            if g.shape != w.shape:
                raise AssertionError(f"rank {rank}: {program.__name__} {key}: shape {g.shape} "
                                     f"under mpi, {w.shape} under sim")
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6,
                                       err_msg=f"rank {rank}: {program.__name__} {key}")
            checks += 1
    if rank == 0:
        print(f"user collectives ok: {checks} checks on {N} ranks", flush=True)


main()
