"""Distributed tensors in eager (PyNative) mode.

A distributed Tensor keeps ``_layout`` (a :class:`TensorLayout`) and, in ``_data``,
the stack of the local shards of the devices this process holds (leading axis =
local devices). The dispatcher hands every op with a distributed input to
:func:`dist_apply`, which runs it in one of these ways, each derived from the op's
sharding rule (parallel/rules/) where one is needed:

1. **other layout kinds**: inputs whose layout class registered its own runner
   (:func:`register_layout_kind`; hybrid parallel's per-device values) go there.
2. **pending sums**: an op declared linear in its pending inputs at registration
   (``register(..., linear=...)``: Add/Sub of terms of one sum, Mul/RealDiv by a fixed
   value, Neg, Cast to a float, Reshape, Transpose, BroadcastTo, ReduceSum/Mean) runs its
   rule, which keeps the sums pending over the same device axes
   (:func:`dualmode.parallel.rules.base.pending_sums`); any other op first resolves them with
   an AllReduce. A pending sum's layout names the op that made it (``partial_op``,
   kept through the linear ops), and its resolution is reported under that op.
3. **data parallel** (:func:`_batch_global`): when every distributed input is split on
   dim 0 only, the stacks ``(n, B/n, ...)`` are views of the global values ``(B, ...)``;
   when the op's rule, given these layouts, moves no data and needs no collective, the
   op's own kernel runs once on the global values and the outputs are stored in the
   rule's output layouts (a batch split is a view, a pending sum over the batch n equal
   shares). One numpy call for all devices. A batch that does not divide
   (:func:`_padded_batch_global`): the stacks are the padded global values (a zero row
   after each short piece), on which the kernels of some ops are exact
   (:func:`_pads_pass`); those run once the same way, their outputs' pads zeroed.
4. **the rule** (:func:`dualmode.parallel.sharding.sharded_apply`): inputs moved into
   the layouts the rule asks for, its local computation on the stacks, its collectives.
5. **fallback**: anything else gathers its distributed inputs to the global value
   (an AllGather, reported as "redistribution") and runs as a plain op.

A process holding only some devices (backend "mpi": stacks of one device) skips the
data-parallel path 3, which views a stack as every device's rows, and runs
the ops' sharding rules instead (their local computations are per device, for a stack
of any length; the rules' collectives and the redistribution executor go through the
backend). Global values entering the program are cut into this process's blocks only
(:func:`local_rows`); reading a global value (``asnumpy``, :func:`assemble`) gathers
the stacks of the world first, an AllGather every rank must make in the same order
that CommReport does not record (an observation); the gather fallback (5) is a real,
recorded AllGather over the world.
"""
from __future__ import annotations

import numpy as np

from .._core import _tensor as _core
from .._core._dp import Dispatch, share_of
from .._core._tensor import KIND_GENERIC, TensorBase
from ..communication.totals import DeferredShares
from ..ops._registry import remember
from .buffers import pooled_call
from .devices import BACKEND_STATE, device_num, parallel_active
from .devices import some_devices as _some_devices
from .moves import REDISTRIBUTE, gather_global, gather_stack, moved, resolve_partial
from .rules.base import pending_sums
from .sharding import decide, keep_made_by, sharded_apply
from .stacks import assemble, distribute, is_batch_layout, local_rows
from .tensor_layout import TensorLayout

__all__ = ["distribute", "dist_apply", "assemble", "parallel_active", "device_num",
           "is_batch_layout", "resolve_partial", "register_layout_kind", "local_rows",
           "moved", "REDISTRIBUTE", "gather_stack", "batch_global_outputs"]


# ---------------------------------------------------------------------------
# layouts and stacks
# ---------------------------------------------------------------------------
# ---------------------------------------------------------------------------
# running an op
# ---------------------------------------------------------------------------
def _run(op, attrs, arrays):
    """Validate and run `op`'s kernel on plain arrays."""
    _core.infer(op, attrs, *arrays)
    if op.kind == KIND_GENERIC:
        return op.kernel(attrs, *arrays)
    return op.kernel(*arrays)


#: layout classes other than TensorLayout, each with the function that runs an op when an
#: input has such a layout (hybrid parallel's per-device values register theirs)
LAYOUT_KINDS: dict = {}


def register_layout_kind(layout_cls, apply_fn) -> None:
    """Route ops with an input in `layout_cls` to ``apply_fn(op, attrs, inputs, rec)``."""
    LAYOUT_KINDS[layout_cls] = pooled_call(apply_fn)


