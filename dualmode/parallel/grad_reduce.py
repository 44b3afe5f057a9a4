"""Data-parallel gradient AllReduce with communication fusion.

A gradient computed from batch-split data arrives as a partial tensor: device d
holds its share p_d of the global gradient, and the AllReduce of the shares is that
gradient. How it then counts is one rule, :func:`replica_gradient_scale`: where each
device has a loss of its own (data_parallel, hybrid_parallel: a MindSpore script's loss
is the mean over the device's local batch, so device d's own gradient is n * p_d)
``gradients_mean=True`` takes the mean of the devices' gradients, the single-device
gradient, and ``False`` their sum, n times it. In semi_auto_parallel and auto_parallel
the program is written for the global batch: the gradient is the global loss's, and the
update equals the single device's whatever ``gradients_mean`` says (a weight replicated
on n devices is never moved n times). Plain (replicated) gradients are already whole and
are left alone.

Gradients are packed into buckets, one AllReduce per bucket:
``all_reduce_fusion_config=[20, 35]`` splits gradients 0-19 / 20-34 / 35-; the
``comm_fusion={"allreduce": {"mode": ..., "config": ...}}`` modes are "index" (the
same list), "size" (buckets of `config` MB) and "auto" (64 MB buckets). Without
either, every gradient has its own AllReduce. :func:`fusion_buckets` also buckets the
ReduceScatters and AllGathers a compiled graph fuses (``comm_fusion["reducescatter"]``
/ ``["allgather"]``, modes "size" and "auto"; graph/fuse.py).

A sharded weight's gradient moves into the weight's layout before its update. Eagerly
(:func:`fuse_gradient_moves`, called by the optimizer) as in a compiled step
(graph/fuse.py), the moves that are one collective are bucketed with the same helpers:
the AllReduces of pending sums (:func:`resolves_pending`) over a group of devices
(:func:`resolve_key`, per ``comm_fusion["allreduce"]``) and the one-step
ReduceScatters (:func:`single_step`, :func:`step_group`, per
``comm_fusion["reducescatter"]``), each bucket of several gradients ONE collective; so
a program reports the same collectives run eagerly and compiled.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import context
from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..communication.sim import shares_total
from ..communication.totals import stored
from ..communication import trace
from ..communication.trace import comm_cause
from .devices import backend as _backend
from .redistribution.planner import plan_redistribution
from .tensor_layout import TensorLayout

__all__ = ["reduce_gradients", "replica_gradient_scale", "fusion_buckets",
           "broadcast_parameters", "is_dp_partial", "resolves_pending", "bucket_name",
           "single_step", "step_group", "resolve_key", "grouped_buckets", "fused_bucket",
           "fuse_gradient_moves"]

_AUTO_MB = 64

#: the parallel modes in which every device computes a loss of its own (its local batch's),
#: so ``gradients_mean`` chooses between the sum and the mean of the devices' gradients
PER_DEVICE_LOSS_MODES = (context.ParallelMode.DATA_PARALLEL,
                         context.ParallelMode.HYBRID_PARALLEL)


def replica_gradient_scale(n: int, mode=None, gradients_mean=None):
    """The factor taking the AllReduce of the shares of a replicated weight's gradient
    (the gradient of the global loss) to the gradient the update applies, on `n` devices
    in parallel mode `mode` with `gradients_mean` (both default to the context's); None
    for 1. The one rule for the eager optimizer and a compiled train step:

    - data_parallel, hybrid_parallel (each device has its own loss): `n` for the sum of
      the devices' gradients (``gradients_mean=False``), None for their mean;
    - semi_auto_parallel, auto_parallel (one program over the global batch) and
      stand_alone: None whatever ``gradients_mean`` says, so the update equals the
      single device's."""
    ap = context._STATE.auto_parallel
    mode = ap.parallel_mode if mode is None else mode
    mean = ap.gradients_mean if gradients_mean is None else gradients_mean
    if mode in PER_DEVICE_LOSS_MODES and not mean and n != 1:
        return n
    return None


def fusion_buckets(sizes_bytes, op: str = "allreduce"):
    """Split positions 0..len-1 (of collectives of kind `op`: "allreduce",
    "reducescatter" or "allgather", with those bytes per device) into buckets per the
    fusion settings, in order.

    ``comm_fusion[op]`` with mode "size" closes a bucket before the member that would
    take it past ``config`` MB (a member larger than that is a bucket of its own); "auto"
    does so at 64 MB; "index" (AllReduce only, as ``all_reduce_fusion_config``) cuts
    before the given positions. Without a setting for `op`, every collective is a bucket
    of its own (no fusion)."""
    n = len(sizes_bytes)
    if n == 0:
        return []
    fusion = (context.get_auto_parallel_context("comm_fusion") or {}).get(op)
    mode, config = (fusion["mode"], fusion.get("config")) if fusion else (None, None)
    idx = context.get_auto_parallel_context("all_reduce_fusion_config") \
        if op == "allreduce" else None
    if mode == "index":
        idx = config
    if idx:
        cuts = [c for c in idx if 0 < c < n]
        bounds = [0] + cuts + [n]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]
    if mode in ("size", "auto"):
        limit = (config if mode == "size" else _AUTO_MB) * 1024 * 1024
        buckets, cur, cur_bytes = [], [], 0
        for i, s in enumerate(sizes_bytes):
            if cur and cur_bytes + s > limit:
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += s
        buckets.append(cur)
        return buckets
    return [[i] for i in range(n)]


