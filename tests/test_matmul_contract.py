"""MatMul whose contracted dim is split over device axes: the total of each group of devices
that share a sum, kept as equal shares of the pending sum (the per-device products,
summed over each group, are the oracle)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, ops
from dualmode.parallel import CommReport
from dualmode.parallel.rules import contract as rules
from dualmode.parallel.rules.contract import contract_groups, stack_matmul


def _per_device_sums(a, b, dm, axes):
    """The oracle: every device's own product, each group's products (devices that
    differ only along `axes`) added up and split into equal shares."""
    nd = len(dm)
    full_a = np.broadcast_to(a, dm + a.shape[nd:]).reshape((-1,) + a.shape[nd:])
    full_b = np.broadcast_to(b, dm + b.shape[nd:]).reshape((-1,) + b.shape[nd:])
    prods = stack_matmul(full_a, full_b).reshape(dm + (a.shape[-2], b.shape[-1]))
    parts = np.prod([dm[i] for i in axes])
    total = prods.sum(axis=tuple(axes), keepdims=True) / parts
    return np.broadcast_to(total, prods.shape).reshape((-1,) + prods.shape[nd:])


@pytest.mark.parametrize("dm,axes", [((8,), (0,)), ((2, 4), (1,)), ((2, 4), (0,)),
                                     ((2, 4), (0, 1)), ((2, 4), (1, 0)),
                                     ((2, 2, 2), (0, 2))])
@pytest.mark.parametrize("b_repeats", [False, True])
@pytest.mark.parametrize("k", [5, rules.JOIN_BELOW_K + 3])
def test_contract_groups_equals_the_per_device_products_summed(dm, axes, b_repeats, k,
                                                                monkeypatch):
    """Both routes: a short contracted length joins the blocks into one GEMM (copying
    the first operand's blocks, by rows or, stored by columns, by rows of its
    transpose), a long one adds the per-device products."""
    rng = np.random.default_rng(len(dm) * 10 + len(axes))
    m, c = 3, 4
    a = rng.standard_normal(dm + (m, k))
    # b_repeats: b is the same on every device of the other axes (a grid of size 1
    # there), the case where every group's rows are one GEMM
    b = rng.standard_normal(tuple(1 if b_repeats and i not in axes else d
                                  for i, d in enumerate(dm)) + (k, c))
    out = contract_groups(a, b, dm, axes)
    assert out.shape == (np.prod(dm), m, c)
    np.testing.assert_allclose(out, _per_device_sums(a, b, dm, axes), rtol=1e-12)
    if len(axes) == len(dm):
        assert out.strides[0] == 0          # one total, every device a view of it
    # transposed (non-contiguous) operands, as the MatMul rule passes them
    at = np.swapaxes(rng.standard_normal(dm + (k, m)), -1, -2)
    bt = np.swapaxes(rng.standard_normal(dm + (c, k)), -1, -2)
    joined = []
    real = rules._joined_product
    monkeypatch.setattr(rules, "_joined_product", lambda *a: joined.append(1) or real(*a))
    np.testing.assert_allclose(contract_groups(at, bt, dm, axes),
                               _per_device_sums(at, bt, dm, axes), rtol=1e-12)
    if k < rules.JOIN_BELOW_K:
        assert joined, "a short contraction joins its blocks into one GEMM per group"


def test_matmul_1x8_8x1_equals_one_device_and_moves_one_reduce():
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    communication.init()
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 32)).astype(np.float32)
        w = rng.standard_normal((32, 8)).astype(np.float32)
        mm = ops.MatMul().shard(((1, 8), (8, 1)))
        with CommReport() as rep:
            out = mm(Tensor(x), Tensor(w))
            value = out.asnumpy()
        np.testing.assert_allclose(value, x @ w, rtol=1e-5, atol=1e-5)
        assert out.layout is not None and out.layout.partial
        assert rep.records == []            # the pending sum is resolved lazily
        with CommReport() as rep:
            total = ops.relu(out).asnumpy()
        np.testing.assert_allclose(total, np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)
        assert [r.kind for r in rep.records] == ["AllReduce"]
    finally:
        dm.reset_auto_parallel_context()
        communication.init()


def test_grouped_matmul_and_its_gradients_equal_one_device():
    """Products large enough to run as one GEMM per group of devices (the contracted
    dim split over one axis of two): forward value and both gradients equal numpy's,
    and the grouping changes nothing that CommReport sees."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    assert (64 // 2) * 128 * (256 // 4) >= rules.GROUPED_MIN_MACS
    dm.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    communication.init()
    calls = []
    real = rules.contract_groups

    def spy(*args):
        calls.append(args[3])
        return real(*args)

    try:
        rules.contract_groups = spy
        mm = ops.MatMul().shard(((2, 4), (4, 1)))
        wp = dm.Parameter(Tensor(w), name="w")

        def loss(a):
            return ops.ReduceSum()(ops.relu(mm(a, wp)) * 0.5)

        with CommReport() as grouped_rep:
            value, (gx, (gw,)) = dm.value_and_grad(loss, 0, [wp])(Tensor(x))
            got = [value.asnumpy(), gx.asnumpy(), gw.asnumpy()]
        assert (1,) in calls                 # the forward product: grouped over axis 1
        h = x @ w
        mask = (h > 0).astype(np.float32) * 0.5
        np.testing.assert_allclose(got[0], (np.maximum(h, 0) * 0.5).sum(), rtol=1e-4)
        np.testing.assert_allclose(got[1], mask @ w.T, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[2], x.T @ mask, rtol=1e-4, atol=1e-4)
        # the same program with per-device products: the same collectives
        rules.contract_groups = lambda a, b, d, axes: rules.grid_to_stack(np.matmul(a, b), d)
        with CommReport() as plain_rep:
            value, (gx, (gw,)) = dm.value_and_grad(loss, 0, [wp])(Tensor(x))
            np.testing.assert_allclose(gw.asnumpy(), got[2], rtol=1e-4, atol=1e-4)
        assert [(r.kind, r.group_size) for r in grouped_rep.records] == \
            [(r.kind, r.group_size) for r in plain_rep.records]
    finally:
        rules.contract_groups = real
        dm.reset_auto_parallel_context()
        communication.init()
