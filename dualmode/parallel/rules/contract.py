"""The contraction family (einsum-style): MatMul, BatchMatMul, BiasAdd, Transpose.

A split of a summed (contracted) letter leaves the output a pending sum over its device
axes, resolved by the next op that is not linear in it (an AllReduce, or a
ReduceScatter when that op wants the result split)."""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from ...communication.totals import DeferredShares, deferral_on
from ..devices import device_num
from ..sharding import (ShardPlan, accepts_grids, expand_stack, grid_to_stack, layout,
                        register_rule)
from .base import parts as _parts
from .base import pending_sums

__all__ = ["rule", "contract_pairs", "contract_groups", "stack_matmul", "GROUPED_MIN_MACS"]


# An op of this family declares ``family=("contract", subscripts[, combine])``:
# ``subscripts(attrs, ranks)`` gives its einsum subscripts for inputs of those ranks --
# ``(inputs, output[, labels])``, e.g. ``(("mk", "kn"), "mn")`` -- or None when the ranks
# do not fit (the op's own shape check then names the error). A letter is one dim shared
# by every input and output naming it; an input dim of size 1 under a letter of larger
# size broadcasts. ``combine`` is "mul" (a product summed over the letters missing from
# the output: matmul form), "add" (every input letter is an output letter; a broadcast
# sum) or a numpy function of the inputs aligned to the output's letters (unit dims where
# an input lacks one; every input letter an output letter): an elementwise map along
# named dims, e.g. PReLU's per-channel weight. ``labels`` names letters in strategy
# errors (default: "contracted dim" for a summed letter, "batch dim <d>" for the others).
# From the subscripts alone the rule derives which dims a strategy must split alike,
# the output layout, and pending sums: a split of a summed letter leaves the output a
# pending sum over its device axes.

def _subscripts(spec, attrs, ranks):
    found = spec(attrs, tuple(ranks))
    if found is None:
        return None
    ins, out = found[0], found[1]
    return tuple(ins), out, (found[2] if len(found) > 2 else {})


def contract_pairs(spec, combine="mul"):
    """The `shared` function of an op with einsum subscripts `spec`: every pair of input
    dims under one letter with equal sizes, summed letters first. Under a strategy of
    the gathered form (:func:`gathered_form`) the contracted dim is not shared: the
    inputs may split it differently."""
    def pairs(prim, xs):
        if len(xs) < 2:
            return []
        found = _subscripts(spec, vars(prim), [len(x.shape) for x in xs])
        if found is None:
            return []
        ins, out, labels = found
        free = _product_letter(ins, out) if combine == "mul" and \
            gathered_form(prim, ins, out, device_num()) else None
        return [(i, di, j, dj, what)
                for i, di, j, dj, what in _letter_pairs(ins, out, tuple(labels.items()))
                if xs[i].shape[di] == xs[j].shape[dj] and ins[i][di] != free]

    def hint(prim, xs):
        """The gathered form, as the error of a strategy that splits the contracted dim
        differently offers it (None when the op cannot take it)."""
        found = _subscripts(spec, vars(prim), [len(x.shape) for x in xs]) \
            if len(xs) == 2 and combine == "mul" else None
        if found is None or _product_letter(*found[:2]) is None:
            return None
        return f"or the same strategy (p, q) for both inputs with p * q = device_num " \
               f"({device_num()}), each input's contracted dim then gathered"
    pairs.hint = hint
    return pairs


def _product_letter(ins, out):
    """The contracted letter of a plain 2-d product ``mk,kn->mn`` (no transposes), else
    None."""
    if len(ins) == 2 and len(ins[0]) == 2 and len(ins[1]) == 2 and len(out) == 2:
        (m, k), (k2, n) = ins
        if k == k2 and k not in out and out == m + n and m != n:
            return k
    return None


