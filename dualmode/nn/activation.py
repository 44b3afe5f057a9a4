"""Activation cells: ReLU, Tanh, Sigmoid, Softmax, GELU, FastGelu, PReLU, and
``get_activation(name)``."""
from __future__ import annotations

import numpy as np

from .. import ops
from .._core._tensor import TensorBase
from ..tensor import Parameter, Tensor
from .cell import Cell

__all__ = ["ReLU", "Tanh", "Sigmoid", "Softmax", "GELU", "FastGelu", "PReLU",
           "get_activation"]


class ReLU(Cell):
    """max(x, 0), elementwise."""

    def construct(self, x):
        return ops.relu(x)


class Tanh(Cell):
    """Hyperbolic tangent, elementwise."""

    def construct(self, x):
        return ops.tanh(x)


class Sigmoid(Cell):
    """1 / (1 + exp(-x)), elementwise."""

    def construct(self, x):
        return ops.sigmoid(x)


class Softmax(Cell):
    """Softmax along `axis`.

    Parameters
    ----------
    axis : int
        The axis normalised to sum to one (default -1).
    """

    def __init__(self, axis: int = -1):
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"Softmax: axis must be an int, got {axis!r}")
        self.axis = axis

    def construct(self, x):
        return ops.softmax(x, self.axis)

    def extend_repr(self):
        return f"axis={self.axis}"


class GELU(Cell):
    """Gaussian error linear unit, as MindSpore's ``nn.GELU``: with ``approximate=True``
    (the default) 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the GeLU primitive
    held as ``self.gelu`` (give it a strategy with ``cell.gelu.shard(...)``); with False
    x * P(X <= x) = 0.5 x (1 + erf(x / sqrt(2)))."""

    def __init__(self, approximate: bool = True):
        super().__init__()
        if not isinstance(approximate, bool):
            raise TypeError(f"GELU: approximate must be a bool, got {approximate!r}")
        self.approximate = approximate
        if approximate:
            self.gelu = ops.GeLU()

    def construct(self, x):
        if self.approximate:
            return self.gelu(x)
        return ops.gelu(x, approximate="none")

    def extend_repr(self):
        return f"approximate={self.approximate}"


class FastGelu(Cell):
    """x / (1 + exp(-1.702 |x|)) * exp(0.851 (x - |x|)), the FastGeLU primitive held as
    ``self.fast_gelu``."""

    def __init__(self):
        super().__init__()
        self.fast_gelu = ops.FastGeLU()

    def construct(self, x):
        return self.fast_gelu(x)


class PReLU(Cell):
    """x where x > 0, else w * x, as MindSpore's ``nn.PReLU(channel=1, w=0.25)``: the
    trainable Parameter ``w`` (float32, shape (channel,)) holds one slope per channel
    (dim 1 of x), all `w` (a float) or the given 1-D Tensor; the PReLU primitive is
    ``self.prelu`` (a strategy: ``cell.prelu.shard(((1, 4, 1, 1), (4,)))``)."""

    def __init__(self, channel: int = 1, w=0.25):
        super().__init__()
        if isinstance(channel, bool) or not isinstance(channel, int) or channel < 1:
            raise ValueError(f"PReLU: channel={channel!r} must be an int >= 1")
        if isinstance(w, TensorBase):
            value = np.asarray(w.asnumpy(), np.float32)
            if value.shape != (channel,):
                raise ValueError(f"PReLU: w has shape {value.shape}; expected ({channel},) "
                                 f"(one slope per channel)")
        elif isinstance(w, (int, float)) and not isinstance(w, bool):
            value = np.full((channel,), w, np.float32)
        else:
            raise TypeError(f"PReLU: w must be a float or a Tensor of shape ({channel},), "
                            f"got {type(w).__name__}")
        self.w = Parameter(Tensor(value), name="a")
        self.prelu = ops.PReLU()

    def construct(self, x):
        return self.prelu(x, self.w)


_ACTIVATIONS = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid, "softmax": Softmax,
                "gelu": GELU, "fast_gelu": FastGelu}


def get_activation(name: str) -> Cell:
    """A new activation cell by name ("relu", "tanh", "sigmoid", "softmax", "gelu",
    "fast_gelu").

    Raises
    ------
    ValueError
        For an unknown name, listing the valid ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"get_activation: name must be a str, got {type(name).__name__}")
    cls = _ACTIVATIONS.get(name.lower())
    if cls is None:
        raise ValueError(f"get_activation: unknown activation {name!r}; expected one of "
                         f"{', '.join(repr(k) for k in _ACTIVATIONS)}")
    return cls()
