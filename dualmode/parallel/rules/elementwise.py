"""Elementwise ops (any number of inputs, with numpy broadcasting): a family rule built
for every op of kind unary or binary, or declaring ``family=("elementwise",)`` (Cast,
Select, AddN, the logical ops).

The first input that splits a dim decides its device axes; the others are moved to
match, and the output keeps those splits. Pending sums stay pending through an op
linear in them (``a + b`` over the same devices, ``a * c``)."""
from __future__ import annotations

from ..._core._tensor import KIND_UNARY, broadcast_shapes
from ..redistribution.planner import plan_redistribution
from ..shared_dims import elementwise_pairs
from ..sharding import ShardPlan, expand_stack, layout, register_rule, run_kernel
from .base import parts as _parts
from .base import pending_sums

__all__ = ["rule"]


def _elementwise_plan(op, attrs, lays, dtypes):
    dist = [lay for lay in lays if lay is not None]
    pend = pending_sums(op, attrs, lays)
    if pend is None:
        return None
    pending, carriers = pend
    dm = dist[0].device_matrix
    out_shape = ()
    for lay in dist:
        out_shape = broadcast_shapes(op.name, out_shape, lay.shape)
    rank = len(out_shape)
    # the first input that splits a dim decides it; nothing is split along the axes of
    # a pending sum (a factor must be whole where the terms of the sum differ). When
    # letting the input split over the most devices decide first moves no more bytes
    # per device, it decides first: nothing is then computed twice.
    ref = _elementwise_refs(dist, rank, out_shape, pending)
    need = _elementwise_needs(lays, dm, ref, out_shape, pending, carriers)
    most = sorted(dist, key=lambda lay: -_parts(lay.device_matrix, lay.split_axes))
    if [id(lay) for lay in most] != [id(lay) for lay in dist]:
        ref2 = _elementwise_refs(most, rank, out_shape, pending)
        need2 = _elementwise_needs(lays, dm, ref2, out_shape, pending, carriers)
        if ref2 != ref and _moved_bytes(lays, need2) <= _moved_bytes(lays, need):
            ref, need = ref2, need2
    if carriers and _moved_bytes(lays, need) > _resolve_bytes(lays, carriers):
        # keeping the sum pending would gather a factor whole along its axes (a
        # per-channel sum times a batch-split activation): finishing the sum first moves
        # fewer bytes, so the rule declines and the caller resolves it
        return None
    out = layout(dm, ref, out_shape, pending)

    def local(attrs, stacks):
        args = [expand_stack(s, rank) if lay is not None else s for s, lay in zip(stacks, need)]
        return run_kernel(op, attrs, args)

    return ShardPlan(tuple(need), (out,), local)


def _elementwise_refs(order, rank, out_shape, pending):
    """Per output dim, the device axes splitting it: each input in `order` claims the
    dims it splits that no earlier input claimed, on axes not used yet."""
    ref, used = [()] * rank, set(pending)
    for lay in order:
        off = rank - lay.ndim
        for d, axes in enumerate(lay.tensor_map):
            od = d + off
            if axes and not ref[od] and lay.shape[d] == out_shape[od] and not set(axes) & used:
                ref[od] = axes
                used |= set(axes)
    return ref


def _elementwise_needs(lays, dm, ref, out_shape, pending, carriers):
    rank = len(out_shape)
    need = []
    for i, lay in enumerate(lays):
        if lay is None:
            need.append(None)
            continue
        off = rank - lay.ndim
        need.append(layout(dm, [ref[d + off] if lay.shape[d] == out_shape[d + off] else ()
                                for d in range(lay.ndim)], lay.shape,
                           pending if i in carriers else ()))
    return need


def _moved_bytes(lays, needs) -> float:
    """Bytes per device (4-byte items) that moving `lays` into `needs` communicates."""
    return sum(plan_redistribution(have, want, 4).bytes
               for have, want in zip(lays, needs) if have is not None and have != want)


def _resolve_bytes(lays, carriers) -> float:
    """Bytes per device (4-byte items) that finishing the pending sums of the inputs at
    `carriers` communicates (their AllReduces)."""
    return sum(plan_redistribution(lays[i], lays[i].without_partial(), 4).bytes
               for i in carriers)


def rule(op):
    """Register `op`'s elementwise rule."""
    return register_rule(op.name, per_device=True, uneven=True,
                         shared=None if op.kind == KIND_UNARY else elementwise_pairs)(
        lambda attrs, lays, dtypes: _elementwise_plan(op, attrs, lays, dtypes))
