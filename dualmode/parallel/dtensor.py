"""Distributed tensors in eager (PyNative) mode.

A distributed Tensor keeps ``_layout`` (a :class:`TensorLayout`) and, in ``_data``,
the stack of the local shards of the devices this process holds (leading axis =
local devices). The dispatcher hands every op with a distributed input to
:func:`dist_apply`, which picks one of four ways to run it:

1. **partial-linear**: inputs holding pending partial sums stay partial through
   ops that are linear in them (Add/Sub of two partials, Mul/RealDiv by a
   replicated value, Neg, Cast, Reshape, ReduceSum/ReduceMean); any other op
   first resolves them with an AllReduce.
2. **batch-local**: when every distributed input is split on dim 0 only (the
   data-parallel layout) and the op treats rows independently (its rule in
   ``_BATCH_LOCAL``), the stacks ``(n, B/n, ...)`` are viewed as the concatenated
   batch ``(B, ...)`` and the op's own kernel runs once over every device's
   shard; outputs are split on dim 0 again. One numpy call for all devices.
3. **batch-contracting**: ops that sum over the batch (MatMul contracting dim 0,
   ReduceSum/Mean over dim 0, GatherGrad) run per device on the stacks and give a
   partial result; ReduceMax/Min finish with an AllReduce(max/min).
4. **fallback**: anything else gathers its distributed inputs to the global value
   (an AllGather, reported as "redistribution") and runs as a plain op.

Operator-level sharding rules for every op (issue 4) extend this table.

A process holding only some devices (backend "mpi": stacks of one device) skips the
data-parallel fast paths 2 and 3, which view a stack as every device's rows, and runs
the ops' sharding rules instead (their local computations are per device, for a stack
of any length; the rules' collectives and the redistribution executor go through the
backend). Global values entering the program are cut into this process's blocks only
(:func:`local_rows`); reading a global value (``asnumpy``, :func:`assemble`) gathers
the stacks of the world first, an AllGather every rank must make in the same order
that CommReport does not record (an observation); the gather fallback (4) is a real,
recorded AllGather over the world.
"""
from __future__ import annotations

import functools
import math

import weakref

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import KIND_GENERIC, TensorBase
from .. import context
from ..ops._registry import register, same_as_input
from ..communication.trace import record
from ..tensor import Parameter
from .devices import backend as _backend
from .devices import device_num, parallel_active
from .devices import holds_all_devices as _holds_all_devices
from .devices import live_backend as _live_backend
from .devices import op_cause as _cause
from .devices import some_devices as _some_devices
from .devices import world_stack
from .layout import TensorLayout, stand_in
from .sharding import sharded_apply

__all__ = ["distribute", "dist_apply", "assemble", "parallel_active", "device_num",
           "is_batch_layout", "resolve_partial"]


# ---------------------------------------------------------------------------
# layouts and stacks
# ---------------------------------------------------------------------------
def is_batch_layout(layout) -> bool:
    """Split on dim 0 over a 1-axis device matrix, nothing else split or partial."""
    return (layout is not None and len(layout.device_matrix) == 1 and not layout.partial
            and len(layout.tensor_map) > 0 and layout.tensor_map[0] == (0,)
            and all(m == () for m in layout.tensor_map[1:]))


def _is_partial_only(layout) -> bool:
    return (layout is not None and layout.partial
            and all(m == () for m in layout.tensor_map))


#: Tensors a data set made from this rank's own shard (``num_shards`` = the MPI world,
#: ``shard_id`` = this rank): a network takes them as its local rows of the batch.
#: (by id: tensors compare elementwise)
RANK_SHARDS = weakref.WeakValueDictionary()


def local_rows(arr, layout: TensorLayout) -> np.ndarray:
    """The stack of this process's blocks of the global value `arr` in `layout` (every
    device's under "sim"; only ``backend.local_ranks``' otherwise, the others never
    built)."""
    b = _live_backend()
    if b is not None and len(b.local_ranks) < layout.device_num == b.world_size:
        return layout.local_blocks_of(arr, b.local_ranks)
    return layout.local_blocks(arr)


