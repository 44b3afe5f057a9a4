"""CommReport lists the collective that resolves a pending sum under the op whose
strategy made the sum (the MatMul that split its contracted dim), with the op where it
was resolved as ``resolved_by``: in PyNative mode, in GRAPH_MODE (and its per-op
predicted times), and equally on backend "mpi" (tests/mpi_scripts/report_pending_sums.py).

Hand-computed bytes: MatMul((2, 4), (4, 1)) on 8 devices of a (16, 32) x (32, 8)
product leaves a (16, 8) float32 output split in 2 on rows and pending over the 4
devices that split the contracted dim: 8 x 8 x 4 = 256 B per device. Its AllReduce over
groups of 4 moves 2 (4-1)/4 x 256 = 384 B per device, its ReduceScatter (4-1)/4 x 256 =
192 B."""
import json

import numpy as np
import pytest

import dualmode as dm
from dualmode import Parameter, Tensor, communication, nn, ops
from dualmode.parallel import CommReport, compiled_comm_times

from _devices import devices
from _mpi import load_mpi_script, run_mpi_script

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 32)).astype(np.float32)
W = RNG.standard_normal((32, 8)).astype(np.float32)
Y = RNG.standard_normal((16, 8, 4)).astype(np.float32)

# (kind, group size, groups, bytes per device, op, resolved_by, reason), by hand
RELU = [("AllReduce", 4, 2, 384.0, "MatMul", "ReLU", "forward")]
SPLIT = [("ReduceScatter", 4, 2, 192.0, "MatMul", "ReLU", "redistribution")]
EXPECTED = {"relu": RELU, "split": SPLIT, "chain": RELU}


def _rows(rep):
    return [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.op, r.resolved_by,
             r.reason) for r in rep.records]


