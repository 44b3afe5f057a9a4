"""Moving a distributed tensor's pieces without changing its value: the recorded
``Redistribute`` op, pending sums resolved (AllReduce), a value gathered whole
(AllGather), and a tensor moved into any required layout (the step the sharding engine
takes before running an op: the planner's executor when it is available; otherwise the
always-correct route, which assembles the global value — an AllGather over the split
axes and an AllReduce over the partial ones, reported as "redistribution" — and keeps
each device's block of it). Each has a Tensor form (recorded on the tape, so gradients
pass through) and a stack form (what the graph executor runs). The AllReduce that
resolves a pending sum is reported under the op that made it (the layout's
``partial_op``), with the op that needed it as ``resolved_by``.
"""
from __future__ import annotations

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..communication.totals import as_stack, remember_totals, stored
from ..communication.trace import comm_cause, pending_sum, record
from ..ops._registry import register, same_as_input
from ..tensor import Parameter
from .devices import backend as _backend
from .devices import live_backend, world_stack
from .devices import op_cause as _cause
from .redistribution.executor import execute, run_plan_grid
from .redistribution.planner import plan_redistribution
from .stacks import is_batch_layout
from .tensor_layout import TensorLayout

__all__ = ["REDISTRIBUTE", "moved", "resolve_partial", "resolve_stack", "gather_global",
           "gather_stack"]


def resolve_partial(t, op_name):
    """AllReduce a partial tensor into one without pending sums (plain when nothing else
    is split). Recorded on the tape, so gradients flow through it."""
    stack, layout = resolve_stack(t._data, t._layout, op_name)
    return moved(t, stack, layout)


def resolve_stack(stack, layout, op_name, reason=None):
    """`stack` in `layout` with its pending sums AllReduced: ``(stack, layout without
    partial)``, or ``(global value, None)`` when nothing else is split. The AllReduce is
    reported under the op that made the sums (``layout.partial_op``), resolved by
    `op_name` (with `reason`; None: the forward or backward pass running)."""
    with _cause(op_name, reason), pending_sum(layout.partial_op):
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


def gather_stack(stack, layout, op_name, reason=None):
    """The global value of `stack` in `layout`: pending sums AllReduced, splits
    AllGathered (reported with `reason`; None: the resolve as the pass running, the
    gathers as "redistribution")."""
    if layout.partial:
        stack, layout = resolve_stack(stack, layout, op_name, reason)
        if layout is None:
            return stack
    backend = _backend()
    if is_batch_layout(layout):
        with _cause(op_name, reason or "redistribution"):
            out = backend.all_gather(stack, members=None, axis=0)
        return np.asarray(out[0])
    if stack.shape[0] != layout.device_num:
        # a process holding some devices (one per MPI rank): one AllGather within each
        # group of devices that differ only along the splitting axes, the groups "sim"
        # records; every device's block is then the one of the member of this process's
        # group at its coordinates along those axes (one replica of each block)
        groups = layout.group_members(layout.split_axes)
        with _cause(op_name, reason or "redistribution"):
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
    with _cause(op_name, reason or "redistribution"):
        record("AllGather", group, layout.device_num // group, stack[0].nbytes)
    return layout.assemble(stack)


def _report_gather(src: TensorLayout, nbytes: int, op_name, reason):
    with comm_cause(op_name, reason):
        if src.partial:
            group = int(np.prod([src.device_matrix[a] for a in src.partial]))
            record("AllReduce", group, src.device_num // group, nbytes)
        split = src.split_axes
        if split:
            group = int(np.prod([src.device_matrix[a] for a in split]))
            record("AllGather", group, src.device_num // group, nbytes)


def redistribute_tensor(x, dst: TensorLayout, op_name=None, reason="redistribution"):
    """The local stack of `x` (a Tensor, distributed or not, or an array) in `dst`;
    the collectives are reported with `reason`."""
    if isinstance(x, TensorBase) and x._layout is not None:
        return move_stack(stored(x), x._layout, dst, op_name, reason)
    value = x._value() if isinstance(x, TensorBase) else np.asarray(x)
    stack = local_stack(value, dst)
    if isinstance(x, TensorBase) and not isinstance(x, Parameter):
        remember_blocks(stack, value, dst)
    return stack


def remember_blocks(stack, value, dst: TensorLayout):
    """Record that `stack` holds every device's blocks of `value` in `dst` (see
    :mod:`dualmode.communication.totals`), so a device grid of them, or the whole value,
    is read from `value` itself. Only for values that never change (a plain Tensor's;
    not a Parameter's, which the optimizer updates); `stack` becomes read-only. Stacks
    under :data:`REMEMBER_MIN_BYTES` are not recorded: copying them costs less."""
    if stack.nbytes >= REMEMBER_MIN_BYTES and not dst.partial \
            and stack.shape[0] == dst.device_num and stack.strides[0] != 0:
        remember_totals(stack, dst.local_blocks_grid(value), dst.device_matrix, ())


#: the smallest stack whose whole value :func:`remember_blocks` records
REMEMBER_MIN_BYTES = 64 * 1024


def move_stack(stack, src: TensorLayout, dst: TensorLayout, op_name=None,
               reason="redistribution"):
    """`stack` (this process's shards in `src`) as its shards in `dst`. Pending sums
    resolved on the way are reported under the op that made them (``src.partial_op``)."""
    if src.partial:
        with pending_sum(src.partial_op):
            return _move_stack(stack, src, dst, op_name, reason)
    return _move_stack(stack, src, dst, op_name, reason)


def _move_stack(stack, src, dst, op_name, reason):
    if src.device_num == dst.device_num:
        plan = plan_redistribution(src, dst, stack.itemsize or 1)
        return execute(plan, stack, op_name=op_name, reason=reason)
    stack = as_stack(stack)
    global_value = src.assemble(world_stack(stack, src))
    _report_gather(src, stack[0].nbytes, op_name, reason)
    return local_stack(global_value, dst)


def local_stack(global_value, dst: TensorLayout):
    """This process's blocks of a global value in `dst` (no communication)."""
    b = live_backend()
    if b is not None and len(b.local_ranks) < dst.device_num == b.world_size:
        # a process holding some devices ("mpi"): only its own blocks
        if not any(dst.tensor_map):
            return np.broadcast_to(global_value[None], (len(b.local_ranks),)
                                   + tuple(global_value.shape))
        return dst.local_blocks_of(global_value, b.local_ranks)
    if not any(dst.tensor_map):
        return np.broadcast_to(global_value[None], (dst.device_num,) + tuple(global_value.shape))
    return dst.local_blocks(global_value)


def redistribute_grid(x, dst: TensorLayout, op_name=None, reason="redistribution"):
    """`x` (a Tensor, distributed or not) in `dst` as an array broadcastable to
    ``dst.device_matrix + dst.local_shape`` (size 1 along device axes that split nothing,
    so replicas are neither written nor computed twice); the collectives are reported
    with `reason`. None when this process does not hold every device (use
    :func:`redistribute_tensor`)."""
    if dst.partial:
        return None
    if isinstance(x, TensorBase) and x._layout is not None:
        src = x._layout
        if not isinstance(src, TensorLayout) or src.device_num != dst.device_num:
            return None
        stack = stored(x)
        plan = plan_redistribution(src, dst, stack.itemsize or 1)
        with pending_sum(src.partial_op if src.partial else None):
            return run_plan_grid(plan, stack, op_name=op_name, reason=reason)
    value = x._value() if isinstance(x, TensorBase) else np.asarray(x)
    return dst.local_blocks_grid(value)                 # a plain value: local slices only
