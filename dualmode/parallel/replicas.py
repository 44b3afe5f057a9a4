"""A sharded Parameter whose replicas are stored once.

A weight sharded over some device axes and repeated over the others (``((4, 1),)`` on 8
devices: 4 row blocks, each held by 2 devices) holds one stack ``(devices, *block)`` in
which every replica is a copy: the optimizer then updates each block once per replica.
When this process holds every device ("sim") and the stack would take
:data:`MIN_STACK_BYTES` or more, :func:`store_blocks` keeps instead one copy of each
distinct block: a writable device grid of shape ``device_matrix`` (size 1
along the replicated axes) ``+ local_shape``, in a :class:`ReplicaBlocks` (a deferred
stack, ``Tensor._lazy``). The readers that take device grids use it as it is:

* the sharding engine's grid inputs (``sharding.stack_grid``, ``sharding.replica_grid``,
  and a local that accepts grids is given them when a Parameter is stored so);
* graph mode's ``Program.bind``, which passes it on as stored;
* ``stacks.assemble`` (``asnumpy``), which reads the value from it;
* an optimizer update (``optimizer._sharded_pair``): each distinct block is updated
  once, from the gradient's grid; the optimizer's states of the weight are stored once
  as well.

Anything else that reads the stack (``Tensor._data``, a move into another layout, a
checkpoint's raw shards) writes it once: the written stack
then becomes the Parameter's storage for good (the grid is no longer used), so every
holder of the Parameter's storage keeps seeing one array, updated in place as before.
"""
from __future__ import annotations

import math

import numpy as np

from .._core._tensor import Deferred
from .devices import holds_all_devices
from .tensor_layout import TensorLayout

__all__ = ["ReplicaBlocks", "store_blocks", "replica_blocks"]


class ReplicaBlocks(Deferred):
    """The stack of a Parameter's blocks in `layout`, each distinct block stored once in
    `grid` (``layout.device_matrix`` with 1 along its replicated axes, then
    ``layout.local_shape``; writable: the optimizer updates it in place). Written as a
    full stack only when read as one; that stack (kept by :class:`Deferred`, and the
    Parameter's ``_data`` from its next read) then replaces the grid as the storage."""

    def __init__(self, grid: np.ndarray, layout: TensorLayout):
        super().__init__(layout.stack_shape, grid.dtype)
        self.grid = grid
        self.layout = layout
        self._written = False

    def current_grid(self, layout):
        """The grid, when it is still the storage and `layout` is its layout; else None
        (read the stack)."""
        if self._written or (layout is not self.layout and layout != self.layout):
            return None
        return self.grid

    def _write(self):
        lay = self.layout
        out = np.empty(self.shape, self.dtype)
        np.copyto(out.reshape(lay.device_matrix + lay.local_shape), self.grid)
        self._written = True        # from now on the stack (Deferred keeps it) is the value
        return out


#: the smallest stack (all devices' blocks) kept as a grid of distinct blocks: below it
#: the grid path of a small op costs more than updating the replicas saves
MIN_STACK_BYTES = 64 * 1024


def store_blocks(param, layout: TensorLayout, value: np.ndarray) -> bool:
    """Store `param` (a Parameter, the global `value`) in `layout` with each distinct
    block once (see the module docstring), when `layout` repeats over some device axis,
    this process holds every device, the dtype is a float and the stack would take at
    least :data:`MIN_STACK_BYTES`; False (nothing stored) otherwise."""
    if not layout.replicated_axes or layout.partial or value.dtype.kind != "f" \
            or math.prod(layout.stack_shape) * value.dtype.itemsize < MIN_STACK_BYTES \
            or not holds_all_devices(layout.device_num):
        return False
    grid = np.array(layout.local_blocks_grid(value), order="C")     # owned, writable
    param._data = None
    param._lazy = ReplicaBlocks(grid, layout)
    return True


def replica_blocks(t):
    """The writable grid of `t`'s distinct blocks when `t` (a Parameter) stores its
    replicas once (:class:`ReplicaBlocks`, still its storage); else None."""
    lazy = t._lazy
    if type(lazy) is ReplicaBlocks:
        return lazy.current_grid(t._layout)
    return None