class Net(nn.Cell):
    """MatMul((2, 4), (4, 1)) then an op that needs the sum: ReLU at once ("relu"), a
    ReLU that wants the result split as the MatMul's output rows and columns ("split":
    a ReduceScatter), or ReLU after Mul, Reshape and Transpose, which keep the sum
    pending ("chain")."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.w = Parameter(Tensor(W), name="w")
        self.mm = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU().shard(((2, 4),)) if case == "split" else ops.ReLU()

    def construct(self, x):
        h = self.mm(x, self.w)
        if self.case == "chain":
            h = ops.Transpose()(ops.Reshape()(h * 2.0, (8, 16)), (1, 0))
        return self.relu(h)


def _expected(case):
    h = X @ W
    if case == "chain":
        h = (h * 2.0).reshape(8, 16).T
    return np.maximum(h, 0)


def _run(case, mode):
    """The output and CommReport of the second call of Net(case) on 8 devices, the
    input whole on every device (full_batch: it is sliced locally, no collective)."""
    with devices(8, full_batch=True):
        dm.set_context(mode=dm.GRAPH_MODE if mode == "graph" else dm.PYNATIVE_MODE)
        net = Net(case)
        net(Tensor(X))                                    # compiles in GRAPH_MODE
        with CommReport() as rep:
            out = net(Tensor(X)).asnumpy()
    return out, rep


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("case", ["relu", "split", "chain"])
def test_the_resolution_is_listed_under_the_matmul_resolved_by_its_consumer(case, mode):
    out, rep = _run(case, mode)
    np.testing.assert_allclose(out, _expected(case), rtol=1e-5, atol=1e-5)
    assert _rows(rep) == EXPECTED[case]
    kind = EXPECTED[case][0][0]
    assert rep.count(op="MatMul") == 1 and rep.count(kind, op="MatMul") == 1
    assert rep.count(op="ReLU") == 0                    # the consumer is charged nothing
    assert rep.count(resolved_by="ReLU") == 1
    assert rep.bytes(op="MatMul") == rep.bytes() == EXPECTED[case][0][3]
    assert rep.bytes(kind, EXPECTED[case][0][6], op="MatMul", resolved_by="ReLU") == \
        EXPECTED[case][0][3]
    assert rep.bytes(op="MatMul", resolved_by="Mul") == 0.0


@pytest.mark.parametrize("case", ["relu", "split"])
def test_plain_ops_in_pynative_mode(case):
    with devices(8):
        mm = ops.MatMul().shard(((2, 4), (4, 1)))
        relu = ops.ReLU().shard(((2, 4),)) if case == "split" else ops.ReLU()
        with CommReport() as rep:
            out = relu(mm(Tensor(X), Tensor(W))).asnumpy()
    np.testing.assert_allclose(out, _expected(case), rtol=1e-5, atol=1e-5)
    assert _rows(rep) == EXPECTED[case]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_each_sum_names_its_own_maker_through_the_same_linear_ops(mode):
    # a ReduceSum over a split dim leaves a sum in the same layout as the MatMul's;
    # both go through Mul (whose plan for that layout is cached by the first call)
    # and are resolved by ReLU: each AllReduce names the op that made its sum
    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm = ops.MatMul().shard(((2, 4), (4, 1)))
            self.rs = ops.ReduceSum().shard(((2, 1, 4),))

        def construct(self, x, w, y):
            a = ops.ReLU()(self.mm(x, w) * 2.0)
            b = ops.ReLU()(self.rs(y, 2) * 2.0)
            return a, b

    with devices(8, full_batch=True):
        dm.set_context(mode=dm.GRAPH_MODE if mode == "graph" else dm.PYNATIVE_MODE)
        net = Two()
        args = (Tensor(X), Tensor(W), Tensor(Y))
        net(*args)
        with CommReport() as rep:
            a, b = net(*args)
            a, b = a.asnumpy(), b.asnumpy()
    np.testing.assert_allclose(a, np.maximum(X @ W * 2, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b, np.maximum(Y.sum(2) * 2, 0), rtol=1e-5, atol=1e-5)
    assert sorted(_rows(rep)) == sorted(
        [RELU[0], ("AllReduce", 4, 2, 384.0, "ReduceSum", "ReLU", "forward")])


def test_the_table_shows_the_resolving_op_beside_the_maker():
    _, rep = _run("relu", "eager")
    lines = str(rep).splitlines()
    head = next(line for line in lines if line.lstrip().startswith("#"))
    assert head.split()[:5] == ["#", "kind", "op", "resolved", "by"]
    row = next(line for line in lines if line.lstrip().startswith("0 "))
    assert row.split()[:6] == ["0", "AllReduce", "MatMul", "ReLU", "forward", "2"]
    # the byte column of the totals line sits under the header's
    total = next(line for line in lines if "call(s)" in line)
    assert total.rstrip().endswith("384 B") and \
        len(total.rstrip()) == len(head.rstrip()) == len(row.rstrip())
    # a collective that resolves nothing shows "-" there
    with devices(8):
        with CommReport() as rep2:
            ops.AllGather()(Tensor(np.ones((8, 2), np.float32)))
    assert rep2.records and all(r.resolved_by is None for r in rep2.records)
    assert str(rep2).splitlines()[3].split()[3] == "-"


def test_filters_reject_a_bad_op_by_name():
    rep = CommReport()
    with pytest.raises(TypeError, match=r"CommReport.count: op=3 has type int; expected None "
                                        r"or an op's name such as 'MatMul'"):
        rep.count(op=3)
    with pytest.raises(TypeError, match=r"CommReport.bytes: resolved_by=\('ReLU',\) has type "
                                        r"tuple"):
        rep.bytes(resolved_by=("ReLU",))


def test_compiled_times_per_op_count_the_resolution_for_the_matmul():
    with devices(8, full_batch=True):
        f = ops.shard(lambda x, w: ops.relu(ops.matmul(x, w) * 2.0),
                      in_strategy=((2, 4), (4, 1)))
        f(Tensor(X), Tensor(W))
        with CommReport(link="10GbE") as rep:
            f(Tensor(X), Tensor(W))
        per_op = compiled_comm_times(f, link="10GbE")
    assert [r.op for r in rep.records] == ["MatMul"]
    assert list(per_op) == ["MatMul-0"]
    (kind, p, n, t), = per_op["MatMul-0"]["collectives"]
    assert (kind, p) == (rep.records[0].kind, rep.records[0].group_size)
    assert t == pytest.approx(rep.predicted_time(op="MatMul"), rel=1e-12)


def test_records_under_mpi_equal_the_simulated_ones(tmp_path):
    out = tmp_path / "records.json"
    proc = run_mpi_script("report_pending_sums.py", [out], tmp_path, ranks=4, timeout=180)
    assert "report ok: 6 cases" in proc.stdout
    got = json.loads(out.read_text())
    mod = load_mpi_script("report_pending_sums.py")
    try:
        want = mod.all_records("sim")
    finally:
        dm.reset_auto_parallel_context()
        communication.init("sim")
    assert got == {k: [list(r) for r in v] for k, v in want.items()}
    # by hand on 4 devices, (2, 2): a (8, 8) float32 block per device, groups of 2
    for key, rows in want.items():
        resolving = [r for r in rows if r[5] is not None]
        kind = "ReduceScatter" if key.startswith("split") else "AllReduce"
        assert resolving == [(kind, 2, 2, 128.0 if kind == "ReduceScatter" else 256.0,
                              "MatMul", "ReLU",
                              "redistribution" if kind == "ReduceScatter" else "forward")]