def is_dp_partial(lay) -> bool:
    """Is `lay` a data-parallel gradient: pending over the one axis of all devices, not
    split (its AllReduce is the one ``gradients_mean`` and fusion apply to)?"""
    return lay is not None and lay.partial == (0,) and len(lay.device_matrix) == 1 and \
        all(m == () for m in lay.tensor_map)


def resolves_pending(src, dst) -> bool:
    """Is the move of a value from layout `src` into `dst` (a layout, or None for a whole
    value) exactly an AllReduce of its pending sums: `dst` is `src` without them, or a
    whole value when `src` splits nothing? (The eager optimizer's fusion and a compiled
    graph's lowering both ask it.)"""
    if not src.partial:
        return False
    if dst is None:
        return not any(src.tensor_map)
    # the cheap comparisons first: without_partial() builds a layout
    return dst.tensor_map == src.tensor_map and dst.device_matrix == src.device_matrix \
        and dst == src.without_partial()


def single_step(plan, kind: str):
    """The step of the redistribution `plan` when it is exactly one `kind` collective
    ("ReduceScatter", "AllGather"), else None: the moves fusion packs into buckets."""
    if plan is None or len(plan) != 1 or plan[0].kind != kind:
        return None
    return plan[0]


def step_group(plan, step, dtype):
    """(key, members) of the one-step `plan`: the device groups `step` runs over (ranks
    of the plan's unified device matrix), with the dtype, as a hashable key; and those
    groups (the ``members`` of the fused collective)."""
    return _step_group(plan.device_matrix, step.axes, np.dtype(dtype).str)


@functools.lru_cache(maxsize=256)
def _step_group(device_matrix, axes, dtype):
    members = TensorLayout(device_matrix, (), ()).group_members(axes)
    return (members.shape, members.tobytes(), dtype), members


def resolve_key(src):
    """The key bucketing the AllReduces of pending sums (a move from `src` to
    ``src.without_partial()``, or to a whole value when nothing is split): one bucket
    holds AllReduces over the same groups of devices."""
    return src.device_matrix, src.partial


def grouped_buckets(keys, sizes, op: str, buckets=fusion_buckets):
    """Buckets of the positions whose key is not None: per key (keys in order of first
    appearance) ``buckets(sizes of its positions, op)``, as lists of positions."""
    groups = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    return [[members[k] for k in bucket] for members in groups.values()
            for bucket in buckets([sizes[i] for i in members], op)]


def fused_bucket(dtypes) -> bool:
    """Does a bucket of collectives of these dtypes run as one fused collective (more
    than one member, one dtype)? Otherwise each member runs alone, as unfused."""
    return len(dtypes) > 1 and len(set(dtypes)) == 1


#: (gradient signature, fusion settings) -> the fused buckets of an eager update
#: (see :func:`_fused_moves`); an optimizer's signature repeats every step
_FUSED_MOVES: dict = {}
_FUSED_MOVES_MAX = 256


