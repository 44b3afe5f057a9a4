"""Global values and this process's stacks of shards.

A distributed Tensor keeps ``_layout`` (a TensorLayout) and, in ``_data``, the stack of
the local shards of the devices this process holds (leading axis = local devices):
every device's under "sim", its own only under "mpi". These functions go between a
global value and such a stack; no collective of the program is made (reading a global
value under "mpi" gathers the world's stacks, an observation CommReport does not
record).
"""
from __future__ import annotations

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..communication.totals import known_totals, stored
from .devices import live_backend as _live_backend
from .devices import some_devices as _some_devices
from .devices import world_stack
from .replicas import replica_blocks
from .tensor_layout import TensorLayout

__all__ = ["is_batch_layout", "local_rows", "distribute", "assemble"]


def is_batch_layout(layout) -> bool:
    """Split on dim 0 over a 1-axis device matrix into pieces of equal size, nothing
    else split or partial (the stack, its first two axes merged, is the global value)."""
    return (layout is not None and len(layout.device_matrix) == 1 and not layout.partial
            and len(layout.tensor_map) > 0 and layout.tensor_map[0] == (0,)
            and all(m == () for m in layout.tensor_map[1:]) and layout.even)




def local_rows(arr, layout: TensorLayout) -> np.ndarray:
    """The stack of this process's blocks of the global value `arr` in `layout` (every
    device's under "sim"; only ``backend.local_ranks``' otherwise, the others never
    built)."""
    b = _live_backend()
    if b is not None and len(b.local_ranks) < layout.device_num == b.world_size:
        return layout.local_blocks_of(arr, b.local_ranks)
    return layout.local_blocks(arr)


def distribute(x, layout: TensorLayout):
    """A distributed Tensor holding `x` (a Tensor or array with the global value)
    in `layout`: this process's blocks of it. Batch splits are views; other layouts
    copy the local blocks."""
    arr = x._value() if isinstance(x, TensorBase) else np.asarray(x)
    if _some_devices():
        return _core.wrap_dist(local_rows(arr, layout), layout)
    if is_batch_layout(layout):
        n = layout.device_matrix[0]
        stack = arr.reshape((n, arr.shape[0] // n) + arr.shape[1:])
    else:
        stack = layout.local_blocks(arr)
    return _core.wrap_dist(stack, layout)


def assemble(t) -> np.ndarray:
    """The global value of a distributed tensor (an observation, not a collective of the
    program: under "mpi" an unrecorded AllGather over the world, so every rank must
    read it, in the same order)."""
    layout = t._layout
    grid = replica_blocks(t)
    if grid is not None:                   # a Parameter's replicas stored once: read them
        return layout.assemble_totals(grid)
    if isinstance(layout, TensorLayout):
        # a stack whose whole value is known (pending sums' totals, deferred or not; the
        # blocks of a plain value): read it, the stack is neither written nor added up
        totals = known_totals(stored(t), layout.device_matrix, layout.partial)
        if totals is not None:
            return layout.assemble_totals(totals)
    s = t._data
    if isinstance(layout, TensorLayout) and s.shape[0] != layout.device_num:
        s = world_stack(s, layout)
    if is_batch_layout(layout):
        return s.reshape((s.shape[0] * s.shape[1],) + s.shape[2:])
    return layout.assemble(s)
