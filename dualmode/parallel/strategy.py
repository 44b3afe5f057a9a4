"""Executing ``Primitive.shard(...)`` strategies eagerly (semi-auto parallel).

Before the op runs, each tensor input is moved into the layout its strategy (or
Layout) gives; the op's sharding rule then computes on the shards. An out_strategy
moves the output the same way afterwards (e.g. a MatMul's pending sums into a row
split: a ReduceScatter). In stand-alone mode, or without a parallel backend,
strategies are checked but do not change how the op runs.

A parameter consumed by a sharded op is stored in that op's layout from then on. A
delayed parameter (``no_init_parameters()``) is then made directly in that layout:
its initializer builds one block per distinct slice this process's devices hold
(devices that replicate a slice share one generated block) and the whole tensor is
never built; random initializers give every block the values of the same slice of the
whole tensor, so the numbers equal the single-device run's.

With ``strategy_ckpt_load_file`` set, a parameter the file names is stored in its saved
layout instead (at its first sharded use, or before a compile: ``apply_saved_layouts``)
and keeps it: an op that needs it elsewhere gets a moved copy. Every layout stored here
is reported to ``strategy_ckpt_save_file`` (strategy_ckpt.py).
"""
from __future__ import annotations

import numpy as np

from .. import context
from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..communication.totals import DEFERRING
from ..communication.trace import note_memory
from ..tensor import Parameter
from ..ops.primitive import _flat
from .devices import device_num, live_backend, parallel_active
from .moves import moved
from .tensor_layout import TensorLayout
from .moves import redistribute_tensor
from .replicas import store_blocks
from .sharding import cacheable_strategy, op_strategy_layouts, same_placement
from .strategy_ckpt import layouts_fixed, loading, saved_layout
from .strategy_checks import check_strategy_for

#: the parallel modes that run operator strategies (the others ignore them)
STRATEGY_MODES = ("semi_auto_parallel", "auto_parallel")


def strategies_active() -> bool:
    """Do shard strategies run sharded now?"""
    return context._STATE.auto_parallel.parallel_mode in STRATEGY_MODES and parallel_active()


def check_device_count(prim) -> None:
    """Under semi_auto/auto parallel with one device set on purpose (``device_num=1``),
    a strategy that needs more devices is an error naming it, not a silent single-device
    run (stand-alone mode ignores strategies and runs on one device)."""
    if context.get_auto_parallel_context("parallel_mode") not in STRATEGY_MODES or \
            context._STATE.auto_parallel.device_num != 1:
        return
    for i, st in enumerate(prim.in_strategy or ()):
        need = 1
        for v in st if isinstance(st, tuple) else ():
            need *= v if isinstance(v, int) else 1
        if need > 1:
            raise ValueError(f"{prim.name}: in_strategy[{i}]={st} needs {need} devices but "
                             f"device_num=1; set device_num to the devices the strategy "
                             f"uses, or run stand_alone to ignore strategies")


def is_sharded_layout(layout) -> bool:
    """A TensorLayout that splits some dim (not per-device values, not replicated)."""
    return isinstance(layout, TensorLayout) and any(layout.tensor_map)


def _local_ranks(lay: TensorLayout) -> np.ndarray:
    """The ranks of `lay` whose shards this process stores (every rank under "sim")."""
    b = live_backend()
    if b is not None and b.world_size == lay.device_num:
        return np.asarray(b.local_ranks, np.int64)
    return np.arange(lay.device_num, dtype=np.int64)


def delayed_local_shards(param, lay: TensorLayout) -> np.ndarray:
    """The local shards ``(local devices, *lay.local_shape)`` of a delayed parameter in
    `lay`, made by its initializer one block per distinct slice (never the whole tensor).

    The stack is written in place by optimizers, so each device gets its own (writable)
    copy of its block; the generator runs once per distinct block only.
    """
    ranks = _local_ranks(lay)
    starts = lay.block_index[ranks] * np.asarray(lay.local_shape, np.int64)
    distinct, which = np.unique(starts, axis=0, return_inverse=True)
    blocks = param._init_blocks(distinct, lay.local_shape)
    return blocks[which.reshape(-1)]


def _store_sharded(param, lay, op_name):
    """`param` in `lay` for `op_name`. A parameter lives in the layout of the first
    sharded op that consumes it, or in its layout from ``strategy_ckpt_load_file``: the
    file wins, and an op whose strategy needs the parameter elsewhere gets a moved copy
    (its gradient comes back into the stored layout), as does an op that needs a
    sharded parameter whole."""
    if param._layout is None:
        saved = saved_layout(param, op_name)
        if saved is not None:
            _store_from_file(param, saved)
    if param._layout is not None:
        if param._layout == lay:
            return param
        if same_placement(param._layout, lay):     # the same blocks, another matrix
            return moved(param, param._data, lay)
        if is_sharded_layout(lay) and not stored_from_file(param):
            raise placement_conflict(param, lay, op_name)
    elif is_sharded_layout(lay):
        _store(param, lay, op_name)
        return param
    with DEFERRING:                       # a moved copy's stack: may stay unwritten
        stack = redistribute_tensor(param, lay, op_name)
    return moved(param, stack, lay)


