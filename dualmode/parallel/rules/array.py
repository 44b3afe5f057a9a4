"""Sharding rules of the array ops: Reshape, BroadcastTo, OneHot, Gather and GatherGrad,
Concat, Split, basic indexing (GetItem, IndexAdd; StridedSlice is written with it), Tile,
Dropout, Diag and FillV2; and how a sharded Parameter is written in place (Assign, AssignAdd,
AssignSub).

Same contract as every rule (:mod:`dualmode.parallel.rules`): a rule gets the op's attrs, the input layouts over one
device matrix (None for scalars) and the input dtypes, and returns a
:class:`~.sharding.ShardPlan` or None (the caller then gathers the inputs and runs the
op plainly, which is always correct). Every local computation runs once over the
stacks' leading device axis.

Communication each rule implies (beyond moving inputs into the required layouts):

- ``Reshape``: a split survives when it is on the first dim of a merged or split group
  of dims (and still divides); other splits are gathered first.
- ``BroadcastTo``: splits of the broadcast input carry over; new dims are whole.
- ``OneHot``: the indices' splits carry over; the depth dim is whole. A strategy over
  the output's dims (MindSpore's form) places the indices on that strategy's device
  matrix, so each device's block of the classes is cut locally: no communication.
- ``Gather``: a table split on the gathered axis (vocabulary parallel) looks up, on
  each device, only the indices falling in its rows (index minus the device's row
  offset, other indices masked to zero); the output is a pending partial sum over the
  table's split axes, resolved by one AllReduce when a consumer needs it whole
  (MindSpore's offset-mask-AllReduce). Other table dims and the index dims keep their
  splits in the output: no communication.
- ``GatherGrad`` (Gather's gradient): index dims split -> the result is a pending sum
  over those axes; device axes that split neither input split the table's rows, each
  device adding only the rows it holds (so a vocabulary-split table's gradient arrives
  in the table's layout without communication).
- ``Concat`` / ``Split``: the concat / split axis must be whole (an AllGather when it
  is not); other dims keep their splits.
- ``GetItem`` (basic indexing) / ``IndexAdd`` (its gradient): dims that are sliced or
  indexed must be whole; full-slice dims keep their splits. Advanced indexing has no
  rule (gathered).
- ``Tile``: dims with multiple 1 keep their split; a tiled dim is whole in the input
  (an AllGather when it is split) and its output is split over the input's axes when
  they divide the multiple (each device makes its share of the copies), else whole. A
  strategy over the output's dims (MindSpore's form) places the input on that
  strategy's device matrix, tiled dims whole, so the output is cut into the strategy's
  layout on each device: no communication.
- ``Assign`` / ``AssignAdd`` / ``AssignSub``: the new value is computed elementwise; a
  Parameter stored in a layout is written in that layout (its shards of the value, moved
  there when the value has another layout).
- ``Dropout``: elementwise on any layout; the mask is drawn for the global shape from
  the context's generator, exactly as one device draws it, and each device keeps its
  block, so the numbers equal the single-device run.
- ``Diag``: the input whole (an AllGather when it is split), the output whole on every
  device, as MindSpore (which has no parallel implementation of it).
- ``FillV2``: the output whole on the value's devices; its strategy, over the output's
  dims as MindSpore's, cuts each device's block locally: no communication.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...context import rng
from ...ops._array import OUTPUT_STRATEGY_LAYOUTS, PARAMETER_WRITERS, _is_advanced
from ...ops._registry import REGISTRY
from ..devices import backend, device_num
from ..layout_spec import Layout
from ..moves import redistribute_tensor
from ..shared_dims import concat_pairs
from ..sharding import ShardPlan, expand_stack, layout, register_rule
from .base import parts as _parts
from .base import pending_sums


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


@register_rule("Reshape", per_device=True, uneven=True)
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
        k = _parts(dm, axes)
        # a split is kept when each device's rows stay its rows: the dim keeps its size
        # (pieces of unequal size too), or both sizes divide into equal pieces
        if axes and (x.shape[gi[0]] == out_shape[gj[0]] or
                     (x.shape[gi[0]] % k == 0 and out_shape[gj[0]] % k == 0)):
            in_map[gi[0]] = axes
            out_map[gj[0]] = axes
    need = layout(dm, in_map, x.shape, pend[0])
    out = layout(dm, out_map, out_shape, pend[0])
    local_shape = out.local_shape

    def local(attrs, stacks):
        s = stacks[0]
        return s.reshape((s.shape[0],) + tuple(local_shape))

    return ShardPlan((need,), (out,), local)


@register_rule("BroadcastTo", per_device=True, uneven=True)
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


@register_rule("OneHot", uneven=True)
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


def _local_ranks(n):
    """The global ranks of the `n` devices held by this process (stack order)."""
    ranks = np.asarray(backend().local_ranks, dtype=np.int64)
    if ranks.shape[0] != n:               # a stack over every device (e.g. a global view)
        ranks = np.arange(n, dtype=np.int64)
    return ranks


def _row_offsets(lay, dim, n):
    """Per local device (stack order), the first global index along `dim` it holds."""
    return lay.part_starts[_local_ranks(n), dim]


def _plain(lays):
    return all(lay is not None and not lay.partial for lay in lays)


# ---------------------------------------------------------------------------
# Gather: table splits follow to the output, a split gathered axis gives pending sums
# ---------------------------------------------------------------------------
def _check_index_range(ix, size, axis):
    if ix.size:
        lo, hi = ix.min(), ix.max()
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"Gather: index {bad} is out of range for dim {axis} (size "
                             f"{size}) of input 0; expected 0 <= index < {size}")


@register_rule("Gather", uneven=True)
def _gather(attrs, lays, dtypes):
    p, i = lays
    if not _plain((p, i)):
        return None
    axis = attrs["axis"]
    dm = p.device_matrix
    q = i.ndim
    used = set(p.split_axes)             # the table keeps every split (tables are big)
    i_map = []
    for axes in i.tensor_map:            # index dims keep the axes the table leaves free
        keep = axes if axes and not set(axes) & used else ()
        i_map.append(keep)
        used |= set(keep)
    vocab = p.tensor_map[axis]
    need_i = layout(dm, i_map, i.shape)
    out_map = list(p.tensor_map[:axis]) + i_map + list(p.tensor_map[axis + 1:])
    out_shape = tuple(p.shape[:axis]) + tuple(i.shape) + tuple(p.shape[axis + 1:])
    out = layout(dm, out_map, out_shape, vocab)
    size = p.shape[axis]
    rows = p.local_shape[axis]

    def local(attrs, stacks):
        ps, ix = stacks
        ix = np.asarray(ix)
        _check_index_range(ix, size, axis)
        n = ps.shape[0]
        tab = np.moveaxis(ps, axis + 1, 1)           # (n, rows, *pre, *post)
        dev = np.arange(n).reshape((n,) + (1,) * q)
        if vocab:
            off = _row_offsets(p, axis, n).reshape((n,) + (1,) * q)
            held = p.local_shapes[_local_ranks(n), axis].reshape((n,) + (1,) * q) \
                if axis in p.uneven_dims else rows        # a short piece holds fewer
            loc = ix - off
            mask = (loc >= 0) & (loc < held)
            r = tab[dev, np.where(mask, loc, 0)]     # (n, *idx, *pre, *post)
            r[~mask] = 0                             # indices other devices hold
        else:
            r = tab[dev, ix]
        if axis:
            r = np.moveaxis(r, tuple(range(1 + q, 1 + q + axis)), tuple(range(1, 1 + axis)))
        return r

    return ShardPlan((p, need_i), (out,), local)


@register_rule("GatherGrad", uneven=True)
def _gather_grad(attrs, lays, dtypes):
    i, g = lays
    if not _plain((i, g)):
        return None
    axis, shape = attrs["axis"], tuple(attrs["shape"])
    dm = i.device_matrix
    q = i.ndim
    if g.ndim != len(shape) - 1 + q:
        return None
    out_map = [()] * len(shape)
    used = set()
    for d in range(len(shape)):                      # table dims other than axis: from g
        if d == axis:
            continue
        gd = d if d < axis else d - 1 + q
        axes = g.tensor_map[gd]
        if axes and shape[d] == g.shape[gd]:
            out_map[d] = axes
            used |= set(axes)
    k_map = []
    for k in range(q):                               # index dims: g's split, else idx's
        gk, ik = g.tensor_map[axis + k], i.tensor_map[k]
        pick = gk if gk and not set(gk) & used else ik if ik and not set(ik) & used else ()
        k_map.append(pick)
        used |= set(pick)
    partial = tuple(a for axes in k_map for a in axes)
    rows_axes, parts = [], 1                         # free axes split the table's rows
    for a in range(len(dm)):
        if a not in used and dm[a] > 1 and shape[axis] % (parts * dm[a]) == 0:
            rows_axes.append(a)
            parts *= dm[a]
    out_map[axis] = tuple(rows_axes)
    need_i = layout(dm, k_map, i.shape)
    g_map = list(out_map[:axis]) + k_map + list(out_map[axis + 1:])
    need_g = layout(dm, g_map, g.shape)
    out = layout(dm, out_map, shape, partial)
    local_shape = out.local_shape
    rows = local_shape[axis]
    size = shape[axis]

    def local(attrs, stacks):
        ix, gs = stacks
        ix = np.asarray(ix)
        _check_index_range(ix, size, axis)
        n = gs.shape[0]
        # g viewed as (n, *idx, *pre, *post), the table as (n, rows, *pre, *post)
        gm = np.moveaxis(gs, tuple(range(1, 1 + axis)), tuple(range(1 + q, 1 + q + axis))) \
            if axis else gs
        res = np.zeros((n, rows) + tuple(local_shape[:axis]) + tuple(local_shape[axis + 1:]),
                       dtype=gs.dtype)
        dev = np.broadcast_to(np.arange(n).reshape((n,) + (1,) * q), ix.shape)
        if rows_axes:
            off = _row_offsets(out, axis, n).reshape((n,) + (1,) * q)
            loc = ix - off
            mask = (loc >= 0) & (loc < rows)
            np.add.at(res, (dev[mask], loc[mask]), gm[np.broadcast_to(mask, ix.shape)])
        else:
            np.add.at(res, (dev, ix), gm)
        return np.moveaxis(res, 1, 1 + axis) if axis else res

    return ShardPlan((need_i, need_g), (out,), local)


# ---------------------------------------------------------------------------
# Concat / Split: the axis is whole, other dims keep their splits
# ---------------------------------------------------------------------------
@register_rule("Concat", shared=concat_pairs, uneven=True)
def _concat(attrs, lays, dtypes):
    if not lays or not _plain(lays):
        return None
    axis = attrs["axis"]
    dm = lays[0].device_matrix
    rank = lays[0].ndim
    if any(lay.ndim != rank for lay in lays):
        return None
    ref, used = [()] * rank, set()
    for lay in lays:                     # input 0 first: the first split of a dim decides
        for d, axes in enumerate(lay.tensor_map):
            if d != axis and axes and not ref[d] and not set(axes) & used:
                ref[d] = axes
                used |= set(axes)
    need = tuple(layout(dm, ref, lay.shape) for lay in lays)
    shape = list(lays[0].shape)
    shape[axis] = sum(lay.shape[axis] for lay in lays)
    out = layout(dm, ref, shape)

    def local(attrs, stacks):
        return np.concatenate(stacks, axis=axis + 1)

    return ShardPlan(need, (out,), local)


@register_rule("Split", uneven=True)
def _split(attrs, lays, dtypes):
    x = lays[0]
    if not _plain((x,)):
        return None
    axis, sizes = attrs["axis"], tuple(attrs["sizes"])
    dm = x.device_matrix
    tmap = [() if d == axis else m for d, m in enumerate(x.tensor_map)]
    need = layout(dm, tmap, x.shape)
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = s
        outs.append(layout(dm, tmap, shape))
    cuts = tuple(int(c) for c in np.cumsum(sizes)[:-1])

    def local(attrs, stacks):
        return tuple(np.split(stacks[0], cuts, axis=axis + 1))

    return ShardPlan((need,), tuple(outs), local)


# ---------------------------------------------------------------------------
# basic indexing: full-slice dims keep their split, indexed dims are whole
# ---------------------------------------------------------------------------
def _basic_index(index, shape):
    """For a basic index on `shape`: (per input dim its output dim or None when an int
    removes it, per input dim whether it is a full slice, output rank, the index with
    full slices as slice(None)); None for advanced or malformed indices."""
    if _is_advanced(index) or sum(k is Ellipsis for k in index) > 1:
        return None
    consumed = sum(1 for k in index if k is not None and k is not Ellipsis)
    if consumed > len(shape):
        return None
    expanded = []
    for k in index:
        if k is Ellipsis:
            expanded += [slice(None)] * (len(shape) - consumed)
        else:
            expanded.append(k)
    if Ellipsis not in index:
        expanded += [slice(None)] * (len(shape) - consumed)
    out_of, full, local_index, d, o = [], [], [], 0, 0
    for k in expanded:
        if k is None:
            local_index.append(None)
            o += 1
        elif isinstance(k, slice):
            is_full = k.indices(shape[d]) == (0, shape[d], 1)
            out_of.append(o)
            full.append(is_full)
            local_index.append(slice(None) if is_full else k)
            d += 1
            o += 1
        else:
            out_of.append(None)
            full.append(False)
            local_index.append(k)
            d += 1
    return out_of, full, o, (slice(None),) + tuple(local_index)


def _index_shape(shape, index):
    """The shape of x[index] for x of `shape` (a zero-stride probe; None if invalid)."""
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, dtype=np.bool_), shape=shape,
                                            strides=(0,) * len(shape))
    try:
        return probe[index].shape
    except (IndexError, TypeError, ValueError):
        return None


@register_rule("GetItem", uneven=True)
def _getitem(attrs, lays, dtypes):
    x = lays[0]
    if not _plain((x,)):
        return None
    info = _basic_index(attrs["index"], x.shape)
    if info is None:
        return None
    out_of, full, rank, local_index = info
    dm = x.device_matrix
    in_map = [m if f else () for m, f in zip(x.tensor_map, full)]
    out_map = [()] * rank
    for d, o in enumerate(out_of):
        if o is not None:
            out_map[o] = in_map[d]
    out_shape = _index_shape(x.shape, attrs["index"])
    if out_shape is None or len(out_shape) != rank:
        return None
    need = layout(dm, in_map, x.shape)
    out = layout(dm, out_map, out_shape)

    def local(attrs, stacks):
        return np.array(stacks[0][local_index])

    return ShardPlan((need,), (out,), local)


@register_rule("IndexAdd", uneven=True)
def _index_add(attrs, lays, dtypes):
    g = lays[0]
    if not _plain((g,)):
        return None
    shape = tuple(attrs["shape"])
    info = _basic_index(attrs["index"], shape)
    if info is None:
        return None
    out_of, full, rank, local_index = info
    if rank != g.ndim:
        return None
    dm = g.device_matrix
    out_map = [g.tensor_map[o] if f and o is not None else ()
               for o, f in zip(out_of, full)]
    g_map = [()] * g.ndim
    for d, o in enumerate(out_of):
        if o is not None:
            g_map[o] = out_map[d]
    need = layout(dm, g_map, g.shape)
    out = layout(dm, out_map, shape)
    local_shape = out.local_shape

    def local(attrs, stacks):
        gs = stacks[0]
        res = np.zeros((gs.shape[0],) + tuple(local_shape), dtype=gs.dtype)
        res[local_index] = gs
        return res

    return ShardPlan((need,), (out,), local)


# ---------------------------------------------------------------------------
# Dropout: elementwise, with the mask one device would draw
# ---------------------------------------------------------------------------
@register_rule("Dropout", uneven=True)
def _dropout(attrs, lays, dtypes):
    x = lays[0]
    if not _plain((x,)):
        return None
    shape = x.shape

    def local(attrs, stacks):
        xs = stacks[0]
        keep = attrs["keep_prob"]
        # the draw of the single-device kernel (same generator call, global shape), so
        # the random stream and every element's mask equal the one-device run
        mask = (rng().random(shape) < keep).astype(xs.dtype)
        if any(x.tensor_map):
            mask = x.local_blocks(mask)
            if mask.shape[0] != xs.shape[0]:
                mask = mask[_local_ranks(xs.shape[0])]
        else:
            mask = np.broadcast_to(mask[None], xs.shape)
        out = xs * mask
        out *= xs.dtype.type(1.0 / keep)
        return out, mask

    return ShardPlan((x,), (x, x), local)


# ---------------------------------------------------------------------------
# Tile: dims tiled once keep their split; a tiled dim is whole in the input, and its
# output is split over the input's axes when they divide the multiple (each device
# then makes multiples / parts copies, as MindSpore splits a tiled dim's multiple)
# ---------------------------------------------------------------------------
@register_rule("Tile", per_device=True, uneven=True)
def _tile(attrs, lays, dtypes):
    x = lays[0]
    pend = pending_sums("Tile", attrs, lays)
    if x is None or pend is None:
        return None
    mult = tuple(attrs["multiples"])
    off = len(mult) - x.ndim
    dm = x.device_matrix
    in_map = [axes if mult[d + off] == 1 else () for d, axes in enumerate(x.tensor_map)]
    out_map = [()] * off + [axes if mult[d + off] == 1 or not mult[d + off] % _parts(dm, axes)
                            else () for d, axes in enumerate(x.tensor_map)]
    local_mult = (1,) + tuple(m // _parts(dm, axes) if m > 1 else 1
                              for m, axes in zip(mult, out_map))
    need = layout(dm, in_map, x.shape, pend[0])
    shape = tuple(s * m for s, m in zip((1,) * off + tuple(x.shape), mult))
    out = layout(dm, out_map, shape, pend[0])

    def local(attrs, stacks):
        s = stacks[0]
        s = s.reshape((s.shape[0],) + (1,) * off + s.shape[1:])
        return np.tile(s, local_mult)

    return ShardPlan((need,), (out,), local)


# ---------------------------------------------------------------------------
# strategies over an op's output dims (Tile, OneHot): the input on that strategy's matrix
# ---------------------------------------------------------------------------
def _input_on_output_matrix(opname, s, dims):
    """The input placed on the device matrix of strategy `s` over the output's dims (the
    repeated factor outermost, then one axis per entry > 1, as a strategy's own layout):
    input dim d on the axis of output dim ``dims[d]`` (None: whole). The output then lies
    on the same matrix, so cutting it into `s`'s layout moves nothing."""
    return _on_output_matrix(opname, tuple(s), tuple(dims), device_num())


