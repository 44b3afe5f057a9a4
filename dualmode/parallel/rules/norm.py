"""Sharding rules of the normalisations. LayerNorm: the dims before begin_norm_axis (the
rows) keep their split, the normalised dims are whole on each device, gamma and beta
follow x's split of their dims and the statistics x's rows; nothing is communicated.
Its backward, LayerNormGrad, splits alike; its dgamma and dbeta are pending sums over
the devices that split the rows. BatchNorm (one op): x keeps its splits, the
per-channel inputs and statistics follow its channel split; in training the per-channel
float64 (sum, sum of squares) over the N/H/W splits are totalled by one AllReduce of the
(2, C) buffer inside the op (folding them into mean and variance is not linear):
global-batch statistics, as one device."""
from __future__ import annotations

import numpy as np

from ...ops import _conv as C
from ...ops import _norm as N
from ..devices import backend as _backend
from ..devices import op_cause
from ..sharding import ShardPlan, layout, register_rule

__all__ = ["bn_pairs", "layer_norm_pairs"]


# ---------------------------------------------------------------------------
# BatchNorm (x, scale, bias, mean, variance) -> (y, mean, variance)
# ---------------------------------------------------------------------------
def bn_pairs(prim, xs):
    """BatchNorm's shared dims: x's channels and each per-channel input's one dim."""
    if len(xs) != 5 or xs[0].ndim < 2:
        return []
    return [(0, 1, j, 0, "channel dim") for j in range(1, 5)
            if xs[j].ndim == 1 and xs[j].shape[0] == xs[0].shape[1]]


@register_rule("BatchNorm", shared=bn_pairs, uneven=True)
def _batch_norm(attrs, lays, dtypes):
    """x keeps every split; the per-channel inputs and the statistics follow its channel
    split. Training with the batch (N, H, W...) split: each device's float64 sums and
    sums of squares are totalled by one AllReduce of the (2, C) buffer over the devices
    that split it, inside the op, so the statistics are the global batch's."""
    if any(lay is None or lay.partial for lay in lays):
        return None
    x = lays[0]
    dm = x.device_matrix
    ch = x.tensor_map[1]
    per_channel = layout(dm, (ch,), (x.shape[1],))
    summed = tuple(a for d, axes in enumerate(x.tensor_map) if d != 1 for a in axes)
    members = x.group_members(summed) if summed and attrs["is_training"] else None

    def all_reduce(sums):
        with op_cause("BatchNorm"):
            return np.asarray(_backend().all_reduce(np.ascontiguousarray(sums),
                                                    members=members, op="sum"))

    def local(attrs, stacks):
        return C.batch_norm_stack(attrs, *stacks,
                                  all_reduce=all_reduce if members is not None else None)

    # `post` of Nones when the op communicates: no output is finished by a collective,
    # but the plan is not collective-free, so the data-parallel shortcuts that run the
    # kernel once on the global values (which would skip, and not report, the AllReduce
    # every device makes under MPI) take the rule instead
    post = (None, None, None) if members is not None else ()
    return ShardPlan((x,) + (per_channel,) * 4, (x, per_channel, per_channel), local, post)


# ---------------------------------------------------------------------------
# LayerNorm (x, gamma, beta) -> (y, mean, variance)
# ---------------------------------------------------------------------------
def _ln_axes(prim, xs):
    try:
        return N.layer_norm_axes(prim.name, prim.begin_norm_axis, prim.begin_params_axis,
                                 xs[0].ndim)
    except (AttributeError, TypeError, ValueError):
        return None


def layer_norm_pairs(prim, xs):
    """LayerNorm's shared dims: gamma's and beta's dims are x's from begin_params_axis."""
    axes = _ln_axes(prim, xs) if len(xs) == 3 else None
    if axes is None:
        return []
    bpa = axes[1]
    tail = tuple(xs[0].shape[bpa:])
    return [(0, bpa + d, j, d, f"dim {bpa + d}") for j in (1, 2)
            if tuple(xs[j].shape) == tail for d in range(len(tail))]


@register_rule("LayerNorm", per_device=True, shared=layer_norm_pairs, uneven=True)
def _layer_norm(attrs, lays, dtypes):
    """The rows (dims before begin_norm_axis) keep x's split; the normalised dims are
    made whole; gamma and beta take x's split of their dims; each device normalises its
    rows with their own statistics, as one device does."""
    if any(lay is None or lay.partial for lay in lays):
        return None
    x = lays[0]
    dm = x.device_matrix
    bna, bpa = attrs["begin_norm_axis"], attrs["begin_params_axis"]
    tmap = [m if d < bna else () for d, m in enumerate(x.tensor_map)]
    need_x = layout(dm, tmap, x.shape)
    need_p = layout(dm, tmap[bpa:], x.shape[bpa:])
    stats = layout(dm, tmap, x.shape[:bna] + (1,) * (len(x.shape) - bna))

    def local(attrs, stacks):
        return N.layer_norm_stack(attrs, *stacks)

    return ShardPlan((need_x, need_p, need_p), (need_x, stats, stats), local)


# ---------------------------------------------------------------------------
# LayerNormGrad (x, dy, variance, mean, gamma) -> (dx, dgamma, dbeta)
# ---------------------------------------------------------------------------
@register_rule("LayerNormGrad", per_device=True, uneven=True)
def _layer_norm_grad(attrs, lays, dtypes):
    """As LayerNorm: the rows keep x's split and the normalised dims are whole, so each
    device computes dx for its rows; gamma is whole. dgamma and dbeta are each device's
    sums over its rows: pending sums over the devices that split the rows. The op is
    linear in dy, so a pending sum dy holds stays pending in every output (over axes
    the rows are not split on)."""
    if any(lay is None for lay in lays):
        return None
    x, dy = lays[0], lays[1]
    dm = x.device_matrix
    bna = attrs["begin_norm_axis"]
    tmap = [m if d < bna else () for d, m in enumerate(x.tensor_map)]
    rows = {a for m in tmap for a in m}
    pending = tuple(a for a in dy.partial if a not in rows)
    shape = x.shape
    need_x = layout(dm, tmap, shape)
    stats = layout(dm, tmap, shape[:bna] + (1,) * (len(shape) - bna))
    params = shape[bna:]
    need_g = layout(dm, ((),) * len(params), params)
    summed = layout(dm, ((),) * len(params), params, rows | set(pending))

    def local(attrs, stacks):
        return N.layer_norm_grad_stack(attrs, *stacks)

    return ShardPlan((need_x, layout(dm, tmap, shape, pending), stats, stats, need_g),
                     (layout(dm, tmap, shape, pending), summed, summed), local)
