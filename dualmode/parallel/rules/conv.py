"""Sharding rules of the image ops (NCHW): Conv2D and its backward ops, MaxPool/AvgPool
and theirs (BatchNorm's are in :mod:`.norm`).

* Batch (N) and output-channel splits are local; an input-channel split of Conv2D is
  contracted, so its output is a pending sum over those device axes (resolved like
  MatMul's contracted dim, by the next op that is not linear in it).
* H/W splits exchange **halos**: a device's output rows need the kernel's overlap from
  its neighbours' input rows. :func:`halo_exchange` cuts from every device the edge
  strips its neighbours need, AllGathers the strips within the group of devices that
  split that dim (a real collective through the backend, recorded in CommReport as the
  op's own "forward"/"backward" communication — under "mpi" each process holds one
  device and receives its neighbours' strips this way), and glues the previous
  device's tail and the next device's head onto each block; the global border gets the
  op's padding value. The backward ops that scatter into the input (Conv2DBackpropInput,
  MaxPoolGrad, AvgPoolGrad) compute each device's contribution on its extended block and
  send the overhanging margins back the same way (:func:`halo_reduce`), where the
  neighbour adds them. A split is kept only where both H_in and H_out divide by its
  parts, every device's window grid lines up with its block (``H_in / parts == stride *
  H_out / parts``) and the overlap reaches only the next device; otherwise the rule asks
  for that dim whole (a redistribution), which is always correct. The backward ops
  derive the other side's layout from the split they are given (the input gradient's
  from dy's), so these checks hold for both sides.
"""
from __future__ import annotations

import numpy as np

from ...ops import _conv as C
from ..devices import backend as _backend
from ..devices import op_cause
from ..sharding import ShardPlan, layout, register_rule
from .base import parts as _parts

__all__ = ["halo_exchange", "halo_reduce", "conv_pairs"]


def _free(axes, used):
    return tuple(axes) if axes and not set(axes) & used else ()


# ---------------------------------------------------------------------------
# halos
# ---------------------------------------------------------------------------
def _positions(lay, axes):
    """Per local device: its block index along the dim split over `axes`, and the group
    spec of the devices that split it."""
    members = lay.group_members(axes)
    inv = np.empty(members.size, np.int64)
    inv[members.ravel()] = np.tile(np.arange(members.shape[1]), members.shape[0])
    return inv[np.asarray(_backend().local_ranks)], members


def _edge_gather(strips, lay, axes, dim, opname):
    """AllGather `strips` (D, ..., e, ...) along stack dim `dim` in the group splitting the
    dim over `axes`: (D, parts, e, ...rest) with the dim moved to axis 2."""
    pos, members = _positions(lay, axes)
    with op_cause(opname):
        got = np.asarray(_backend().all_gather(np.ascontiguousarray(strips), members=members,
                                               axis=dim - 1))
    got = np.moveaxis(got, dim, 1)
    parts = members.shape[1]
    return got.reshape((got.shape[0], parts, -1) + got.shape[2:]), pos, parts


def halo_exchange(stack, lay, axes, dim, lo, hi, fill, opname):
    """Each device's block along stack dim `dim` (split over device `axes` of `lay`)
    extended by `lo` rows of its previous neighbour and `hi` of its next (`fill` past the
    global border); a negative `hi` crops the block's tail instead."""
    size = stack.shape[dim]
    take_hi = max(hi, 0)
    if lo == 0 and take_hi == 0:
        return stack if hi >= 0 else np.take(stack, np.arange(size + hi), axis=dim)
    idx = np.r_[np.arange(take_hi), np.arange(size - lo, size)]
    g, pos, parts = _edge_gather(np.take(stack, idx, axis=dim), lay, axes, dim, opname)
    d = np.arange(g.shape[0])
    body = np.moveaxis(stack, dim, 1)
    if hi < 0:
        body = body[:, :size + hi]
    pieces = []
    if lo:
        prev = g[d, np.maximum(pos - 1, 0), take_hi:]
        prev[pos == 0] = fill
        pieces.append(prev)
    pieces.append(body)
    if take_hi:
        nxt = g[d, np.minimum(pos + 1, parts - 1), :take_hi]
        nxt[pos == parts - 1] = fill
        pieces.append(nxt)
    return np.moveaxis(np.concatenate(pieces, axis=1), 1, dim)


