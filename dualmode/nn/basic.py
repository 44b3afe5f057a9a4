"""Basic layers: Dense, Flatten, Dropout."""
from __future__ import annotations

import math
import warnings

from .. import ops
from .._core._tensor import TensorBase
from ..common import dtype as _dt
from ..common.initializer import HeUniform, Uniform, initializer
from ..ops import _math
from ..ops.primitive import Primitive
from ..tensor import Parameter
from ._checks import check_bool, check_float, check_int
from .activation import get_activation
from .cell import Cell

__all__ = ["Dense", "Flatten", "Dropout", "make_parameter"]


def make_parameter(owner, what, init, shape, dtype, name):
    """A Parameter of `shape` filled by `init` (a str, Initializer, number or Tensor)."""
    shape = tuple(shape)
    if isinstance(init, TensorBase) and tuple(init.shape) != shape:
        raise ValueError(f"{owner}: {what} has shape {tuple(init.shape)}; expected {shape}")
    return Parameter(initializer(init, shape, dtype), name=name)


def compute_operands(cell, name, x):
    """``(x, weight, bias)`` of a layer with a ``weight`` (and maybe a ``bias``) in the
    dtype it computes in: float16 under ``Model(amp_level="O2")`` (the Model sets
    ``amp_dtype`` on the cell), else as stored; TypeError naming the layer when the input's
    dtype is not the weight's."""
    d = cell.__dict__      # registered Parameters live there (see Cell)
    weight = d["weight"] if "weight" in d else cell.weight
    bias = d["bias"] if "bias" in d else getattr(cell, "bias", None)
    amp = d.get("amp_dtype")
    if amp is not None:
        x, weight = ops.cast(x, amp), ops.cast(weight, amp)
        bias = ops.cast(bias, amp) if bias is not None else None
    if x.dtype != weight.dtype:
        raise TypeError(f"{name}: input has dtype {x.dtype} but the weight has dtype "
                        f"{cell.weight.dtype}; cast the input with ops.cast")
    return x, weight, bias


class Dense(Cell):
    """Fully connected layer: ``activation(x @ weight.T + bias)``.

    Parameters
    ----------
    in_channels, out_channels : int
        Sizes of the last input dim and of the output.
    weight_init : str, Initializer, number or Tensor, optional
        Weight of shape ``(out_channels, in_channels)``; default
        ``HeUniform(negative_slope=sqrt(5))`` (MindSpore's).
    bias_init : str, Initializer, number or Tensor, optional
        Bias of shape ``(out_channels,)``; default ``Uniform(1 / sqrt(in_channels))``.
    has_bias : bool
        Add the bias (default True).
    activation : str, Cell or Primitive, optional
        Applied to the output ("relu", "tanh", "sigmoid", "softmax" or a cell).
    dtype : dtype
        Parameter dtype (default float32).

    Inputs of rank > 2 are flattened to 2-D for the product and reshaped back.
    """

    def __init__(self, in_channels, out_channels, weight_init=None, bias_init=None,
                 has_bias=True, activation=None, dtype=_dt.float32):
        super().__init__()
        self.in_channels = check_int("Dense", "in_channels", in_channels, 1)
        self.out_channels = check_int("Dense", "out_channels", out_channels, 1)
        self.has_bias = check_bool("Dense", "has_bias", has_bias)
        dtype = _dt.as_dtype(dtype, "Dense")
        if weight_init is None:
            weight_init = HeUniform(negative_slope=math.sqrt(5))
        self.weight = make_parameter("Dense", "weight_init", weight_init,
                                     (self.out_channels, self.in_channels), dtype, None)
        self.bias = None
        if self.has_bias:
            if bias_init is None:
                bias_init = Uniform(1.0 / math.sqrt(self.in_channels))
            self.bias = make_parameter("Dense", "bias_init", bias_init, (self.out_channels,),
                                       dtype, None)
        if isinstance(activation, str):
            activation = get_activation(activation)
        elif activation is not None and not isinstance(activation, (Cell, Primitive)):
            raise TypeError(f"Dense: activation must be a str, a Cell, a Primitive or None, "
                            f"got {type(activation).__name__}")
        self.activation = activation

    def construct(self, x):
        shape = x.shape
        if not shape or shape[-1] != self.in_channels:
            raise ValueError(f"Dense: input has shape {tuple(shape)}; its last dim must equal "
                             f"in_channels={self.in_channels}")
        x, weight, bias = compute_operands(self, "Dense", x)
        if len(shape) != 2:
            x = ops.reshape(x, (-1, self.in_channels))
        x = _math.mat_mul(x, weight, False, True)      # 2-D: the MatMul op itself
        if self.has_bias:
            x = _math.bias_add(x, bias)
        if self.activation is not None:
            x = self.activation(x)
        if len(shape) != 2:
            x = ops.reshape(x, tuple(shape[:-1]) + (self.out_channels,))
        return x

    def extend_repr(self):
        s = f"input_channels={self.in_channels}, output_channels={self.out_channels}"
        if self.has_bias:
            s += ", has_bias=True"
        if isinstance(self.activation, Primitive):   # a child Cell prints itself
            s += f", activation={self.activation!r}"
        return s


