"""Collective primitives for hybrid-parallel user code: ``ops.AllReduce`` & co.

MindSpore's hybrid parallel mode runs the same program on every device; these ops are
the communication the user writes by hand. Their meaning is defined per device, then
mapped to dualmode's values:

* a **device-local** value (a ``layerwise_parallel`` parameter, or anything computed
  from one; see :mod:`dualmode.parallel.device_local`): device ``d`` contributes its
  own value;
* a **plain** (replicated) value: every device contributes the same value, so
  ``AllReduce("sum")`` gives ``n * x``, ``"mean"``/``"max"``/``"min"`` give ``x`` and
  ``"prod"`` gives ``x ** n``;
* a **batch-split** value (the data-parallel layout of network inputs): device ``d``
  contributes its shard of the batch (``AllReduce`` of a ``(B, k)`` input split over
  ``n`` devices gives a ``(B/n, k)`` value); other distributed values (pending partial
  sums, operator-sharded tensors) contribute their global value, like plain ones.

=============  ============================================  =================================
op             per device d (group of k devices)             result
=============  ============================================  =================================
AllReduce      reduce (sum/mean/max/min/prod) the values     plain (device-local for a group
                                                              that omits some devices)
AllGather      concatenate the k values along dim 0          plain, shape (k * s0, ...)
ReduceScatter  sum the values, keep part d of k along dim 0  device-local, shape (s0 / k, ...)
Broadcast      the value of the group's root_rank            plain (device-local for a group
                                                              that omits some devices)
AlltoAll       split along split_dim in k chunks, send        device-local
               chunk j to device j, concatenate what
               arrives (in source order) along concat_dim
=============  ============================================  =================================

Gradients: AllReduce sends the (replicated) output gradient to every device's input
(divided by k for mean; for max/min to the devices holding the result, ties sharing
it; for prod times the other devices' product); AllGather gives device d rows
``[d*s0:(d+1)*s0]`` of the gradient (a ReduceScatter when the gradient is a pending
partial sum); ReduceScatter AllGathers the gradient to every device's input (sum and
mean only, as MindSpore); Broadcast sends the gradient to the root, zeros elsewhere;
AlltoAll runs the inverse AlltoAll (split and concat dims swapped). One rule under
both backends: a plain result is one value with one gradient (the program has one
loss, not one per device), an input every device holds alike (plain) gets the sum of
the devices' gradients, and a device-local input (a ``layerwise_parallel`` weight) its
device's own. So a layer whose collective rebuilds the single device's value (the
AllReduce of partial sums, the AllGather of column blocks, ...) trains exactly as the
single device does, with every device's slice getting its part of the gradient.

Every collective runs through the communication backend, so
:class:`dualmode.parallel.CommReport` records it with reason ``"user"`` (``"backward"``
for those its gradient issues).

Groups: the world group (``"hccl_world_group"``, also ``"nccl_world_group"`` and
``"mccl_world_group"``) or a group made by ``dm.communication.create_group``. In the
one-process simulation every device runs the op, so AllGather, ReduceScatter and
AlltoAll with ``split_dim != concat_dim`` need a group of every device (in any order);
AllReduce, Broadcast and AlltoAll with ``split_dim == concat_dim`` also accept a
smaller group, whose non-members keep their values. ``Broadcast(root_rank)`` counts
``root_rank`` within the group.

Under ``parallel_mode="stand_alone"`` no op is split, but every device the backend
started (each MPI rank, or each simulated device of ``init()`` with ``device_num``
set) runs the whole program, and a collective communicates among them as in
MindSpore: after ``init()`` on 4 devices ``AllReduce()(ones(3))`` is ``[4, 4, 4]``
under both backends. With one device (no backend, ``get_group_size() == 1``,
``device_num=1`` set to run one device on purpose, or under "sim" no ``device_num``
set) every collective returns its input unchanged. A process launched as one of several MPI ranks that calls a
collective before ``init()`` gets a RuntimeError naming ``init()``.
"""
from __future__ import annotations

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import OpDef, TensorBase
from ..communication import comm_cause, get_backend, group_members
from ..communication.management import started_backend
from ..ops._registry import (KIND_GENERIC, REGISTRY, apply, const, register, same_as_input,
                             wrap)
from ..ops.collectives import WORLD_GROUP
from . import device_local as dl
from .moves import gather_global
from .stacks import is_batch_layout
from .devices import parallel_active
from .grad_reduce import is_dp_partial
from .graph.trace import is_abstract

_WORLD_ALIASES = frozenset({"hccl_world_group", "nccl_world_group", "mccl_world_group"})


