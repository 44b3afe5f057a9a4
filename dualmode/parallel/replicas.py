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

The grid may also be made where it is first used: a weight the parallel optimizer
updated as its slices (``optimizer_shard``) is stored as a :class:`ReplicaBlocks` whose
`source` AllGathers the slices into the grid on the first read (the grid, or the stack
written from it), so the gather writes each distinct block once and no replica.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .._core._tensor import Deferred
from .devices import holds_all_devices
from .tensor_layout import TensorLayout

__all__ = ["ReplicaBlocks", "store_blocks", "replica_blocks", "worth_storing_once"]


class ReplicaBlocks(Deferred):
    """The stack of a Parameter's blocks in `layout`, each distinct block stored once in
    `grid` (``layout.device_matrix`` with 1 along its replicated axes, then
    ``layout.local_shape``; writable: the optimizer updates it in place). Written as a
    full stack only when read as one; that stack (kept by :class:`Deferred`, and the
    Parameter's ``_data`` from its next read) then replaces the grid as the storage.

    `grid` is None when `source` makes it on first use: an object with ``dtype``,
    ``device_bytes`` (what a device holds until then) and ``gathered()`` (returns the
    grid, a fresh array; called once)."""

    def __init__(self, grid: Optional[np.ndarray], layout: TensorLayout, source=None):
        if grid is None and source is None:
            raise ValueError("ReplicaBlocks: give the grid, or a source that makes it")
        super().__init__(layout.stack_shape, grid.dtype if grid is not None else source.dtype)
        self.grid = grid
        self.layout = layout
        self.source = source        # None once the grid is made
        self._written = False

    def _fill(self) -> np.ndarray:
        """The grid, made by the source first if it is not yet."""
        if self.grid is None:
            self.grid = self.source.gathered()
            self.source = None
        return self.grid

    def current_grid(self, layout):
        """The grid, when it is still the storage and `layout` is its layout; else None
        (read the stack). A grid made on first use is made now."""
        if self._written or (layout is not self.layout and layout != self.layout):
            return None
        return self._fill()

    @property
    def device_bytes(self) -> int:
        """What one device stores: its block (the source's figure until it is made)."""
        if self.grid is None:
            return self.source.device_bytes
        return math.prod(self.layout.local_shape) * self.dtype.itemsize

    def stack_copy(self) -> np.ndarray:
        """A new array of the full stack (the storage stays as it is)."""
        lay = self.layout
        out = np.empty(self.shape, self.dtype)
        np.copyto(out.reshape(lay.device_matrix + lay.local_shape), self._fill())
        return out

    def _write(self):
        out = self.stack_copy()
        self._written = True        # from now on the stack (Deferred keeps it) is the value
        return out

    def __reduce__(self):
        # a copy (copy.deepcopy, pickle) holds the grid: a grid made on first use is
        # made now (a read of the value)
        self._fill()
        return super().__reduce__()


#: the smallest stack (all devices' blocks) kept as a grid of distinct blocks: below it
#: the grid path of a small op costs more than updating the replicas saves
MIN_STACK_BYTES = 64 * 1024


def worth_storing_once(layout: TensorLayout, dtype) -> bool:
    """Is a float value in `layout` worth storing with its replicas once (a process
    holding every device): `layout` repeats over some device axis, holds no pending
    sums, and its stack would take at least :data:`MIN_STACK_BYTES`?"""
    dtype = np.dtype(dtype)
    return bool(layout.replicated_axes) and not layout.partial and dtype.kind == "f" \
        and math.prod(layout.stack_shape) * dtype.itemsize >= MIN_STACK_BYTES


def store_blocks(param, layout: TensorLayout, value: np.ndarray) -> bool:
    """Store `param` (a Parameter, the global `value`) in `layout` with each distinct
    block once (see the module docstring), when `layout` repeats over some device axis,
    this process holds every device, the dtype is a float and the stack would take at
    least :data:`MIN_STACK_BYTES`; False (nothing stored) otherwise."""
    if not worth_storing_once(layout, value.dtype) or \
            not holds_all_devices(layout.device_num):
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
