"""The parallel optimizer (``enable_parallel_optimizer=True``): a weight's optimizer
states and update split over the devices that hold replicas of it (ZeRO-style).

Which weights. In data_parallel, semi_auto_parallel and auto_parallel, a trained weight
whose layout repeats over some device axes — every weight kept whole in data_parallel,
a replicated or partly split one in the semi-auto modes (its "data-parallel" replicas) —
is sharded when it takes at least ``parallel_optimizer_threshold`` KB (default 64;
counted over the whole weight, as MindSpore counts it) and its slice's first dim divides
by the shard count. The shard count is ``optimizer_weight_shard_size``, or every replica
when it is -1 (the default); with ``n`` smaller than the replicas, the replicas form
groups of ``n`` devices consecutive in rank order (MindSpore's groups). Other weights are
updated as without the parallel optimizer.

The optimizer slice (:func:`shard_layout`) is the weight's layout with its first dim
split further over the replica axes of the group (innermost first), so each device of a
group owns 1/n of the weight's slice. A step of a sharded weight is then:

1. its gradient moves into that layout, with reason "gradient": pending over the
   group's devices, this is one ReduceScatter (ReduceScatter, then an AllReduce over
   the groups, when ``n`` is smaller than the replicas) where the optimizer would have
   AllReduced it; a data-parallel gradient is scaled as the AllReduce would have been
   (``grad_reduce.replica_gradient_scale``);
2. the optimizer updates each device's slice of the weight, and its states (momentum,
   Adam's moments) exist only as those slices: 1/n of the memory per device;
3. the updated slices are AllGathered back into the weight's layout (reason
   "parallel_optimizer"), so the next step's forward reads the whole weight.

With ``comm_fusion`` entries "reducescatter" / "allgather" the ReduceScatters and the
AllGathers are bucketed (one collective per bucket), as the other gradient collectives
are. The eager optimizer and a compiled train step use the same layouts: graph lowering
(graph/lower.py) moves a sharded weight's gradient into :func:`shard_layout` before the
update, which then moves nothing.

The weight the forward pass reads stays whole on each device between steps (MindSpore
gathers it inside the forward and frees it after the backward); the optimizer's own
memory — its states and the slices it updates — is what is split.
:func:`optimizer_memory` reports it per device.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from .. import context
from .._core import _tensor as _core
from .._core._tensor import TensorBase
from ..communication import trace
from ..communication.trace import comm_cause
from .devices import backend as _backend, device_num
from .grad_reduce import (bucket_name, fuse_gradient_moves, fused_bucket, grouped_buckets,
                          is_dp_partial, replica_gradient_scale, single_step, step_group)
from .moves import move_stack, redistribute_tensor
from .pipeline import parameter_stage
from .devices import live_backend
from .redistribution.planner import plan_redistribution
from .tensor_layout import TensorLayout

__all__ = ["shard_layout", "settings", "plan", "ParameterShards", "optimizer_memory",
           "OptimizerMemory", "MODES"]

#: the parallel modes in which the parallel optimizer applies
MODES = (context.ParallelMode.DATA_PARALLEL, context.ParallelMode.SEMI_AUTO_PARALLEL,
         context.ParallelMode.AUTO_PARALLEL)

_REASON = "parallel_optimizer"


def settings():
    """``(threshold_kb, shard_size, device_num)`` when the parallel optimizer applies
    (enabled, a mode of :data:`MODES`, more than one device), else None."""
    ap = context._STATE.auto_parallel
    if not ap.enable_parallel_optimizer or ap.parallel_mode not in MODES:
        return None
    n = device_num()
    if n <= 1:
        return None
    cfg = ap.parallel_optimizer_config
    return (cfg.get("parallel_optimizer_threshold", 64),
            cfg.get("optimizer_weight_shard_size", -1), n)


def shard_layout(param, use_layout) -> Optional[TensorLayout]:
    """The layout of `param`'s optimizer slice when the parallel optimizer shards it
    (see the module docstring), `use_layout` being the layout the weight is stored and
    read in (None: a whole value); None when it is not sharded.

    Raises ValueError naming ``optimizer_weight_shard_size`` when the shard size does
    not divide the weight's replicas (or cannot be cut from its replica axes)."""
    st = settings()
    if st is None or not getattr(param, "requires_grad", True) or \
            getattr(param, "layerwise_parallel", False):
        return None
    if use_layout is not None and not isinstance(use_layout, TensorLayout):
        return None                                  # per-device values
    return _shard_layout(use_layout, tuple(param.shape), np.dtype(param.dtype).str,
                         param.name, *st)


