"""Sharding rules, one per op (or family), registered with :func:`register_rule`.

Each rule receives the op's attrs, the input layouts over one device matrix (None
for scalars) and the input dtypes, and returns a :class:`ShardPlan` (or None to let
the caller gather the inputs instead). Ops without a rule here are run on gathered
inputs, which is always correct; rules only make them cheaper.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from ..communication.totals import DeferredShares, deferral_on
from ..ops._registry import REGISTRY, linearity
from .._core import _tensor as _core
from .._core._tensor import KIND_BINARY, KIND_UNARY, broadcast_shapes
from .redistribution.planner import plan_redistribution
from .shared_dims import elementwise_pairs
from .sharding import (ShardPlan, accepts_grids, expand_stack, grid_to_stack, layout,
                       register_rule, run_kernel)
from .tensor_layout import stand_in


def _parts(dm, axes):
    return math.prod(dm[a] for a in axes)


# ---------------------------------------------------------------------------
# elementwise (with numpy broadcasting)
# ---------------------------------------------------------------------------
def pending_sums(op, attrs, lays):
    """``(axes, carriers)``: the device axes of the pending sums `op` keeps for inputs
    in `lays` (its outputs are pending over them too) and the positions of the inputs
    that carry them; ``((), ())`` with no pending input; None when a pending sum must be
    resolved first (the op is not linear in that input, per its registration)."""
    carriers = tuple(i for i, lay in enumerate(lays) if lay is not None and lay.partial)
    if not carriers:
        return (), ()
    lin = linearity(REGISTRY[op] if isinstance(op, str) else op, attrs)
    axes = {lays[i].partial for i in carriers}
    if lin is None or len(axes) != 1:
        return None
    if lin == "sum":                      # every input a term of the same pending sum
        return (axes.pop(), carriers) if len(carriers) == len(lays) else None
    return (axes.pop(), carriers) if len(carriers) == 1 and carriers[0] in lin else None


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


def _elementwise_rule(op):
    return register_rule(op.name, per_device=True,
                         shared=elementwise_pairs if op.kind == KIND_BINARY else None)(
        lambda attrs, lays, dtypes: _elementwise_plan(op, attrs, lays, dtypes))


# ---------------------------------------------------------------------------
# contraction family (einsum-style): MatMul, BatchMatMul, BiasAdd, Transpose
# ---------------------------------------------------------------------------
# An op of this family declares ``family=("contract", subscripts[, combine])``:
# ``subscripts(attrs, ranks)`` gives its einsum subscripts for inputs of those ranks --
# ``(inputs, output[, labels])``, e.g. ``(("mk", "kn"), "mn")`` -- or None when the ranks
# do not fit (the op's own shape check then names the error). A letter is one dim shared
# by every input and output naming it; an input dim of size 1 under a letter of larger
# size broadcasts. ``combine`` is "mul" (a product summed over the letters missing from
# the output: matmul form) or "add" (every input letter is an output letter; a broadcast
# sum). ``labels`` names letters in strategy errors (default: "contracted dim" for a
# summed letter, "batch dim <d>" for the others).
# From the subscripts alone the rule derives which dims a strategy must split alike,
# the output layout, and pending sums: a split of a summed letter leaves the output a
# pending sum over its device axes.

def _subscripts(spec, attrs, ranks):
    found = spec(attrs, tuple(ranks))
    if found is None:
        return None
    ins, out = found[0], found[1]
    return tuple(ins), out, (found[2] if len(found) > 2 else {})


def contract_pairs(spec):
    """The `shared` function of an op with einsum subscripts `spec`: every pair of input
    dims under one letter with equal sizes, summed letters first."""
    def pairs(prim, xs):
        if len(xs) < 2:
            return []
        found = _subscripts(spec, vars(prim), [len(x.shape) for x in xs])
        if found is None:
            return []
        ins, out, labels = found
        return [(i, di, j, dj, what)
                for i, di, j, dj, what in _letter_pairs(ins, out, tuple(labels.items()))
                if xs[i].shape[di] == xs[j].shape[dj]]
    return pairs


@functools.lru_cache(maxsize=256)
def _letter_pairs(ins, out, labels):
    """Every pair of input dims under one letter, summed letters first (before sizes)."""
    labels = dict(labels)
    summed, kept = [], []
    for i, j in itertools.combinations(range(len(ins)), 2):
        for di, letter in enumerate(ins[i]):
            dj = ins[j].find(letter)
            if dj >= 0:
                default = "contracted dim" if letter not in out else "batch dim {d}"
                pair = (i, di, j, dj, labels.get(letter, default).format(d=di))
                (summed if letter not in out else kept).append(pair)
    return tuple(summed + kept)


def _matmul_form(op, ins, out):
    """``(transpose_a, transpose_b)`` when subscripts ``ins -> out`` are a batched matrix
    product with numpy's broadcasting of the leading letters."""
    if len(ins) == 2 and len(out) >= 2:
        a, b = ins
        batch, m, n = out[:-2], out[-2], out[-1]
        k = a[-1] if a[-2] == m else a[-2]
        if len(a) >= 2 and len(b) >= 2 and set(a[-2:]) == {m, k} and \
                set(b[-2:]) == {k, n} and k not in out and batch.endswith(a[:-2]) and \
                batch.endswith(b[:-2]) and len({m, n, k}) == 3:
            return a[-2:] == k + m, b[-2:] == n + k
    raise ValueError(f"{op.name}: contraction subscripts {','.join(ins)}->{out} are not a "
                     f"(batched) matrix product; the contraction family runs only that form")