# ---------------------------------------------------------------------------
# groups and the backend
# ---------------------------------------------------------------------------
def _group_size(attrs) -> int:
    mem = attrs.get("members")
    return attrs.get("n", 1) if mem is None else len(mem)


def _is_full(attrs) -> bool:
    mem = attrs.get("members")
    return mem is None or len(mem) == attrs["n"]


def _members2d(attrs):
    mem = attrs.get("members")
    return None if mem is None else np.asarray(mem, dtype=np.int64).reshape(1, -1)


def _resolve_group(opname, group, n):
    """None for the world group (ranks in order), else the tuple of the group's world
    ranks in group-rank order."""
    if group in _WORLD_ALIASES:
        return None
    try:
        mem = group_members(group)[0]
    except ValueError as e:
        raise ValueError(f"{opname}: group {group!r} is not valid: {e}") from None
    if len(mem) == n and np.array_equal(mem, np.arange(n)):
        return None
    return tuple(int(r) for r in mem)


def _require_full(opname, attrs, why):
    if not _is_full(attrs):
        raise RuntimeError(
            f"{opname}: group {attrs['group']!r} (ranks {list(attrs['members'])}) does not "
            f"contain every one of the {attrs['n']} devices; in the one-process simulation "
            f"every device runs the collective and {why}, so it needs a group of all "
            f"{attrs['n']} devices (e.g. the world group {WORLD_GROUP!r})")


def _comm(opname, method, *args, **kw):
    """Run one backend collective, recorded as `opname`'s ("user", or "backward")."""
    reason = "backward" if _core.in_backward() else "user"
    with comm_cause(opname, reason):
        return getattr(get_backend(), method)(*args, **kw)


# ---------------------------------------------------------------------------
# gradients arriving at a collective
# ---------------------------------------------------------------------------
def _plain_grad(g, opname):
    """The gradient of a plain output as one array (resolving partial sums, gathering
    shards; per-device gradients of a plain value are summed)."""
    if not isinstance(g, TensorBase):
        return np.asarray(g)
    lay = g._layout
    if lay is None:
        return g._value()
    if isinstance(lay, dl.DeviceLocalLayout):
        g = _core.wrap_dist(g._data, dl._partial_layout(lay.shape, lay.device_num))
    return gather_global(g, opname)


def _local_grad(g, n, shape, opname):
    """The gradient of a device-local output as this process's stack (rows, *shape)."""
    if isinstance(g, TensorBase) and isinstance(g._layout, dl.DeviceLocalLayout):
        return g._data
    return np.broadcast_to(_plain_grad(g, opname), (dl.local_row_count(n),) + tuple(shape))


def _wrap_local(stack, layout):
    return _core.wrap_dist(stack, layout)


def _exclusive_prod(x):
    """Per device, the product of the other devices' values (no division)."""
    ones = np.ones_like(x[:1])
    left = np.concatenate([ones, np.cumprod(x[:-1], axis=0)], axis=0)
    right = np.concatenate([np.cumprod(x[:0:-1], axis=0)[::-1], ones], axis=0)
    return left * right


def _reduce_grad(op, xm, ym, gm, k):
    """Per-member input gradients of a k-device reduction: xm (k, *s) the inputs, ym
    the result and gm the summed output gradient (both broadcastable to xm)."""
    dt = xm.dtype
    if op == "sum":
        return np.broadcast_to(gm, xm.shape)
    if op == "mean":
        return np.broadcast_to(np.true_divide(gm, k, dtype=dt), xm.shape)
    if op in ("max", "min"):
        mask = (xm == ym)
        ties = np.add.reduce(mask, axis=0, dtype=dt)
        return (mask * np.true_divide(gm, np.maximum(ties, 1), dtype=dt)).astype(dt, copy=False)
    return (gm * _exclusive_prod(xm)).astype(dt, copy=False)      # prod


# ---------------------------------------------------------------------------
# AllReduce
# ---------------------------------------------------------------------------
def _check_reducible(name, x, op):
    if x.dtype.kind == "b":
        raise TypeError(f"{name}: input 0 has dtype bool; supported dtypes: integer and "
                        f"floating dtypes (use ops.cast)")
    if op == "mean" and x.dtype.kind != "f":
        raise TypeError(f"{name}: op='mean' needs a floating dtype but input 0 has dtype "
                        f"{x.dtype}; use op='sum' or ops.cast")


def _infer_all_reduce(attrs, x):
    _check_reducible("AllReduce", x, attrs["op"])
    return ((tuple(x.shape), x.dtype),)