@functools.lru_cache(maxsize=1024)
def _shard_layout(use, shape, dtype, name, threshold, size, world):
    if not shape or math.prod(shape) * np.dtype(dtype).itemsize < threshold * 1024:
        return None
    if use is None:
        use = TensorLayout.replicated(shape, world)
    if use.partial or use.device_num != world:
        return None
    dm = list(use.device_matrix)
    reps = [a for a in use.replicated_axes if dm[a] > 1]
    replicas = math.prod(dm[a] for a in reps)
    if replicas == 1:
        return None                                  # split over every device already
    n = replicas if size == -1 else size
    key = "parallel_optimizer_config['optimizer_weight_shard_size']"
    if replicas % n:
        valid = [-1] + [d for d in range(2, replicas + 1) if replicas % d == 0]
        raise ValueError(
            f"{key}={size} does not divide the {replicas} data-parallel replicas of "
            f"parameter {name!r} (shape {shape}, layout {use}); valid values for it: "
            f"{valid}")
    # the group: n devices consecutive in rank order among the replicas, i.e. the
    # innermost replica axes (the last one cut when n takes part of it)
    tmap = [tuple(m) for m in use.tensor_map]
    need, shard_axes = n, []
    for a in reversed(reps):
        if need == 1:
            break
        d = dm[a]
        if need % d == 0:
            shard_axes.insert(0, a)
            need //= d
        elif d % need == 0:                          # cut axis a into (d / need, need)
            dm[a:a + 1] = [d // need, need]
            tmap = [tuple(x + 1 if x > a else x for x in m) for m in tmap]
            shard_axes = [x + 1 if x > a else x for x in shard_axes]
            shard_axes.insert(0, a + 1)
            need = 1
        else:
            sizes = tuple(use.device_matrix[x] for x in reps)
            raise ValueError(
                f"{key}={size} cannot be cut from the replica axes {sizes} of parameter "
                f"{name!r} (groups of consecutive ranks); use -1 or a product of the "
                f"innermost replica axes")
    if use.local_shape[0] % n:
        return None                                  # first dim not divisible: as MindSpore
    tmap[0] = tmap[0] + tuple(shard_axes)
    return TensorLayout(tuple(dm), tuple(tmap), shape)


def use_layout(p):
    """The layout `p` is stored and read in (None: a whole value)."""
    lay = p._layout
    return lay if isinstance(lay, TensorLayout) else None


class _Target:
    """Stands for a sharded weight where the gradient helpers ask for the layout its
    gradient must reach (its optimizer slice's)."""

    __slots__ = ("name", "_layout", "requires_grad", "layerwise_parallel")

    def __init__(self, name, layout):
        self.name, self._layout = name, layout
        self.requires_grad, self.layerwise_parallel = True, False


def other_stages(params) -> frozenset:
    """Positions in `params` of the weights another process updates: under pipeline
    parallelism with one stage per process (backend "mpi"), the weights of the other
    stages (this rank holds them but never reads their gradients). Empty otherwise."""
    view = live_backend()
    here = getattr(view, "stage", None) if view is not None else None
    if here is None:
        return frozenset()
    return frozenset(i for i, p in enumerate(params)
                     if parameter_stage(p) not in (None, here))


def plan(optimizer, skip=frozenset()) -> Optional["ParameterShards"]:
    """The optimizer slices of `optimizer`'s parameters for this update, or None when
    the parallel optimizer shards none of them; the positions in `skip` (weights this
    process does not update: :func:`other_stages`) are not sharded. Errors are raised
    before anything changes. States left as slices by earlier updates of weights this
    update does not split (the parallel optimizer turned off, a larger threshold) are
    first put back into their weights' layouts."""
    on = settings() is not None
    sliced = optimizer.__dict__.get("_sliced_states")
    if not on and not sliced:
        return None                                  # the usual case: nothing to do
    layouts = [None if i in skip else shard_layout(p, use_layout(p))
               for i, p in enumerate(optimizer.parameters)] if on \
        else [None] * len(optimizer.parameters)
    if sliced:
        for i in [i for i in sliced if layouts[i] is None and i not in skip]:
            _unslice_states(optimizer, i)
            sliced.discard(i)
    if all(s is None for s in layouts):
        return None
    return ParameterShards(optimizer.parameters, layouts)


def _unslice_states(optimizer, i):
    """Parameter `i`'s states, stored as optimizer slices, back in its layout (whole
    when it has none): the values kept, gathered."""
    p = optimizer.parameters[i]
    dst = use_layout(p)
    for name in optimizer.__dict__.get("_state_names", ()):
        st = getattr(optimizer, name)[i]
        if dst is None:
            st._data = np.array(st.asnumpy())
        else:
            st._data = np.array(redistribute_tensor(st, dst, st.name, reason=_REASON))
        st._layout = dst


class ParameterShards:
    """The parallel optimizer's plan for one update: per parameter its optimizer slice's
    layout (None: not sharded), and the steps of the update (:meth:`scatter`,
    :meth:`weight_slice`, :meth:`match_states`, :meth:`gather`)."""

    def __init__(self, params, layouts):
        self.params = params
        self.layouts = layouts
        self.targets = [p if s is None else _Target(p.name, s)
                        for p, s in zip(params, layouts)]
        self.ready = set()            # positions whose gradient :meth:`scatter` moved

    def sharded(self, i) -> bool:
        """Is weight `i` updated on its optimizer slices (its gradient moved there)?"""
        return i in self.ready

    # ---- 1. the gradients ------------------------------------------------------------
    def scatter(self, grads):
        """`grads` with each sharded weight's gradient in its optimizer slice's layout:
        ReduceScattered (fused per ``comm_fusion["reducescatter"]``), reason
        "gradient"; a data-parallel gradient scaled as its AllReduce would have been."""
        grads = [g if isinstance(g, TensorBase) else _core.wrap_dist(np.asarray(g), None)
                 for g in grads]                     # an array: a whole gradient
        idx = [i for i, s in enumerate(self.layouts) if s is not None
               and self.params[i].requires_grad]
        if not idx:
            return grads
        scale = replica_gradient_scale(_backend().world_size)
        scaled = {i for i in idx if scale is not None and use_layout(self.params[i]) is None
                  and is_dp_partial(grads[i]._layout)}
        moved = fuse_gradient_moves([grads[i] for i in idx], [self.targets[i] for i in idx])
        for i, g in zip(idx, moved):
            dst, p = self.layouts[i], self.params[i]
            if isinstance(g, TensorBase) and g._layout == dst:
                stack = g._data
            else:
                stack = redistribute_tensor(g, dst, p.name, reason="gradient")
            if i in scaled:
                stack = np.multiply(stack, scale, dtype=stack.dtype)
            grads[i] = _core.wrap_dist(stack, dst)
            self.ready.add(i)
        return grads

    # ---- 2. the update ---------------------------------------------------------------
    def weight_slice(self, i) -> np.ndarray:
        """This process's slices of weight `i` in its optimizer slice's layout: a new
        array the update writes (cut locally from the weight: no communication)."""
        p = self.params[i]
        return np.array(redistribute_tensor(p, self.layouts[i], p.name, reason=_REASON))

    def match_states(self, optimizer, i) -> None:
        """Parameter `i`'s optimizer states stored as its optimizer slices: a state held
        otherwise (zeros at the start, restored from a checkpoint, or the weight's
        layout) is cut into them locally."""
        dst = self.layouts[i]
        for name in optimizer.__dict__.get("_state_names", ()):
            st = getattr(optimizer, name)[i]
            if st._layout == dst:
                continue
            if st._layout is not None and not isinstance(st._layout, TensorLayout):
                raise RuntimeError(f"{type(optimizer).__name__}: state {st.name!r} holds "
                                   f"per-device values; the parallel optimizer cannot "
                                   f"slice it")
            stack = np.array(redistribute_tensor(st, dst, st.name, reason=_REASON))
            st._data = stack
            st._init = None
            st._layout = dst
            optimizer.__dict__.setdefault("_sliced_states", set()).add(i)

    # ---- 3. the updated slices back into the weights ------------------------------------
    def gather(self, updated: Dict[int, np.ndarray]) -> None:
        """AllGather each updated slice stack (position -> stack in its optimizer
        slice's layout) into its weight's layout and store it there; fused per
        ``comm_fusion["allgather"]`` (one collective per bucket of a device group and
        dtype), reason "parallel_optimizer"."""
        if not updated:
            return
        order = sorted(updated)
        fusion = "allgather" in (context.get_auto_parallel_context("comm_fusion") or {})
        keys, sizes, groups, uses = [], [], [], []
        for i in order:
            p, src = self.params[i], self.layouts[i]
            dst = use_layout(p) or TensorLayout.replicated(p.shape, src.device_num)
            uses.append(dst)
            plan_ = plan_redistribution(src, dst, np.dtype(p.dtype).itemsize)
            step = single_step(plan_, "AllGather") if fusion else None
            sizes.append(math.prod(dst.local_shape) * np.dtype(p.dtype).itemsize)
            if step is None:
                keys.append(None)
                groups.append(None)
                continue
            key, members = step_group(plan_, step, updated[i].dtype)
            keys.append(key)
            groups.append((members, step.dim))
        done = set()
        backend = _backend()
        for bucket in grouped_buckets(keys, sizes, "allgather"):
            if not fused_bucket([updated[order[k]].dtype for k in bucket]):
                continue
            names = [self.params[order[k]].name for k in bucket]
            stacks = [updated[order[k]] for k in bucket]
            members = groups[bucket[0]][0]
            axes = [groups[k][1] for k in bucket]
            if trace._STATE.reports:
                with comm_cause(bucket_name(names, "parameters"), _REASON):
                    outs = backend.all_gather_fused(stacks, members, axes)
            else:
                outs = backend.all_gather_fused(stacks, members, axes)
            for k, out in zip(bucket, outs):
                _store(self.params[order[k]], np.asarray(out))
                done.add(k)
        for k, i in enumerate(order):
            if k in done:
                continue
            p = self.params[i]
            out = move_stack(updated[i], self.layouts[i], uses[k], p.name, _REASON)
            _store(p, np.asarray(out))


def _store(p, stack):
    """Write the gathered `stack` (this process's blocks in the weight's layout) into
    `p`'s storage, in place where it can (every holder of the array sees the new
    value). A weight whose replicas were stored once (``parallel.replicas``) was written
    as a stack when its slices were cut (:meth:`ParameterShards.weight_slice`)."""
    value = stack[0] if use_layout(p) is None else stack
    arr = p._data
    if _writable_like(arr, value):
        np.copyto(arr, value)
    else:
        p._data = np.array(value, dtype=p.dtype)


def _writable_like(arr, value) -> bool:
    return isinstance(arr, np.ndarray) and arr.flags.writeable and arr.shape == value.shape \
        and arr.dtype == value.dtype and all(s != 0 for s in arr.strides[:1])


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer keeps per device, in bytes (see :func:`optimizer_memory`)."""

    #: the optimizer's states (momentum, moments...) on one device
    states: int
    #: the weights' slices one device updates (the optimizer's master copy of them)
    weights: int
    #: per parameter name: into how many slices the parallel optimizer cuts it (1: not)
    shards: Dict[str, int]


def optimizer_memory(optimizer) -> OptimizerMemory:
    """The bytes one device keeps for `optimizer`: its states (as stored now: before
    the first update they have the shape of their weights) and the slices of the
    weights it updates, with the parallel optimizer's shard count per parameter (as the
    next update will cut them). With the parallel optimizer on, both drop by the shard
    count for every sharded weight."""
    plan_ = plan(optimizer)
    shards, weights = {}, 0
    for i, p in enumerate(optimizer.parameters):
        lay = use_layout(p)
        local = lay.local_shape if lay is not None else tuple(p.shape)
        s = plan_.layouts[i] if plan_ is not None else None
        count = 1 if s is None else local[0] // s.local_shape[0]
        shards[p.name] = count
        weights += math.prod(local) * np.dtype(p.dtype).itemsize // count
    states = 0
    for name in optimizer.__dict__.get("_state_names", ()):
        for st in getattr(optimizer, name):
            lay = st._layout
            local = lay.local_shape if lay is not None else tuple(st.shape)
            states += math.prod(local) * np.dtype(st.dtype).itemsize
    return OptimizerMemory(states, weights, shards)