def _contract_plan(op, spec, combine, attrs, lays):
    if any(lay is None for lay in lays):
        return None
    found = _subscripts(spec, attrs, [lay.ndim for lay in lays])
    pend = pending_sums(op, attrs, lays)
    if found is None or pend is None:
        return None
    ins, out_sub, _ = found
    pending, carriers = pend
    dm = lays[0].device_matrix
    size = {}
    for sub, lay in zip(ins, lays):
        for letter, s in zip(sub, lay.shape):
            size[letter] = max(size.get(letter, 1), s)
    # the first input splitting a letter decides its axes (as in the elementwise family);
    # nothing is split along the axes of a pending sum
    ref, used = {}, set(pending)
    for sub, lay in zip(ins, lays):
        for letter, axes, s in zip(sub, lay.tensor_map, lay.shape):
            if axes and letter not in ref and s == size[letter] and not set(axes) & used:
                ref[letter] = axes
                used |= set(axes)
    need = tuple(layout(dm, [ref.get(c, ()) if lay.shape[d] == size[c] else ()
                             for d, c in enumerate(sub)], lay.shape,
                        pending if i in carriers else ())
                 for i, (sub, lay) in enumerate(zip(ins, lays)))
    summed = {a for c, axes in ref.items() if c not in out_sub for a in axes}
    out = layout(dm, [ref.get(c, ()) for c in out_sub], [size[c] for c in out_sub],
                 set(pending) | summed)
    if combine == "add":
        local = _broadcast_add(ins, out_sub)
    else:
        k = next((c for c in ins[0] if c not in out_sub), None)
        summed_axes = ref.get(k, ())
        # grouping pays for its bookkeeping only on products of some size
        macs = math.prod(out.local_shape) * size.get(k, 1) // _parts(dm, summed_axes)
        grouped = len(summed_axes) == len(dm) or macs >= GROUPED_MIN_MACS
        local = _matmul_local(op, ins, out_sub, dm, summed_axes if grouped else ())
    return ShardPlan(need, (out,), local)


