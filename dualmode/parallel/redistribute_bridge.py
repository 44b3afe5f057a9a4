"""Moving a tensor into a required layout (the step the sharding engine takes before
running an op). Uses the planner's executor when it is available; otherwise the
always-correct route: assemble the global value (an AllGather over the split axes and
an AllReduce over the partial ones, reported as "redistribution") and keep each
device's block of it."""
from __future__ import annotations

import numpy as np

from .._core._tensor import TensorBase
from ..communication.totals import as_stack, remember_totals, stored
from ..communication.trace import comm_cause, pending_sum, record
from ..tensor import Parameter
from .tensor_layout import TensorLayout
from .devices import live_backend, world_stack
from .redistribute import execute, plan_redistribution, run_plan_grid


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
