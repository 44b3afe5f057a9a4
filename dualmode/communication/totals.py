"""Stacks of pending sums that remember their totals (and blocks their value).

When one process holds every device ("sim"), an op that produces a pending sum often
computes its total first: the grouped MatMul (:func:`dualmode.parallel.rules.contract.
contract_groups`) runs one GEMM per group of devices that share a sum and only then
writes that group's total as equal shares, one per device. Whoever later adds the
shares up (a redistribution that needs the global value, an AllReduce over exactly
those groups) gets the same numbers from the totals without reading the shares — and
the exact totals, where adding ``parts`` shares of ``total / parts`` may round.

Over no axes the totals are the blocks themselves: the stack of a plain value cut into
a layout remembers the value (its blocks as a device grid of views), so an op that
wants the blocks as a grid, or a redistribution that wants the whole value, reads the
value instead of gathering the copies back (the grouped MatMul's inputs).

A stack is remembered by identity (a weak reference: the entry leaves with the stack)
and made read-only, as are its totals, so neither can change behind the record. A view
or copy of a remembered stack is not remembered; it is added up as any other.

Such stacks need not be written at all. While :data:`DEFERRING` is on (a ``with
DEFERRING:`` block around the steps whose results become Tensors, or graph steps that
read deferred stacks), the grouped MatMul, a redistribution of a known value into blocks
that would be a copy, and a result computed once per replica set return a
:class:`DeferredShares` instead of the stack. A Tensor that wraps one writes the stack
on the first read of its ``_data``; the readers that know this form (through
:func:`known_totals`) take the totals, and the stack is never written.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .._core._dp import TOTALS, remember_totals, share_of
from .._core._tensor import DEFERRING, Deferred, deferral_on

__all__ = ["remember_totals", "known_totals", "group_totals", "DeferredShares", "DEFERRING",
           "deferral_on", "as_stack", "share_of", "stored"]

#: id(stack) -> (weak reference to the stack, totals, device matrix, summed axes): the
#: registry kept in C (``_core._dp.TOTALS``; ``remember_totals`` documented there), so
#: the data-parallel dispatch records the equal shares it makes without a Python call
_TOTALS = TOTALS


def known_totals(stack: np.ndarray, device_matrix, axes) -> Optional[np.ndarray]:
    """The totals grid recorded for `stack` (this very object, or a
    :class:`DeferredShares`) as pending sums over the sorted device `axes` of
    `device_matrix`, or None."""
    if type(stack) is DeferredShares:
        if stack.axes == tuple(axes) and stack.device_matrix == tuple(device_matrix):
            return stack.totals
        return None
    found = _TOTALS.get(id(stack))
    if found is None or found[0]() is not stack or found[3] != tuple(axes) \
            or found[2] != tuple(device_matrix):
        return None
    return found[1]


def group_totals(stack: np.ndarray, members: np.ndarray, device_matrix=None,
                 group_axes=()) -> Optional[np.ndarray]:
    """``(num_groups, *local)``: the totals of `stack`'s pending sums for the groups of
    ranks `members` ``(num_groups, group_size)``, when they are exactly the groups the
    sums were recorded over (in any order); else None. When the groups come as axes of
    the recorded device matrix (`device_matrix`, `group_axes`), a view of the totals."""
    found = _TOTALS.get(id(stack))
    if found is None or found[0]() is not stack or not found[3]:
        return None
    totals, dm, axes = found[1], found[2], found[3]
    k = len(dm)
    local = totals.shape[k:]
    others = [a for a in range(k) if a not in axes]
    if device_matrix is not None and tuple(device_matrix) == dm \
            and tuple(sorted(group_axes)) == axes:
        red = totals[tuple(0 if a in axes else slice(None) for a in range(k))]
        shape = tuple(dm[a] for a in others) + local
        if red.shape != shape:                 # totals that repeat over some other axis
            red = np.broadcast_to(red, shape)
        return red.reshape((members.shape[0],) + local)
    if members.shape[1] != math.prod(dm[a] for a in axes):
        return None
    coords = np.unravel_index(members, dm)                 # per axis, (G, group_size)
    for a in others:                                       # one group: one coordinate
        if (coords[a] != coords[a][:, :1]).any():
            return None
    return totals[tuple(coords[a][:, 0] if totals.shape[a] > 1 else
                        np.zeros(members.shape[0], np.int64) for a in range(k))]


# ---------------------------------------------------------------------------
# shares not written until read
# ---------------------------------------------------------------------------
class DeferredShares(Deferred):
    """The stack ``(prod(device_matrix), *local)`` of equal shares ``totals / parts``
    of pending sums over the device `axes`, described by its `totals` (a grid as in
    :func:`remember_totals`) and written only when read. Over no axes (``parts`` 1) it
    is the blocks of a whole value. The written stack is remembered with its totals,
    so readers of either form get the same numbers."""

    def __init__(self, totals: np.ndarray, device_matrix, axes, parts: int):
        device_matrix = tuple(device_matrix)
        super().__init__((math.prod(device_matrix),) + totals.shape[len(device_matrix):],
                         totals.dtype)
        if totals.flags.writeable:
            totals.flags.writeable = False
        self.totals, self.device_matrix = totals, device_matrix
        self.axes, self.parts = tuple(sorted(axes)), parts

    def add_in_place(self, totals: np.ndarray) -> bool:
        """Add `totals` (a grid shaped like :attr:`totals`) into this still unwritten
        value's own totals. Only for the owner of a value nothing else has read, whose
        totals no other array shares (a running sum the caller made): the read-only flag
        this class sets is lifted for the addition. False, nothing done, when the shapes
        differ or the totals lie in read-only memory."""
        t = self.totals
        if totals.shape != t.shape:
            return False
        try:
            t.flags.writeable = True          # made read-only when shared; it is not
        except ValueError:
            return False
        np.add(t, totals, out=t)
        t.flags.writeable = False
        return True

    def _write(self):
        dm, local = self.device_matrix, self.shape[1:]
        if all(t == 1 for t in self.totals.shape[:len(dm)]):
            # one total: every device a view of one share (of the value itself)
            one = self.totals.reshape(local)
            out = np.broadcast_to(one if self.parts == 1 else share_of(one, self.parts),
                                  self.shape)
        else:
            out = np.empty(self.shape, dtype=self.dtype)
            if self.parts == 1:                     # the blocks of a whole value
                np.copyto(out.reshape(dm + local), self.totals)
            else:
                share_of(self.totals, self.parts, out=out.reshape(dm + local))
        return remember_totals(out, self.totals, dm, self.axes)


def stored(t):
    """A distributed Tensor's stack as it is stored: a deferred stack stays unwritten
    (for readers that take its totals, or :func:`as_stack` it when they must)."""
    return t._lazy if t._lazy is not None else t._data


def as_stack(stack):
    """`stack` as an array: a :class:`Deferred` is written."""
    return stack.materialize() if isinstance(stack, Deferred) else stack
