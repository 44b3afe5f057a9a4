"""Where CommReport lists the collective resolving a pending sum, on backend "mpi"
(run under ``mpiexec -n 4``) or "sim" (imported, in-process): a MatMul whose strategy
splits the contracted dim, then an op that needs the sum, in PyNative and GRAPH_MODE.

    mpiexec -n 4 python report_pending_sums.py OUT.json

Every rank checks the output against numpy; rank 0 writes the records of every case to
OUT.json (tests/test_report_pending_sums.py compares them with the "sim" backend's)."""
import json
import sys

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport

N = 4
CASES = ("relu", "split", "chain")
MODES = ("eager", "graph")


class Net(nn.Cell):
    """MatMul((2, 2), (2, 1)) leaves sums pending over the 2 devices that split the
    contracted dim; "relu" resolves them at once, "split" wants the result split (a
    ReduceScatter), "chain" keeps them through Mul, Reshape and Transpose first."""

    def __init__(self, case, w):
        super().__init__()
        self.case = case
        self.w = Parameter(Tensor(w), name="w")
        self.mm = ops.MatMul().shard(((2, 2), (2, 1)))
        self.relu = ops.ReLU().shard(((2, 2),)) if case == "split" else ops.ReLU()

    def construct(self, x):
        h = self.mm(x, self.w)
        if self.case == "chain":
            h = ops.Transpose()(ops.Reshape()(h * 2.0, (8, 16)), (1, 0))
        return self.relu(h)


def expected(case, x, w):
    h = x @ w
    if case == "chain":
        h = (h * 2.0).reshape(8, 16).T
    return np.maximum(h, 0)


def run(case, mode, backend):
    """The output and the records ``(kind, group size, groups, bytes per device, op,
    resolved_by, reason)`` of the second call (the first compiles in GRAPH_MODE)."""
    dm.reset_auto_parallel_context()
    communication.init(backend)
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=N)
    communication.init(backend)
    dm.set_context(mode=dm.GRAPH_MODE if mode == "graph" else dm.PYNATIVE_MODE)
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 32)).astype(np.float32)
        w = rng.standard_normal((32, 8)).astype(np.float32)
        net = Net(case, w)
        net(Tensor(x))
        with CommReport() as rep:
            out = net(Tensor(x)).asnumpy()
        np.testing.assert_allclose(out, expected(case, x, w), rtol=1e-5, atol=1e-5)
        return [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.op, r.resolved_by,
                 r.reason) for r in rep.records]
    finally:
        dm.set_context(mode=dm.PYNATIVE_MODE)
        dm.reset_auto_parallel_context()


def all_records(backend):
    return {f"{case}/{mode}": run(case, mode, backend) for case in CASES for mode in MODES}


if __name__ == "__main__":
    found = all_records("mpi")
    assert communication.get_backend().name == "mpi"
    if communication.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(found, f)
        print(f"report ok: {len(found)} cases")
