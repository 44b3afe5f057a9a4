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
3. the weight is then stored as its updated slices (:class:`GatherOnRead`, the
   Parameter's deferred value): its whole value is AllGathered (reason
   "parallel_optimizer") where it is next read — the next forward pass, ``asnumpy``,
   a checkpoint — and the next update reads the slices themselves (no cut, no copy).
   When this process holds every device and the weight's layout repeats its blocks
   (over the gathered axes at least), the Parameter's deferred value is instead a
   :class:`~dualmode.parallel.replicas.ReplicaBlocks` made by that gather: each
   distinct block written once, read as a device grid by the readers that take one,
   the replicas written only for a reader of the whole stack.

With ``comm_fusion`` entries "reducescatter" / "allgather" the ReduceScatters and the
AllGathers are bucketed (one collective per bucket), as the other gradient collectives
are: the first read of any weight of a bucket gathers the whole bucket. The eager
optimizer and a compiled train step use the same layouts: graph lowering (graph/lower.py)
moves a sharded weight's gradient into :func:`shard_layout` before the update, which
then moves nothing.

Between steps a device thus holds 1/n of each sharded weight; the gathered whole lives
from its first read (the forward pass) until the update replaces it (MindSpore gathers
the weight inside the forward pass and frees it after the step). Every process reads a
weight where the program does, so under "mpi" the ranks gather in the same order (an
SPMD program reads its weights in one order on every rank).
:func:`optimizer_memory` reports the bytes per device.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from .. import context
from .._core import _tensor as _core
from .._core._tensor import Deferred, TensorBase
from ..communication import trace
from ..communication.totals import as_stack
from ..communication.trace import comm_cause
from .devices import backend as _backend, device_num
from .grad_reduce import (bucket_name, fuse_gradient_moves, fused_bucket, grouped_buckets,
                          is_dp_partial, replica_gradient_scale, single_step, step_group)
from .moves import redistribute_tensor
from .pipeline import parameter_stage
from .devices import live_backend
from .redistribution.executor import execute, global_value, run_plan_grid
from .redistribution.planner import plan_redistribution
from .replicas import ReplicaBlocks, worth_storing_once
from .tensor_layout import TensorLayout

__all__ = ["shard_layout", "settings", "plan", "ParameterShards", "GatherOnRead",
           "stored_slices", "optimizer_memory", "OptimizerMemory", "MODES"]

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


def _layouts(optimizer, skip=frozenset()) -> list:
    """Per parameter of `optimizer` its optimizer slice's layout for the next update
    (None: not sharded, or a position in `skip`); raises as :func:`shard_layout`."""
    if settings() is None:
        return [None] * len(optimizer.parameters)
    return [None if i in skip else shard_layout(p, use_layout(p))
            for i, p in enumerate(optimizer.parameters)]


def plan(optimizer, skip=frozenset()) -> Optional["ParameterShards"]:
    """The optimizer slices of `optimizer`'s parameters for this update, or None when
    the parallel optimizer shards none of them; the positions in `skip` (weights this
    process does not update: :func:`other_stages`) are not sharded. Errors are raised
    before anything changes. States and weights left as slices by earlier updates of
    weights this update does not split (the parallel optimizer turned off, a larger
    threshold) are first put back into their weights' layouts."""
    sliced = optimizer.__dict__.get("_sliced_states")
    kept = optimizer.__dict__.get("_weight_slices")
    if settings() is None and not sliced and not kept:
        return None                                  # the usual case: nothing to do
    layouts = _layouts(optimizer, skip)
    if sliced:
        for i in [i for i in sliced if layouts[i] is None and i not in skip]:
            _unslice_states(optimizer, i)
            sliced.discard(i)
    if kept:
        for i in [i for i in kept if layouts[i] is None and i not in skip]:
            _unslice_weight(optimizer.parameters[i], kept.pop(i))
    if all(s is None for s in layouts):
        return None
    return ParameterShards(optimizer.parameters, layouts,
                           optimizer.__dict__.setdefault("_weight_slices", {}))


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


def _unslice_weight(p, pending) -> None:
    """Weight `p`, stored as its optimizer slices (`pending`, its :class:`GatherOnRead`)
    by an earlier update that this one does not split: its value gathered (where it was
    not read yet) and stored as an array of its own that updates write in place."""
    if pending.holds(p):
        p._data = np.array(p._data)


