"""Conv2d: the Conv2D primitive with its weight (and optional bias) as Parameters."""
from __future__ import annotations

import math

from .. import ops
from ..common import dtype as _dt
from ..common.initializer import HeUniform, Uniform
from ..ops._conv import check_pad, check_pad_mode, pair
from ._checks import check_bool, check_float_tensor, check_int
from .basic import compute_operands, make_parameter
from .cell import Cell

__all__ = ["Conv2d"]


class Conv2d(Cell):
    """2-D convolution over NCHW input (MindSpore's ``nn.Conv2d``).

    Parameters
    ----------
    in_channels, out_channels : int
    kernel_size, stride, dilation : int or (int, int)
    pad_mode : "same" (default), "valid" or "pad"
    padding : int or (top, bottom, left, right), with pad_mode="pad"
    group : int
        Channel groups; in_channels and out_channels must be divisible by it.
    has_bias : bool
        Add a per-channel bias (default False).
    weight_init, bias_init : str, Initializer, number or Tensor, optional
        Defaults ``HeUniform(negative_slope=sqrt(5))`` and ``Uniform(1 / sqrt(fan_in))``.
    dtype : dtype
        Parameter dtype (default float32).

    The primitive is ``self.conv2d`` (an ``ops.Conv2D``): ``cell.conv2d.shard(...)`` sets
    its strategy.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, pad_mode="same",
                 padding=0, dilation=1, group=1, has_bias=False, weight_init=None,
                 bias_init=None, data_format="NCHW", dtype=_dt.float32):
        super().__init__()
        self.in_channels = check_int("Conv2d", "in_channels", in_channels, 1)
        self.out_channels = check_int("Conv2d", "out_channels", out_channels, 1)
        self.group = check_int("Conv2d", "group", group, 1)
        if self.in_channels % self.group or self.out_channels % self.group:
            raise ValueError(f"Conv2d: in_channels={self.in_channels} and out_channels="
                             f"{self.out_channels} must both be divisible by "
                             f"group={self.group}")
        self.kernel_size = pair("Conv2d", "kernel_size", kernel_size)
        self.stride = pair("Conv2d", "stride", stride)
        self.dilation = pair("Conv2d", "dilation", dilation)
        self.pad_mode = check_pad_mode("Conv2d", pad_mode)
        self.padding = check_pad("Conv2d", padding, self.pad_mode)
        self.has_bias = check_bool("Conv2d", "has_bias", has_bias)
        dtype = _dt.as_dtype(dtype, "Conv2d")
        shape = (self.out_channels, self.in_channels // self.group) + self.kernel_size
        if weight_init is None:
            weight_init = HeUniform(negative_slope=math.sqrt(5))
        self.weight = make_parameter("Conv2d", "weight_init", weight_init, shape, dtype,
                                     "weight")
        if self.has_bias:
            if bias_init is None:
                fan_in = shape[1] * shape[2] * shape[3]
                bias_init = Uniform(1.0 / math.sqrt(fan_in))
            self.bias = make_parameter("Conv2d", "bias_init", bias_init,
                                       (self.out_channels,), dtype, "bias")
        self.conv2d = ops.Conv2D(self.out_channels, self.kernel_size, pad_mode=self.pad_mode,
                                 pad=self.padding, stride=self.stride, dilation=self.dilation,
                                 group=self.group, data_format=data_format)
        self.bias_add = ops.BiasAdd()

    def construct(self, x):
        check_float_tensor("Conv2d", "input", x)
        x, weight, bias = compute_operands(self, "Conv2d", x)
        y = self.conv2d(x, weight)
        if self.has_bias:
            y = self.bias_add(y, bias)
        return y

    def extend_repr(self):
        return (f"input_channels={self.in_channels}, output_channels={self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"pad_mode={self.pad_mode}, padding={self.padding}, "
                f"dilation={self.dilation}, group={self.group}, has_bias={self.has_bias}")