def distribute(x, layout: TensorLayout):
    """A distributed Tensor holding `x` (a Tensor or array with the global value)
    in `layout`: this process's blocks of it. Batch splits are views; other layouts
    copy the local blocks."""
    arr = x._value() if isinstance(x, TensorBase) else np.asarray(x)
    if _some_devices():
        return _core.wrap_dist(local_rows(arr, layout), layout)
    if is_batch_layout(layout):
        n = layout.device_matrix[0]
        stack = arr.reshape((n, arr.shape[0] // n) + arr.shape[1:])
    else:
        stack = layout.local_blocks(arr)
    return _core.wrap_dist(stack, layout)


def assemble(t) -> np.ndarray:
    """The global value of a distributed tensor (an observation, not a collective of the
    program: under "mpi" an unrecorded AllGather over the world, so every rank must
    read it, in the same order)."""
    layout = t._layout
    s = t._data
    if isinstance(layout, TensorLayout) and s.shape[0] != layout.device_num:
        s = world_stack(s, layout)
    if is_batch_layout(layout):
        return s.reshape((s.shape[0] * s.shape[1],) + s.shape[2:])
    return layout.assemble(s)


def resolve_partial(t, op_name):
    """AllReduce a partial tensor into one without pending sums (plain when nothing else
    is split). Recorded on the tape, so gradients flow through it."""
    layout = t._layout
    backend = _backend()
    with _cause(op_name):
        out = backend.all_reduce(t._data, members=_members(layout, layout.partial), op="sum")
    rest = layout.without_partial()
    if all(m == () for m in rest.tensor_map):
        return moved(t, np.asarray(out[0]), None)
    return moved(t, np.asarray(out), rest)


# Moving a tensor into another layout changes where its pieces live, not its value,
# so the gradient passes through unchanged (in whatever layout it arrives). On a plain
# global value the kernel is the identity; the moves themselves are made by `moved`.
REDISTRIBUTE = register("Redistribute", infer=same_as_input,
                        kernel=lambda attrs, x: x, backward=lambda node, g: (g,))


def moved(x, stack, layout):
    """`x` (a Tensor) now stored as `stack` in `layout`, as a recorded Redistribute."""
    rec = isinstance(x, TensorBase) and x._node is not None and _core.recording()
    return _core.finish(REDISTRIBUTE, {"dst": layout}, (x,), stack, rec, (layout,))


def _members(layout, axes):
    return layout.group_members(axes)


def _gather_global(t, op_name):
    """The global value of a distributed input, moved by an AllGather (fallback)."""
    layout = t._layout
    if layout.partial:
        t = resolve_partial(t, op_name)
        if t._layout is None:
            return t._value()
        layout = t._layout
    backend = _backend()
    if is_batch_layout(layout):
        with _cause(op_name, "redistribution"):
            out = backend.all_gather(t._data, members=None, axis=0)
        return np.asarray(out[0])
    if t._data.shape[0] != layout.device_num:
        # a process holding some devices: one AllGather of the stacks over the world
        with _cause(op_name, "redistribution"):
            out = backend.all_gather(np.ascontiguousarray(t._data)[:, None], members=None,
                                     axis=0)
        return layout.assemble(out[0])
    # one AllGather over the axes that split the tensor; under "sim" the blocks are
    # reassembled in place, so only the record is made here
    group = 1
    for a in layout.split_axes:
        group *= layout.device_matrix[a]
    with _cause(op_name, "redistribution"):
        record("AllGather", group, layout.device_num // group, t._data[0].nbytes)
    return layout.assemble(t._data)


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
    LAYOUT_KINDS[layout_cls] = apply_fn


def dist_apply(op, attrs, inputs, rec):
    """Run `op` when at least one input is distributed (see the module docstring)."""
    layouts = [x._layout if isinstance(x, TensorBase) else None for x in inputs]
    for lay in layouts:
        kind = LAYOUT_KINDS.get(type(lay))
        if kind is not None:
            return kind(op, attrs, inputs, rec)
    if any(lay is not None and lay.partial for lay in layouts):
        out = _partial_linear(op, attrs, inputs, layouts, rec)
        if out is not None:
            return out
        inputs = tuple(resolve_partial(x, op.name)
                       if lay is not None and lay.partial else x
                       for x, lay in zip(inputs, layouts))
        layouts = [x._layout if isinstance(x, TensorBase) else None for x in inputs]
        if all(lay is None for lay in layouts):
            return _core.apply(op, attrs, inputs)
    dist = [lay for lay in layouts if lay is not None]
    if all(is_batch_layout(lay) for lay in dist) and len({(lay.device_matrix, lay.shape[0])
                                                         for lay in dist}) == 1 \
            and not _some_devices():
        # the data-parallel fast paths view the stacks as every device's rows; a process
        # holding some devices runs the sharding rules below (per-device on its stack)
        n, batch = dist[0].device_matrix[0], dist[0].shape[0]
        merged = [_merged(x) for x in inputs]
        kind = _batch_rule(op, attrs, merged, layouts, batch)
        if kind == "local":
            return _batch_local(op, attrs, inputs, merged, n, batch, rec)
        if kind == "contract":
            return _CONTRACT[op.name](op, attrs, inputs, layouts, n, batch, rec)
    out = _sharded(op, attrs, inputs, rec, layouts)
    if out is not None:
        return out
    if op.kind != KIND_GENERIC and len(set(dist)) == 1 and all(
            lay is not None or np.ndim(_merged(x)) == 0 for x, lay in zip(inputs, layouts)):
        # elementwise on one shared layout (scalars aside): run on the stacks as they are
        stacks = [x._data if lay is not None else _merged(x) for x, lay in zip(inputs, layouts)]
        _core.infer(op, attrs, *[stand_in(s.dtype, dist[0].shape)
                                 if lay is not None else s for s, lay in zip(stacks, layouts)])
        out = op.kernel(*stacks)
        return _core.finish(op, attrs, inputs, np.asarray(out), rec, (dist[0],))
    return _fallback(op, attrs, inputs, layouts, rec)


def _sharded(op, attrs, inputs, rec, layouts):
    """The op's sharding rule (parallel/rules.py), when it has one."""
    return sharded_apply(op, attrs, inputs, rec, layouts)


def _merged(x):
    if isinstance(x, TensorBase):
        if x._layout is None:
            return x._value()
        s = x._data
        return s.reshape((s.shape[0] * s.shape[1],) + s.shape[2:])
    return x


def _batch_local(op, attrs, inputs, merged, n, batch, rec):
    out = _run(op, attrs, merged)
    outs = out if op.multi_output else (out,)
    arrays, lays = [], []
    for o in outs:
        o = np.asarray(o)
        if o.ndim >= 1 and o.shape[0] == batch:
            arrays.append(o.reshape((n, batch // n) + o.shape[1:]))
            lays.append(_batch_layout(o.shape, n))
        else:
            arrays.append(o)
            lays.append(None)
    return _core.finish(op, attrs, inputs, tuple(arrays) if op.multi_output else arrays[0],
                        rec, tuple(lays))


def _fallback(op, attrs, inputs, layouts, rec):
    plain = tuple(_core.wrap_dist(_gather_global(x, op.name), None)
                  if lay is not None else x for x, lay in zip(inputs, layouts))
    arrays = [x._value() if isinstance(x, TensorBase) else x for x in plain]
    out = _run(op, attrs, arrays)
    return _core.finish(op, attrs, inputs, out, rec, None)


# ---------------------------------------------------------------------------
# batch-local rules: does the op treat dim 0 rows independently here?
# ---------------------------------------------------------------------------
def _rank_aligned(merged, layouts, out_rank):
    return all(np.ndim(m) == out_rank for m, lay in zip(merged, layouts) if lay is not None)


def _elementwise(attrs, merged, layouts, batch):
    return _rank_aligned(merged, layouts, max(np.ndim(m) for m in merged))


def _axis_not_0(key):
    return lambda attrs, merged, layouts, batch: attrs[key] != 0


def _matmul(attrs, merged, layouts, batch):
    a, b = layouts
    if not attrs["transpose_a"] and a is not None and b is None:
        return "local"
    if attrs["transpose_a"] and not attrs["transpose_b"] and a is not None and b is not None:
        return "contract"
    return None


def _batch_matmul(attrs, merged, layouts, batch):
    rank = max(np.ndim(m) for m in merged)
    return rank >= 3 and _rank_aligned(merged, layouts, rank)


def _reduce(attrs, merged, layouts, batch):
    return "contract" if 0 in attrs["axis"] else "local"


def _getitem(attrs, merged, layouts, batch):
    idx = attrs["index"]
    return (len(idx) >= 1 and isinstance(idx[0], slice) and idx[0] == slice(None)
            and not any(isinstance(k, np.ndarray) or k is None or k is Ellipsis for k in idx))


def _index_add(attrs, merged, layouts, batch):
    return attrs["shape"][0] == batch and _getitem(attrs, merged, layouts, batch)


def _gather(attrs, merged, layouts, batch):
    params, idx = layouts
    if attrs["axis"] != 0:
        return params is not None and idx is None
    return params is None and idx is not None and np.ndim(merged[1]) >= 1


def _gather_grad(attrs, merged, layouts, batch):
    idx, g = layouts
    if attrs["axis"] == 0:
        return "contract" if idx is not None and g is not None else None
    return g is not None and idx is None and attrs["shape"][0] == batch


def _onehot(attrs, merged, layouts, batch):
    return layouts[0] is not None and attrs["axis"] != 0 and layouts[1] is None


def _reshape(attrs, merged, layouts, batch):
    return len(attrs["shape"]) >= 1 and attrs["shape"][0] == batch


_ALWAYS = lambda attrs, merged, layouts, batch: True  # noqa: E731

_BATCH_LOCAL = {
    "Cast": _ALWAYS, "Dropout": _ALWAYS,
    "BroadcastTo": lambda at, m, lay, b: np.ndim(m[0]) == len(at["shape"]),
    "BiasAdd": lambda at, m, lay, b: lay[1] is None,
    "MatMul": _matmul, "BatchMatMul": _batch_matmul,
    "ReduceSum": _reduce, "ReduceMean": _reduce, "ReduceMax": _reduce, "ReduceMin": _reduce,
    "Softmax": _axis_not_0("axis"), "LogSoftmax": _axis_not_0("axis"),
    "Reshape": _reshape,
    "Transpose": lambda at, m, lay, b: at["perm"][0] == 0,
    "GetItem": _getitem, "IndexAdd": _index_add,
    "Concat": _axis_not_0("axis"), "Split": _axis_not_0("axis"),
    "Gather": _gather, "GatherGrad": _gather_grad, "OneHot": _onehot,
    "SparseSoftmaxCrossEntropyWithLogits": lambda at, m, lay, b: all(x is not None for x in lay),
    "SparseSoftmaxCrossEntropyGrad": lambda at, m, lay, b: lay[0] is not None
    and lay[1] is not None,
}


def _batch_rule(op, attrs, merged, layouts, batch):
    rule = _BATCH_LOCAL.get(op.name)
    if rule is None:
        if op.kind == KIND_GENERIC:
            return None
        rule = _elementwise
    res = rule(attrs, merged, layouts, batch)
    if res is True:
        return "local"
    return res or None


# ---------------------------------------------------------------------------
# batch-contracting ops: per-device results that are partial sums
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _partial_layout(shape, n):
    """Every dim whole, pending sums over the n devices (cached: layouts are values)."""
    return TensorLayout((n,), ((),) * len(shape), tuple(shape), partial=(0,))


@functools.lru_cache(maxsize=4096)
def _partial_like(lay, shape):
    """Every dim of `shape` whole, pending sums over the same device axes as `lay` (and
    repeated over its other axes): what a linear op on a partial-only input gives."""
    return TensorLayout(lay.device_matrix, ((),) * len(shape), tuple(shape),
                        partial=lay.partial)


@functools.lru_cache(maxsize=4096)
def _batch_layout(shape, n):
    """Dim 0 split over n devices (cached)."""
    return TensorLayout.batch_split(shape, n)


def _shares(total, n):
    """A partial stack whose n equal shares add up to `total`, stored once.

    A pending sum may be split across devices any way that adds up to the same
    total; when one process holds every device, batch-contracting ops compute the
    total with one call over all devices' rows and keep it as n equal shares (a
    stride-0 view), so no per-device copies or partial products are made."""
    share = np.true_divide(total, n, dtype=total.dtype) if n > 1 else total
    return np.broadcast_to(share[None], (n,) + share.shape)


def _contract_matmul(op, attrs, inputs, layouts, n, batch, rec):
    a, b = inputs
    ma, mb = _merged(a), _merged(b)
    _core.infer(op, attrs, ma, mb)                       # validate on the global shapes
    if _holds_all_devices(n):
        # one GEMM over every device's rows, kept as n equal shares (see _shares); the
        # 1/n is applied to the smallest of the three arrays
        m, k = ma.shape[1], mb.shape[1]
        if n > 1 and min(ma.size, mb.size) < m * k:
            if ma.size <= mb.size:
                ma = np.true_divide(ma, n, dtype=ma.dtype)
            else:
                mb = np.true_divide(mb, n, dtype=mb.dtype)
            total = np.matmul(ma.T, mb)
            out = np.broadcast_to(total[None], (n,) + total.shape)
        else:
            out = _shares(np.matmul(ma.T, mb), n)
    else:
        out = np.matmul(np.swapaxes(a._data, -1, -2), b._data)   # (n_local, m, k)
    return _core.finish(op, attrs, inputs, out, rec, (_partial_layout(out.shape[1:], n),))


def _contract_reduce(op, attrs, inputs, layouts, n, batch, rec):
    x = inputs[0]
    arr = _merged(x)
    _core.infer(op, attrs, arr)
    if op.name in ("ReduceMax", "ReduceMin"):
        total = op.kernel(attrs, arr)
        # each device reduces its rows, then an AllReduce(max/min) combines them
        with _cause(op.name):
            out = _backend().all_reduce(np.broadcast_to(total[None], (n,) + total.shape),
                                        members=None,
                                        op="max" if op.name == "ReduceMax" else "min")
        return _core.finish(op, attrs, inputs, np.asarray(out[0]), rec, None)
    if _holds_all_devices(n):
        local = _shares(np.asarray(op.kernel(attrs, arr)), n)
    else:
        axes = tuple(a + 1 for a in attrs["axis"])
        stack = x._data
        local = np.add.reduce(stack, axis=axes, dtype=stack.dtype, keepdims=attrs["keep_dims"])
        if op.name == "ReduceMean":
            local = np.true_divide(local, math.prod(arr.shape[a] for a in attrs["axis"]),
                                   dtype=stack.dtype)
    return _core.finish(op, attrs, inputs, local, rec,
                        (_partial_layout(local.shape[1:], n),))


def _out_shape(shape, attrs):
    axes, keep = attrs["axis"], attrs["keep_dims"]
    return tuple(1 if i in axes else s for i, s in enumerate(shape)) if keep else \
        tuple(s for i, s in enumerate(shape) if i not in axes)


def _contract_gather_grad(op, attrs, inputs, layouts, n, batch, rec):
    idx, g = inputs
    mi, mg = _merged(idx), _merged(g)
    _core.infer(op, attrs, mi, mg)
    shape = tuple(attrs["shape"])
    if _holds_all_devices(n):
        out = _shares(np.asarray(op.kernel(attrs, mi, mg)), n)
    else:
        out = np.zeros((idx._data.shape[0],) + shape, dtype=g._data.dtype)
        istack = idx._data.reshape(out.shape[0], -1)
        gstack = g._data.reshape((out.shape[0], istack.shape[1]) + shape[1:])
        dev = np.broadcast_to(np.arange(out.shape[0])[:, None], istack.shape)
        np.add.at(out, (dev, istack), gstack)
    return _core.finish(op, attrs, inputs, out, rec, (_partial_layout(shape, n),))


_CONTRACT = {
    "MatMul": _contract_matmul, "ReduceSum": _contract_reduce,
    "ReduceMean": _contract_reduce, "ReduceMax": _contract_reduce,
    "ReduceMin": _contract_reduce, "GatherGrad": _contract_gather_grad,
}


# ---------------------------------------------------------------------------
# partial-linear ops
# ---------------------------------------------------------------------------
def _partial_linear(op, attrs, inputs, layouts, rec):
    """Run ops that are linear in their partial inputs on the stacks; None if not."""
    name = op.name
    p = [bool(lay is not None and lay.partial) for lay in layouts]
    if not all(_is_partial_only(lay) for lay, pi in zip(layouts, p) if pi):
        return None
    lay0 = next(lay for lay in layouts if lay is not None and lay.partial)
    n = lay0.device_num
    stacks = [x._data if isinstance(x, TensorBase) and x._layout is not None else
              (x._value() if isinstance(x, TensorBase) else x) for x in inputs]
    if any(lay is not None and not lay.partial for lay in layouts):
        return None                      # mixed with a split tensor: resolve first
    if name in ("Add", "Sub"):
        if not (p[0] and p[1] and layouts[0] == layouts[1]):
            return None
    elif name in ("Mul", "RealDiv"):
        if p[0] + p[1] != 1 or (name == "RealDiv" and p[1]):
            return None
        other = stacks[1] if p[0] else stacks[0]
        if np.ndim(other) > len(lay0.shape):
            return None
    elif name in ("Neg", "Cast"):
        pass
    elif name == "Reshape":
        out = np.reshape(stacks[0], (stacks[0].shape[0],) + tuple(attrs["shape"]))
        return _core.finish(op, attrs, inputs, out, rec, (_partial_like(lay0, out.shape[1:]),))
    elif name in ("ReduceSum", "ReduceMean"):
        return _partial_reduce(op, attrs, inputs, lay0, n, rec)
    else:
        return None
    # validate on global-shaped stand-ins (zero-strided, no memory)
    _core.infer(op, attrs, *[stand_in(x.dtype, lay.shape)
                             if lay is not None else x for lay, x in zip(layouts, stacks)])
    shared = all(s.strides[0] == 0 for s, lay in zip(stacks, layouts)
                 if lay is not None and lay.partial)
    if shared:                 # equal shares stored once: compute one share
        k = next(s.shape[0] for s, lay in zip(stacks, layouts) if lay is not None)
        stacks = [s[:1] if lay is not None and lay.partial else s
                  for s, lay in zip(stacks, layouts)]
    if op.kind == KIND_GENERIC:
        out = op.kernel(attrs, *stacks)
    else:
        out = op.kernel(*stacks)
    out = np.asarray(out)
    if shared:
        out = np.broadcast_to(out, (k,) + out.shape[1:])
    return _core.finish(op, attrs, inputs, out, rec, (_partial_like(lay0, out.shape[1:]),))


def _partial_reduce(op, attrs, inputs, lay0, n, rec):
    x = inputs[0]
    _core.infer(op, attrs, stand_in(x._data.dtype, lay0.shape))
    stack = x._data
    shared = stack.strides[0] == 0
    axes = tuple(a + 1 for a in attrs["axis"])
    local = np.add.reduce(stack[:1] if shared else stack, axis=axes, dtype=stack.dtype,
                          keepdims=attrs["keep_dims"])
    if op.name == "ReduceMean":
        local = np.true_divide(local, math.prod(lay0.shape[a] for a in attrs["axis"]),
                               dtype=stack.dtype)
    if shared:
        local = np.broadcast_to(local, (stack.shape[0],) + local.shape[1:])
    return _core.finish(op, attrs, inputs, local, rec, (_partial_like(lay0, local.shape[1:]),))


_core.set_dist_hooks(dist_apply, assemble)


# ---------------------------------------------------------------------------
# network inputs: split per dataset_strategy
# ---------------------------------------------------------------------------
def distribute_inputs(args):
    """Split the Tensor arguments of a top-level network call as batch data, per the
    context's ``dataset_strategy`` ("data_parallel", "full_batch" or per-input
    strategy tuples). Tensors already distributed, Parameters and 0-d values are
    left alone."""
    strategy = context.get_auto_parallel_context("dataset_strategy")
    if strategy == "full_batch":
        return args
    n = device_num()
    out, k = [], 0
    for i, a in enumerate(args):
        if not isinstance(a, TensorBase) or a._layout is not None or a.ndim == 0 \
                or isinstance(a, Parameter):
            out.append(a)
            continue
        shape = tuple(a.shape)
        if strategy == "data_parallel" and RANK_SHARDS.get(id(a)) is a and _some_devices():
            # this rank's own shard of the data set (num_shards = ranks): it IS the local
            # rows of a global batch n times as large
            layout = TensorLayout.batch_split((shape[0] * n,) + shape[1:], n)
            out.append(moved(a, a._value()[None], layout))
            k += 1
            continue
        if strategy == "data_parallel":
            if shape[0] % n:
                raise ValueError(
                    f"dataset_strategy='data_parallel': input {i} has batch size {shape[0]} "
                    f"(shape {shape}), which does not divide over {n} devices; use a batch "
                    f"size that is a multiple of {n} (or drop_remainder=True)")
            layout = TensorLayout.batch_split(shape, n)
        else:
            if k >= len(strategy):
                raise ValueError(f"dataset_strategy={strategy!r} gives {len(strategy)} "
                                 f"strategies but the network got more tensor inputs (input "
                                 f"{i}); give one strategy per input")
            layout = TensorLayout.from_strategy(strategy[k], shape, n, "dataset_strategy", k)
        k += 1
        out.append(moved(a, distribute(a, layout)._data, layout))   # on the tape
    return tuple(out)