def _fw_all_reduce(attrs, stack, n):
    out = _comm("AllReduce", "all_reduce", stack, members=_members2d(attrs), op=attrs["op"])
    if _is_full(attrs):
        return np.asarray(out[0]), True
    return out, False


def _bw_all_reduce(node, g):
    x = node.inputs[0]
    attrs = node.attrs
    lay = x._layout
    n, op = lay.device_num, attrs["op"]
    k = _group_size(attrs)
    xs = x._data
    y = node.outputs[0]
    if _is_full(attrs):
        G = _plain_grad(g, "AllReduce")
        ym = y._value() if op in ("max", "min") else None
        if op in ("max", "min", "prod"):      # needs every device's input (unrecorded
            xs = dl.all_rows(xs, n)            # under "mpi", as sim reads its stack)
        dx = _reduce_grad(op, xs, ym, G, k)   # member order does not matter: all devices
        return (_wrap_local(dl.own_rows(dx, n) if dx.shape[0] == n else dx, lay),)
    gs = _local_grad(g, n, lay.shape, "AllReduce")
    gsum = _comm("AllReduce", "all_reduce", gs, members=_members2d(attrs), op="sum")
    if op == "sum":
        return (_wrap_local(gsum, lay),)       # members: the summed gradient; others: own
    mem = np.asarray(attrs["members"], dtype=np.int64)
    dx = np.array(dl.all_rows(gsum, n))
    ym = dl.all_rows(y._data, n)[mem] if op in ("max", "min") else None
    dx[mem] = _reduce_grad(op, dl.all_rows(xs, n)[mem], ym, dx[mem], k)
    return (_wrap_local(dl.own_rows(dx, n), lay),)


# ---------------------------------------------------------------------------
# AllGather
# ---------------------------------------------------------------------------
def _infer_all_gather(attrs, x):
    if x.ndim == 0:
        raise ValueError("AllGather: input 0 is 0-d; AllGather concatenates the devices' "
                         "values along dim 0, so they need rank >= 1")
    k = _group_size(attrs)
    return (((k * x.shape[0],) + tuple(x.shape[1:]), x.dtype),)


def _fw_all_gather(attrs, stack, n):
    _require_full("AllGather", attrs, "AllGather changes the value's shape")
    out = _comm("AllGather", "all_gather", stack, members=_members2d(attrs), axis=0)
    return np.asarray(out[0]), True


def _is_dp_partial(g):
    lay = g._layout if isinstance(g, TensorBase) else None
    return not isinstance(lay, dl.DeviceLocalLayout) and is_dp_partial(lay)


def _bw_all_gather(node, g):
    x = node.inputs[0]
    lay = x._layout
    n = lay.device_num
    attrs = node.attrs
    k = _group_size(attrs)
    if _is_dp_partial(g) and g._data.shape[0] == dl.local_row_count(n):
        # device d only needs part d of the summed gradient: a ReduceScatter
        dx = _comm("AllGather", "reduce_scatter", g._data, members=_members2d(attrs), axis=0,
                   op="sum")
        return (_wrap_local(dx, lay),)
    G = _plain_grad(g, "AllGather")
    parts = G.reshape((k,) + tuple(lay.shape))
    if attrs["members"] is None:
        return (_wrap_local(dl.own_rows(parts, n), lay),)
    dx = np.empty((n,) + tuple(lay.shape), dtype=parts.dtype)
    dx[np.asarray(attrs["members"], dtype=np.int64)] = parts
    return (_wrap_local(dl.own_rows(dx, n), lay),)