class GatherOnRead(Deferred):
    """A weight the parallel optimizer updated, stored as its slices: the stack
    `slices` of this process's blocks in the optimizer slice's layout `slice_layout`,
    AllGathered into the weight's layout (its whole value when it has none) on the
    first read of the Parameter's ``_data``. The gather runs for every weight of its
    ``comm_fusion["allgather"]`` bucket at once (one fused AllGather) and is reported
    with reason "parallel_optimizer" under the weights' names. Readers of the shape,
    dtype, name or layout do not gather.

    When the weight is gathered into a grid of its distinct blocks, the Parameter holds
    :attr:`view`, a :class:`~dualmode.parallel.replicas.ReplicaBlocks` whose source is
    this object (which stays the optimizer's record of the slices)."""

    def __init__(self, gathers, k, shape, dtype, slices, slice_layout, whole_bytes):
        super().__init__(shape, dtype)
        self.gathers, self.k = gathers, k
        self.slices, self.slice_layout = slices, slice_layout
        self.whole_bytes = whole_bytes
        self.out = None                   # the gathered array, once read
        # what the Parameter holds: this, or the ReplicaBlocks whose grid it gathers
        self.view = self

    def gathered(self) -> np.ndarray:
        """The gathered value (gathered now unless it already was): the stack, the
        whole value, or for a :class:`ReplicaBlocks` view its grid of distinct blocks;
        an array of its own (it never shares memory with the slices)."""
        if self.out is None:
            self.out = self.gathers.take(self.k)
        return self.out

    def _write(self):
        return self.gathered()

    @property
    def device_bytes(self) -> int:
        """What one device stores of the weight now: its slice, or once gathered the
        whole block (the gathered copy the step reads; the update drops it)."""
        if self.out is not None:
            return self.whole_bytes
        return math.prod(self.slice_layout.local_shape) * self.dtype.itemsize

    def holds(self, p) -> bool:
        """Is this still `p`'s value (not replaced since: ``set_data``, a checkpoint
        loaded, an assignment)?"""
        view = self.view
        if p._lazy is view:
            return True
        if p._lazy is not None or self.out is None:
            return False
        if view is self:
            return p._arr is self.out
        return view._written and p._arr is view.materialize()    # the stack it wrote

    def _stack_copy(self) -> np.ndarray:
        view = self.view
        return np.array(self.materialize()) if view is self else view.stack_copy()

    def __deepcopy__(self, memo):
        # a copy of the Parameter: the gathered value, an array of its own
        return _Value(self._stack_copy())

    def __reduce__(self):
        return _Value, (self._stack_copy(),)


class _Value(Deferred):
    """A written stack held as a deferred one (a copy of a :class:`GatherOnRead`: in a
    copied optimizer it stands for slices no weight holds, so its next update cuts its
    slices from its weights)."""

    out = None

    def __init__(self, value):
        super().__init__(value.shape, value.dtype)
        self.value = value

    def _write(self):
        return self.value

    @staticmethod
    def holds(p) -> bool:
        return False


class _Gathers:
    """The AllGathers of one update's slices, run when a weight is first read: the
    positions of :attr:`entries` form units (a fused bucket, or one weight alone), and
    reading any weight of a unit gathers the unit. The backend is the one of the
    update (a weight read after the parallel context was left still gathers over the
    devices that hold its slices)."""

    def __init__(self, backend, entries, units):
        self.backend = backend
        # (name, slice layout, weight layout or None, stack, plan, as a grid of distinct
        # blocks: see :func:`_as_grid`)
        self.entries = entries
        self.units = units          # (positions, (members, axes) when fused, else None)
        self.unit_of = {k: u for u, (ks, _) in enumerate(units) for k in ks}
        self.outs = {}

    def take(self, k) -> np.ndarray:
        """Weight `k`'s gathered value (its unit gathered now unless it already was)."""
        if k not in self.outs:
            self._run(self.units[self.unit_of[k]])
        return self.outs.pop(k)

    def _run(self, unit):
        ks, fused = unit
        backend = self.backend
        if fused is not None:
            members, axes = fused
            if self.entries[ks[0]][5]:          # every member into a grid of its blocks
                for k, grid in zip(ks, _fused_grids(backend, [self.entries[k] for k in ks],
                                                    members)):
                    self.outs[k] = grid
                return
            stacks = [self.entries[k][3] for k in ks]
            if trace._STATE.reports:
                names = [self.entries[k][0] for k in ks]
                with comm_cause(bucket_name(names, "parameters"), _REASON):
                    outs = backend.all_gather_fused(stacks, members, axes)
            else:
                outs = backend.all_gather_fused(stacks, members, axes)
        else:
            name, _, _, stack, plan_, as_grid = self.entries[ks[0]]
            if as_grid:
                self.outs[ks[0]] = _grid(plan_, stack, backend, name)
                return
            outs = [execute(plan_, stack, backend, op_name=name, reason=_REASON)]
        for k, out in zip(ks, outs):
            self.outs[k] = _own(as_stack(out), self.entries[k][2] is None, self.entries[k][3])


