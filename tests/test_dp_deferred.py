"""Data-parallel gradients left unwritten (dualmode.parallel.dtensor._stored): an eager
op that sums over the batch computes its total once and, for 64 KiB or more, keeps it as
a deferred stack of n equal shares (totals.DeferredShares); the sim fused AllReduce of
the gradients reads the known total without writing the shares, records the same
collective, and the step equals the single-device step. Also the shares' arithmetic
(communication.sim.share_of): exactly ``total / n``.

Oracles: the single-device run of the same program, numpy's quotient, the shares
written out and reduced by numpy, and the CommReport of the same collectives on written
stacks."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, nn
from dualmode.communication import SimBackend
from dualmode.communication.sim import equal_shares, share_of
from dualmode.communication.totals import DeferredShares
from dualmode.parallel import CommReport, dtensor

from _devices import set_devices

N = 8


def _setup(devices):
    set_devices(devices if devices > 1 else None, "data_parallel", gradients_mean=True)


# ------------------------------------------------------------------ share_of

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [2, 3, 6, 8, 64, 4096])
def test_share_of_is_the_quotient_bit_for_bit(dtype, n):
    rng = np.random.default_rng(n)
    info = np.finfo(dtype)
    # magnitudes over the whole range, down to subnormal results, and special values
    mags = np.exp2(rng.uniform(np.log2(info.smallest_subnormal), np.log2(info.max), 4000))
    total = (rng.choice([-1.0, 1.0], 4000) * mags).astype(dtype)
    total = np.concatenate([total, np.array([0.0, -0.0, np.inf, -np.inf, info.tiny,
                                             info.smallest_subnormal * 3], dtype)])
    got = share_of(total, n)
    want = np.true_divide(total, n, dtype=dtype)
    assert got.dtype == dtype and got is not total
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    np.testing.assert_array_equal(got.view(uint), want.view(uint))


def test_the_quotient_check_sees_a_rounded_reciprocal():
    # the comparison above would fail for a multiplication by an inexact 1 / n
    total = np.random.default_rng(0).standard_normal(4000).astype(np.float32)
    assert not np.array_equal(total * np.float32(1 / 3), np.true_divide(total, 3,
                                                                        dtype=np.float32))


# ------------------------------------------------------------- sim AllReduce

def _deferred(total, n=N):
    return DeferredShares(total[None], (n,), (0,), n)


def _records(report):
    return [(r.kind, r.group_size, r.num_groups, r.bytes_per_device) for r in report.records]


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_fused_all_reduce_reads_a_deferred_total_without_writing(op, deferred_writes):
    rng = np.random.default_rng(1)
    b = SimBackend(N)
    total = rng.standard_normal((300, 70)).astype(np.float32)
    other = rng.standard_normal((40,)).astype(np.float32)
    plain = rng.standard_normal((N, 50)).astype(np.float32)
    lazy = _deferred(total)
    with CommReport() as fast:
        out = b.all_reduce_fused([lazy, equal_shares(other, N), plain], None, op)
    assert deferred_writes == []
    want = total if op == "sum" else np.true_divide(total, N, dtype=np.float32)
    for d in range(N):
        np.testing.assert_array_equal(out[0][d], want)
    # the same collective on the written stacks: same numbers, same record
    with CommReport() as written:
        ref = b.all_reduce_fused([np.array(lazy.materialize()), np.array(equal_shares(
            other, N)), plain], None, op)
    assert _records(fast) == _records(written) and len(fast.records) == 1
    for o, r in zip(out, ref):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)


def test_groups_other_than_the_world_add_the_written_shares():
    b = SimBackend(N)
    total = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    lazy = _deferred(total)
    members = np.arange(N).reshape(2, N // 2)
    out = b.all_reduce_fused([lazy], members, "sum")[0]
    written = np.asarray(lazy.materialize())
    np.testing.assert_allclose(out, np.broadcast_to(written[:N // 2].sum(0), out.shape),
                               rtol=1e-6, atol=1e-6)


def test_a_backend_that_does_not_read_deferred_stacks_gets_them_written(deferred_writes):
    b = SimBackend(N)
    b.reads_deferred = False
    total = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    out = b.all_reduce_fused([_deferred(total)], None, "sum")[0]
    assert deferred_writes == [(N, 64, 32)]
    np.testing.assert_allclose(out[0], total, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------- a data-parallel step

class Wide(nn.Cell):
    """Weights of 128 KiB and 8 KiB: the first one's gradient is deferred."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(256, 128)
        self.fc2 = nn.Dense(128, 16)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def _step(devices, steps=2):
    _setup(devices)
    rng = np.random.default_rng(4)
    net = Wide()
    for p in net.trainable_params():
        p.set_data((rng.standard_normal(p.shape) * 0.05).astype(np.float32))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = dm.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses, lazy = [], []
    with CommReport() as report:
        for _ in range(steps):
            x = rng.standard_normal((64, 256)).astype(np.float32)
            y = rng.integers(0, 16, 64).astype(np.int32)
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            lazy.append([g._lazy is not None for g in grads])
            opt(grads)
            losses.append(float(loss.asnumpy()))
    return losses, [p.asnumpy() for p in net.trainable_params()], _records(report), lazy


def test_a_data_parallel_step_writes_no_gradient_and_equals_one_device(deferred_writes):
    try:
        losses, weights, _, lazy = _step(N)
        assert deferred_writes == []
        # the 128 x 256 weight's gradient (128 KiB) is deferred, the small ones written
        assert all(flags == [True, False, False, False] for flags in lazy)
        ref_losses, ref_weights, _, _ = _step(1)
    finally:
        _setup(1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for w, r in zip(weights, ref_weights):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)


def test_deferral_changes_neither_numbers_nor_the_comm_report(monkeypatch):
    try:
        deferred = _step(N)
        monkeypatch.setattr(dtensor.dist_apply, "defer_bytes", 1 << 62)     # every gradient written
        written = _step(N)
    finally:
        _setup(1)
    assert written[3][0] == [False] * 4 and deferred[3][0][0]
    assert deferred[2] == written[2] and len(deferred[2]) == 2 * 4   # one per gradient
    np.testing.assert_array_equal(deferred[0], written[0])
    for a, b in zip(deferred[1], written[1]):
        np.testing.assert_array_equal(a, b)


def _grads(devices):
    _setup(devices)
    rng = np.random.default_rng(6)
    net = Wide()
    for p in net.trainable_params():
        p.set_data((rng.standard_normal(p.shape) * 0.05).astype(np.float32))
    x = rng.standard_normal((64, 256)).astype(np.float32)
    y = rng.integers(0, 16, 64).astype(np.int32)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    return dm.grad(lambda a, b: loss_fn(net(a), b), None, net.trainable_params())(
        Tensor(x), Tensor(y))


def test_reading_a_deferred_gradient_gives_its_shares():
    try:
        ref = _grads(1)[0].asnumpy()
        g = _grads(N)[0]
        assert g._lazy is not None
        total = np.array(g._lazy.totals[0])    # what the kernel computed, once
        stack = g._data                         # the shares, written now
        assert stack.shape == (N,) + total.shape and g._lazy is None
        for d in (0, 5):
            np.testing.assert_array_equal(stack[d], np.true_divide(total, N,
                                                                  dtype=np.float32))
        np.testing.assert_allclose(g.asnumpy(), ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(total, ref, rtol=1e-5, atol=1e-7)
    finally:
        _setup(1)
