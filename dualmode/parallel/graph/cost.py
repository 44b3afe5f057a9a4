"""The alpha-beta cost model of collectives and redistributions (seconds).

One collective costs ``alpha + beta * bytes``, where ``bytes`` is what one device moves
(the formulas of :mod:`dualmode.communication.trace`: AllReduce ``2 (n-1) s / n``,
AllGather ``(n-1) s``, ReduceScatter and AlltoAll ``(n-1) s / n`` for a buffer of ``s``
bytes per device in a group of ``n``). Defaults:

* ``alpha = 10e-6`` s: the latency of launching one collective (one step of a plan),
  the order of an NCCL/HCCL collective's fixed cost on one node;
* ``beta = 1e-10`` s per byte: 10 GB/s of bandwidth per device.

A redistribution costs the sum over its plan's communicating steps
(:func:`~dualmode.parallel.redistribution.planner.plan_redistribution`); LocalSlice and Remesh
steps move nothing and cost nothing, so an equal or merely finer layout is free.
Costs are cached per ``(src, dst, itemsize, model)``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ...communication.trace import bytes_per_device
from ..tensor_layout import TensorLayout
from ..redistribution.planner import plan_redistribution

__all__ = ["CostModel", "DEFAULT_MODEL", "redistribution_cost", "partial_cost",
           "allreduce_cost", "cost_cache_info", "clear_cost_cache"]


def _check_coeff(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ValueError(f"CostModel: {name}={value!r} is not valid; expected a finite "
                         f"number >= 0 (seconds{' per byte' if name == 'beta' else ''})")
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """Cost of one collective: ``alpha + beta * bytes moved per device`` (seconds).

    Parameters
    ----------
    alpha : float
        Seconds per collective (per step of a plan). Default 10 us.
    beta : float
        Seconds per byte moved by one device. Default 1e-10 (10 GB/s).
    """

    alpha: float = 10e-6
    beta: float = 1e-10

    def __post_init__(self):
        object.__setattr__(self, "alpha", _check_coeff("alpha", self.alpha))
        object.__setattr__(self, "beta", _check_coeff("beta", self.beta))

    def collective(self, nbytes: float) -> float:
        """The cost of one collective moving ``nbytes`` per device."""
        return self.alpha + self.beta * float(nbytes)

    def __repr__(self):
        return f"CostModel(alpha={self.alpha:g}, beta={self.beta:g})"


DEFAULT_MODEL = CostModel()


def _model(model, owner) -> CostModel:
    if model is None:
        return DEFAULT_MODEL
    if not isinstance(model, CostModel):
        raise TypeError(f"{owner}: model={model!r} is not a CostModel")
    return model


def _check_itemsize(itemsize, owner):
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"{owner}: itemsize={itemsize!r} is not valid; expected a positive "
                         f"int (bytes per element)")


def _check_layout(name, lay, owner):
    if not isinstance(lay, TensorLayout):
        raise TypeError(f"{owner}: {name}={lay!r} is not a TensorLayout")


def redistribution_cost(src: TensorLayout, dst: TensorLayout, itemsize: int = 4,
                        model: Optional[CostModel] = None) -> float:
    """The cost of moving a tensor from layout ``src`` to ``dst``.

    Sums ``model.collective(step.bytes)`` over the communicating steps of
    ``plan_redistribution(src, dst, itemsize)`` (pending partial sums in ``src`` are
    resolved by the plan's AllReduce / ReduceScatter steps). 0 when ``src == dst``.

    Raises
    ------
    RedistributionError (a ValueError)
        When the layouts hold different shapes or device counts (from the planner).
    """
    _check_layout("src", src, "redistribution_cost")
    _check_layout("dst", dst, "redistribution_cost")
    _check_itemsize(itemsize, "redistribution_cost")
    model = _model(model, "redistribution_cost")
    if src == dst:
        return 0.0
    return _cached_cost(src, dst, itemsize, model)


@functools.lru_cache(maxsize=16384)
def _cached_cost(src, dst, itemsize, model) -> float:
    total = 0.0
    for step in plan_redistribution(src, dst, itemsize):
        if step.communicates and step[3] > 1:
            total += model.alpha + model.beta * step[4]
    return total


def allreduce_cost(layout: TensorLayout, axes: Sequence[int], itemsize: int = 4,
                   model: Optional[CostModel] = None) -> float:
    """The cost of an AllReduce of ``layout``'s local buffer over device ``axes`` (0 when
    the group holds one device)."""
    _check_layout("layout", layout, "allreduce_cost")
    _check_itemsize(itemsize, "allreduce_cost")
    model = _model(model, "allreduce_cost")
    dm = layout.device_matrix
    bad = [a for a in axes if not isinstance(a, int) or not 0 <= a < len(dm)]
    if bad:
        raise ValueError(f"allreduce_cost: axes={tuple(axes)!r} has {bad[0]!r}, not an axis "
                         f"of device matrix {dm}; valid axes are 0..{len(dm) - 1}")
    n = math.prod(dm[a] for a in axes)
    if n <= 1:
        return 0.0
    buf = math.prod(layout.local_shape) * itemsize
    return model.collective(bytes_per_device("AllReduce", n, buf))


def partial_cost(layout: TensorLayout, itemsize: int = 4,
                 model: Optional[CostModel] = None) -> float:
    """The cost of resolving ``layout``'s pending partial sums by one AllReduce over its
    ``partial`` axes (0 when nothing is pending).

    A redistribution planned from a partial layout already includes this (or a cheaper
    ReduceScatter); use it for an output nothing consumes in another layout.
    """
    _check_layout("layout", layout, "partial_cost")
    return allreduce_cost(layout, layout.partial, itemsize, model)


def cost_cache_info():
    """The ``functools`` cache statistics of :func:`redistribution_cost`."""
    return _cached_cost.cache_info()


def clear_cost_cache() -> None:
    """Forget every cached redistribution cost."""
    _cached_cost.cache_clear()