def _as_grid(use, dtype, backend) -> bool:
    """Is a weight in layout `use` (None: whole) gathered into a grid of its distinct
    blocks (a :class:`ReplicaBlocks`)? When the update's `backend` holds every device
    and the layout is worth storing so (``replicas.worth_storing_once``)."""
    return use is not None and len(backend.local_ranks) == use.device_num \
        and worth_storing_once(use, dtype)


def _grid(plan_, stack, backend, name) -> np.ndarray:
    """The AllGather `plan_` of the slices `stack` as the grid of the destination's
    distinct blocks (1 along the axes that split nothing), recorded as the collective:
    the whole value assembled once from the slices (one copy, no replica written)."""
    grid = run_plan_grid(plan_, stack, backend, op_name=name, reason=_REASON)
    if grid is None:
        raise RuntimeError(f"parallel optimizer: cannot gather parameter {name!r} as a grid "
                           f"of its blocks: this process does not hold every device")
    if np.may_share_memory(grid, stack):      # a view of the slices the update writes
        grid = np.array(grid)
    return grid


def _fused_grids(backend, entries, members) -> list:
    """The grids of :func:`_grid` for the members `entries` of a fused bucket, gathered
    over the device groups `members`, recorded as the one AllGather
    ``backend.all_gather_fused`` records (the summed slice bytes; input plus output
    buffers as the memory note)."""
    grids = []
    for _, src, use, stack, _, _ in entries:
        grid = use.local_blocks_grid(global_value(stack, src))
        if np.may_share_memory(grid, stack):
            grid = np.array(grid)
        grids.append(grid)
    plan_ = backend.plan("fused_all_gather", members)
    stacks = [e[3] for e in entries]
    # the gathered buffers' sizes, for the record's memory note (nothing allocated)
    outs = [np.broadcast_to(np.zeros((), s.dtype), (s.shape[0], plan_.group_size * s[0].size))
            for s in stacks]
    with comm_cause(bucket_name([e[0] for e in entries], "parameters"), _REASON):
        backend._record_fused("AllGather", plan_, stacks, outs)
    return grids


def _own(stack, whole, slices) -> np.ndarray:
    """The gathered `stack` as the weight stores it: its first device's block when
    the weight is a whole value (`whole`), else the stack; copied when it is a view
    into a larger buffer (a fused collective's), which it would keep alive, or into
    the `slices` the next update writes in place."""
    value = stack[0] if whole else stack
    base = value
    while isinstance(base.base, np.ndarray):
        base = base.base
    if (base is not value and base.nbytes > value.nbytes) or \
            np.may_share_memory(value, slices):
        value = np.array(value)
    return value