class Flatten(Cell):
    """Merge dims `start_dim` .. `end_dim` into one (default: keep the batch dim).

    Parameters
    ----------
    start_dim, end_dim : int
        The first and last dims merged (negative counts from the end).
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim = check_int("Flatten", "start_dim", start_dim)
        self.end_dim = check_int("Flatten", "end_dim", end_dim)

    def construct(self, x):
        shape = tuple(x.shape)
        nd = max(len(shape), 1)
        start, end = self.start_dim, self.end_dim
        for name, v in (("start_dim", start), ("end_dim", end)):
            if not -nd <= v < nd:
                raise ValueError(f"Flatten: {name}={v} is out of range for an input of rank "
                                 f"{len(shape)} (shape {shape})")
        start, end = start % nd, end % nd
        if start > end:
            raise ValueError(f"Flatten: start_dim={self.start_dim} comes after "
                             f"end_dim={self.end_dim} for an input of rank {len(shape)}")
        if not shape:
            return ops.reshape(x, (1,))
        merged = math.prod(shape[start:end + 1])
        return ops.reshape(x, shape[:start] + (merged,) + shape[end + 1:])


class Dropout(Cell):
    """Randomly zero elements with probability `p` while training (MindSpore 2.x).

    Kept elements are scaled by ``1 / (1 - p)``; in evaluation mode (the default,
    see ``set_train``) the input is returned unchanged.

    Parameters
    ----------
    keep_prob : float, optional
        Deprecated: the probability of keeping an element, in (0, 1].
    p : float, optional
        The probability of dropping an element, in [0, 1). Default 0.5.
    """

    def __init__(self, keep_prob=None, p=None):
        super().__init__()
        if keep_prob is not None and p is not None:
            raise ValueError(f"Dropout: give either p (drop probability) or the deprecated "
                             f"keep_prob, not both; got keep_prob={keep_prob!r}, p={p!r}")
        if keep_prob is not None:
            warnings.warn("Dropout: keep_prob is deprecated; use p = 1 - keep_prob",
                          DeprecationWarning, stacklevel=2)
            keep_prob = check_float("Dropout", "keep_prob", keep_prob, 0.0, 1.0, lo_open=True)
            p = 1.0 - keep_prob
        elif p is None:
            p = 0.5
        else:
            p = check_float("Dropout", "p", p, 0.0, 1.0, hi_open=True)
        self.p = p

    @property
    def keep_prob(self) -> float:
        return 1.0 - self.p

    def construct(self, x):
        if not self.training or self.p == 0.0:
            return x
        return ops.dropout(x, p=self.p, training=True)

    def extend_repr(self):
        return f"p={self.p}"
