"""Run under ``mpiexec -n 4``: the gradient entering a GRAPH_MODE Cell is gathered over the
same (smallest) groups of devices under "mpi" as under "sim", and CommReport lists the
same collectives.

semi_auto_parallel on 4 devices: a Cell holding ``Softmax(axis=1).shard(((1, 4),))``,
whose output goes through ``Square().shard(((1, 2),))`` outside it (eager), times a
constant, summed. The gradient of the Square's input is split in 2 along dim 1 and
replicated on the other 2 devices; the Cell wants it whole, which is an AllGather
within each of the 2 groups of 2 devices (never one over all 4).

Every rank runs the program on the MPI world, then on 4 simulated devices in this
process, and compares the loss, the input gradient and the CommReport entries (kind,
op, reason, group size, groups, bytes per device); rank 0 writes them to OUT.npz:
``python user_coll_boundary_grad.py OUT.npz``.
"""
import sys

import numpy as np

import dualmode as dm
from dualmode import Tensor, communication, nn, ops

X = np.random.default_rng(10).standard_normal((8, 32)).astype(np.float32)
C = np.random.default_rng(11).standard_normal((8, 32)).astype(np.float32)


class Inner(nn.Cell):
    def __init__(self):
        super().__init__()
        self.softmax = ops.Softmax(axis=1).shard(((1, 4),))

    def construct(self, x):
        return self.softmax(x)


def run(backend):
    """(loss, input gradient, CommReport entries) on `backend` (None: mpi)."""
    dm.reset_auto_parallel_context()
    dm.set_context(mode=dm.GRAPH_MODE)
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4)
    communication.init(backend)
    inner = Inner()
    square = ops.Square().shard(((1, 2),))
    coef = Tensor(C)

    def loss(x):
        return ops.reduce_sum(square(inner(x)) * coef)

    try:
        with dm.parallel.CommReport() as rep:
            value, grad = dm.value_and_grad(loss)(Tensor(X))
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
    entries = [(r.kind, r.op, r.reason, r.group_size, r.num_groups, r.bytes_per_device)
               for r in rep.records]
    return float(value.asnumpy()), grad.asnumpy(), entries


def reference():
    """The single device in numpy: loss and input gradient."""
    e = np.exp(X - X.max(1, keepdims=True))
    s = e / e.sum(1, keepdims=True)
    ds = 2 * s * C
    return float((s * s * C).sum()), s * (ds - (ds * s).sum(1, keepdims=True))


def main():
    out = sys.argv[1]
    got = run(None)
    assert communication.get_backend().name == "mpi"
    rank = communication.get_rank()
    want = run("sim")
    assert got[2] == want[2], f"rank {rank}: CommReport under mpi {got[2]}, under sim {want[2]}"
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"rank {rank} loss")
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7,
                               err_msg=f"rank {rank} gradient")
    if rank == 0:
        entries = np.array([tuple(str(v) for v in e) for e in got[2]])
        np.savez(out, loss=got[0], grad=got[1], entries=entries)


if __name__ == "__main__":
    main()
