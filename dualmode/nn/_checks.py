"""Argument checks shared by layers, losses and optimizers (each raises a named error)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from .._core._tensor import TensorBase


def check_int(owner, name, value, minimum=None):
    """An int (not bool), optionally >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: {name}={value} must be >= {minimum}")
    return int(value)


def check_bool(owner, name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}: {name} must be a bool, got {value!r}")
    return bool(value)


def check_float(owner, name, value, lo=None, hi=None, lo_open=False, hi_open=False):
    """A real number in the interval [lo, hi] (ends open when asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a float, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name}={value} must be a finite float")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ValueError(f"{owner}: {name}={value} must be in {left}{lo_s}, {hi_s}{right}")
    return value


def check_tensor(owner, name, x):
    """A Tensor (or numpy array) input."""
    if not isinstance(x, (TensorBase, np.ndarray)):
        raise TypeError(f"{owner}: {name} must be a Tensor, got {type(x).__name__}")
    return x


def check_float_tensor(owner, name, x):
    check_tensor(owner, name, x)
    if x.dtype.kind != "f":
        raise TypeError(f"{owner}: {name} has dtype {x.dtype}; expected a float dtype "
                        f"(float16, float32 or float64)")
    return x