def halo_reduce(ext, lay, axes, dim, lo, hi, block, opname):
    """Inverse of :func:`halo_exchange` for gradients: `ext` holds each device's
    contributions to its extended block (`lo` rows before its own, max(hi, 0) after);
    the overhangs are sent to the neighbours that own those rows and added there. The
    result has `block` rows along `dim` (zeros where a cropped block had none)."""
    take_hi = max(hi, 0)
    size = ext.shape[dim] - lo - take_hi
    if lo or take_hi:
        idx = np.r_[np.arange(lo), np.arange(lo + size, lo + size + take_hi)]
        g, pos, parts = _edge_gather(np.take(ext, idx, axis=dim), lay, axes, dim, opname)
        d = np.arange(g.shape[0])
    body = np.moveaxis(ext, dim, 1)[:, lo:lo + size].copy()
    if lo:             # the next device's `lo` overhang covers my last lo rows
        nxt = g[d, np.minimum(pos + 1, parts - 1), :lo]
        nxt[pos == parts - 1] = 0
        body[:, size - lo:] += nxt
    if take_hi:        # the previous device's trailing overhang covers my first rows
        prev = g[d, np.maximum(pos - 1, 0), lo:]
        prev[pos == 0] = 0
        body[:, :take_hi] += prev
    if size < block:   # a cropped block (hi < 0): its last rows get no gradient
        body = np.concatenate([body, np.zeros((body.shape[0], block - size) + body.shape[2:],
                                              body.dtype)], axis=1)
    return np.moveaxis(body, 1, dim)