#: call signature -> the data-parallel route taken for it (see :func:`_dp_signature`),
#: or _MOVES when its rule moves data or ends with a collective (the rule then runs)
_DP_ROUTES: dict = {}
_MOVES = "moves"


def _dist_apply(op, attrs, inputs, rec, layouts, key, batch, partial):
    """Paths 2 to 5 for a call the C dispatch (:data:`dist_apply`) has no route for:
    `layouts` of the inputs, `key` the call's signature (None: not a pure batch split,
    or unhashable), `batch` whether every distributed input is a batch split, `partial`
    whether one holds pending sums. Path 3 remembers its route under `key`."""
    if partial:
        if pending_sums(op, attrs, layouts) is not None:
            # linear in its pending inputs (its registration says so): the rule keeps
            # the sums pending, over the same device axes
            out = sharded_apply(op, attrs, inputs, rec, layouts)
            if out is not None:
                return keep_made_by(out, layouts)   # still the sums of the op that made them
        inputs = tuple(resolve_partial(x, op.name)
                       if lay is not None and lay.partial else x
                       for x, lay in zip(inputs, layouts))
        layouts = [x._layout if isinstance(x, TensorBase) else None for x in inputs]
        if all(lay is None for lay in layouts):
            return _core.apply(op, attrs, inputs)
        batch = all(is_batch_layout(lay) for lay in layouts if lay is not None)
    if batch and not _some_devices():
        # data parallel: the stacks are every device's rows, so each input's global value
        # is a free view of its stack (a process holding some devices runs the rules)
        out = _batch_global(op, attrs, inputs, layouts, rec, key)
        if out is not None:
            return out
    elif not batch and not _some_devices() and all(
            lay is None or is_padded_batch_layout(lay) for lay in layouts):
        # data parallel with a batch that does not divide: each stack is the padded
        # global value (the pads where the short pieces end)
        out = _padded_batch_global(op, attrs, inputs, layouts, rec)
        if out is not None:
            return out
    out = _sharded(op, attrs, inputs, rec, layouts)
    if out is not None:
        return out
    return _fallback(op, attrs, inputs, layouts, rec)


def _sharded(op, attrs, inputs, rec, layouts):
    """The op's sharding rule (parallel/rules/), when it has one."""
    return sharded_apply(op, attrs, inputs, rec, layouts)


def _merged(x):
    if isinstance(x, TensorBase):
        if x._layout is None:
            return x._value()
        s = x._data
        return s.reshape((s.shape[0] * s.shape[1],) + s.shape[2:])
    return x


def _fallback(op, attrs, inputs, layouts, rec):
    plain = tuple(_core.wrap_dist(gather_global(x, op.name), None)
                  if lay is not None else x for x, lay in zip(inputs, layouts))
    arrays = [x._value() if isinstance(x, TensorBase) else x for x in plain]
    out = _run(op, attrs, arrays)
    return _core.finish(op, attrs, inputs, out, rec, None)


# ---------------------------------------------------------------------------
# data parallel: every distributed input split on dim 0 only, every device here
# ---------------------------------------------------------------------------
def _shares(total, n):
    """A partial stack whose n equal shares add up to `total`, stored once.

    A pending sum may be split across devices any way that adds up to the same
    total; when one process holds every device, an op that sums over the batch is
    computed with one call over all devices' rows and kept as n equal shares (a
    stride-0 view), so no per-device copies or partial products are made."""
    if n > 1 and total.dtype.kind not in "fc":
        # integers do not split into equal shares: device 0 holds the total, others 0
        stack = np.zeros((n,) + total.shape, dtype=total.dtype)
        stack[0] = total
        return stack
    share = share_of(total, n) if n > 1 else total
    return np.broadcast_to(share[None], (n,) + share.shape)