def _broadcast_add(ins, out_sub):
    """Stacks aligned to the output's letters (unit dims where an input lacks one),
    added."""
    perms = [(0,) + tuple(1 + d for d in sorted(range(len(sub)),
                                                 key=lambda d: out_sub.index(sub[d])))
             for sub in ins]

    def local(attrs, stacks):
        aligned = []
        for s, sub, perm in zip(stacks, ins, perms):
            s = np.transpose(s, perm)
            dims = iter(s.shape[1:])
            aligned.append(s.reshape((s.shape[0],) + tuple(
                next(dims) if c in sub else 1 for c in out_sub)))
        return functools.reduce(np.add, aligned)
    return local


#: per-device multiply-adds from which a partially contracted MatMul runs as one GEMM
#: per group of devices (below it the per-device products are cheaper than the
#: grouping's bookkeeping); a product contracted over every device axis always is
GROUPED_MIN_MACS = 1 << 18


def _matmul_local(op, ins, out_sub, dm, summed):
    """The local product of a (batched) matrix product whose contracted letter is split
    over the device axes `summed` (in order). A 2-d product with `summed` axes, run
    where this process holds every device, is one GEMM per group of devices (see
    :func:`contract_groups`); otherwise one product per device."""
    ta, tb = _matmul_form(op, ins, out_sub)
    rank = len(out_sub)
    devices = math.prod(dm)
    grid_ndim = len(dm) + 2
    grouped = bool(summed) and devices > 1

    def local(attrs, stacks):
        sa = _swap(expand_stack(stacks[0], rank), ta)
        sb = _swap(expand_stack(stacks[1], rank), tb)
        if rank > 2:
            return np.matmul(sa, sb)
        grids = sa.ndim == grid_ndim and sb.ndim == grid_ndim and grid_ndim > 3
        if grouped and sa.dtype.kind in "fc" and sb.dtype.kind in "fc" and (
                grids or (sa.shape[0] == devices and sb.shape[0] == devices)):
            if not grids:
                sa = sa.reshape(dm + sa.shape[1:])
                sb = sb.reshape(dm + sb.shape[1:])
            return contract_groups(sa, sb, dm, summed)
        if grids:
            # device grids: the per-device products broadcast over repeated blocks
            return grid_to_stack(np.matmul(sa, sb), dm)
        return stack_matmul(sa, sb)

    prefer = grouped and len(summed) < len(dm)
    return accepts_grids(local, prefer=prefer) if rank == 2 else local


def _swap(x, flag):
    return x.swapaxes(-1, -2) if flag else x


def stack_matmul(a, b):
    """Per-device a[d] @ b[d] for stacks (n, m, k) and (n, k, c). When every device holds
    the same b (a stride-0 stack), the n products are one GEMM over all devices' rows."""
    if b.ndim == 3 and a.ndim == 3 and b.strides[0] == 0 and a.shape[0] > 1:
        n, m, k = a.shape
        out = np.matmul(a.reshape(n * m, k), b[0])
        return out.reshape(n, m, out.shape[-1])
    return np.matmul(a, b)


def _merge_blocks(grid, axes, before):
    """`grid` (device axes, x, y) with the device `axes` (in order) moved in front of
    local dim `before` (0: x, 1: y) and merged into it: the blocks of that dim
    concatenated in the order the axes split it. A view when the strides allow."""
    nd = grid.ndim - 2
    others = [i for i in range(nd) if i not in axes]
    order = others + ([nd] if before == 1 else []) + list(axes) + [nd + before] + \
        ([nd + 1] if before == 0 else [])
    g = grid.transpose(order)
    shape = [grid.shape[i] for i in others]
    merged = math.prod(grid.shape[i] for i in axes) * grid.shape[nd + before]
    shape += [grid.shape[nd], merged] if before == 1 else [merged, grid.shape[nd + 1]]
    return g.reshape(shape)


def _rows_view(x):
    """`x` (..., r, k) viewed as one matrix (rows, k) without a copy, or None when its
    strides do not allow it."""
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
    for (n0, s0), (n1, s1) in zip(lead, lead[1:]):
        if s0 != n1 * s1:
            return None
    return x.reshape((-1, x.shape[-1]))


