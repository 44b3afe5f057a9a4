"""Layout values derived once: strategy layouts are cached (errors are raised on every
call), inference stand-ins take no memory."""
import numpy as np
import pytest

from dualmode.parallel import LayoutError, TensorLayout
from dualmode.parallel.layout import stand_in


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