def gathered_form(prim, ins, out, devices) -> bool:
    """Is `prim`'s in_strategy MindSpore's form in which the two inputs of a 2-d matrix
    product without transposes (``mk,kn->mn``) split the contracted dim differently:
    the same strategy ``(p, q)`` for both, over all `devices` (``p * q``)? The op then
    computes with each input's contracted dim gathered (``(p, 1)`` and ``(1, q)``), so
    each device holds whole rows and columns of the product, and its output is split
    ``(p, q)`` with no pending sum (the rule's :func:`_gathered_letters`)."""
    st = getattr(prim, "in_strategy", None)
    if _product_letter(ins, out) is None or not isinstance(st, tuple) or len(st) != 2:
        return False
    a, b = st
    return type(a) is tuple and a == b and len(a) == 2 and \
        all(type(v) is int and v >= 1 for v in a) and a[0] * a[1] == devices


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
    # nothing is split along the axes of a pending sum; a summed letter whose splits
    # conflict (see _gathered_letters) is gathered in every input when the output's
    # letters then take all of its axes (no parallelism lost)
    gathered = _gathered_letters(ins, out_sub, lays, size) if combine == "mul" else {}
    ref = _letter_axes(ins, lays, size, pending, gathered)
    if gathered:
        taken = {a for c in out_sub for a in ref.get(c, ())}
        keep = {c: axes for c, axes in gathered.items() if axes <= taken}
        if len(keep) != len(gathered):
            ref = _letter_axes(ins, lays, size, pending, keep)
    need = tuple(layout(dm, [ref.get(c, ()) if lay.shape[d] == size[c] else ()
                             for d, c in enumerate(sub)], lay.shape,
                        pending if i in carriers else ())
                 for i, (sub, lay) in enumerate(zip(ins, lays)))
    summed = {a for c, axes in ref.items() if c not in out_sub for a in axes}
    out = layout(dm, [ref.get(c, ()) for c in out_sub], [size[c] for c in out_sub],
                 set(pending) | summed)
    if combine == "add":
        local = _broadcast_add(ins, out_sub)
    elif callable(combine):
        local = _broadcast_add(ins, out_sub, combine)
    else:
        k = next((c for c in ins[0] if c not in out_sub), None)
        summed_axes = ref.get(k, ())
        # grouping pays for its bookkeeping only on products of some size
        macs = math.prod(out.local_shape) * size.get(k, 1) // _parts(dm, summed_axes)
        grouped = len(summed_axes) == len(dm) or macs >= GROUPED_MIN_MACS
        local = _matmul_local(op, ins, out_sub, dm, summed_axes if grouped else ())
    return ShardPlan(need, (out,), local)


def _letter_axes(ins, lays, size, pending, gathered):
    """Each letter's device axes: the first input splitting it (at full size) decides,
    no axis twice, none of a pending sum's, and the `gathered` letters unsplit."""
    ref, used = {}, set(pending)
    for sub, lay in zip(ins, lays):
        for letter, axes, s in zip(sub, lay.tensor_map, lay.shape):
            if axes and letter not in ref and s == size[letter] and not set(axes) & used \
                    and letter not in gathered:
                ref[letter] = axes
                used |= set(axes)
    return ref


def _gathered_letters(ins, out_sub, lays, size) -> dict:
    """The summed letters whose splits conflict, with the union of the axes splitting
    them: a summed letter that

    - two inputs split over disjoint device axes, e.g. ``k`` of ``mk,kn->mn`` with both
      inputs ``(p, q)`` over a ``(p, q)`` matrix (k on axis 1 in the first input, on
      axis 0 in the second: MindSpore's MatMul with equal 2-d strategies), or
    - one input splits over axes on which another input, not splitting it, splits a
      letter of the output (both inputs ``(1, q)``: k of the first and n of the second
      on one axis).

    Gathering such a letter in every input (an AllGather of each along the axes that
    split it) keeps the inputs' other splits and leaves no pending sum: the output of
    both examples is split as the strategy, ``(p, q)`` and ``(1, q)``."""
    splits, kept = {}, []
    for sub, lay in zip(ins, lays):
        mine, keep = {}, set()
        for letter, axes, s in zip(sub, lay.tensor_map, lay.shape):
            if axes and s == size[letter]:
                if letter in out_sub:
                    keep |= set(axes)
                else:
                    mine[letter] = set(axes)
        for letter, axes in mine.items():
            splits.setdefault(letter, []).append(axes)
        kept.append((set(mine), keep))
    return {letter: set().union(*axes) for letter, axes in splits.items()
            if any(not a & b for a, b in itertools.combinations(axes, 2)) or any(
                letter not in summed and keep & a for summed, keep in kept for a in axes)}


def _broadcast_add(ins, out_sub, fn=None):
    """Stacks aligned to the output's letters (unit dims where an input lacks one),
    added (or given to `fn`, an elementwise numpy function of them)."""
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
        return functools.reduce(np.add, aligned) if fn is None else fn(*aligned)
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


#: the per-device contracted length below which a partially contracted product joins
#: its blocks into one GEMM even when that copies the first operand (short GEMMs run
#: well below the speed of long ones; above it the copy costs more than it gains)
JOIN_BELOW_K = 512


def _merge_blocks(grid, axes, before, copy=True):
    """`grid` (device axes, x, y) with the device `axes` (in order) moved in front of
    local dim `before` (0: x, 1: y) and merged into it: the blocks of that dim
    concatenated in the order the axes split it. A view when the strides allow; else a
    copy, or None with ``copy=False``."""
    nd = grid.ndim - 2
    others = [i for i in range(nd) if i not in axes]
    order = others + ([nd] if before == 1 else []) + list(axes) + [nd + before] + \
        ([nd + 1] if before == 0 else [])
    g = grid.transpose(order)
    shape = [grid.shape[i] for i in others]
    merged = math.prod(grid.shape[i] for i in axes) * grid.shape[nd + before]
    shape += [grid.shape[nd], merged] if before == 1 else [merged, grid.shape[nd + 1]]
    if copy:
        return g.reshape(shape)
    try:
        return g.reshape(shape, copy=False)
    except ValueError:
        return None