def contract_groups(a, b, dm, axes):
    """The stack of pending sums of a device-local matrix product whose contracted dim is
    split over the device `axes` (in order), computed as one GEMM per group of devices.

    `a` and `b` are device grids ``dm + (m, k)`` and ``dm + (k, c)`` (size 1 along a
    device axis where the operand is replicated; full along `axes`). The devices that
    differ only along `axes` hold the blocks of one sum: their blocks of the contracted
    dim are concatenated (in the order the axes split it) into one GEMM whose result is
    that group's total, kept as equal shares of the pending sum (any split of a pending
    sum that adds up to the total is valid). When `b` repeats over every other device
    axis, all groups are one GEMM over their stacked rows. Returns a stack
    ``(prod(dm), m, c)``; with every axis summed it is a stride-0 view of one total.
    While :data:`~dualmode.communication.totals.DEFERRING` is on, the stack is returned
    unwritten (a :class:`~dualmode.communication.totals.DeferredShares`)."""
    nd = len(dm)
    others = [i for i in range(nd) if i not in axes]
    a2 = _merge_blocks(a, axes, 1)                   # (others..., m, |axes| k)
    b2 = _merge_blocks(b, axes, 0)                   # (others..., |axes| k, c)
    total = None
    if others and all(b2.shape[i] == 1 for i in range(len(others))):
        rows = _rows_view(a2)                        # every group's rows, one GEMM
        if rows is not None:
            total = np.matmul(rows, b2.reshape(b2.shape[-2:]))
            total = total.reshape(a2.shape[:-1] + total.shape[-1:])
    if total is None:
        total = np.matmul(a2, b2)
    parts = _parts(dm, axes)
    grid_shape = [1] * nd
    for i, s in zip(others, total.shape[:-2]):
        grid_shape[i] = s
    total = total.reshape(tuple(grid_shape) + total.shape[-2:])
    # the shares (a view of one share when there is one total), remembering their
    # totals: whoever adds them up again reads the totals instead
    shares = DeferredShares(total, dm, axes, parts)
    return shares if deferral_on() else shares.materialize()   # written only if read


def _contract_rule(op):
    fam = op.extras["family"]
    spec, combine = fam[1], (fam[2] if len(fam) > 2 else "mul")
    if combine not in ("mul", "add"):
        raise ValueError(f"register: op {op.name} declares contraction combine {combine!r}; "
                         f"valid: 'mul', 'add'")
    return register_rule(op.name, per_device=combine == "add", shared=contract_pairs(spec))(
        lambda attrs, lays, dtypes: _contract_plan(op, spec, combine, attrs, lays))


# ---------------------------------------------------------------------------
# reductions: sums over split dims stay pending; max/min finish with an AllReduce
# ---------------------------------------------------------------------------
def _make_reduce(op):
    name, combine = op.name, op.extras["family"][1]

    def rule(attrs, lays, dtypes):
        x = lays[0]
        pend = pending_sums(name, attrs, lays)
        if x is None or pend is None:
            return None
        dm = x.device_matrix
        axes, keep = attrs["axis"], attrs["keep_dims"]
        red_axes = tuple(sorted(a for d in axes for a in x.tensor_map[d]))
        tmap = [() if d in axes else m for d, m in enumerate(x.tensor_map)] if keep else \
            [m for d, m in enumerate(x.tensor_map) if d not in axes]
        shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape)) if keep else \
            tuple(s for d, s in enumerate(x.shape) if d not in axes)
        stack_axes = tuple(d + 1 for d in axes)
        count = math.prod(x.shape[d] for d in axes)
        if combine in ("sum", "mean"):
            out = layout(dm, tmap, shape, set(red_axes) | set(pend[0]))

            def local(attrs, stacks):
                s = stacks[0]
                r = np.add.reduce(s, axis=stack_axes, dtype=s.dtype, keepdims=keep)
                if combine == "mean":
                    r = np.true_divide(r, count, dtype=s.dtype)
                return r

            return ShardPlan((x,), (out,), local)
        ufunc = np.maximum if combine == "max" else np.minimum
        out = layout(dm, tmap, shape)

        def local(attrs, stacks):
            return ufunc.reduce(stacks[0], axis=stack_axes, keepdims=keep)

        post = ((combine, red_axes),) if red_axes else ()
        return ShardPlan((x,), (out,), local, post)
    return rule


