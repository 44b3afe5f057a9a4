"""One device matrix per op (MindSpore): an op's strategy tuples map the dims its inputs
share to the same device axis, the leftover factor is repeated calculation (highest axis)."""
import re

import numpy as np
import pytest

from dualmode import Tensor, ops
from dualmode.parallel import CommReport, LayoutError, TensorLayout
from dualmode.parallel.dtensor import distribute
from dualmode.parallel.sharding import op_strategy_layouts

T = TensorLayout
MM_SHARED = [(0, 1, 1, 0, "contracted dim")]




def test_matmul_2x2_2x2_on_8_devices_is_one_2x2x2_matrix():
    a, b = T.from_op_strategy(((2, 2), (2, 2)), [(8, 8), (8, 8)], 8, MM_SHARED, "MatMul")
    assert a.device_matrix == b.device_matrix == (2, 2, 2)
    assert a.tensor_map == ((0,), (1,))            # rows, contracted
    assert b.tensor_map == ((1,), (2,))            # contracted (same axis), columns


def test_repeated_calculation_is_the_highest_axis():
    a, b = T.from_op_strategy(((2, 1), (1, 2)), [(8, 8), (8, 8)], 8, MM_SHARED, "MatMul")
    assert a.device_matrix == (2, 2, 2)
    assert a.tensor_map == ((1,), ()) and b.tensor_map == ((), (2,))


def test_agrees_with_per_input_strategies_where_they_coincide():
    shapes = [(16, 784), (784, 32)]
    got = T.from_op_strategy(((2, 4), (4, 1)), shapes, 8, MM_SHARED, "MatMul")
    want = tuple(T.from_strategy(s, sh, 8) for s, sh in zip(((2, 4), (4, 1)), shapes))
    assert got == want
    (x,) = T.from_op_strategy(((4, 1),), [(16, 8)], 8)
    assert x == T.from_strategy((4, 1), (16, 8), 8)


def test_product_of_the_op_matrix_must_divide_device_num():
    with pytest.raises(LayoutError, match=re.escape(
            "MatMul: in_strategy=((2, 2), (2, 2)) needs a device matrix of 8 devices (one axis "
            "per op dim, shared dims on one axis) but device_num is 4")):
        T.from_op_strategy(((2, 2), (2, 2)), [(8, 8), (8, 8)], 4, MM_SHARED, "MatMul")


def _run(layouts, x, w):
    with CommReport() as rep:
        out = ops.matmul(distribute(Tensor(x), layouts[0]), distribute(Tensor(w), layouts[1]))
        moved = rep.bytes()
        resolved = ops.relu(out)
    return out, resolved, moved, rep


def test_matmul_2x2_2x2_moves_only_the_allreduce_of_partial_sums(eight):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    prim = ops.MatMul().shard(((2, 2), (2, 2)))
    unified = op_strategy_layouts(prim, [Tensor(x), Tensor(w)], 8)
    out, resolved, moved, rep = _run(unified, x, w)
    assert moved == 0                                     # the inputs already agree
    assert out.layout.partial == (1,) and out.layout.tensor_map == ((0,), (2,))
    assert [(r.kind, r.group_size) for r in rep.records] == [("AllReduce", 2)]
    # (8, 4) f32 blocks, AllReduce over 2 devices: 2 (n - 1) / n * S bytes per device
    assert rep.bytes() == 2 * 1 / 2 * (4 * 4 * 4)
    np.testing.assert_allclose(out.asnumpy(), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(resolved.asnumpy(), np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)
    # the same strategy mapped input by input puts the contracted dims on different
    # axes, so the weight has to move before the product
    per_input = tuple(T.from_strategy(s, sh, 8) for s, sh in zip(((2, 2), (2, 2)),
                                                                   ((8, 16), (16, 8))))
    out2, _, moved2, _ = _run(per_input, x, w)
    assert moved2 > 0
    np.testing.assert_allclose(out2.asnumpy(), x @ w, rtol=1e-5, atol=1e-5)
