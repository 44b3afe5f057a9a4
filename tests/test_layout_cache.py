"""Layout values derived once: strategy layouts are cached (errors are raised on every
call), inference stand-ins take no memory."""
import numpy as np
import pytest

from dualmode.parallel import LayoutError, TensorLayout
from dualmode.parallel.tensor_layout import stand_in


def test_from_strategy_is_cached_and_still_validates():
    a = TensorLayout.from_strategy((2, 4), (8, 8), 8, "MatMul", 0)
    assert TensorLayout.from_strategy((2, 4), (8, 8), 8, "MatMul", 0) is a
    assert TensorLayout.from_strategy([2, 4], (8, 8), 8, "MatMul", 0) is a
    for _ in range(2):
        with pytest.raises(LayoutError, match=r"MatMul: in_strategy\[0\]=\(2, 4\) needs 8 "
                                              r"devices but device_num is 4"):
            TensorLayout.from_strategy((2, 4), (8, 8), 4, "MatMul", 0)


def test_stand_in_is_a_zero_strided_read_only_zero():
    s = stand_in(np.dtype(np.float32), (1024, 1024))
    assert s.shape == (1024, 1024) and s.dtype == np.float32 and s.strides == (0, 0)
    assert not s.flags.writeable and not s.any()
    assert stand_in(np.dtype(np.float32), (1024, 1024)) is s


def test_assemble_with_replicated_and_partial_axes():
    lay = TensorLayout((2, 2, 2), ((1,), ()), (4, 3), partial=(2,))
    g = np.arange(12.0).reshape(4, 3)
    blocks = lay.without_partial().local_blocks(g).reshape((2, 2, 2, 2, 3)) / 2
    np.testing.assert_array_equal(lay.assemble(blocks.reshape(8, 2, 3)), g)


def test_cached_constructors_still_reject_bools():
    TensorLayout.from_strategy((1, 4), (8, 8), 4, "MatMul", 0)
    with pytest.raises(TypeError, match=r"MatMul: in_strategy\[0\]=\(True, 4\) must be a tuple "
                                        r"of ints"):
        TensorLayout.from_strategy((True, 4), (8, 8), 4, "MatMul", 0)
    assert TensorLayout.batch_split([16, 4], 8) is TensorLayout.batch_split((16, 4), 8)
    with pytest.raises(LayoutError, match="batch_split"):
        TensorLayout.batch_split((16, 4), True)


def test_primitive_remembers_passed_shapes_only_for_its_strategy(sim_devices):
    """A primitive skips the strategy checks for input shapes that passed them before,
    for the same strategy only: new shapes, a re-shard and an assigned strategy are
    checked again (strategies run, and are checked, under semi-auto parallel)."""
    import dualmode as dm
    sim_devices(8)
    mm = dm.ops.MatMul().shard(((2, 1), (1, 1)))
    a = dm.Tensor(np.ones((4, 4), np.float32))
    np.testing.assert_array_equal(mm(a, a).asnumpy(), np.full((4, 4), 4.0, np.float32))
    bad = dm.Tensor(np.ones((1, 4), np.float32))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]\[0\]=2 exceeds "
                                             r"dim 0 \(size 1\) of input 0"):
            mm(bad, a)
    mm.shard(((1, 8), (8, 1)))
    with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]\[1\]=8 exceeds "
                                         r"dim 1 \(size 4\) of input 0"):
        mm(a, a)
    mm.in_strategy = ((4, 1), (1, 1))
    with pytest.raises(ValueError, match=r"MatMul: in_strategy\[0\]\[0\]=4 exceeds "
                                         r"dim 0 \(size 1\) of input 0"):
        mm(bad, a)


def test_layout_equality_ignores_alias_and_cached_values():
    a = TensorLayout((2, 4), ((0,), (1,)), (8, 8))
    b = TensorLayout((2, 4), ((0,), (1,)), (8, 8), alias=("dp", "mp"))
    a.local_blocks(np.zeros((8, 8)))              # fills a's cached values only
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != TensorLayout((2, 4), ((0,), ()), (8, 8))
    assert a != TensorLayout((2, 4), ((0,), ()), (8, 8), partial=(1,))
    assert (a == "layout") is False and a != (2, 4)