def _rows_view(x):
    """`x` (..., r, k) viewed as one matrix (rows, k) without a copy, or None when its
    strides do not allow it."""
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
    for (n0, s0), (n1, s1) in zip(lead, lead[1:]):
        if s0 != n1 * s1:
            return None
    return x.reshape((-1, x.shape[-1]))


def _joined_product(a, b, dm, axes, a2):
    """The totals of :func:`contract_groups` as one GEMM per group: the blocks of the
    contracted dim concatenated (`a2` is `a`'s, already joined); one GEMM over every
    group's stacked rows when `b` repeats over the other device axes."""
    nd = len(dm)
    others = [i for i in range(nd) if i not in axes]
    b2 = _merge_blocks(b, axes, 0)                   # (others..., |axes| k, c)
    total = None
    if others and all(b2.shape[i] == 1 for i in range(len(others))):
        rows = _rows_view(a2)                        # every group's rows, one GEMM
        if rows is not None:
            total = np.matmul(rows, b2.reshape(b2.shape[-2:]))
            total = total.reshape(a2.shape[:-1] + total.shape[-1:])
    if total is None:
        total = np.matmul(a2, b2)
    grid_shape = [1] * nd
    for i, s in zip(others, total.shape[:-2]):
        grid_shape[i] = s
    return total.reshape(tuple(grid_shape) + total.shape[-2:])


def contract_groups(a, b, dm, axes):
    """The stack of pending sums of a device-local matrix product whose contracted dim is
    split over the device `axes` (in order), as the totals of each group of devices.

    `a` and `b` are device grids ``dm + (m, k)`` and ``dm + (k, c)`` (size 1 along a
    device axis where the operand is replicated; full along `axes`). The devices that
    differ only along `axes` hold the blocks of one sum. Its total is computed one of
    two ways, which give the same sums up to float rounding:

    - joined: the blocks of the contracted dim concatenated (in the order the axes split
      it) into one GEMM per group -- when `a`'s blocks join without a copy, or its
      per-device contracted length is short (below :data:`JOIN_BELOW_K`), so the copy
      is cheap and the longer GEMM faster (an `a` stored by columns, the transposed
      activations of a weight gradient, is joined as the rows of its transpose, so
      each block is one contiguous copy);
    - per device: each device's block product in one batched ``matmul`` over the grid
      (a weight repeated over the other axes broadcasts, not copied), added over `axes`
      -- an m x c addition per device instead of copying the m x k blocks.

    The total is kept as equal shares of the pending sum (any split of a pending sum
    that adds up to the total is valid). Returns a stack ``(prod(dm), m, c)``; with
    every axis summed it is a stride-0 view of one total. While
    :data:`~dualmode.communication.totals.DEFERRING` is on, the stack is returned
    unwritten (a :class:`~dualmode.communication.totals.DeferredShares`)."""
    axes = tuple(axes)
    a2 = _merge_blocks(a, axes, 1, copy=False)
    if a2 is None and a.shape[-1] < JOIN_BELOW_K:
        if a.strides[-1] <= a.strides[-2]:
            a2 = _merge_blocks(a, axes, 1)
        else:
            # stored by columns (a transposed operand: a weight gradient's activations):
            # its transpose's blocks stacked, one contiguous copy each, and viewed back
            a2 = np.swapaxes(_merge_blocks(np.swapaxes(a, -1, -2), axes, 0), -1, -2)
    if a2 is not None:
        total = _joined_product(a, b, dm, axes, a2)
    else:
        total = np.matmul(a, b).sum(axis=axes, keepdims=True)   # 1 along `axes`
    # the shares (a view of one share when there is one total), remembering their
    # totals: whoever adds them up again reads the totals instead
    shares = DeferredShares(total, dm, axes, _parts(dm, axes))
    return shares if deferral_on() else shares.materialize()   # written only if read


def rule(op):
    """Register the rule of `op`, which declares ``family=("contract", subscripts[, combine])``."""
    fam = op.extras["family"]
    spec, combine = fam[1], (fam[2] if len(fam) > 2 else "mul")
    if not callable(combine) and combine not in ("mul", "add"):
        raise ValueError(f"register: op {op.name} declares contraction combine {combine!r}; "
                         f"valid: 'mul', 'add' or an elementwise function")
    return register_rule(op.name, per_device=combine != "mul", uneven=True,
                         shared=contract_pairs(spec, combine))(
        lambda attrs, lays, dtypes: _contract_plan(op, spec, combine, attrs, lays))
