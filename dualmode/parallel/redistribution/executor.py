"""Running a redistribution plan on a stack of local shards: step by step through
the backend's collectives, or (every device in this process) through the global
value, recording the same collectives."""
from __future__ import annotations

import math
from typing import Dict, Optional, Union

import numpy as np

from ...communication import _live_backend, trace
from ...communication.sim import SimBackend, replicated_view
from ..._core._tensor import Deferred
from ...communication.totals import (DeferredShares, as_stack, deferral_on, known_totals,
                                     remember_totals)
from ...communication.trace import comm_cause
from ..layout_spec import LayoutSpec
from ..tensor_layout import TensorLayout
from .planner import plan_redistribution
from .steps import Plan


# ============================================================================ executor

_SIM: Dict[int, object] = {}


def _resolve_backend(backend, src, stack):
    if backend is not None:
        if backend.world_size != src.device_num:
            raise ValueError(f"redistribute: the backend has {backend.world_size} devices but "
                             f"{src!r} has {src.device_num}")
        return backend
    live = _live_backend()
    if live is not None and live.world_size == src.device_num:
        return live
    if stack.shape[0] == src.device_num:     # a stack of every device: simulate them
        sim = _SIM.get(src.device_num)
        if sim is None:
            sim = _SIM[src.device_num] = SimBackend(src.device_num)
        return sim
    raise RuntimeError(f"redistribute: no backend holds {src.device_num} devices; call "
                       "dualmode.communication.init() or pass backend=")


