"""Which devices this process runs: the live communication backend, seen from the
parallel layer.

Everything in :mod:`dualmode.parallel` that needs the device count, the backend's
collectives or whether this process holds every device asks here, so no module of the
layer reaches into another for it.
"""
from __future__ import annotations

import numpy as np

from .. import context
from .._core import _tensor as _core
from ..communication import _live_backend, get_backend, trace
from ..communication.management import ensure_init, no_device_num_error
from ..communication.trace import comm_cause

__all__ = ["backend", "live_backend", "device_num", "parallel_active", "some_devices",
           "holds_all_devices", "op_cause", "world_stack"]


#: the communication state whose ``backend`` is the live backend (None before
#: ``communication.init()``), read directly by the C dispatch path (_core/_dp.pyx)
BACKEND_STATE = context._STATE.comm


def backend():
    """The live backend (RuntimeError naming ``init`` when there is none)."""
    return get_backend()


def live_backend():
    """The live backend, or None before ``communication.init()``."""
    return _live_backend()


def device_num() -> int:
    """Devices of the live parallel context (1 when none)."""
    b = _live_backend()
    return b.world_size if b is not None else 1


def parallel_active() -> bool:
    """True when ops should run distributed: a parallel mode and >1 device.

    Never a silent single device: with a parallel mode set and no backend yet, the
    backend ``init()`` would make is started (``device_num`` set, or launched by
    mpiexec); a parallel mode whose simulated devices are only one because
    ``device_num`` was never set is a ValueError naming ``device_num``.
    """
    cfg = context._STATE.auto_parallel
    if cfg.parallel_mode == "stand_alone":
        return False
    b = _live_backend()
    if b is None:
        if context._STATE.ps.enable_ps:     # a parameter server's scheduler or server
            return False
        b = ensure_init(cfg.parallel_mode)
    elif b.world_size == 1 and b.name == "sim" and cfg.device_num is None:
        raise no_device_num_error(cfg.parallel_mode)
    return b.world_size > 1


def some_devices() -> bool:
    """Does this process hold only some of the job's devices (backend "mpi": stacks of
    one device)? The "sim" fast paths that view a stack as every device's shards are
    taken only when it does not."""
    b = _live_backend()
    return b is not None and len(b.local_ranks) < b.world_size


def holds_all_devices(n: int) -> bool:
    """Does this process hold all `n` devices (the "sim" backend)?"""
    b = _live_backend()
    return b is not None and len(b.local_ranks) == n


def op_cause(op_name, reason=None):
    """Attribute the collectives issued inside the block to `op_name`: "forward", or
    "backward" while the tape runs a backward pass, unless `reason` says otherwise.
    While no report listens nothing is recorded, so there is no cause to set (every op
    of a step enters one)."""
    if not trace._STATE.reports:
        return _NO_CAUSE
    return comm_cause(op_name, op_reason(reason))


class _NoCause:
    """The ``with`` block of :func:`op_cause` while nothing records."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_CAUSE = _NoCause()


def op_reason(reason=None) -> str:
    """`reason`, or "forward"/"backward" (whichever pass runs) when it is None."""
    return reason or ("backward" if _core.in_backward() else "forward")


def world_stack(stack, layout) -> np.ndarray:
    """The stack of every device's shards of `layout`, from this process's `stack`: the
    stack itself when it holds them all ("sim"), else an AllGather over the world that
    CommReport does not record (an observation; see Backend.world_stack)."""
    if stack.shape[0] == layout.device_num:
        return stack
    return get_backend().world_stack(stack)
