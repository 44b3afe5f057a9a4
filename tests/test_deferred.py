"""Deferred stacks (dualmode.communication.totals.DeferredShares): in eager execution a
sharded op's output whose whole value is known (the grouped MatMul's pending sums, the
blocks of a known value, the replicas of a result computed once per replica set) is
written only when something reads it as a stack. Reading it gives exactly the stack
the op would have written; the readers that know the totals never write it; the
numbers and the CommReport of a train step do not depend on it."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dualmode import Parameter, Tensor, nn, ops
from dualmode._core import _tensor as _core
from dualmode.communication import totals as totals_mod
from dualmode.communication.totals import DeferredShares, known_totals
from dualmode.parallel import CommReport, TensorLayout
from dualmode.parallel import sharding
from dualmode.parallel.rules import contract as rules
from dualmode.parallel.auto_parallel import AutoParallel
from dualmode.communication import SimBackend
from dualmode.parallel.redistribution import execute, plan_redistribution, run_plan
from dualmode.parallel.redistribution import executor

from _steps import mean_square_step
from test_redistribute import check_result, layout_pairs

RNG = np.random.default_rng(11)
LR = 0.05


def _no_deferral(monkeypatch):
    for mod in (rules, sharding, executor):
        monkeypatch.setattr(mod, "deferral_on", lambda: False)


def test_a_deferred_matmul_output_reads_as_its_shares(eight, deferred_writes):
    writes = deferred_writes
    a = RNG.standard_normal((64, 1024)).astype(np.float32)  # large enough to be grouped
    w = RNG.standard_normal((1024, 32)).astype(np.float32)
    out = ops.MatMul().shard(((2, 4), (4, 1)))(Tensor(a), Tensor(w))
    assert out._lazy is not None
    assert out.dtype == np.float32 and out.shape == (64, 32)
    assert out._lazy is not None and writes == []           # described, not written
    twin = _core.detached(out)
    assert twin._lazy is out._lazy                          # the tape's copy stays deferred
    stack = out._data                                       # now written
    assert out._lazy is None and len(writes) == 1
    # device (i, j) holds a quarter of its row block's product (its share of the sum)
    for i in range(2):
        rows = (a[32 * i:32 * (i + 1)] @ w) / 4
        for j in range(4):
            np.testing.assert_allclose(stack[4 * i + j], rows, rtol=1e-5, atol=1e-5)
    assert known_totals(stack, (2, 4), (1,)) is not None    # the totals still known
    assert twin._data is stack and len(writes) == 1         # one write for both
    np.testing.assert_allclose(out.asnumpy(), a @ w, rtol=1e-5, atol=1e-5)


def test_asnumpy_of_a_deferred_output_reads_its_totals(eight, deferred_writes):
    a = RNG.standard_normal((64, 1024)).astype(np.float32)  # large enough to be grouped
    w = RNG.standard_normal((1024, 32)).astype(np.float32)
    out = ops.MatMul().shard(((2, 4), (4, 1)))(Tensor(a), Tensor(w))
    got = out.asnumpy()
    assert deferred_writes == [] and out._lazy is not None   # the shares never written
    np.testing.assert_allclose(got, a @ w, rtol=1e-5, atol=1e-5)
    got[...] = 0                                             # a copy: out keeps its value
    np.testing.assert_allclose(out.asnumpy(), a @ w, rtol=1e-5, atol=1e-5)


def test_a_deferred_stack_behaves_as_an_array():
    lay = TensorLayout((2, 4), ((0,), ()), (8, 6), partial=(1,))
    value = RNG.standard_normal((8, 6)).astype(np.float32)
    totals = lay.without_partial().local_blocks_grid(value)[:, :1]
    d = DeferredShares(np.ascontiguousarray(totals), (2, 4), (1,), 4)
    assert d.shape == (8, 4, 6) and d.dtype == np.float32 and d.ndim == 3
    assert d.nbytes == 8 * 4 * 6 * 4 and d.itemsize == 4 and len(d) == 8
    want = lay.without_partial().local_blocks(value) / np.float32(4)
    np.testing.assert_array_equal(np.asarray(d), want)
    assert np.asarray(d) is d.materialize()                 # written once
    np.testing.assert_array_equal(d[5], want[5])
    np.testing.assert_allclose(lay.assemble(d.materialize()), value, rtol=1e-6, atol=1e-6)
    assert known_totals(d, (2, 4), (1,)) is d.totals
    assert known_totals(d, (2, 4), (0,)) is None


def test_kernels_outside_eager_execution_write_their_stacks():
    """Graph mode keeps plain arrays: outside `DEFERRING` the grouped MatMul writes."""
    a = RNG.standard_normal((16, 24)).astype(np.float32)
    b = RNG.standard_normal((24, 8)).astype(np.float32)
    ga = TensorLayout((2, 4), ((0,), (1,)), a.shape).local_blocks_grid(a)
    gb = TensorLayout((2, 4), ((1,), ()), b.shape).local_blocks_grid(b)
    assert isinstance(rules.contract_groups(ga, gb, (2, 4), (1,)), np.ndarray)
    with totals_mod.DEFERRING:
        assert isinstance(rules.contract_groups(ga, gb, (2, 4), (1,)), DeferredShares)
    assert not totals_mod.deferral_on()


class _Net(nn.Cell):
    """The seed network's sharded layers: a MatMul whose contracted dim is split, a
    ReLU on a layout with replicas, a second split contraction, a ReLU on rows."""

    def __init__(self, w1, w2):
        super().__init__()
        self.w1, self.w2 = Parameter(Tensor(w1.copy())), Parameter(Tensor(w2.copy()))
        self.mm1 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu1 = ops.ReLU().shard(((4, 1),))
        self.mm2 = ops.MatMul().shard(((1, 8), (8, 1)))
        self.relu2 = ops.ReLU().shard(((8, 1),))

    def construct(self, x):
        return self.relu2(self.mm2(self.relu1(self.mm1(x, self.w1)), self.w2))


def _train_step(x, w1, w2, compiled=False, steps=1):
    net = _Net(w1, w2)
    step = mean_square_step(net, nn.SGD(net.trainable_params(), learning_rate=LR))
    if compiled:
        step = AutoParallel(step, parallel_mode="semi_auto")
    for _ in range(steps - 1):
        step(Tensor(x))
    with CommReport() as report:
        loss = step(Tensor(x))
    records = [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.reason)
               for r in report.records]
    return float(loss.asnumpy()), net.w1.asnumpy(), net.w2.asnumpy(), records


def _numpy_step(x, w1, w2):
    h = x @ w1
    a = np.maximum(h, 0)
    z = a @ w2
    y = np.maximum(z, 0)
    loss = np.mean(y * y)
    dz = (2 * y / y.size) * (z > 0)
    g2 = a.T @ dz
    dh = (dz @ w2.T) * (h > 0)
    g1 = x.T @ dh
    return loss, w1 - LR * g1, w2 - LR * g2


def test_a_train_step_writes_no_deferred_stack_and_equals_one_device(eight, monkeypatch,
                                                                      deferred_writes):
    x = RNG.standard_normal((64, 512)).astype(np.float32)    # 128 KiB: its value is kept
    w1 = (RNG.standard_normal((512, 64)) * 0.05).astype(np.float32)
    w2 = (RNG.standard_normal((64, 16)) * 0.05).astype(np.float32)
    writes = deferred_writes
    made = []
    real_init = DeferredShares.__init__

    def spy_init(self, *args):
        real_init(self, *args)
        made.append(self.shape)

    monkeypatch.setattr(DeferredShares, "__init__", spy_init)
    loss, n1, n2, _ = _train_step(x, w1, w2)
    assert len(made) >= 4 and writes == []      # described, never written
    ref_loss, r1, r2 = _numpy_step(x, w1, w2)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(n1, r1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(n2, r2, rtol=1e-5, atol=1e-6)


def test_a_compiled_train_step_writes_no_deferred_stack_and_equals_eager(eight,
                                                                         deferred_writes):
    """Graph mode: moves and the optimizer read deferred stacks; the compiled step
    (its second run, on the weights of the first) equals two eager steps, numbers and
    CommReport."""
    x = RNG.standard_normal((64, 512)).astype(np.float32)
    w1 = (RNG.standard_normal((512, 64)) * 0.05).astype(np.float32)
    w2 = (RNG.standard_normal((64, 16)) * 0.05).astype(np.float32)
    eager = _train_step(x, w1, w2, steps=2)
    deferred_writes.clear()
    compiled = _train_step(x, w1, w2, compiled=True, steps=2)
    assert deferred_writes == []
    assert compiled[3] == eager[3] and compiled[3]
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    np.testing.assert_allclose(compiled[1], eager[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compiled[2], eager[2], rtol=1e-5, atol=1e-6)
    _, r1, r2 = _numpy_step(x, w1, w2)
    _, r1, r2 = _numpy_step(x, r1, r2)
    np.testing.assert_allclose(compiled[1], r1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compiled[2], r2, rtol=1e-5, atol=1e-6)


def test_deferral_changes_neither_numbers_nor_the_comm_report(eight, monkeypatch):
    x = RNG.standard_normal((64, 512)).astype(np.float32)
    w1 = (RNG.standard_normal((512, 64)) * 0.05).astype(np.float32)
    w2 = (RNG.standard_normal((64, 16)) * 0.05).astype(np.float32)
    deferred = _train_step(x, w1, w2)
    _no_deferral(monkeypatch)
    written = _train_step(x, w1, w2)
    assert deferred[3] == written[3] and deferred[3]
    assert deferred[0] == pytest.approx(written[0], rel=1e-6)
    np.testing.assert_allclose(deferred[1], written[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(deferred[2], written[2], rtol=1e-6, atol=1e-7)


def test_reading_a_deferred_output_in_place_sees_one_stack(eight):
    """A deferred output read by a plain op (no fast path) is written once and used."""
    a = RNG.standard_normal((64, 1024)).astype(np.float32)
    w = RNG.standard_normal((1024, 32)).astype(np.float32)
    out = ops.MatMul().shard(((2, 4), (4, 1)))(Tensor(a), Tensor(w))
    assert out._lazy is not None
    doubled = out * 2                                        # linear in the pending sum
    np.testing.assert_allclose(doubled.asnumpy(), 2 * (a @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.exp(out * 0.01).asnumpy(), np.exp((a @ w) * 0.01),
                               rtol=1e-5, atol=1e-5)


def _deferred_of(src, g):
    """`src`'s stack of `g` as a DeferredShares: equal shares over its partial axes
    (the blocks themselves when it has none)."""
    dm_ = src.device_matrix
    totals = src.without_partial().local_blocks_grid(g)
    totals = np.ascontiguousarray(
        totals[tuple(slice(0, 1) if a in src.partial else slice(None)
                     for a in range(len(dm_)))])
    parts = int(np.prod([dm_[a] for a in src.partial]))
    return DeferredShares(totals, dm_, src.partial, parts)


def _records(rep):
    return [(r.kind, r.group_size, r.num_groups, r.bytes_per_device, r.op, r.reason)
            for r in rep.records]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_property_a_deferred_source_redistributes_as_its_written_stack(pair):
    """Any redistribution of a deferred stack (read through its totals, the result
    itself left deferred where it would be a copy) gives the numbers and CommReport of
    the same plan run on the written stack, step by step."""
    src, dst = pair
    g = np.random.default_rng(2).standard_normal(src.shape)
    d = _deferred_of(src, g)
    written = d.materialize().copy()                     # an array nobody remembers
    check_result(written, src, g)                        # the shares add up to g
    d = _deferred_of(src, g)                             # a fresh, unwritten one
    plan = plan_redistribution(src, dst, written.itemsize)
    with CommReport() as rep_steps:
        want = run_plan(plan, written, SimBackend(src.device_num), op_name="P")
    with CommReport() as rep_deferred, totals_mod.DEFERRING:
        got = execute(plan, d, SimBackend(src.device_num), op_name="P")
    assert _records(rep_deferred) == _records(rep_steps)
    got = totals_mod.as_stack(got)
    assert got.shape == want.shape
    check_result(got, dst, g)
    if not dst.partial:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