class ParameterShards:
    """The parallel optimizer's plan for one update: per parameter its optimizer slice's
    layout (None: not sharded), and the steps of the update (:meth:`scatter`,
    :meth:`weight_slice`, :meth:`match_states`, :meth:`gather`). `kept` (the
    optimizer's, position -> :class:`GatherOnRead`) holds the slices the last update
    stored."""

    def __init__(self, params, layouts, kept=None):
        self.params = params
        self.layouts = layouts
        self.kept = {} if kept is None else kept
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
        """This process's slices of weight `i` in its optimizer slice's layout, an array
        the update writes in place: the slices the last update stored (read as they
        are: no cut, no communication), or, when the weight holds another value (its
        first update, a value set since), cut locally from it."""
        p, dst = self.params[i], self.layouts[i]
        pending = self.kept.pop(i, None)
        if pending is not None and pending.holds(p) and pending.slice_layout == dst \
                and pending.slices.dtype == p.dtype:
            return pending.slices
        return np.array(redistribute_tensor(p, dst, p.name, reason=_REASON))

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

    # ---- 3. the weights stored as their updated slices --------------------------------
    def gather(self, updated: Dict[int, np.ndarray]) -> None:
        """Store each updated slice stack (position -> stack in its optimizer slice's
        layout) as its weight's value, a :class:`GatherOnRead`: AllGathered into the
        weight's layout where the weight is first read, per bucket of
        ``comm_fusion["allgather"]`` (one collective per bucket of a device group and
        dtype), reason "parallel_optimizer". Nothing is communicated here."""
        if not updated:
            return
        order = sorted(updated)
        fusion = "allgather" in (context.get_auto_parallel_context("comm_fusion") or {})
        keys, sizes, groups, entries = [], [], [], []
        for i in order:
            p, src, stack = self.params[i], self.layouts[i], updated[i]
            use = use_layout(p)
            dst = use or TensorLayout.replicated(tuple(p.shape), src.device_num)
            plan_ = plan_redistribution(src, dst, np.dtype(p.dtype).itemsize)
            entries.append([p.name, src, use, stack, plan_, False])
            step = single_step(plan_, "AllGather") if fusion else None
            sizes.append(math.prod(dst.local_shape) * np.dtype(p.dtype).itemsize)
            if step is None:
                keys.append(None)
                groups.append(None)
                continue
            key, members = step_group(plan_, step, stack.dtype)
            keys.append(key)
            groups.append((members, step.dim))
        units, done = [], set()
        for bucket in grouped_buckets(keys, sizes, "allgather"):
            if fused_bucket([updated[order[k]].dtype for k in bucket]):
                units.append((list(bucket), (groups[bucket[0]][0],
                                             [groups[k][1] for k in bucket])))
                done.update(bucket)
        units += [([k], None) for k in range(len(order)) if k not in done]
        backend = _backend()
        for ks, _ in units:                 # a unit's weights into grids: all or none
            grids = all(_as_grid(entries[k][2], updated[order[k]].dtype, backend)
                        for k in ks)
            for k in ks:
                entries[k][5] = grids
        gathers = _Gathers(backend, entries, units)
        for k, i in enumerate(order):
            p, stack = self.params[i], updated[i]
            use = entries[k][2]
            shape = tuple(p.shape) if use is None else (stack.shape[0],) + tuple(use.local_shape)
            pending = GatherOnRead(gathers, k, shape, p.dtype, stack, self.layouts[i],
                                   sizes[k])
            if entries[k][5]:
                pending.view = ReplicaBlocks(None, use, source=pending)
            p._data = None
            p._lazy = pending.view
            p._init = None
            self.kept[i] = pending


def stored_slices(p):
    """``(slice layout, stack)`` when the parallel optimizer stores Parameter `p` as its
    optimizer slices and its whole value is not gathered yet (between steps); else
    None."""
    lazy = p._lazy
    if type(lazy) is ReplicaBlocks:             # gathered into a grid on first use
        lazy = lazy.source
    if type(lazy) is GatherOnRead and lazy.out is None:
        return lazy.slice_layout, lazy.slices
    return None


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer keeps per device, in bytes (see :func:`optimizer_memory`)."""

    #: the optimizer's states (momentum, moments...) on one device
    states: int
    #: the weights' slices one device updates (the optimizer's master copy of them),
    #: which is all a device stores of a sharded weight between steps
    weights: int
    #: per parameter name: into how many slices the parallel optimizer cuts it (1: not)
    shards: Dict[str, int]
    #: the sharded weights' gathered whole blocks one device holds now: 0 between
    #: steps; from a weight's first read (the forward pass) until the update drops it,
    #: its block in the layout the step reads
    gathered: int = 0


def optimizer_memory(optimizer) -> OptimizerMemory:
    """The bytes one device keeps for `optimizer`: its states (as stored now: before
    the first update they have the shape of their weights), the slices of the weights
    it updates, with the parallel optimizer's shard count per parameter (as the next
    update will cut them), and the gathered copies of sharded weights held now. With
    the parallel optimizer on, states and weights drop by the shard count for every
    sharded weight. Reads no value (gathers nothing)."""
    layouts = _layouts(optimizer)
    kept = optimizer.__dict__.get("_weight_slices") or {}
    shards, weights, gathered = {}, 0, 0
    for i, p in enumerate(optimizer.parameters):
        lay = use_layout(p)
        local = lay.local_shape if lay is not None else tuple(p.shape)
        s = layouts[i]
        count = 1 if s is None else local[0] // s.local_shape[0]
        shards[p.name] = count
        nbytes = math.prod(local) * np.dtype(p.dtype).itemsize
        weights += nbytes // count
        pending = kept.get(i)
        if pending is not None and pending.out is not None and pending.holds(p):
            gathered += nbytes
    states = 0
    for name in optimizer.__dict__.get("_state_names", ()):
        for st in getattr(optimizer, name):
            lay = st._layout
            local = lay.local_shape if lay is not None else tuple(st.shape)
            states += math.prod(local) * np.dtype(st.dtype).itemsize
    return OptimizerMemory(states, weights, shards, gathered)