def fuse_gradient_moves(grads, params):
    """`grads` (aligned with `params`) with the moves of an eager optimizer update that
    are one collective done in fused buckets, as a compiled step fuses them
    (graph/fuse.py): a gradient pending over some devices resolved by an AllReduce
    (into its sharded weight's layout, or whole for a weight kept whole; not the
    data-parallel ones, :func:`reduce_gradients`) per ``comm_fusion["allreduce"]``
    (or ``all_reduce_fusion_config``), per group of devices; a gradient moved into its
    sharded weight's layout by one ReduceScatter per ``comm_fusion["reducescatter"]``,
    per group of devices and dtype. Each bucket of several gradients is ONE collective
    (reported as "gradient", named after its weights) and its gradients come back in
    their targets' layouts; the others are left as they are (the optimizer moves each
    alone). Without fusion settings `grads` is returned unchanged. The buckets are
    worked out once per signature of the gradients (layouts, dtypes) and settings."""
    grads = list(grads)
    fusion = context.get_auto_parallel_context("comm_fusion") or {}
    index = context.get_auto_parallel_context("all_reduce_fusion_config")
    if not ("allreduce" in fusion or "reducescatter" in fusion or index):
        return grads
    sig = tuple((g._layout, p._layout if isinstance(p._layout, TensorLayout) else None,
                 g.dtype)
                if isinstance(g, TensorBase) and isinstance(g._layout, TensorLayout) and
                p.requires_grad and not getattr(p, "layerwise_parallel", False) else None
                for g, p in zip(grads, params))
    key = (sig, repr(fusion), repr(index))
    moves = _FUSED_MOVES.get(key)
    if moves is None:
        if len(_FUSED_MOVES) >= _FUSED_MOVES_MAX:
            _FUSED_MOVES.clear()
        moves = _FUSED_MOVES[key] = _fused_moves(sig, "reducescatter" in fusion)
    backend = _backend()
    for kind, bucket, members, axes, dsts in moves:
        stacks = [grads[i]._data for i in bucket]
        if trace._STATE.reports:           # named for the reports that listen
            with comm_cause(bucket_name(params[i].name for i in bucket), "gradient"):
                outs = _fused_move(backend, kind, stacks, members, axes, dsts)
        else:
            outs = _fused_move(backend, kind, stacks, members, axes, dsts)
        for i, out, dst in zip(bucket, outs, dsts):
            grads[i] = _core.wrap_dist(out, dst)
    return grads


def _fused_move(backend, kind, stacks, members, axes, dsts):
    """One bucket of :func:`fuse_gradient_moves`: its collective, the results."""
    if kind == "AllReduce":
        outs = backend.all_reduce_fused(stacks, members, "sum")
        return [out if dst is not None else np.asarray(out[0]) for out, dst in zip(outs, dsts)]
    return backend.reduce_scatter_fused(stacks, members, axes)


def _fused_moves(sig, scatter: bool) -> tuple:
    """The fused collectives of :func:`fuse_gradient_moves` for gradients of signature
    `sig` (per gradient ``(layout, its weight's layout, dtype)``, None when it is not
    moved): ``(kind, positions, members, axes, target layouts)`` per bucket of several
    gradients, AllReduces first; `scatter`: ReduceScatter fusion is configured."""
    n = len(sig)
    ar_keys, rs_keys, sizes, dtypes = [None] * n, [None] * n, [0] * n, [None] * n
    dsts, steps = [None] * n, [None] * n
    for i, entry in enumerate(sig):
        if entry is None:
            continue
        src, lay, dtype = entry
        dst = lay if lay is not None and any(lay.tensor_map) else None
        if src == dst or dst is not None and dst.device_num != src.device_num:
            continue
        dtypes[i], dsts[i] = dtype, dst
        sizes[i] = math.prod(src.local_shape) * dtype.itemsize
        if resolves_pending(src, dst):
            if not is_dp_partial(src):           # those: reduce_gradients
                ar_keys[i] = resolve_key(src)
        elif dst is not None and scatter:
            plan = plan_redistribution(src, dst, dtype.itemsize or 1)
            step = single_step(plan, "ReduceScatter")
            if step is not None:
                rs_keys[i], members = step_group(plan, step, dtype)
                steps[i] = (members, step.dim)
    moves = []
    for bucket in grouped_buckets(ar_keys, sizes, "allreduce"):
        if fused_bucket([dtypes[i] for i in bucket]):
            src = sig[bucket[0]][0]
            moves.append(("AllReduce", tuple(bucket), src.group_members(src.partial), None,
                          tuple(dsts[i] for i in bucket)))
    for bucket in grouped_buckets(rs_keys, sizes, "reducescatter"):
        if fused_bucket([dtypes[i] for i in bucket]):
            moves.append(("ReduceScatter", tuple(bucket), steps[bucket[0]][0],
                          [steps[i][1] for i in bucket], tuple(dsts[i] for i in bucket)))
    return tuple(moves)


