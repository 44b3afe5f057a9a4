"""Moving a distributed tensor's pieces without changing its value: the recorded
``Redistribute`` op, pending sums resolved (AllReduce), a value gathered whole
(AllGather). Each has a Tensor form (recorded on the tape, so gradients pass through)
and a stack form (what the graph executor runs). The AllReduce that resolves a pending
sum is reported under the op that made it (the layout's ``partial_op``), with the op
that needed it as ``resolved_by``.
"""
from __future__ import annotations

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..communication.trace import pending_sum, record
from ..ops._registry import register, same_as_input
from .devices import backend as _backend
from .devices import op_cause as _cause
from .stacks import is_batch_layout

__all__ = ["REDISTRIBUTE", "moved", "resolve_partial", "resolve_stack", "gather_global",
           "gather_stack"]


def resolve_partial(t, op_name):
    """AllReduce a partial tensor into one without pending sums (plain when nothing else
    is split). Recorded on the tape, so gradients flow through it."""
    stack, layout = resolve_stack(t._data, t._layout, op_name)
    return moved(t, stack, layout)


def resolve_stack(stack, layout, op_name):
    """`stack` in `layout` with its pending sums AllReduced: ``(stack, layout without
    partial)``, or ``(global value, None)`` when nothing else is split. The AllReduce is
    reported under the op that made the sums (``layout.partial_op``), resolved by
    `op_name`."""
    with _cause(op_name), pending_sum(layout.partial_op):
        out = _backend().all_reduce(stack, members=_members(layout, layout.partial), op="sum")
    rest = layout.without_partial()
    if all(m == () for m in rest.tensor_map):
        return np.asarray(out[0]), None
    return np.asarray(out), rest


# Moving a tensor into another layout changes where its pieces live, not its value,
# so the gradient passes through unchanged (in whatever layout it arrives). On a plain
# global value the kernel is the identity; the moves themselves are made by `moved`.
REDISTRIBUTE = register("Redistribute", infer=same_as_input,
                        kernel=lambda attrs, x: x, backward=lambda node, g: (g,))


def moved(x, stack, layout):
    """`x` (a Tensor) now stored as `stack` in `layout`, as a recorded Redistribute."""
    rec = isinstance(x, TensorBase) and x._node is not None and _core.recording()
    return _core.finish(REDISTRIBUTE, {"dst": layout}, (x,), stack, rec, (layout,))


def _members(layout, axes):
    return layout.group_members(axes)


def gather_global(t, op_name):
    """The global value of a distributed input, moved by an AllGather (fallback)."""
    return gather_stack(t._data, t._layout, op_name)


def gather_stack(stack, layout, op_name):
    """The global value of `stack` in `layout`: pending sums AllReduced, splits
    AllGathered (reported as "redistribution")."""
    if layout.partial:
        stack, layout = resolve_stack(stack, layout, op_name)
        if layout is None:
            return stack
    backend = _backend()
    if is_batch_layout(layout):
        with _cause(op_name, "redistribution"):
            out = backend.all_gather(stack, members=None, axis=0)
        return np.asarray(out[0])
    if stack.shape[0] != layout.device_num:
        # a process holding some devices (one per MPI rank): one AllGather within each
        # group of devices that differ only along the splitting axes, the groups "sim"
        # records; every device's block is then the one of the member of this process's
        # group at its coordinates along those axes (one replica of each block)
        groups = layout.group_members(layout.split_axes)
        with _cause(op_name, "redistribution"):
            out = backend.all_gather(np.ascontiguousarray(stack)[:, None], members=groups,
                                     axis=0)
        k = groups.shape[1]
        pos = np.empty(layout.device_num, dtype=np.int64)
        pos[groups.ravel()] = np.tile(np.arange(k, dtype=np.int64), groups.shape[0])
        return layout.assemble(out[0][pos])
    # one AllGather over the axes that split the tensor; under "sim" the blocks are
    # reassembled in place, so only the record is made here
    group = 1
    for a in layout.split_axes:
        group *= layout.device_matrix[a]
    with _cause(op_name, "redistribution"):
        record("AllGather", group, layout.device_num // group, stack[0].nbytes)
    return layout.assemble(stack)
