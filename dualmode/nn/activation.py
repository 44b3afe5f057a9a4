"""Activation cells: ReLU, Tanh, Sigmoid, Softmax, GELU, FastGelu, and
``get_activation(name)``."""
from __future__ import annotations

from .. import ops
from .cell import Cell

__all__ = ["ReLU", "Tanh", "Sigmoid", "Softmax", "GELU", "FastGelu", "get_activation"]


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
