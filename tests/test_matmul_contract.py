"""MatMul whose every device axis is contracted: one GEMM over all devices' blocks, kept
as equal shares of the pending sum (the per-device products' sum is the oracle)."""
import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor, communication, ops
from dualmode.parallel import CommReport
from dualmode.parallel.rules import contract_all, stack_matmul


@pytest.mark.parametrize("n,m,k,c", [(8, 5, 3, 4), (4, 2, 6, 1), (2, 3, 1, 7)])
def test_contract_all_equals_the_sum_of_per_device_products(n, m, k, c):
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, m, k))
    b = rng.standard_normal((n, k, c))
    out = contract_all(a, b)
    assert out.shape == (n, m, c) and out.strides[0] == 0
    np.testing.assert_allclose(out.sum(axis=0), stack_matmul(a, b).sum(axis=0), rtol=1e-12)
    # transposed (non-contiguous) operands, as the MatMul rule passes them
    at = np.swapaxes(rng.standard_normal((n, k, m)), -1, -2)
    bt = np.swapaxes(rng.standard_normal((n, c, k)), -1, -2)
    np.testing.assert_allclose(contract_all(at, bt).sum(axis=0),
                               np.matmul(at, bt).sum(axis=0), rtol=1e-12)


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