def reduce_gradients(grads, params=None):
    """AllReduce the partial gradients in `grads` (fused per the context's settings);
    returns a list of plain Tensors (other entries unchanged)."""
    grads = list(grads)
    todo = []
    for i, g in enumerate(grads):
        if not isinstance(g, TensorBase):
            continue
        lay = g._layout
        if lay is None:
            continue
        if params is not None:
            p = params[i]
            if getattr(p, "_layout", None) is not None or getattr(p, "layerwise_parallel",
                                                                  False):
                continue      # per-device and sharded weights: reduced by the optimizer
        if not _dp_partial(lay):
            grads[i] = _core.wrap_dist(g._value(), None)     # other layouts: gather
            continue
        todo.append(i)
    if not todo:
        return grads
    backend = _backend()
    scale = replica_gradient_scale(backend.world_size)
    # a gradient's stack as it is: one not written yet (equal shares whose total is
    # known, Tensor._lazy) the sim backend reads without writing
    stacks = [stored(grads[i]) for i in todo]
    if not trace._STATE.reports and backend.reads_deferred:
        todo, stacks = _known_sums(grads, todo, stacks, backend.world_size, scale)
    for bucket in fusion_buckets([math.prod(st.shape[1:]) * st.itemsize for st in stacks]):
        members = [todo[k] for k in bucket]
        inputs = [stacks[k] for k in bucket]
        dtype = inputs[0].dtype
        if len(inputs) > 1:
            dtype = np.result_type(*[st.dtype for st in inputs])
            inputs = [st if st.dtype == dtype else np.asarray(st).astype(dtype)
                      for st in inputs]
        # the AllReduce(sum) of the shares p_d is the global loss's gradient (the mean
        # of the devices' own gradients n * p_d where each has its own loss), then
        # scaled per replica_gradient_scale. One collective per bucket (no packing copy
        # on simulated devices), each result a view into it
        if trace._STATE.reports:           # named for the reports that listen
            name = bucket_name([params[i].name for i in members]) if params is not None \
                else f"{len(members)} gradients" if len(members) > 1 else "gradient"
            with comm_cause(name, "gradient"):
                outs = backend.all_reduce_fused(inputs, None, "sum")
        else:
            outs = backend.all_reduce_fused(inputs, None, "sum")
        for i, k, out in zip(members, bucket, outs):
            total = out[0] if scale is None else np.multiply(out[0], scale, dtype=out.dtype)
            if total.dtype != stacks[k].dtype:
                total = total.astype(stacks[k].dtype)
            grads[i] = _core.wrap_dist(total, None)
    return grads


def _known_sums(grads, todo, stacks, world: int, scale):
    """While no report records the AllReduces, the gradients among `todo` whose stacks
    are equal shares over the whole world with a known total (a data-parallel gradient
    on simulated devices) take the AllReduce's result, that total (times `scale`, see
    :func:`replica_gradient_scale`), directly: the same numbers without the collective's
    machinery (about 10 us a gradient). Returns the positions and stacks left for the
    collectives."""
    left, left_stacks = [], []
    for i, st in zip(todo, stacks):
        total = shares_total(st) if st.shape[0] == world else None
        if total is None:
            left.append(i)
            left_stacks.append(st)
            continue
        if scale is not None:
            total = np.multiply(total, scale, dtype=total.dtype)
        grads[i] = _core.wrap_dist(total, None)
    return left, left_stacks


def _dp_partial(lay) -> bool:
    """:func:`is_dp_partial` of a gradient's layout, kept on a (immutable) TensorLayout
    after the first ask."""
    if type(lay) is not TensorLayout:
        return is_dp_partial(lay)
    found = lay.__dict__.get("_is_dp_partial")
    if found is None:
        found = lay.__dict__["_is_dp_partial"] = is_dp_partial(lay)
    return found


def bucket_name(names, what: str = "gradients") -> str:
    """What a fused collective carries, for reports: 'a, b, c' or 'a .. z (k <what>)'."""
    names = [str(x) for x in names]
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} {what})"


def broadcast_parameters(params, root=0):
    """``parameter_broadcast``: give every device rank `root`'s values of the
    (replicated) `params`, one Broadcast per parameter. Under "sim" the devices
    already share one array, so only the collectives run."""
    backend = _backend()
    n = backend.world_size
    for p in params:
        if getattr(p, "layerwise_parallel", False) or p._layout is not None:
            continue
        value = p._value()
        stack = np.broadcast_to(value[None], (len(backend.local_ranks),) + value.shape)
        with comm_cause(p.name, "parameter_broadcast"):
            out = backend.broadcast(stack, members=None, root=root)
        if n > 1 and len(backend.local_ranks) == 1:       # one device per process
            p._data[...] = np.asarray(out[0])