def _local_slice(x, dim, axes, parts, mesh, local_ranks):
    """Each local device keeps piece (its coordinates along ``axes``, row-major) of its
    block along ``dim``."""
    coords = mesh.rank_coords[list(local_ranks)]
    sizes = mesh.device_matrix
    piece = np.zeros(len(local_ranks), np.int64)
    for a in axes:
        piece = piece * sizes[a] + coords[:, a]
    n, local = x.shape[0], x.shape[1:]
    y = x.reshape((n,) + local[:dim] + (parts, local[dim] // parts) + local[dim + 1:])
    y = np.moveaxis(y, dim + 1, 1)
    return y[np.arange(n), piece]


def redistribute(stack: np.ndarray, src: TensorLayout, dst: Union[TensorLayout, LayoutSpec],
                 backend=None, *, op_name: Optional[str] = None,
                 reason: str = "redistribution") -> np.ndarray:
    """Move a stack of local shards from layout ``src`` to layout ``dst``.

    Parameters
    ----------
    stack : ndarray ``(local devices, *src.local_shape)``
        This process's shards in ``src`` (partial values for ``src.partial`` axes).
    src, dst : TensorLayout (``dst`` may be an applied Layout)
    backend : Backend, optional
        Defaults to the live backend (a "sim" backend of ``src.device_num`` devices when
        none is live and the stack holds every device).
    op_name : str, optional
        The op the redistribution is for, as CommReport shows it.

    Returns
    -------
    ndarray ``(local devices, *dst.local_shape)``
        The shards in ``dst`` (the input itself when the layouts are equal). May be a
        read-only view; copy before writing.
    """
    if not isinstance(stack, np.ndarray):
        stack = np.asarray(stack)
    plan = plan_redistribution(src, dst, stack.itemsize or 1)
    return run_plan(plan, stack, backend, op_name=op_name, reason=reason)


def run_plan(plan: Plan, stack: np.ndarray, backend=None, *,
             op_name: Optional[str] = None, reason: str = "redistribution") -> np.ndarray:
    """Execute ``plan`` on a stack of local shards in ``plan.src`` (see :func:`redistribute`).

    Every collective goes through ``backend`` inside ``comm_cause(op_name,
    "redistribution")``; LocalSlices are local numpy indexing.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"run_plan: expected a Plan, got {plan!r}")
    if not isinstance(stack, np.ndarray):
        stack = np.asarray(stack)
    src = plan.src
    backend = _resolve_backend(backend, src, stack)
    local_ranks = backend.local_ranks
    want = (len(local_ranks),) + src.local_shape
    if stack.shape != want:
        raise ValueError(f"redistribute: the stack has shape {np.shape(stack)}, expected "
                         f"{want} (local devices, *local shape of {src!r})")
    if not len(plan):
        return stack
    if not (src.even and plan.dst.even):
        return _run_uneven(plan, stack, backend, op_name, reason)
    x = stack
    mesh = plan._mesh(plan.device_matrix)
    with comm_cause(op_name, reason):
        for step in plan:
            kind = step[0]
            if kind == "LocalSlice":
                x = _local_slice(x, step[1][0], step[2], step[3], mesh, local_ranks)
            elif kind == "AllGather":
                x = backend.all_gather(x, mesh.group_members(step[2]), axis=step[1][0])
            elif kind == "AllToAll":
                x = backend.all_to_all(x, mesh.group_members(step[2]), split_axis=step[1][1],
                                       concat_axis=step[1][0])
            elif kind == "ReduceScatter":
                x = backend.reduce_scatter(x, mesh.group_members(step[2]), axis=step[1][0])
            elif kind == "AllReduce":
                x = backend.all_reduce(x, mesh.group_members(step[2]))
            else:                                       # Remesh
                mesh = plan._mesh(step.device_matrix)
    return x


def _run_uneven(plan, stack, backend, op_name, reason):
    """:func:`run_plan` for layouts whose splits do not all divide their dims. The
    plan's collectives over intermediate layouts do not compose for pieces of unequal
    size (gathering 2 of 4 pieces of 6 rows gives 4 rows, where a 2-way split holds 3).
    With every device in this process the move goes through the global value
    (assembled, then cut), recording the plan's collectives with the bytes of the real
    pieces. A process holding some devices cuts its blocks from a source that every
    device holds whole (no communication), resolves pending sums over a layout that
    stays the same with AllReduces of the (alike padded) pieces, and otherwise makes one
    AlltoAll in which each device sends every other the part of its piece that the
    other's new piece holds (:func:`_exchange`). Pending sums kept by the destination
    are stored whole on the first device of each sum."""
    src, dst = plan.src, plan.dst
    ranks = tuple(backend.local_ranks)
    if len(ranks) == src.device_num:
        if trace._STATE.reports or trace.GROUP_SINKS:
            with comm_cause(op_name, reason):
                _record_steps(plan, stack.itemsize)
        value = global_value(stack, src)
        whole = dst.without_partial()
        out = whole.local_blocks(value)
        ranks = None
    elif all(step[0] == "AllReduce" for step in plan):
        # the same pieces on both sides: sums of alike padded pieces (zeros + zeros)
        x = as_stack(stack)
        mesh = plan._mesh(plan.device_matrix)
        with comm_cause(op_name, reason):
            for step in plan:
                x = backend.all_reduce(x, mesh.group_members(step[2]))
        return x
    elif not src.split_axes and not src.partial:
        value = np.asarray(stack)[0]                  # every device holds the whole value
        out = dst.without_partial().local_blocks_of(value, ranks)
    else:
        with comm_cause(op_name, reason):
            out = _exchange(plan, as_stack(stack), backend)
    if not dst.partial:
        return out
    out = np.array(out)
    coords = dst.rank_coords[np.arange(dst.device_num) if ranks is None else list(ranks)]
    later = (coords[:, list(dst.partial)] != 0).any(axis=1)
    out[later] = 0                        # the other shares of each sum are zeros
    return out


def _exchange_plan(plan):
    """Who sends what in :func:`_exchange` (a function of the layouts, kept on the plan):
    ``(box_lo, box_hi, longest)``, the boxes ``(n, n, ndim)`` of the global tensor that
    device i sends device j (empty where it sends nothing) and the largest one's size.
    Every distinct source piece (a block, and with pending sums each summand of it) is
    sent once to each destination: by the destination itself when it holds it, else by
    one of its holders, spread over them."""
    found = plan.__dict__.get("_exchange")
    if found is not None:
        return found
    src, dst = plan.src, plan.dst
    n = src.device_num
    key = np.concatenate([src.block_index, src.rank_coords[:, list(src.partial)]], axis=1)
    _, group = np.unique(key, axis=0, return_inverse=True)
    group = np.asarray(group).reshape(-1)
    sends = np.zeros((n, n), bool)                 # sends[i, j]: device i sends to j
    everyone = np.arange(n)
    for g in range(int(group.max()) + 1):          # the distinct source pieces (<= n)
        holders = np.flatnonzero(group == g)
        pick = holders[everyone % len(holders)]
        pick[holders] = holders                    # a holder takes its own
        sends[pick, everyone] = True
    s_lo = src.part_starts
    s_hi = s_lo + src.local_shapes
    d_lo, d_hi = dst.part_starts, dst.part_starts + dst.local_shapes
    lo = np.maximum(s_lo[:, None, :], d_lo[None, :, :])
    hi = np.minimum(s_hi[:, None, :], d_hi[None, :, :])
    hi = np.where(sends[:, :, None] & (hi > lo).all(axis=2)[:, :, None], np.maximum(hi, lo),
                  lo)
    longest = int(np.prod(hi - lo, axis=2).max()) if n else 0
    found = plan.__dict__["_exchange"] = (lo, hi, longest)
    return found


def _box_index(lo, hi, origin, slot):
    """The flat indices, in a slot of shape `slot` whose first element is the global
    index `origin`, of the box ``[lo, hi)`` of the global tensor (row-major)."""
    axes = [np.arange(a - o, b - o) for a, b, o in zip(lo, hi, origin)]
    return np.ravel_multi_index(np.meshgrid(*axes, indexing="ij"), slot).ravel()


def _exchange_index(plan, rank):
    """For device `rank`: ``(send, recv)``, each ``(n, longest)`` flat indices into its
    source slot (what it sends each device, in order) and its destination slot (where
    what each device sends it goes); the slot's size marks the unused tail of a slot (a
    zero appended to the slot, a dump past the new piece). Kept on the plan."""
    cache = plan.__dict__.setdefault("_exchange_index", {})
    found = cache.get(rank)
    if found is not None:
        return found
    src, dst = plan.src, plan.dst
    lo, hi, longest = _exchange_plan(plan)
    n, width = src.device_num, max(longest, 1)
    s_size, d_size = int(np.prod(src.local_shape)), int(np.prod(dst.local_shape))
    send = np.full((n, width), s_size, np.int64)
    recv = np.full((n, width), d_size, np.int64)
    for j in range(n):                      # once per plan and device: what it sends j
        if (hi[rank, j] > lo[rank, j]).all():
            idx = _box_index(lo[rank, j], hi[rank, j], src.part_starts[rank], src.local_shape)
            send[j, :idx.size] = idx
    for i in range(n):                      # and where what i sends it goes
        if (hi[i, rank] > lo[i, rank]).all():
            idx = _box_index(lo[i, rank], hi[i, rank], dst.part_starts[rank], dst.local_shape)
            recv[i, :idx.size] = idx
    found = cache[rank] = (send, recv)
    return found


def _exchange(plan, stack, backend):
    """The destination's pieces from the source's (`stack`: this process's devices), for
    a process that holds some devices: one AlltoAll over every device, each sending each
    other the part of its piece that the other's new piece holds (flattened, in slots of
    the largest such part), each adding what it receives into its new piece (the
    summands of a pending sum add up). Packing and unpacking are one indexing each
    (:func:`_exchange_index`)."""
    src, dst = plan.src, plan.dst
    n = src.device_num
    ranks = list(backend.local_ranks)
    sends, recvs = zip(*[_exchange_index(plan, r) for r in ranks])
    flat = np.concatenate([stack.reshape(len(ranks), -1),
                           np.zeros((len(ranks), 1), stack.dtype)], axis=1)
    send = np.take_along_axis(flat, np.stack(sends).reshape(len(ranks), -1), axis=1)
    got = np.asarray(backend.all_to_all(send, np.arange(n)[None], split_axis=0,
                                        concat_axis=0))
    size = int(np.prod(dst.local_shape))
    out = np.zeros((len(ranks), size + 1), stack.dtype)
    where = np.stack(recvs).reshape(len(ranks), -1)
    rows = np.broadcast_to(np.arange(len(ranks))[:, None], where.shape)
    np.add.at(out, (rows, where), got)       # summands of a pending sum add up
    return out[:, :size].reshape((len(ranks),) + tuple(dst.local_shape))


# ============================================================================ direct executor

_RECORD_KIND = {"AllGather": "AllGather", "AllToAll": "AlltoAll",
                "ReduceScatter": "ReduceScatter", "AllReduce": "AllReduce"}


def _record_steps(plan: Plan, itemsize: int) -> None:
    """Record ``plan``'s collectives exactly as :func:`run_plan` makes the backend record
    them (kind, group size, groups, input bytes per device, and input plus output bytes
    as the memory note), without running them."""
    if trace.GROUP_SINKS:
        mesh = plan._mesh(plan.device_matrix)
        for step in plan:
            if step[0] == "Remesh":
                mesh = plan._mesh(step.device_matrix)
            elif step.communicates or step[4]:     # (a LocalSlice that moves rows)
                trace.note_groups(mesh.group_members(step[2]))
    if not trace._STATE.reports:
        return
    n = plan.src.device_num
    # a device's piece, as the number of parts of each dim: prod(n_d / parts_d) elements
    # (the pieces of a split that does not divide differ by one row; that is their mean,
    # so the recorded bytes averaged over the devices are exact)
    shape, split = plan.src.shape, list(plan.src.dim_parts)

    def piece():
        b = itemsize * math.prod(d / p for d, p in zip(shape, split))
        return int(b) if b == int(b) else b

    exact = plan.src.even and plan.dst.even
    scale = plan.itemsize and itemsize / plan.itemsize

    for step in plan:
        kind, dims, parts = step[0], step[1], step[3]
        if kind == "LocalSlice" and step[4]:
            # pieces of unequal size need not nest: a device's new piece may hold rows its
            # old one did not (8 rows cut in 2 then in 6: the third piece is row 4), which
            # the devices along the slice's axes send each other (an AlltoAll of unequal
            # counts, of the plan's exact bytes)
            before = _buffer_of("AllToAll", parts, step[4] * scale)
            split[dims[0]] *= parts
            trace.record("AlltoAll", parts, n // parts, before)
            trace.note_memory(before + piece())
            continue
        if kind in ("LocalSlice", "Remesh"):
            if kind == "LocalSlice":
                split[dims[0]] *= parts
            continue
        # pieces of unequal size: the buffer whose formula bytes are the plan's exact mean
        before = piece() if exact else _buffer_of(kind, parts, step[4] * scale)
        if kind == "AllGather":
            split[dims[0]] //= parts
        elif kind == "AllToAll":
            split[dims[1]] *= parts
            split[dims[0]] //= parts
        elif kind == "ReduceScatter":
            split[dims[0]] *= parts
        trace.record(_RECORD_KIND[kind], parts, n // parts, before)
        trace.note_memory(before + piece())


def _buffer_of(kind: str, parts: int, nbytes: float) -> float:
    """The input buffer for which the trace formula of `kind` over `parts` devices gives
    `nbytes` per device."""
    if kind == "AllGather":
        return nbytes / (parts - 1)
    if kind == "AllReduce":
        return nbytes * parts / (2 * (parts - 1))
    return nbytes * parts / (parts - 1)


def global_value(stack: np.ndarray, layout: TensorLayout) -> np.ndarray:
    """The global value held by a stack of every device's shards in ``layout`` (pending
    sums added up). A stride-0 stack (one buffer viewed by every device) is read once;
    a batch split is a view; a stack whose whole value is known (pending sums' totals,
    the blocks of a plain value: :mod:`dualmode.communication.totals`) reads it."""
    totals = known_totals(stack, layout.device_matrix, layout.partial)
    if totals is not None:
        return layout.assemble_totals(totals)
    stack = as_stack(stack)
    if stack.strides[0] == 0 and stack.shape[0] > 1 and not layout.split_axes:
        one = stack[0]
        if not layout.partial:
            return one
        parts = math.prod(layout.device_matrix[a] for a in layout.partial)
        return np.multiply(one, parts, dtype=stack.dtype)
    return layout.assemble(stack)


def blocks_of(value: np.ndarray, layout: TensorLayout) -> np.ndarray:
    """The stack of every device's block of the global ``value`` in ``layout`` (no
    partial axes): a read-only view of ``value`` when its strides allow (one buffer
    viewed by every device when nothing is split; a split of one dim over the device
    axes in order), else one copy."""
    if not layout.split_axes:
        return replicated_view(value, layout.device_num)
    return layout.local_blocks_view(value)


def run_plan_direct(plan: Plan, stack: np.ndarray, backend=None, *,
                    op_name: Optional[str] = None,
                    reason: str = "redistribution") -> np.ndarray:
    """The result of :func:`run_plan`, computed through the global value when this
    process holds every device ("sim"): the source blocks are assembled (pending sums
    added) and the destination blocks cut from it, one or two numpy passes whatever the
    number of steps. CommReport records exactly the collectives :func:`run_plan` would
    run. Plans that keep partial sums, or processes that hold only some devices, run
    step by step. While :data:`~dualmode.communication.totals.DEFERRING` is on, blocks
    of a known value that would be a copy are returned unwritten (a deferred stack)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"run_plan_direct: expected a Plan, got {plan!r}")
    if not isinstance(stack, (np.ndarray, Deferred)):
        stack = np.asarray(stack)
    src, dst = plan.src, plan.dst
    backend = _resolve_backend(backend, src, stack)
    if not len(plan) or dst.partial or len(backend.local_ranks) != src.device_num:
        return run_plan(plan, as_stack(stack), backend, op_name=op_name, reason=reason)
    if stack.shape != src.stack_shape:
        raise ValueError(f"redistribute: the stack has shape {np.shape(stack)}, expected "
                         f"{src.stack_shape} (local devices, *local shape of {src!r})")
    if trace._STATE.reports or trace.GROUP_SINKS:
        with comm_cause(op_name, reason):
            _record_steps(plan, stack.itemsize)
    totals = known_totals(stack, src.device_matrix, src.partial)
    known = totals is not None
    value = src.assemble_totals(totals) if known else global_value(stack, src)
    if known and dst.split_axes and deferral_on():
        out = dst.blocks_view(value)
        if out is None:             # blocks that need a copy, for a Tensor: written if read
            return DeferredShares(dst.local_blocks_grid(value), dst.device_matrix, (), 1)
    else:
        out = blocks_of(value, dst)
    if known and out.strides[0] != 0:
        # the source's whole value is known and never changes: so is the result's
        remember_totals(out, dst.local_blocks_grid(value), dst.device_matrix, ())
    return out