def _halo_sizes(size, out_size, parts, k, stride, dilation, lo_pad):
    """(lo, hi) rows a device needs beyond its block, or None when the split cannot be
    kept: either size not divisible by `parts` (a layout derived from the other side of
    the op, e.g. the input gradient of a stride-2 convolution whose output rows are
    split, would have unequal blocks), windows not aligned with the blocks, or reaching
    past the next device."""
    if parts == 1:
        return 0, 0
    if size % parts or out_size % parts or size // parts != stride * (out_size // parts):
        return None
    block = size // parts
    lo = lo_pad
    hi = (out_size // parts - 1) * stride + (k - 1) * dilation + 1 - lo_pad - block
    if lo > block or hi > block:
        return None
    return lo, hi


def _spatial(dm, tmap, used, in_hw, out_hw, kernel, stride, dilation, pads, allow_pad=True):
    """Kept H/W splits and their halos: ([axes_h, axes_w], [(lo, hi) or None per dim])."""
    keep, halos = [], []
    for i in range(2):
        axes = _free(tmap[2 + i], used)
        h = None
        if axes:
            h = _halo_sizes(in_hw[i], out_hw[i], _parts(dm, axes), kernel[i], stride[i],
                            dilation[i], pads[2 * i])
            if h is None or (not allow_pad and (pads[2 * i] or pads[2 * i + 1])):
                axes, h = (), None
        used |= set(axes)
        keep.append(axes)
        halos.append(h)
    return keep, halos


def _halo_post(halos):
    """The plan's ``post`` when a halo is exchanged inside its local computation: one None
    per output, the mark of a plan that communicates although no collective finishes an
    output (as BatchNorm's), so nothing takes it for collective-free."""
    return (None,) if any(h is not None and (h[0] > 0 or h[1] > 0) for h in halos) else ()


def _local_pads(pads, halos):
    """The padding left to apply locally: none along dims whose halo carries it."""
    out = list(pads)
    for i, h in enumerate(halos):
        if h is not None:
            out[2 * i] = out[2 * i + 1] = 0
    return tuple(out)


def _extend(stack, lay, keep, halos, fill, opname):
    for i, h in enumerate(halos):
        if h is not None:
            stack = halo_exchange(stack, lay, keep[i], 3 + i, h[0], h[1], fill, opname)
    return stack


def _shrink(stack, lay, keep, halos, blocks, opname):
    """Gradients on extended blocks back onto each device's own (H, W) `blocks`."""
    for i, h in reversed(list(enumerate(halos))):
        if h is not None:
            stack = halo_reduce(stack, lay, keep[i], 3 + i, h[0], h[1], blocks[i], opname)
    return stack


def _ext_hw(hw, parts_hw, halos):
    return tuple(hw[i] // parts_hw[i] + (h[0] + max(h[1], 0) if h else 0)
                 for i, h in enumerate(halos))


# ---------------------------------------------------------------------------
# Conv2D and its backward ops
# ---------------------------------------------------------------------------
def conv_pairs(prim, xs):
    """Conv2D's shared dim: x's channels and the weight's input channels (group 1)."""
    if len(xs) != 2 or xs[0].ndim != 4 or xs[1].ndim != 4 or \
            getattr(prim, "group", 1) != 1 or xs[0].shape[1] != xs[1].shape[1]:
        return []
    return [(0, 1, 1, 1, "input channel dim")]


def _conv_splits(attrs, x_map, dm, co_axes, k_axes, in_hw, out_hw, n_axes=None):
    """(N, K, Co, [H, W], halos) kept for a convolution with these candidate splits."""
    g = attrs["group"]
    n = tuple(x_map[0] if n_axes is None else n_axes)
    used = set(n)
    k = _free(k_axes, used) if g == 1 else ()
    used |= set(k)
    co = _free(co_axes, used) if g == 1 else ()
    used |= set(co)
    keep, halos = _spatial(dm, x_map, used, in_hw, out_hw, attrs["kernel_size"],
                           attrs["stride"], attrs["dilation"], attrs["pads"])
    return n, k, co, keep, halos


@register_rule("Conv2D", shared=conv_pairs, uneven=True)
def _conv2d(attrs, lays, dtypes):
    x, w = lays
    if x is None or w is None or x.partial or w.partial:
        return None
    dm = x.device_matrix
    out_shape = (x.shape[0], w.shape[0]) + C._out_hw("Conv2D", x.shape[2:], w.shape[2:],
                                                     attrs["stride"], attrs["dilation"],
                                                     attrs["pads"])
    n, k, co, keep, halos = _conv_splits(attrs, x.tensor_map, dm, w.tensor_map[0],
                                         x.tensor_map[1] or w.tensor_map[1], x.shape[2:],
                                         out_shape[2:])
    need_x = layout(dm, (n, k, keep[0], keep[1]), x.shape)
    need_w = layout(dm, (co, k, (), ()), w.shape)
    out = layout(dm, (n, co, keep[0], keep[1]), out_shape, k)
    stride, dilation, pads, g = C._geometry(attrs)
    lpads = _local_pads(pads, halos)

    def local(attrs, stacks):
        xs = _extend(stacks[0], need_x, keep, halos, 0, "Conv2D")
        return C.conv_stack(xs, stacks[1], stride, dilation, lpads, g)

    return ShardPlan((need_x, need_w), (out,), local, _halo_post(halos))


@register_rule("Conv2DBackpropFilter", uneven=True)
def _conv_filter_grad(attrs, lays, dtypes):
    dy, x = lays
    if dy is None or x is None or dy.partial or x.partial:
        return None
    dm = x.device_matrix
    n, k, co, keep, halos = _conv_splits(attrs, x.tensor_map, dm, dy.tensor_map[1],
                                         x.tensor_map[1], x.shape[2:], dy.shape[2:],
                                         n_axes=x.tensor_map[0] or dy.tensor_map[0])
    need_x = layout(dm, (n, k, keep[0], keep[1]), x.shape)
    need_dy = layout(dm, (n, co, keep[0], keep[1]), dy.shape)
    w_shape = (attrs["out_channel"], x.shape[1] // attrs["group"]) + tuple(attrs["kernel_size"])
    summed = set(n) | set(keep[0]) | set(keep[1])
    out = layout(dm, (co, k, (), ()), w_shape, summed)
    stride, dilation, pads, g = C._geometry(attrs)
    lpads = _local_pads(pads, halos)
    kernel = attrs["kernel_size"]

    def local(attrs, stacks):
        xs = _extend(stacks[1], need_x, keep, halos, 0, "Conv2DBackpropFilter")
        return C.conv_filter_grad_stack(stacks[0], xs, kernel, stride, dilation, lpads, g)

    return ShardPlan((need_dy, need_x), (out,), local, _halo_post(halos))


@register_rule("Conv2DBackpropInput", uneven=True)
def _conv_input_grad(attrs, lays, dtypes):
    dy, w = lays
    if dy is None or w is None or dy.partial or w.partial:
        return None
    dm = dy.device_matrix
    in_hw = attrs["in_hw"]
    # the output-channel dim is contracted here: its split becomes a pending sum
    n, k, co, keep, halos = _conv_splits(attrs, (dy.tensor_map[0], (), dy.tensor_map[2],
                                                 dy.tensor_map[3]), dm, w.tensor_map[1],
                                         dy.tensor_map[1] or w.tensor_map[0], in_hw,
                                         dy.shape[2:])
    # roles: k = contracted (output channels), co = x's channels (the weight's dim 1)
    need_dy = layout(dm, (n, k, keep[0], keep[1]), dy.shape)
    need_w = layout(dm, (k, co, (), ()), w.shape)
    x_shape = (dy.shape[0], w.shape[1] * attrs["group"]) + tuple(in_hw)
    out = layout(dm, (n, co, keep[0], keep[1]), x_shape, k)
    stride, dilation, pads, g = C._geometry(attrs)
    lpads = _local_pads(pads, halos)
    parts = (_parts(dm, keep[0]), _parts(dm, keep[1]))
    ext_hw = _ext_hw(in_hw, parts, halos)
    # the extended block starts `lo` rows before the device's own: the local padding
    # keeps the other dims' global padding only
    def local(attrs, stacks):
        ext = C.conv_input_grad_stack(stacks[0], stacks[1], ext_hw, stride, dilation, lpads,
                                      g)
        return _shrink(ext, need_dy, keep, halos, out.local_shape[2:], "Conv2DBackpropInput")

    return ShardPlan((need_dy, need_w), (out,), local, _halo_post(halos))


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------
def _pool_splits(attrs, x, out_hw, mode):
    dm = x.device_matrix
    n, c = x.tensor_map[0], _free(x.tensor_map[1], set(x.tensor_map[0]))
    keep, halos = _spatial(dm, x.tensor_map, set(n) | set(c), x.shape[2:], out_hw,
                           attrs["kernel_size"], attrs["strides"], (1, 1), attrs["pads"],
                           allow_pad=(mode == "max"))
    return dm, n, c, keep, halos


def _pool_shape(attrs, shape):
    return tuple(shape[:2]) + C._out_hw("Pool", shape[2:], attrs["kernel_size"],
                                        attrs["strides"], (1, 1), attrs["pads"])


def _pool_rule(name, mode):
    def rule(attrs, lays, dtypes):
        x = lays[0]
        if x is None or x.partial:
            return None
        out_shape = _pool_shape(attrs, x.shape)
        dm, n, c, keep, halos = _pool_splits(attrs, x, out_shape[2:], mode)
        need = layout(dm, (n, c, keep[0], keep[1]), x.shape)
        out = layout(dm, (n, c, keep[0], keep[1]), out_shape)
        lpads = _local_pads(attrs["pads"], halos)
        fill = -np.inf if mode == "max" else 0

        def local(attrs, stacks):
            xs = _extend(stacks[0], need, keep, halos, fill, name)
            return C.pool_stack(xs, mode, attrs["kernel_size"], attrs["strides"], lpads)

        return ShardPlan((need,), (out,), local, _halo_post(halos))
    return rule


def _pool_grad_rule(name, mode):
    def rule(attrs, lays, dtypes):
        x, dy = lays
        if x is None or dy is None or x.partial or dy.partial:
            return None
        dm, n, c, keep, halos = _pool_splits(attrs, x, dy.shape[2:], mode)
        need_x = layout(dm, (n, c, keep[0], keep[1]), x.shape)
        need_dy = layout(dm, (n, c, keep[0], keep[1]), dy.shape)
        lpads = _local_pads(attrs["pads"], halos)
        fill = -np.inf if mode == "max" else 0

        def local(attrs, stacks):
            xs = _extend(stacks[0], need_x, keep, halos, fill, name)
            ext = C.pool_grad_stack(xs, stacks[1], mode, attrs["kernel_size"],
                                    attrs["strides"], lpads)
            return _shrink(ext, need_x, keep, halos, need_x.local_shape[2:], name)

        return ShardPlan((need_x, need_dy), (need_x,), local, _halo_post(halos))
    return rule


register_rule("MaxPool", uneven=True)(_pool_rule("MaxPool", "max"))
register_rule("AvgPool", uneven=True)(_pool_rule("AvgPool", "avg"))
register_rule("MaxPoolGrad", uneven=True)(_pool_grad_rule("MaxPoolGrad", "max"))
register_rule("AvgPoolGrad", uneven=True)(_pool_grad_rule("AvgPoolGrad", "avg"))


@register_rule("MaxPoolSelect", per_device=True, uneven=True)
def _max_pool_select(attrs, lays, dtypes):
    """Second-order backward of MaxPool: batch and channel splits only."""
    x, gg = lays
    if x is None or gg is None or x.partial or gg.partial:
        return None
    dm = x.device_matrix
    n, c = x.tensor_map[0], _free(x.tensor_map[1], set(x.tensor_map[0]))
    need = layout(dm, (n, c, (), ()), x.shape)
    out_shape = _pool_shape(attrs, x.shape)

    def local(attrs, stacks):
        return C._select_kernel(attrs, *stacks)

    return ShardPlan((need, layout(dm, (n, c, (), ()), gg.shape)),
                     (layout(dm, (n, c, (), ()), out_shape),), local)