# ---------------------------------------------------------------------------
# ReduceScatter
# ---------------------------------------------------------------------------
def _infer_reduce_scatter(attrs, x):
    _check_reducible("ReduceScatter", x, attrs["op"])
    k = _group_size(attrs)
    if x.ndim == 0:
        raise ValueError("ReduceScatter: input 0 is 0-d; ReduceScatter splits dim 0 across "
                         "the devices, so the values need rank >= 1")
    if x.shape[0] % k:
        raise ValueError(f"ReduceScatter: dim 0 (size {x.shape[0]}) of input 0 (per-device "
                         f"shape {tuple(x.shape)}) is not divisible by the {k} devices of "
                         f"group {attrs.get('group', WORLD_GROUP)!r}")
    return (((x.shape[0] // k,) + tuple(x.shape[1:]), x.dtype),)


def _fw_reduce_scatter(attrs, stack, n):
    _require_full("ReduceScatter", attrs, "ReduceScatter changes the value's shape")
    out = _comm("ReduceScatter", "reduce_scatter", stack, members=_members2d(attrs), axis=0,
                op=attrs["op"])
    return out, False


def _bw_reduce_scatter(node, g):
    x = node.inputs[0]
    lay = x._layout
    attrs = node.attrs
    op = attrs["op"]
    if op not in ("sum", "mean"):
        raise RuntimeError(f"ReduceScatter: the gradient of op={op!r} is not supported; "
                           f"only 'sum' and 'mean' have one (as in MindSpore)")
    out_shape = (lay.shape[0] // _group_size(attrs),) + tuple(lay.shape[1:])
    gs = _local_grad(g, lay.device_num, out_shape, "ReduceScatter")
    full = _comm("ReduceScatter", "all_gather", np.ascontiguousarray(gs),
                 members=_members2d(attrs), axis=0)
    if op == "mean":
        full = np.true_divide(full, _group_size(attrs), dtype=full.dtype)
    return (_wrap_local(full, lay),)


# ---------------------------------------------------------------------------
# Broadcast
# ---------------------------------------------------------------------------
def _fw_broadcast(attrs, stack, n):
    out = _comm("Broadcast", "broadcast", stack, members=_members2d(attrs), root=attrs["root"])
    if _is_full(attrs):
        return np.asarray(out[0]), True
    return out, False


def _root_device(attrs):
    mem = attrs["members"]
    return attrs["root"] if mem is None else mem[attrs["root"]]


def _bw_broadcast(node, g):
    x = node.inputs[0]
    lay = x._layout
    n = lay.device_num
    attrs = node.attrs
    root = _root_device(attrs)
    if _is_full(attrs):
        G = _plain_grad(g, "Broadcast")
        dx = np.zeros((n,) + tuple(lay.shape), dtype=G.dtype)
        dx[root] = G
        return (_wrap_local(dl.own_rows(dx, n), lay),)
    gs = _local_grad(g, n, lay.shape, "Broadcast")
    red = _comm("Broadcast", "reduce", np.ascontiguousarray(gs), members=_members2d(attrs),
                root=attrs["root"], op="sum")
    dx = np.array(red)
    others = [m for m in attrs["members"] if m != root]
    dx[np.isin(dl.local_ranks(n), others)] = 0        # this process's rows of the others
    return (_wrap_local(dx, lay),)


# ---------------------------------------------------------------------------
# AlltoAll
# ---------------------------------------------------------------------------
def _infer_all_to_all(attrs, x):
    k = _group_size(attrs)
    sc, sd, cd = attrs["split_count"], attrs["split_dim"], attrs["concat_dim"]
    r = x.ndim
    if sc != k:
        raise ValueError(f"AlltoAll: split_count={sc} must equal the number of devices in "
                         f"group {attrs.get('group', WORLD_GROUP)!r} ({k})")
    for name, d in (("split_dim", sd), ("concat_dim", cd)):
        if not -r <= d < r or r == 0:
            raise ValueError(f"AlltoAll: {name}={d} is out of range for input 0 of per-device "
                             f"shape {tuple(x.shape)}; expected {-r} <= {name} < {r}")
    sd, cd = sd % r, cd % r
    if x.shape[sd] % k:
        raise ValueError(f"AlltoAll: dim {sd} (split_dim, size {x.shape[sd]}) of input 0 "
                         f"(per-device shape {tuple(x.shape)}) is not divisible by "
                         f"split_count={k}")
    shape = list(x.shape)
    shape[sd] //= k
    shape[cd] *= k
    return ((tuple(shape), x.dtype),)


def _fw_all_to_all(attrs, stack, n):
    r = stack.ndim - 1
    sd, cd = attrs["split_dim"] % r, attrs["concat_dim"] % r
    if sd != cd:
        _require_full("AlltoAll", attrs, "AlltoAll with split_dim != concat_dim changes the "
                      "value's shape")
    out = _comm("AlltoAll", "all_to_all", stack, members=_members2d(attrs), split_axis=sd,
                concat_axis=cd)
    return out, False


def _bw_all_to_all(node, g):
    x = node.inputs[0]
    lay = x._layout
    attrs = node.attrs
    r = len(lay.shape)
    sd, cd = attrs["split_dim"] % r, attrs["concat_dim"] % r
    k = _group_size(attrs)
    out_shape = list(lay.shape)
    out_shape[sd] //= k
    out_shape[cd] *= k
    gs = _local_grad(g, lay.device_num, tuple(out_shape), "AlltoAll")
    dx = _comm("AlltoAll", "all_to_all", np.ascontiguousarray(gs), members=_members2d(attrs),
               split_axis=cd, concat_axis=sd)
    return (_wrap_local(dx, lay),)


# ---------------------------------------------------------------------------
# the registered ops
# ---------------------------------------------------------------------------
def _one_device_kernel(name):
    def kernel(attrs, x):
        if attrs.get("n", 1) != 1:
            raise RuntimeError(f"{name}: on {attrs['n']} devices the op runs on per-device "
                               f"values; call it as ops.{name}(...)(x)")
        return x           # one device: every collective is the identity
    return kernel


def _register(name, infer, fw, bw, save_outputs=False):
    op = register(name, kind=KIND_GENERIC, infer=infer, kernel=_one_device_kernel(name),
                  backward=bw, save_outputs=save_outputs)
    op.extras["collective"] = fw           # the forward over the devices' values
    op.extras["device_local"] = _run_local
    # one device: the identity (gradient too), still taped under the op's name so a
    # tape holds every op the user called (check_equivalence aligns runs on it)
    op.extras["one_device"] = OpDef(name, kind=KIND_GENERIC, infer=same_as_input,
                                    kernel=lambda attrs, x: x,
                                    backward=lambda node, g: (g,), reads_inputs=False)
    return op


def _run_local(op, attrs, inputs, n):
    """Run a collective on a device-local input (called by device_local_apply)."""
    if len(inputs) != 1 or not dl.is_device_local(inputs[0]):
        raise TypeError(f"{op.name}: takes one tensor input")
    x = inputs[0]
    if attrs.get("n") != n:
        raise RuntimeError(f"{op.name}: the input holds the values of {n} devices but the op "
                           f"was set up for {attrs.get('n')}")
    stack = x._data
    stand_in = np.broadcast_to(np.zeros((), stack.dtype), stack.shape[1:])
    ((shape, _dt),) = _core.infer(op, attrs, stand_in)
    out, plain = op.extras["collective"](attrs, stack, n)
    layout = None if plain else dl.DeviceLocalLayout(n, shape)
    if plain and np.ndim(out) == 0:
        out = np.asarray(out)
    return _core.finish(op, attrs, (x,), out, x._node is not None, (layout,))


ALL_REDUCE = _register("AllReduce", _infer_all_reduce, _fw_all_reduce, _bw_all_reduce,
                       save_outputs=True)
ALL_GATHER = _register("AllGather", _infer_all_gather, _fw_all_gather, _bw_all_gather)
REDUCE_SCATTER = _register("ReduceScatter", _infer_reduce_scatter, _fw_reduce_scatter,
                           _bw_reduce_scatter)
BROADCAST = _register("Broadcast", same_as_input, _fw_broadcast, _bw_broadcast)
ALL_TO_ALL = _register("AlltoAll", _infer_all_to_all, _fw_all_to_all, _bw_all_to_all)


def _world(name) -> int:
    """The devices a user collective communicates among: those of the parallel context,
    or under ``parallel_mode="stand_alone"`` every device the backend started (MPI
    ranks, or the simulated devices of ``init()``), each running the whole program;
    see :func:`~dualmode.parallel.device_local.context_devices`."""
    if not parallel_active():
        started_backend(name)       # one of several MPI ranks before init(): the error
    return dl.context_devices()


def run(prim, x):
    """Run the collective primitive `prim` (``ops.AllReduce()`` & co.) on one value `x`
    (see the module docstring)."""
    name = prim.name
    n = _world(name)
    if is_abstract(x) and n > 1:
        raise ValueError(f"{name}: op {name} has no sharding rule, so a compiled graph "
                         f"cannot place it; call it outside the compiled function (in "
                         f"PyNative mode)")
    x = const(x, name)
    if n == 1:                             # one device: the identity
        if isinstance(x, TensorBase) and x._node is not None and x._layout is None:
            return apply(REGISTRY[name].extras["one_device"], None, (x,))
        return wrap(x)
    members = _resolve_group(name, prim.group, n)
    k = n if members is None else len(members)
    if isinstance(x, TensorBase):
        lay = x._layout
        if isinstance(lay, dl.DeviceLocalLayout):
            pass
        elif lay is not None and is_batch_layout(lay):
            x = dl.shards_as_device_local(x)      # device d contributes its shard
        else:
            x = dl.to_device_local(x, n, name)    # every device: the global value
    else:
        x = _core.wrap_dist(np.broadcast_to(x, (dl.local_row_count(n),) + x.shape),
                            dl.DeviceLocalLayout(n, x.shape))
    attrs = {"group": prim.group, "n": n, "members": members}
    attrs.update(prim._attrs(tuple(x.shape), k))
    return apply(REGISTRY[name], attrs, (x,))