def run_plan_grid(plan: Plan, stack: np.ndarray, backend=None, *,
                  op_name: Optional[str] = None,
                  reason: str = "redistribution") -> Optional[np.ndarray]:
    """The destination blocks of :func:`run_plan_direct` without writing the replicas:
    an array broadcastable to ``dst.device_matrix + dst.local_shape``, of size 1 along
    the device axes that split nothing (usually a view of the global value). Records
    the same collectives. None when this process does not hold every device or the
    destination keeps partial sums (use :func:`execute` then)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"run_plan_grid: expected a Plan, got {plan!r}")
    src, dst = plan.src, plan.dst
    backend = _resolve_backend(backend, src, stack)
    if dst.partial or len(backend.local_ranks) != src.device_num:
        return None
    want = src.stack_shape
    if stack.shape != want:
        raise ValueError(f"redistribute: the stack has shape {np.shape(stack)}, expected "
                         f"{want} (local devices, *local shape of {src!r})")
    if not len(plan):
        known = known_totals(stack, dst.device_matrix, ())
        if known is not None and not dst.partial:
            return known                    # the blocks of a known value, as a grid
        return as_stack(stack).reshape(dst.device_matrix + dst.local_shape)
    if trace._STATE.reports or trace.GROUP_SINKS:
        with comm_cause(op_name, reason):
            _record_steps(plan, stack.itemsize)
    return dst.local_blocks_grid(global_value(stack, src))


def execute(plan: Plan, stack: np.ndarray, backend=None, *, op_name: Optional[str] = None,
            reason: str = "redistribution") -> np.ndarray:
    """Run ``plan`` the cheapest way for this process: LocalSlice-only plans step by
    step (one indexing each), anything that communicates through
    :func:`run_plan_direct` when every device is local, else :func:`run_plan`."""
    if plan.communicates:
        return run_plan_direct(plan, stack, backend, op_name=op_name, reason=reason)
    return run_plan(plan, as_stack(stack), backend, op_name=op_name, reason=reason)
