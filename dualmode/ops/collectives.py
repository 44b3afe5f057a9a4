"""Collective primitives for hybrid-parallel user code: ``ops.AllReduce`` & co.

The primitives hold their attributes (group, reduction, root, split and concat dims),
validated at construction; how they run is the parallel layer's
(:mod:`dualmode.parallel.collectives`, reached through :mod:`dualmode.ops.interpreter`).
Outside a parallel context every collective returns its input unchanged.
"""
from __future__ import annotations

import numbers

import numpy as np

from . import interpreter
from .primitive import Primitive

_OPS = ("sum", "mean", "max", "min", "prod")


class ReduceOp:
    """The reductions of ``AllReduce`` and ``ReduceScatter``, under MindSpore's names:
    ``ops.AllReduce(ops.ReduceOp.SUM)`` is ``ops.AllReduce("sum")``."""
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
WORLD_GROUP = "hccl_world_group"


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


# ---------------------------------------------------------------------------
# primitives
# ---------------------------------------------------------------------------
class _Collective(Primitive):
    def __init__(self, group=WORLD_GROUP):
        super().__init__()
        if not isinstance(group, str):
            raise TypeError(f"{self.name}: group must be a str, got {group!r}")
        self.group = group

    def _attrs(self, shape, k):
        return {}

    def construct(self, x):
        run = interpreter.base().run_collective
        if isinstance(x, (tuple, list)):
            return tuple(run(self, v) for v in x)
        return run(self, x)

class AllReduce(_Collective):
    """Reduce the devices' values over `group` (op "sum", "mean", "max", "min" or
    "prod"); every device gets the result (see the module docstring)."""
    name = "AllReduce"

    def __init__(self, op="sum", group=WORLD_GROUP):
        super().__init__(group)
        if op not in _OPS:
            raise ValueError(f"AllReduce: op={op!r} is not valid; expected one of "
                             f"{', '.join(repr(o) for o in _OPS)}")
        self.op = op

    def _attrs(self, shape, k):
        return {"op": self.op}


class AllGather(_Collective):
    """Concatenate every device's value along dim 0 (a plain value of shape
    ``(k * s0, ...)``)."""
    name = "AllGather"


class ReduceScatter(_Collective):
    """Reduce over `group`, then device d keeps part d of dim 0 (a device-local value)."""
    name = "ReduceScatter"

    def __init__(self, op="sum", group=WORLD_GROUP):
        super().__init__(group)
        if op not in _OPS:
            raise ValueError(f"ReduceScatter: op={op!r} is not valid; expected one of "
                             f"{', '.join(repr(o) for o in _OPS)}")
        self.op = op

    def _attrs(self, shape, k):
        return {"op": self.op}


class Broadcast(_Collective):
    """Every device of `group` gets the value of its device `root_rank` (counted within
    the group). Takes a Tensor, or a tuple of Tensors as MindSpore's (and returns a
    tuple then)."""
    name = "Broadcast"

    def __init__(self, root_rank=0, group=WORLD_GROUP):
        super().__init__(group)
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
            raise ValueError(f"Broadcast: root_rank={root_rank!r} must be an int >= 0")
        self.root_rank = root_rank

    def _attrs(self, shape, k):
        if self.root_rank >= k:
            raise ValueError(f"Broadcast: root_rank={self.root_rank} is out of range for "
                             f"group {self.group!r} of {k} devices; expected 0 <= root_rank "
                             f"< {k}")
        return {"root": self.root_rank}


class AlltoAll(_Collective):
    """Device d splits its value into `split_count` chunks along `split_dim` and sends
    chunk j to device j, which concatenates what it receives (in source order) along
    `concat_dim`. `split_count` must equal the group's device count."""
    name = "AlltoAll"

    def __init__(self, split_count=1, split_dim=0, concat_dim=0, group=WORLD_GROUP):
        super().__init__(group)
        if not _is_int(split_count) or split_count < 1:
            raise ValueError(f"AlltoAll: split_count={split_count!r} must be a positive int")
        for key, v in (("split_dim", split_dim), ("concat_dim", concat_dim)):
            if not _is_int(v):
                raise TypeError(f"AlltoAll: {key} must be an int, got {v!r}")
        self.split_count, self.split_dim, self.concat_dim = \
            int(split_count), int(split_dim), int(concat_dim)

    def _attrs(self, shape, k):
        return {"split_count": self.split_count, "split_dim": self.split_dim,
                "concat_dim": self.concat_dim}