def _batch_global(op, attrs, inputs, layouts, rec, key=None):
    """Run `op` once on the global values when its sharding rule, given these
    batch-split inputs, moves no data and needs no collective: the op's own kernel over
    every device's rows in one call, its outputs stored in the rule's output layouts
    (a batch split is a view; a pending sum over the batch, n equal shares). None when
    the rule moves data or finishes with a collective (the rule then runs as it is)."""
    found = decide(op, attrs, inputs, layouts)
    if found is None:
        return None
    plan, lays = found[0], found[1]
    moves = bool(plan.post) or any(
        need is not None and (need.partial or (
            isinstance(x, TensorBase) and x._layout is not None and need != have))
        for x, have, need in zip(inputs, lays, plan.inputs))
    if moves:
        if key is not None:   # the same signature runs its rule straight away next time
            remember(_DP_ROUTES, key, _MOVES)
        return None
    merged = [_merged(x) for x in inputs]
    if found[6]:              # this call signature was validated before: the kernel alone
        out = op.kernel(attrs, *merged) if op.kind == KIND_GENERIC else op.kernel(*merged)
    else:
        out = _run(op, attrs, merged)
        found[6] = True
    kinds = output_kinds(plan)
    out_lays = tuple(None if kind == "whole" else lay
                     for lay, (kind, _) in zip(plan.outputs, kinds))
    if key is not None:       # the same signature takes this route again, checks done
        remember(_DP_ROUTES, key, (
            tuple(lay.shape if lay is not None else None for lay in layouts),
            op.kind == KIND_GENERIC, kinds, out_lays, tuple(layouts)))
    return _core.finish(op, attrs, inputs, dist_apply.stored_outputs(out, op, kinds, merged),
                        rec, out_lays)


def is_padded_batch_layout(layout) -> bool:
    """Split on dim 0 only, over a 1-axis device matrix, into pieces of unequal size
    (nothing else split or partial): the stack ``(n, ceil(B/n), ...)``, its first two
    axes merged, is the global value with a zero row after each short piece."""
    return (isinstance(layout, TensorLayout) and not layout.even
            and len(layout.device_matrix) == 1 and not layout.partial
            and layout.tensor_map[0] == (0,)
            and all(m == () for m in layout.tensor_map[1:]))


def _pads_pass(op, kind) -> bool:
    """Whether `op`'s kernel, run once on padded global values (a zero row after each
    short piece of the batch), gives exactly what its rule gives for an output of this
    `kind`, read off its registration: a batch output needs an op whose output rows are
    its input rows' alone, whatever the batch size (elementwise, a contraction or a
    reduction of other dims: the pads' rows are zeroed after); a pending sum over the
    batch needs one to which a zero row adds nothing (a product contracting the batch,
    a sum over it; not a mean, which counts the rows)."""
    fam = op.extras.get("family") or ()
    if op.extras.get("pads_exact"):     # declared so by the op (zero rows in, zero rows out)
        return kind in ("batch", "partial")
    if kind == "batch":
        return op.kind != KIND_GENERIC or fam[:1] in (("elementwise",), ("contract",),
                                                      ("reduce",))
    if kind == "partial":
        return (fam[:1] == ("contract",) and (len(fam) < 3 or fam[2] == "mul")) or \
            fam == ("reduce", "sum")
    return False


#: call signature -> the padded data-parallel route taken for it (the outputs' kinds and
#: layouts), or _MOVES when the rule runs instead (see :func:`_padded_batch_global`)
_PADDED_ROUTES: dict = {}


def _padded_batch_global(op, attrs, inputs, layouts, rec):
    """The data-parallel path for batches that do not divide: when the op's rule, given
    these inputs, moves no data and needs no collective, and the op's kernel is exact
    on padded rows (:func:`_pads_pass`), the kernel runs once over every device's padded
    rows (the stacks, first two axes merged: no copy) as it does for a dividing batch,
    and its outputs take the rule's layouts (a batch output is the padded stack, its
    pads zeroed; a pending sum, n equal shares). None otherwise (the rule runs). The
    route of a call signature is worked out once."""
    try:
        key = (op.name, tuple(attrs.items()) if attrs else (), tuple(layouts),
               tuple([x.dtype for x in inputs]),
               tuple([() if lay is not None else np.shape(x)
                      for x, lay in zip(inputs, layouts)]))
        route = _PADDED_ROUTES.get(key)
    except TypeError:                       # an unhashable attribute (an array, a list)
        key, route = None, None
    checked = route is not None
    if route is None:
        route = _padded_route(op, attrs, inputs, layouts)
        if key is not None:
            remember(_PADDED_ROUTES, key, route)
    if route is _MOVES:
        return None
    kinds, out_lays = route
    merged = [_merged(x) for x in inputs]
    if checked:               # this call signature was validated before: the kernel alone
        out = op.kernel(attrs, *merged) if op.kind == KIND_GENERIC else op.kernel(*merged)
    else:
        out = _run(op, attrs, merged)
    stored = dist_apply.stored_outputs(out, op, kinds, merged)
    outs = list(stored) if op.multi_output else [stored]
    for i, ((kind, _), lay) in enumerate(zip(kinds, out_lays)):
        if kind == "batch" and not lay.even:
            o = outs[i]
            if not (o.flags.writeable and o.strides[0] != 0) or any(o is m for m in merged):
                o = np.array(o)
            outs[i] = lay.zero_pads(o)
    return _core.finish(op, attrs, inputs, tuple(outs) if op.multi_output else outs[0],
                        rec, out_lays)


