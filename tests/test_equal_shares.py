"""Equal shares of a pending sum (communication.sim.equal_shares): a data-parallel
gradient computed once over every device's rows is stored as n equal shares, and the
simulated AllReduce (fused or not) / whole-world ReduceScatter of them reads back the
total itself, exactly, without a pass over the shares.

Oracles: the total the shares were made from (the single-device value), and numpy's
reduction of a materialized copy of the shares."""
import gc

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication as comm, nn
from dualmode.communication import SimBackend
from dualmode.communication import totals as totals_module
from dualmode.communication.sim import equal_shares, shares_total
from dualmode.parallel import CommReport, reduce_gradients

N = 6           # not a power of two: n * (total / n) is not always the total


def _total(shape=(40, 30), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _inexact(total, n):
    """True when n * (total / n), added up as n shares, differs from the total."""
    share = np.float32(total) / np.float32(n)
    return not np.array_equal(np.sum(np.broadcast_to(share, (n,) + total.shape), axis=0,
                                     dtype=np.float32), total)


def test_shares_are_read_only_total_over_n_stored_once():
    total = _total()
    stack = equal_shares(total, N)
    assert stack.shape == (N,) + total.shape and stack.strides[0] == 0
    assert not stack.flags.writeable and not total.flags.writeable
    np.testing.assert_array_equal(stack[3], np.true_divide(total, N, dtype=np.float32))
    found = shares_total(stack)
    assert np.shares_memory(found, total) and np.array_equal(found, total)


def test_the_check_sees_the_oracle_differ():
    # the tests below would pass by accident if n * (total / n) were the total here
    assert _inexact(_total(), N)


@pytest.mark.parametrize("fused", [False, True])
def test_all_reduce_sum_of_shares_is_the_total_exactly(fused):
    b = SimBackend(N)
    total = _total()
    stack = equal_shares(total, N)
    out = b.all_reduce_fused([stack], None, "sum")[0] if fused else \
        b.all_reduce(stack, None, "sum")
    assert out.shape == stack.shape and not out.flags.writeable
    for d in range(N):
        np.testing.assert_array_equal(out[d], total)


@pytest.mark.parametrize("fused", [False, True])
def test_all_reduce_mean_of_shares_is_one_share(fused):
    b = SimBackend(N)
    stack = equal_shares(_total(), N)
    out = b.all_reduce_fused([stack], None, "mean")[0] if fused else \
        b.all_reduce(stack, None, "mean")
    np.testing.assert_allclose(out, np.asarray(stack), rtol=1e-6)


def test_fused_bucket_mixes_shares_and_plain_stacks():
    b = SimBackend(N)
    rng = np.random.default_rng(1)
    totals = [_total((50, 40), 2), _total((7,), 3)]
    plain = [rng.standard_normal((N, 30000)).astype(np.float32),
             rng.standard_normal((N, 5)).astype(np.float32)]
    stacks = [equal_shares(totals[0], N), plain[0], equal_shares(totals[1], N), plain[1]]
    out = b.all_reduce_fused(stacks, None, "sum")
    np.testing.assert_array_equal(out[0][2], totals[0])
    np.testing.assert_array_equal(out[2][5], totals[1])
    for o, p in zip((out[1], out[3]), plain):
        np.testing.assert_allclose(o, np.broadcast_to(p.sum(0), p.shape), rtol=1e-5,
                                   atol=1e-5)


def test_reduce_scatter_of_shares_splits_the_total():
    b = SimBackend(N)
    total = _total((N * 4, 3))
    out = b.reduce_scatter(equal_shares(total, N), None, axis=0, op="sum")
    np.testing.assert_array_equal(out, total.reshape(N, 4, 3))


def test_a_copy_or_derived_stack_is_reduced_from_its_values():
    b = SimBackend(N)
    total = _total()
    stack = equal_shares(total, N)
    for other in (np.array(stack), stack[:, :20], stack * 1):
        want = np.sum(np.asarray(other), axis=0, dtype=np.float32)
        np.testing.assert_allclose(b.all_reduce(other, None, "sum")[0], want, rtol=1e-6)
        assert shares_total(other) is None


def test_the_record_leaves_with_its_stack():
    gc.collect()                     # records of earlier tests' stacks in cycles leave now
    before = len(totals_module._TOTALS)
    stack = equal_shares(_total(), N)
    assert len(totals_module._TOTALS) == before + 1
    del stack
    gc.collect()
    assert len(totals_module._TOTALS) == before


def test_comm_report_is_unchanged_by_the_shortcut():
    b = SimBackend(N)
    total = _total()
    shares = equal_shares(total, N)
    with CommReport() as fast:
        b.all_reduce_fused([shares], None, "sum")
    with CommReport() as plain:
        b.all_reduce_fused([np.array(shares)], None, "sum")
    assert fast.records == plain.records and len(fast.records) == 1
    assert fast.records[0].kind == "AllReduce"
    assert fast.records[0].bytes_per_device == 2 * (N - 1) * total.nbytes / N


@pytest.mark.parametrize("report", [False, True])
@pytest.mark.parametrize("mean", [True, False])
def test_data_parallel_gradients_are_the_single_device_ones(mean, report):
    """The gradients of a data-parallel step on 6 devices after their AllReduce:
    gradients_mean=True gives the single-device gradient, False 6 times it; the same
    whether a report records the AllReduces (the backend's collectives) or none does
    (the known totals taken directly)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, 9)).astype(np.float32)
    y = rng.standard_normal((12, 5)).astype(np.float32)

    def grads():
        net = nn.Dense(9, 5)
        for p, seed in zip(net.trainable_params(), (5, 6)):
            p.set_data(np.random.default_rng(seed).standard_normal(p.shape)
                       .astype(np.float32))
        loss_fn = nn.MSELoss()
        fn = dm.value_and_grad(lambda a, b: loss_fn(net(a), b), None,
                               net.trainable_params())
        _, g = fn(Tensor(x), Tensor(y))
        return [t.asnumpy() if t._layout is None else t
                for t in reduce_gradients(g, net.trainable_params())]

    ref = grads()
    dm.set_auto_parallel_context(parallel_mode="data_parallel", device_num=N,
                                 gradients_mean=mean)
    comm.init()
    try:
        if report:
            with CommReport() as rep:
                got = grads()
            assert [r.kind for r in rep.records].count("AllReduce") == 2   # weight, bias
        else:
            got = grads()
    finally:
        dm.reset_auto_parallel_context()
        comm.init()
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), r * (1 if mean else N), rtol=1e-5,
                                   atol=1e-6)