def _store(param, lay, owner):
    """Store `param` (not laid out yet) as its shards in `lay`."""
    if param._data is None and param._init is not None:
        param._data = delayed_local_shards(param, lay)      # delayed: only local blocks
        param._init = None
    elif not store_blocks(param, lay, param._value()):          # replicas stored once
        param._data = np.array(redistribute_tensor(param, lay, owner))   # writable shards
    param._layout = lay
    param.__dict__["_sharded_by"] = owner
    note_memory(0)                  # active reports see the parameter storage change
    layouts_fixed(((param, lay),))  # strategy_ckpt_save_file


def _store_from_file(param, lay):
    path = context._STATE.auto_parallel.strategy_ckpt_load_file
    _store(param, lay, f"strategy_ckpt_load_file {path!r}")
    param.__dict__["_file_layout"] = lay


def stored_from_file(param) -> bool:
    """Is `param` stored in its layout from ``strategy_ckpt_load_file``?"""
    lay = param.__dict__.get("_file_layout")
    return lay is not None and param._layout == lay


def apply_saved_layouts(params, owner) -> dict:
    """Store each of `params` not laid out yet in its layout from
    ``strategy_ckpt_load_file`` (a compile, ``Model``): every parameter is checked
    against the file before any is stored. Returns ``{name: layout}`` of those stored."""
    if not loading():
        return {}
    todo = []
    for p in params:
        if isinstance(p, Parameter) and p._layout is None and not p.layerwise_parallel:
            lay = saved_layout(p, owner)
            if lay is not None:
                todo.append((p, lay))
    for p, lay in todo:
        _store_from_file(p, lay)
    return {p.name: lay for p, lay in todo}


def placement_conflict(param, lay, op_name, stored_as=None, owner=None) -> ValueError:
    """The error for `op_name` needing `param` in `lay` while it is stored otherwise."""
    stored = stored_as if stored_as is not None else param._layout
    owner = owner if owner is not None else param.__dict__.get("_sharded_by")
    return ValueError(
        f"Parameter {param.name}: {op_name} needs it in layout {lay!r} but it is stored "
        f"as {stored!r} for {owner}; a parameter used by several ops must get one "
        f"consistent layout (give both ops the same strategy for it)")


def _to(x, lay, op_name):
    """`x` in layout `lay`, recorded on the tape so gradients reach `x`."""
    if isinstance(x, TensorBase) and x._layout == lay:
        return x
    if isinstance(x, Parameter) and not x.layerwise_parallel \
            and (x._layout is None or isinstance(x._layout, TensorLayout)):
        return _store_sharded(x, lay, op_name)
    with DEFERRING:                       # a Tensor's stack: may stay unwritten
        stack = redistribute_tensor(x, lay, op_name)
    return moved(x, stack, lay)


def apply_in_strategy(prim, args):
    """`args` with each tensor input in its strategy's layout."""
    if all([isinstance(a, TensorBase) for a in args]):     # the common call: tensors only
        lays = strategy_layouts(prim, args, args)
        return tuple([a if a._layout is lay else _to(a, lay, prim.name)
                      for a, lay in zip(args, lays)])
    args = tuple(_core.wrap(a) if isinstance(a, np.ndarray) else a for a in args)
    tensors = [t for t in _flat(args) if isinstance(t, TensorBase)]
    lays = strategy_layouts(prim, args, tensors)
    out, k = [], 0
    for a in args:
        if isinstance(a, (tuple, list)) and a and isinstance(a[0], TensorBase):
            moved = []
            for t in a:
                moved.append(_to(t, lays[k], prim.name))
                k += 1
            out.append(type(a)(moved))
        elif isinstance(a, TensorBase):
            out.append(_to(a, lays[k], prim.name))
            k += 1
        else:
            out.append(a)
    return tuple(out)


def strategy_layouts(prim, args, tensors):
    """The layouts `prim`'s in_strategy gives its `tensors` (one device matrix for the
    op), after the strategy checks (before anything moves). Both depend only
    on the strategy, the input shapes and the device count (a primitive's attributes
    are fixed at construction), so a primitive keeps them per that signature and a
    repeated call skips the checks it already passed."""
    n = device_num()
    strategy = prim.in_strategy
    key = (strategy, tuple([t.shape for t in tensors]), n)
    cache = prim.__dict__.get("_strategy_layouts")
    if cache is None:
        cache = prim.__dict__["_strategy_layouts"] = {}
    try:
        lays = cache.get(key)
    except TypeError:                    # an unhashable strategy entry: not cached
        key, lays = None, None
    if lays is None:
        check_strategy_for(prim, args)
        lays = op_strategy_layouts(prim, tensors, n)
        if key is not None and cacheable_strategy(strategy):
            cache[key] = lays
    return lays


def apply_out_strategy(prim, out):
    """The op's output(s) moved into the out_strategy layouts."""
    n = device_num()
    outs = out if isinstance(out, tuple) else (out,)
    if len(prim.out_strategy) != len(outs):
        raise ValueError(f"{prim.name}: out_strategy has {len(prim.out_strategy)} entries but "
                         f"the op has {len(outs)} output(s)")
    moved = tuple(_to(o, TensorLayout.from_strategy(s, tuple(o.shape), n, prim.name, i,
                                                    param="out_strategy"), prim.name)
                  for i, (s, o) in enumerate(zip(prim.out_strategy, outs)))
    return moved if isinstance(out, tuple) else moved[0]