def _padded_route(op, attrs, inputs, layouts):
    """``(output kinds, output layouts)`` of :func:`_padded_batch_global` for this call,
    or _MOVES when the rule must run."""
    rows = {lay.shape[0] for lay in layouts if lay is not None}
    for x, lay in zip(inputs, layouts):
        # a whole value with the batch's rows does not line up with the padded ones
        if lay is None and np.ndim(x) > 0 and np.shape(x)[0] in rows:
            return _MOVES
    found = decide(op, attrs, inputs, layouts)
    if found is None:
        return _MOVES
    plan, lays = found[0], found[1]
    if plan.post or any(need is not None and (need.partial or (lay is not None and need != have))
                        for lay, have, need in zip(layouts, lays, plan.inputs)):
        return _MOVES
    padded = [lay.padded if lay is not None else None for lay in layouts]
    try:
        even = decide(op, attrs, inputs, padded)
    except (ValueError, TypeError):
        return _MOVES
    if even is None or even[0].post:
        return _MOVES
    kinds = output_kinds(even[0])
    for (kind, _), want, got in zip(kinds, plan.outputs, even[0].outputs):
        if not _pads_pass(op, kind) or got != (want.padded if kind == "batch" else want):
            return _MOVES
    return kinds, tuple(plan.outputs)


def output_kinds(plan) -> tuple:
    """How :func:`batch_global_outputs` stores each output of `plan`: ``("partial", n)``
    (n equal shares of a pending sum), ``("whole", 0)`` (replicated: one plain value),
    ``("batch", n)`` (a batch split: a view) or ``("blocks", layout)`` (cut into the
    blocks of that layout). Kept on the (immutable, cached) plan after the first ask."""
    kinds = plan.__dict__.get("_output_kinds")
    if kinds is None:
        kinds = plan.__dict__["_output_kinds"] = _output_kinds(plan)
    return kinds


def _output_kinds(plan) -> tuple:
    kinds = []
    for lay in plan.outputs:
        if lay.partial:
            kinds.append(("partial", lay.device_num))
        elif not any(lay.tensor_map):
            kinds.append(("whole", 0))
        elif is_batch_layout(lay):
            kinds.append(("batch", lay.device_matrix[0]))
        else:
            kinds.append(("blocks", lay))
    return tuple(kinds)


def batch_global_outputs(out, op, plan, merged=()):
    """The outputs of `op`'s kernel run once on the global values (`out`) stored in the
    layouts of its rule's `plan`: ``(arrays, layouts)``, a layout None for a replicated
    result kept as one plain value."""
    kinds = output_kinds(plan)
    outs = out if op.multi_output else (out,)
    merged = list(merged)
    return ([dist_apply.stored(o, kind, n, merged) for o, (kind, n) in zip(outs, kinds)],
            [None if kind == "whole" else lay for lay, (kind, _) in zip(plan.outputs, kinds)])


#: run `op` when at least one input is distributed (see the module docstring): paths 1
#: to 3 for a signature seen before in C (dualmode/_core/_dp.pyx), the rest here. Every
#: path but a remembered data-parallel route runs in graph mode's buffer pool
#: (buffers.py; ~0.6 us a call): a data-parallel op makes the arrays a single-device op
#: makes, so it takes them where the rest of the program does (numpy's allocator, whose
#: recently freed blocks are warm in the caches; pool blocks are reused by size class
#: only, so a step between other work reads them cold: 1.11 vs 1.05x numpy at B256)
dist_apply = Dispatch(_DP_ROUTES, _MOVES, TensorLayout, LAYOUT_KINDS,
                      pooled_call(sharded_apply), pooled_call(_dist_apply), is_batch_layout,
                      BACKEND_STATE, DeferredShares, _shares)

_core.set_dist_hooks(dist_apply, assemble)
