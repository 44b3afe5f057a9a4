"""Stacks of pending sums that remember their totals.

When one process holds every device ("sim"), an op that produces a pending sum often
computes its total first: the grouped MatMul (:func:`dualmode.parallel.rules.
contract_groups`) runs one GEMM per group of devices that share a sum and only then
writes that group's total as equal shares, one per device. Whoever later adds the
shares up (a redistribution that needs the global value, an AllReduce over exactly
those groups) gets the same numbers from the totals without reading the shares — and
the exact totals, where adding ``parts`` shares of ``total / parts`` may round.

A stack is remembered by identity (a weak reference: the entry leaves with the stack)
and made read-only, as are its totals, so neither can change behind the record. A view
or copy of a remembered stack is not remembered; it is added up as any other.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import numpy as np

__all__ = ["remember_totals", "known_totals"]

#: id(stack) -> (weak reference to the stack, totals, device matrix, summed axes)
_TOTALS: dict = {}


def remember_totals(stack: np.ndarray, totals: np.ndarray, device_matrix: Tuple[int, ...],
                    axes) -> np.ndarray:
    """Record that `stack` ``(prod(device_matrix), *local)`` holds pending sums over the
    device `axes` whose totals are `totals`: a device grid ``device_matrix + local`` with
    size 1 along `axes` (the devices of one group share one total) and along any axis
    over which the totals repeat. Returns `stack`, now read-only."""
    device_matrix = tuple(device_matrix)
    axes = tuple(sorted(axes))
    k = len(device_matrix)
    if totals.shape[k:] != stack.shape[1:] or any(
            totals.shape[a] != 1 for a in axes) or any(
            t not in (1, d) for t, d in zip(totals.shape[:k], device_matrix)):
        raise ValueError(f"remember_totals: totals of shape {totals.shape} do not fit a "
                         f"stack {stack.shape} summed over axes {axes} of device matrix "
                         f"{device_matrix}")
    if stack.flags.writeable:
        stack.flags.writeable = False
    if totals.flags.writeable:
        totals.flags.writeable = False
    key = id(stack)

    def forget(ref):
        if _TOTALS.get(key, (None,))[0] is ref:
            del _TOTALS[key]

    _TOTALS[key] = (weakref.ref(stack, forget), totals, device_matrix, axes)
    return stack


def known_totals(stack: np.ndarray, device_matrix, axes) -> Optional[np.ndarray]:
    """The totals grid recorded for `stack` (this very object) as pending sums over the
    sorted device `axes` of `device_matrix`, or None."""
    found = _TOTALS.get(id(stack))
    if found is None or found[0]() is not stack or found[3] != tuple(axes) \
            or found[2] != tuple(device_matrix):
        return None
    return found[1]