@functools.lru_cache(maxsize=256)
def _on_output_matrix(opname, s, dims, n):
    total = math.prod(s)
    if n % total:
        raise ValueError(f"{opname}: in_strategy[0]={s} needs {total} devices (its product) "
                         f"but device_num is {n}; its product must divide device_num")
    sizes, names, alias = [], [], {}
    if n > total:
        sizes.append(n // total)
        names.append("repeat")
    for o, k in enumerate(s):
        if k > 1:
            alias[o] = f"dim{o}"
            sizes.append(k)
            names.append(alias[o])
    lay = Layout(tuple(sizes) or (1,), tuple(names) or ("dim0",))
    return lay(*["None" if o is None else alias.get(o, "None") for o in dims])


OUTPUT_STRATEGY_LAYOUTS[:] = [_input_on_output_matrix]


# ---------------------------------------------------------------------------
# Assign / AssignAdd / AssignSub: a sharded Parameter written in place keeps its layout
# ---------------------------------------------------------------------------
def _write_sharded_parameter(param, value, label):
    """`param` (stored in a layout) set to `value`: its own shards of the value, moved
    into the parameter's layout (no communication when the value is already there)."""
    stack = redistribute_tensor(value, param._layout, label)
    param._data = np.array(stack, dtype=param.dtype)      # its storage from now on
    param._init = None


PARAMETER_WRITERS[:] = [_write_sharded_parameter]


# ---------------------------------------------------------------------------
# Diag and FillV2 (MindSpore's creation ops)
# ---------------------------------------------------------------------------
@register_rule("Diag", per_device=True, uneven=True)
def _diag(attrs, lays, dtypes):
    """The input whole (an AllGather when it is split), the output whole on every
    device (MindSpore has no parallel implementation of Diag); a pending sum stays
    pending (Diag is linear)."""
    x = lays[0]
    pend = pending_sums("Diag", attrs, lays)
    if x is None or pend is None:
        return None
    dm = x.device_matrix
    need = layout(dm, [()] * x.ndim, x.shape, pend[0])
    out = layout(dm, [()] * (2 * x.ndim), x.shape * 2, pend[0])

    def local(attrs, stacks):
        s = stacks[0]
        n = math.prod(x.shape)
        out = np.zeros((s.shape[0], n * n), s.dtype)
        out[:, ::n + 1] = s.reshape(s.shape[0], n)
        return out.reshape((s.shape[0],) + x.shape * 2)

    return ShardPlan((need,), (out,), local)


@register_rule("FillV2", per_device=True)
def _fill_v2(attrs, lays, dtypes):
    """The output whole on the value's device matrix (a strategy then cuts it into its
    layout locally); a pending value stays pending (FillV2 is linear in it)."""
    v = lays[0]
    pend = pending_sums("FillV2", attrs, lays)
    if v is None or pend is None:
        return None
    shape = tuple(attrs["shape"])
    out = layout(v.device_matrix, [()] * len(shape), shape, pend[0])

    def local(attrs, stacks):
        s = stacks[0]
        return np.broadcast_to(s.reshape(s.shape[:1] + (1,) * len(shape)),
                               s.shape[:1] + shape).copy()

    return ShardPlan((v,), (out,), local)
