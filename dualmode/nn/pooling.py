"""MaxPool2d and AvgPool2d over NCHW input."""
from __future__ import annotations

from .. import ops
from ._checks import check_float_tensor
from .cell import Cell

__all__ = ["MaxPool2d", "AvgPool2d"]


class _Pool2d(Cell):
    _prim = None

    def __init__(self, kernel_size=1, stride=1, pad_mode="valid", data_format="NCHW"):
        super().__init__()
        self.pool = self._prim(kernel_size, stride, pad_mode, data_format)

    def construct(self, x):
        check_float_tensor(type(self).__name__, "input", x)
        return self.pool(x)

    def extend_repr(self):
        return (f"kernel_size={self.pool.kernel_size}, stride={self.pool.strides}, "
                f"pad_mode={self.pool.pad_mode}")


class MaxPool2d(_Pool2d):
    """Max over kernel_size windows (pad_mode "valid" or "same"); ``self.pool`` is the
    ``ops.MaxPool`` primitive (shard it to set a strategy)."""
    _prim = ops.MaxPool


class AvgPool2d(_Pool2d):
    """Mean over kernel_size windows (pad_mode "valid" or "same": border windows average
    the pixels inside the input); ``self.pool`` is the ``ops.AvgPool`` primitive."""
    _prim = ops.AvgPool