def _reduce_rule(op):
    return register_rule(op.name, per_device=True)(_make_reduce(op))


# ---------------------------------------------------------------------------
# Softmax / LogSoftmax: the softmax axis must be whole on each device
# ---------------------------------------------------------------------------
def _along_axis_whole(op):
    def rule(attrs, lays, dtypes):
        x = lays[0]
        if x is None or x.partial:
            return None
        axis = attrs["axis"]
        tmap = [() if d == axis else m for d, m in enumerate(x.tensor_map)]
        need = layout(x.device_matrix, tmap, x.shape)

        def local(attrs, stacks):
            return op.kernel({"axis": axis + 1}, stacks[0])

        return ShardPlan((need,), (need,), local)
    return rule


def _along_axis_rule(op):
    return register_rule(op.name, per_device=True)(_along_axis_whole(op))


# ---------------------------------------------------------------------------
# Reshape: a split survives when it is on the first dim of a merged/split group
# ---------------------------------------------------------------------------
def _reshape_groups(ins, outs):
    """Pair input and output dims into groups of equal size (unit dims on their own)."""
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        if i < len(ins) and ins[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(outs) and outs[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(ins):
            gi.append(i)
            pi *= ins[i]
            i += 1
        if j < len(outs):
            gj.append(j)
            pj *= outs[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(ins):
                gi.append(i)
                pi *= ins[i]
                i += 1
            elif j < len(outs):
                gj.append(j)
                pj *= outs[j]
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


@register_rule("Reshape", per_device=True)
def _reshape(attrs, lays, dtypes):
    x = lays[0]
    pend = pending_sums("Reshape", attrs, lays)
    if x is None or pend is None:
        return None
    dm = x.device_matrix
    out_shape = tuple(attrs["shape"])
    in_map, out_map = [()] * x.ndim, [()] * len(out_shape)
    for gi, gj in _reshape_groups(x.shape, out_shape):
        if not gi or not gj:
            continue
        axes = x.tensor_map[gi[0]]
        if axes and out_shape[gj[0]] % _parts(dm, axes) == 0:
            in_map[gi[0]] = axes
            out_map[gj[0]] = axes
    need = layout(dm, in_map, x.shape, pend[0])
    out = layout(dm, out_map, out_shape, pend[0])
    local_shape = out.local_shape

    def local(attrs, stacks):
        s = stacks[0]
        return s.reshape((s.shape[0],) + tuple(local_shape))

    return ShardPlan((need,), (out,), local)


@register_rule("BroadcastTo", per_device=True)
def _broadcast_to(attrs, lays, dtypes):
    x = lays[0]
    if x is None or pending_sums("BroadcastTo", attrs, lays) is None:
        return None
    shape = tuple(attrs["shape"])
    off = len(shape) - x.ndim
    tmap = [()] * off + [m if x.shape[d] == shape[d + off] else ()
                         for d, m in enumerate(x.tensor_map)]
    need = layout(x.device_matrix, tmap[off:], x.shape, x.partial)
    out = layout(x.device_matrix, tmap, shape, x.partial)
    local_shape = out.local_shape

    def local(attrs, stacks):
        s = expand_stack(stacks[0], len(shape))
        return np.broadcast_to(s, (s.shape[0],) + tuple(local_shape))

    return ShardPlan((need,), (out,), local)


# ---------------------------------------------------------------------------
# row-wise ops (the losses): rows may be split, every other dim must be whole
# ---------------------------------------------------------------------------
def _rowwise_rule(op):
    """``family=("rowwise",)``: every input and output holds the batch rows on dim 0
    and the kernel treats rows independently, so rows split alike on every input, the
    outputs keep that split, and each device runs the kernel on its rows."""
    def rule(attrs, lays, dtypes):
        if any(lay is None or lay.partial or lay.ndim == 0 for lay in lays):
            return None
        dm, rows = lays[0].device_matrix, lays[0].tensor_map[0]
        count = lays[0].shape[0]
        outs = _core.infer(op, attrs, *[stand_in(d, lay.shape) for d, lay in zip(dtypes, lays)])
        if any(lay.shape[0] != count for lay in lays) or \
                any(not shape or shape[0] != count for shape, _ in outs):
            return None

        def rowwise(shape):
            return layout(dm, (rows,) + ((),) * (len(shape) - 1), shape)

        def local(attrs, stacks):
            n = stacks[0].shape[0]
            flat = [np.ascontiguousarray(s).reshape((-1,) + s.shape[2:]) for s in stacks]
            res = op.kernel(attrs, *flat)
            res = [r.reshape((n, -1) + r.shape[1:]) for r in (res if op.multi_output else (res,))]
            return tuple(res) if op.multi_output else res[0]

        return ShardPlan(tuple(rowwise(lay.shape) for lay in lays),
                         tuple(rowwise(shape) for shape, _ in outs), local)
    return register_rule(op.name, per_device=True, shared=_row_pairs)(rule)


def _row_pairs(prim, xs):
    """Dim 0 of every input is the one batch dim (when the sizes agree); an input of
    input 0's whole shape (dense labels of the logits) is aligned with it element for
    element, so every other dim pairs too."""
    pairs = []
    for j in range(1, len(xs)):
        a, b = tuple(xs[0].shape), tuple(xs[j].shape)
        if a and b and a[0] == b[0]:
            pairs.append((0, 0, j, 0, "batch dim"))
            if a == b:
                pairs.extend((0, d, j, d, f"dim {d}") for d in range(1, len(a)))
    return pairs


@register_rule("OneHot")
def _one_hot(attrs, lays, dtypes):
    idx = lays[0]
    if idx is None or idx.partial:
        return None
    axis = attrs["axis"]
    pos = axis if axis >= 0 else idx.ndim + 1 + axis
    tmap = list(idx.tensor_map)
    tmap.insert(pos, ())
    shape = list(idx.shape)
    shape.insert(pos, attrs["depth"])
    out = layout(idx.device_matrix, tmap, shape)
    op = REGISTRY["OneHot"]

    def local(attrs, stacks):
        at = dict(attrs)
        at["axis"] = -1 if axis == -1 else pos + 1
        return op.kernel(at, *stacks)

    return ShardPlan((idx, None, None), (out,), local)


# ---------------------------------------------------------------------------
# families: every registered op declaring one (or unary/binary by its kind) gets its rule
# ---------------------------------------------------------------------------
FAMILIES = {"elementwise": _elementwise_rule, "reduce": _reduce_rule,
            "along_axis": _along_axis_rule, "contract": _contract_rule,
            "rowwise": _rowwise_rule}


def family_of(op):
    """The sharding family `op` declared at registration (unary and binary ops are
    elementwise by their kind), or None."""
    fam = op.extras.get("family")
    if fam is None and op.kind in (KIND_UNARY, KIND_BINARY):
        return ("elementwise",)
    return fam


def _register_families():
    for op in list(REGISTRY.values()):
        fam = family_of(op)
        if fam is None:
            continue
        if fam[0] not in FAMILIES:
            raise ValueError(f"register: op {op.name} declares sharding family {fam[0]!r}; "
                             f"known families: {sorted(FAMILIES)}")
        FAMILIES[fam[0]](op)


_register_families()
from . import rules_array  # noqa: E402,F401
from . import rules_conv  # noqa: E402,F401
