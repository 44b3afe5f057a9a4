"""Operator-level sharding rules and their eager execution.

A rule is data registered per op name: given the layouts of the op's inputs (all
expressed over one device matrix) it returns a :class:`ShardPlan` — the layout each
input must have, the layouts of the outputs (pending partial sums included), the
local computation on stacks of shards, and any collective that must finish an output
(e.g. AllReduce(max) after a max over a split dim). :func:`sharded_apply`
redistributes the inputs, runs the local computation in one numpy call over the
device axis and wraps the outputs. The same rules serve the backward pass (backward
rules are written with ops), graph planning and propagation, the data-parallel fast
path and hybrid parallel's per-device values. A rule keeps pending sums through its op
when the op is registered as linear in them (:func:`dualmode.parallel.rules.base.pending_sums`).

Device matrices: layouts of different inputs may use different device matrices with
the same rank order (e.g. (8,) and (2, 4)); they are re-expressed over their common
refinement first, which moves no data. :func:`op_strategy_layouts` builds the layouts
of an op's whole in_strategy over ONE device matrix (MindSpore's rule: shared dims on
one axis, leftover factor repeated), so inputs that agree need no move.

Repeated calculation (device axes that split nothing), when this process holds every
device: ops whose rule is registered ``per_device=True`` and whose inputs and outputs
all repeat over some axes compute one replica and copy the results to the others (and
inputs stored once for every device, stride 0, are computed on once); a `local` marked
with :func:`accepts_grids` (MatMul) receives inputs moved into a repeating layout as
device grids (``device_matrix + local_shape``, size 1 where they repeat), broadcast
instead of copied per replica.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

from .._core import _tensor as _core
from .._core._tensor import KIND_GENERIC, TensorBase
from ..communication.sim import broadcast_view
from ..communication.totals import (DEFERRING, DeferredShares, as_stack, deferral_on,
                                   known_totals, share_of, stored)
from ..ops._registry import REGISTRY
from .devices import backend as _backend
from .devices import holds_all_devices, live_backend as _live_backend, op_cause
from .tensor_layout import LayoutError, TensorLayout, stand_in
from .redistribution.unify import unify_device_matrices
from .moves import redistribute_grid, redistribute_tensor
from .replicas import ReplicaBlocks

__all__ = ["ShardPlan", "RULES", "register_rule", "sharded_apply", "rule_plan", "decide", "refine",
           "reexpress", "same_placement", "common_device_matrix", "op_strategy_layouts",
           "accepts_grids", "grid_to_stack", "stack_grid", "wants_grids", "made_by",
           "keep_made_by", "linear_on_totals"]


@dataclass(frozen=True)
class ShardPlan:
    """How to run one op on shards.

    inputs   required layout per input (None: pass the input as it is, e.g. a scalar)
    outputs  layout per output
    local    local(attrs, stacks) -> stack or tuple of stacks (leading device axis)
    post     per output: None, or (op, axes) for an AllReduce(op) over device axes
    """
    inputs: Tuple[Optional[TensorLayout], ...]
    outputs: Tuple[TensorLayout, ...]
    local: Callable
    post: Tuple = ()

    @functools.cached_property
    def even_inputs(self) -> bool:
        """Does every distributed input's split divide its dims (no pads in the stacks)?"""
        return all(lay is None or lay.even for lay in self.inputs)

    @functools.cached_property
    def even_outputs(self) -> bool:
        """Does every output's split divide its dims (no pads to clear after `local`)?"""
        return all(lay.even for lay in self.outputs)


RULES: dict = {}


def register_rule(*names, per_device=False, shared=None, uneven=False):
    """Register a sharding rule for the ops `names` (also in ``OpDef.extras["shard"]``).

    ``per_device=True`` declares the rule a pure per-device map: each device's outputs
    come from that device's input blocks alone, computed the same way on every device
    (so devices holding equal blocks compute equal results, and a layout that repeats
    over some axes needs the computation only once per replica set). ``shared(prim, xs)``
    lists the dims its inputs share (:mod:`dualmode.parallel.shared_dims`): a strategy
    must split them alike, and they sit on one axis of the op's device matrix.
    ``uneven=True`` declares that the rule handles splits that do not divide their dims
    (pieces of two sizes, the short ones stored padded with zeros); other rules refuse
    such inputs by name (:func:`check_even`)."""
    def deco(fn):
        fn.per_device = per_device
        fn.shared = shared
        fn.uneven = uneven
        for name in names:
            RULES[name] = fn
            if name in REGISTRY:
                REGISTRY[name].extras["shard"] = fn
        return fn
    return deco


# ---------------------------------------------------------------------------
# device matrices
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def refine(dm_a: tuple, dm_b: tuple) -> tuple:
    """The coarsest device matrix refining both (same device count, row-major ranks):
    the unified matrix of the redistribution planner, without its unit axes."""
    unified = unify_device_matrices(dm_a, dm_b)     # ValueError on different counts
    if unified is None:
        raise ValueError(f"refine: device matrices {dm_a} and {dm_b} have no common "
                         f"refinement (their rank strides do not nest)")
    return tuple(d for d in unified[0] if d > 1) or (1,)


@functools.lru_cache(maxsize=1024)
def _axis_groups(dm: tuple, fine: tuple) -> tuple:
    """For each axis of `dm`, the consecutive axes of `fine` that make it up."""
    groups, j = [], 0
    for size in dm:
        grp, prod = [], 1
        while prod < size:
            grp.append(j)
            prod *= fine[j]
            j += 1
        groups.append(tuple(grp))
    return tuple(groups)


@functools.lru_cache(maxsize=4096)
def reexpress(layout: TensorLayout, fine: tuple) -> TensorLayout:
    """`layout` over the finer device matrix `fine` (same placement, no data moves)."""
    if layout.device_matrix == fine:
        return layout
    groups = _axis_groups(layout.device_matrix, fine)
    tmap = tuple(tuple(f for a in axes for f in groups[a]) for axes in layout.tensor_map)
    partial = tuple(sorted(f for a in layout.partial for f in groups[a]))
    return TensorLayout(fine, tmap, layout.shape, partial)


def _shared_fn(prim):
    rule = RULES.get("RealDiv" if prim.name == "Div" else prim.name)
    return getattr(rule, "shared", None) if rule is not None else \
        getattr(type(prim), "shared_dims", None)


def shared_dims(prim, xs) -> list:
    """The dims the inputs `xs` of primitive `prim` share, as its op's rule declares them
    (a composite primitive with no op of its own declares ``shared_dims`` itself)."""
    fn = _shared_fn(prim)
    return fn(prim, xs) if fn is not None else []


def shared_dims_hint(prim, xs):
    """Another valid form of `prim`'s strategy its rule offers when the inputs' shared
    dims are split differently (a phrase starting with "or"), or None."""
    hint = getattr(_shared_fn(prim), "hint", None)
    return hint(prim, xs) if hint is not None else None


def same_placement(a: TensorLayout, b: TensorLayout) -> bool:
    """Do `a` and `b` put the same blocks on the same devices (and pend the same sums),
    whatever the factorisation of their device matrices (``(4, 2)`` with a dim on axis 1
    places it as ``(2, 2, 2)`` with it on axis 2)?"""
    if a == b:
        return True
    if a.shape != b.shape or a.device_num != b.device_num:
        return False
    try:
        fine = refine(a.device_matrix, b.device_matrix)
    except ValueError:
        return False
    return reexpress(a, fine) == reexpress(b, fine)


def common_device_matrix(layouts) -> tuple:
    dm = None
    for lay in layouts:
        if lay is not None:
            dm = lay.device_matrix if dm is None else refine(dm, lay.device_matrix)
    return dm


def op_strategy_layouts(prim, tensors, device_num: int) -> tuple:
    """The layouts of `prim`'s tensor inputs under its in_strategy with ONE device matrix
    for the op (MindSpore's rule, :meth:`TensorLayout.from_op_strategy`): the dims the
    inputs share (contracted, batch, broadcast, channel dims; the pairs the strategy
    checks use) sit on the same device axis, so inputs that agree move no data.
    Cached per (op, strategy, shapes, shared dims, device_num): layouts are values."""
    tensors = list(tensors)
    shapes = tuple(tuple(x.shape) for x in tensors)
    shared = tuple(tuple(p) for p in shared_dims(prim, tensors))
    strategy = prim.in_strategy
    build = _op_strategy_layouts if cacheable_strategy(strategy) else \
        _op_strategy_layouts.__wrapped__
    return build(prim.name, strategy, shapes, int(device_num), shared)


def cacheable_strategy(strategy) -> bool:
    """Is `strategy` made of exact int tuples? Only those may key a cache: 2.0, True or
    np.int64(2) hash like 2 and must still reach the checks that refuse (or accept)
    them by name."""
    return isinstance(strategy, tuple) and all(
        type(st) is tuple and all(type(v) is int for v in st) for st in strategy)


@functools.lru_cache(maxsize=4096)
def _op_strategy_layouts(name, strategy, shapes, device_num, shared):
    try:
        return TensorLayout.from_op_strategy(strategy, shapes, device_num, shared, name)
    except LayoutError:
        # the op's matrix would need more devices than there are (e.g. MatMul
        # ((2, 4), (2, 4)) with transpose_b on 8: MindSpore refuses it); each input is
        # then placed on its own matrix, which is still exact, only moves more data
        return tuple(TensorLayout.from_strategy(st, shape, device_num, name, i)
                     for i, (st, shape) in enumerate(zip(strategy, shapes)))


# ---------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------
def to_layout(x, dst: TensorLayout, op_name):
    """The stack of `x` (Tensor or array) in layout `dst`."""
    return redistribute_tensor(x, dst, op_name)


def rule_plan(op, attrs, inputs, layouts):
    """``(plan, input layouts, device matrix, dtypes)`` of `op`'s sharding rule for
    inputs in `layouts` (None: not distributed), every layout over one device matrix;
    None when the op has no rule or the rule declines."""
    specs = [lay if lay is not None else
             tuple(x.shape) if isinstance(x, TensorBase) else
             tuple(np.shape(x)) if np.ndim(x) > 0 else None
             for x, lay in zip(inputs, layouts)]
    return plan_for(op, attrs, specs, [x.dtype for x in inputs])


def plan_for(op, attrs, specs, dtypes):
    """:func:`rule_plan` from what is known before anything runs: per input its
    TensorLayout, or the shape of a whole (undistributed) value, or None for a scalar."""
    rule = RULES.get(op.name)
    if rule is None:
        return None
    dm = common_device_matrix([s for s in specs if isinstance(s, TensorLayout)])
    lays = [reexpress(s, dm) if isinstance(s, TensorLayout) else
            TensorLayout.replicated(s, dm) if s is not None else None for s in specs]
    dtypes = list(dtypes)
    plan = _plan(rule, op.name, attrs, lays, dtypes)
    if plan is None:
        return None
    return plan, lays, dm, dtypes


#: call signature -> what :func:`sharded_apply` decided for it (see :func:`decide`)
_DECISIONS: dict = {}


def decide(op, attrs, inputs, layouts):
    """``(plan, lays, dm, dtypes, reps, grids, checked, ready, lays_out)`` for this call,
    or None when the rule declines. Every part is a function of the op, its attrs, the
    inputs' layouts (shapes for whole values), dtypes and how many devices this process
    holds, so it is cached per that signature; `checked` lists whether shapes were
    validated already, `ready` per input whether it is in the layout the plan needs, and
    `lays_out` the outputs' layouts (None: a replicated result kept as one value)."""
    b = _live_backend()
    try:
        key = (op.name, tuple(attrs.items()) if attrs else (), tuple(layouts),
               tuple([x.dtype for x in inputs]),
               tuple([() if lay is not None else np.shape(x)
                      for x, lay in zip(inputs, layouts)]),
               len(b.local_ranks) if b is not None else 0)
        hit = _DECISIONS.get(key)
    except TypeError:                       # an unhashable attribute (an array, a list)
        key, hit = None, None
    if hit is not None:
        return hit
    found = rule_plan(op, attrs, inputs, layouts)
    if found is None:
        return None
    plan, lays, dm, dtypes = found
    reps = shared_replicas(RULES[op.name], plan, dm)
    grids = not reps and wants_grids(plan, lays, dm)
    ready = tuple(need is not None and have == need for have, need in zip(lays, plan.inputs))
    lays_out = tuple(None if not lay.partial and not any(lay.tensor_map) else lay
                     for lay in plan.outputs)
    hit = [plan, lays, dm, dtypes, reps, grids, False, ready, lays_out]
    if key is not None:
        if len(_DECISIONS) >= _PLANS_MAX:
            _DECISIONS.clear()
        _DECISIONS[key] = hit
    return hit


def sharded_apply(op, attrs, inputs, rec, layouts):
    """Run `op` with its registered rule; None when it has none."""
    found = decide(op, attrs, inputs, layouts)
    if found is None:
        return None
    plan, lays_out = found[0], found[8]
    if plan.even_inputs:
        outs = _local_outputs(op, attrs, inputs, found)
    else:
        with np.errstate(all="ignore"):       # the pads (zeros) may meet log, 1/x, ...
            outs = _local_outputs(op, attrs, inputs, found)
    for i, post in enumerate(plan.post):
        if post is not None:
            red_op, axes = post
            with op_cause(op.name):
                outs[i] = np.asarray(_backend().all_reduce(
                    as_stack(outs[i]), members=plan.outputs[i].group_members(axes),
                    op=red_op))
    if not plan.even_outputs:
        zero_output_pads(plan, outs)
    for i, lay in enumerate(lays_out):
        if lay is None:
            outs[i] = np.asarray(outs[i][0])          # a replicated result: one plain value
    res = tuple(outs) if op.multi_output else outs[0]
    return _core.finish(op, attrs, inputs, res, rec, lays_out)


def _local_outputs(op, attrs, inputs, found) -> list:
    """The output stacks of the local computation of the plan `found` (see
    :func:`decide`) on `inputs`, moved where the plan needs them."""
    plan, lays, dm, dtypes, reps, grids, checked, ready, lays_out = found
    outs = _linear_on_totals(op, attrs, inputs, found)
    if outs is not None:
        return outs
    if reps:
        outs = _apply_once_per_replica_set(op, attrs, inputs, lays, plan, dtypes, dm, reps,
                                           validate=not checked)
        found[6] = True
    elif grids or (getattr(plan.local, "accepts_grids", False)
                   and _blocks_stored_once(inputs, plan.inputs)):
        outs = _apply_on_grids(op, attrs, inputs, plan, dtypes, dm, ready,
                               validate=not checked)
        found[6] = True
    else:
        stacks = []
        for x, need, same in zip(inputs, plan.inputs, ready):
            if need is None:
                stacks.append(x._value() if isinstance(x, TensorBase) else x)
            elif same and isinstance(x, TensorBase) and x._layout is not None:
                stacks.append(x._data)
            else:
                stacks.append(to_layout(x, need, op.name))
        if not checked:                     # the same signature validates the same way
            _validate(op, attrs, stacks, dtypes, plan)
            found[6] = True
        with DEFERRING:                   # the outputs become Tensors: may stay unwritten
            outs = run_local(RULES[op.name], op, attrs, plan, stacks)
    return outs


#: id(plan) -> (plan, the device axes of the pending sums it keeps, or None): whether a
#: plan may run on the totals of its inputs' pending sums (see :func:`_totals_axes`)
_ON_TOTALS: dict = {}


def _totals_axes(op, plan, dm):
    """The device axes over which `plan` keeps its inputs' pending sums when its local
    computation may run once per group of devices sharing a sum, on the group's total:
    a per-device rule (``per_device=True``) that keeps the sums pending (it does so only
    for an op linear in them, per its registration), every output pending over the same
    axes and every other input repeated along them, no finishing collective, even
    splits, this process holding every device. None otherwise."""
    if not getattr(RULES[op.name], "per_device", False) or plan.post \
            or not plan.even_inputs or not plan.even_outputs:
        return None
    axes = {need.partial for need in plan.inputs if need is not None and need.partial}
    if len(axes) != 1:
        return None
    axes = axes.pop()
    for lay, is_output in [(lay, False) for lay in plan.inputs] + \
            [(lay, True) for lay in plan.outputs]:
        if lay is None:
            continue
        if lay.device_matrix != dm or any(set(m) & set(axes) for m in lay.tensor_map) \
                or (not set(axes) <= set(lay.partial) if is_output else
                    lay.partial not in ((), axes)):
            return None
    if not holds_all_devices(math.prod(dm)):
        return None
    return axes


def _linear_on_totals(op, attrs, inputs, found):
    """:func:`linear_on_totals` for an eager call (`found` from :func:`decide`): the
    inputs already in the layouts the plan needs, or whole values every device holds."""
    plan, dm = found[0], found[2]
    if _totals_route(op, plan, dm) is None:
        return None
    stacks = []
    for x, need, same in zip(inputs, plan.inputs, found[7]):
        if need is None:
            stacks.append(x._value() if isinstance(x, TensorBase) else x)
        elif same and isinstance(x, TensorBase) and x._layout is not None:
            stacks.append(stored(x))
        elif any(need.tensor_map) or need.partial or (
                isinstance(x, TensorBase) and x._layout is not None):
            return None
        else:
            # a whole value every device holds: one block standing for all
            value = x._value() if isinstance(x, TensorBase) else np.asarray(x)
            if value.shape != need.local_shape:
                return None
            stacks.append(_Whole(value))
    if not found[6]:                    # the same signature validates the same way
        _validate(op, attrs, stacks, found[3], plan)
        found[6] = True
    return linear_on_totals(op, attrs, plan, dm, stacks)


class _Whole:
    """A whole value standing for the stack of a replicated input (every device's block
    is the value)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _totals_route(op, plan, dm):
    """:func:`_totals_axes` of `plan`, remembered per plan."""
    entry = _ON_TOTALS.get(id(plan))
    if entry is None or entry[0] is not plan:
        if len(_ON_TOTALS) >= _PLANS_MAX:
            _ON_TOTALS.clear()
        entry = _ON_TOTALS[id(plan)] = (plan, _totals_axes(op, plan, dm))
    return entry[1]


def linear_on_totals(op, attrs, plan, dm, stacks):
    """The outputs (deferred stacks of equal shares, :class:`DeferredShares`) of an op
    linear in its inputs' pending sums, computed once per group of devices that share a
    sum, on the group's total, when every input holding a pending sum knows its totals
    (a grouped MatMul's shares, or an earlier op of this route): by linearity the sum of
    the op's per-device results is the op of the sum, so each group's result is that
    total and its devices hold equal shares of it -- instead of the op run on every
    device's share. `stacks`: per input of `plan`, its stack as stored (a deferred
    stack stays unwritten) in the layout the plan needs, or the value when the plan
    needs none. None when this does not apply (the shares are then used)."""
    axes = _totals_route(op, plan, dm)
    if axes is None:
        return None
    dm_c = tuple(1 if a in axes else s for a, s in enumerate(dm))
    grids = []
    for x, need in zip(stacks, plan.inputs):
        if need is None:
            grids.append(x)
        elif type(x) is _Whole:
            grids.append(_compact(x.value.reshape((1,) * len(dm) + x.value.shape), dm_c,
                                  need.local_shape))
        elif need.partial:
            totals = known_totals(x, dm, axes)
            if totals is None:
                return None
            grids.append(_compact(totals, dm_c, need.local_shape))
        else:
            grids.append(replica_grid(x, need, dm, axes))
    out = plan.local(attrs, grids)
    outs = list(out) if op.multi_output else [out]
    n_parts = math.prod(dm[a] for a in axes)
    for i, lay in enumerate(plan.outputs):
        o = np.asarray(outs[i]).reshape(dm_c + lay.local_shape)
        if lay.partial == axes:
            outs[i] = DeferredShares(o, dm, axes, n_parts)
        else:
            # pending over more axes (the op's own sum over a split dim): each device
            # holds its share of its group's result, partial over the others
            full = np.empty((math.prod(dm),) + lay.local_shape, dtype=o.dtype)
            full.reshape(dm + lay.local_shape)[...] = share_of(o, n_parts)
            outs[i] = full
    return outs


def zero_output_pads(plan, outs) -> list:
    """`outs` (a list of output stacks of `plan`) with zeros in the pads of the outputs
    whose splits do not divide their dims (a local computation may leave anything there:
    ``exp(0)`` is 1); the lists' entries are replaced, written in place when writable."""
    for i, lay in enumerate(plan.outputs):
        if lay.even:
            continue
        o = as_stack(outs[i])
        if not (isinstance(o, np.ndarray) and o.flags.writeable and o.strides[0] != 0):
            o = np.array(o)
        ranks = None if o.shape[0] == lay.device_num else _backend().local_ranks
        outs[i] = lay.zero_pads(o, ranks)
    return outs


_PLANS: dict = {}
_PLANS_MAX = 4096


def check_even(rule, name, lays):
    """Refuse, naming the op and the input, layouts whose splits do not divide their
    dims when `rule` does not handle pieces of unequal size."""
    if getattr(rule, "uneven", False):
        return
    for i, lay in enumerate(lays):
        if lay is not None and not lay.even:
            d = lay.uneven_dims[0]
            n, k = lay.shape[d], lay.dim_parts[d]
            raise ValueError(
                f"{name}: input {i} is split into pieces of unequal size (dim {d}, size {n}, "
                f"in {k} parts: {-(-n // k)} or {n // k} rows each); {name} does not handle "
                f"unequal pieces yet: use a split that divides the dim, or leave the dim whole")


def _plan(rule, name, attrs, lays, dtypes):
    """`rule`'s plan for these layouts, cached when the attrs are hashable values: a
    plan is a function of (op, attrs, input layouts, dtypes) alone. Its outputs'
    pending sums are marked as made by `name` (:func:`made_by`). Layouts whose splits
    do not divide are refused unless the rule handles them (:func:`check_even`)."""
    check_even(rule, name, lays)
    try:
        key = (name, tuple(attrs.items()) if attrs else (), tuple(lays), tuple(dtypes))
        hash(key)
    except TypeError:                       # an unhashable attribute (an array, a list)
        return _marked(rule(attrs, lays, dtypes), name, lays)
    plan = _PLANS.get(key, _PLANS)
    if plan is _PLANS:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _marked(rule(attrs, lays, dtypes), name, lays)
    return plan


def made_by(lays):
    """The op that made the pending sums an op linear in them keeps (inputs in `lays`,
    None for a scalar): that of its first input holding one, None when none does."""
    for lay in lays:
        if lay is not None and lay.partial:
            return lay.partial_op
    return None


def _marked(plan, name, lays):
    """`plan` with its outputs' pending sums marked as made by the op `name`, or, when
    an input holds one (an op linear in it keeps it), by the op that made that one.
    Layouts compare equal whoever made their sums, so a cached plan of a linear op may
    name the maker of an earlier call's sum: its callers mark the outputs again from
    their own inputs (:func:`keep_made_by`)."""
    if plan is None or not any(lay.partial for lay in plan.outputs):
        return plan
    maker = made_by(lays) or name
    return dataclasses.replace(plan, outputs=tuple(
        lay.with_partial_op(maker) if lay.partial else lay for lay in plan.outputs))


def keep_made_by(out, layouts):
    """The output(s) `out` (Tensors) of an op linear in the pending sums of its inputs
    (in `layouts`), their pending sums marked as made by the op that made the inputs'
    (see :func:`_marked`); the Tensors are changed in place and returned."""
    maker = made_by(layouts)
    for o in (out if isinstance(out, tuple) else (out,)):
        lay = o._layout if isinstance(o, TensorBase) else None
        if isinstance(lay, TensorLayout) and lay.partial and lay.partial_op != maker:
            o._layout = lay.with_partial_op(maker)
    return out


def run_local(rule, op, attrs, plan, stacks):
    """The plan's local computation as a list of output stacks. When every device holds
    the same inputs (stacks stored once, stride 0 along the devices: equal shares of a
    pending sum, replicated values) a per-device rule computes one device's outputs and
    gives them to all."""
    once = False
    if getattr(rule, "per_device", False):
        dist = [s for s, need in zip(stacks, plan.inputs) if need is not None]
        once = bool(dist) and all(
            isinstance(s, np.ndarray) and s.ndim >= 1 and s.shape[0] > 1 and s.strides[0] == 0
            for s in dist)
    if once:
        n = dist[0].shape[0]
        stacks = [s[:1] if need is not None else s for s, need in zip(stacks, plan.inputs)]
    out = plan.local(attrs, stacks)
    outs = list(out) if op.multi_output else [out]
    if once:
        outs = [broadcast_view(o, (n,) + o.shape[1:]) for o in map(np.asarray, outs)]
    return outs


def _validate(op, attrs, stacks, dtypes, plan):
    """Shape/dtype inference on global-shaped stand-ins (zero-strided: no memory)."""
    _core.infer(op, attrs, *[stand_in(d, lay.shape) if lay is not None
                             else s for s, d, lay in zip(stacks, dtypes, plan.inputs)])


# ---------------------------------------------------------------------------
# replicated device axes: compute once, not once per replica
# ---------------------------------------------------------------------------
def shared_replicas(rule, plan, dm) -> tuple:
    """Device axes along which every input and output of `plan` is replicated (neither
    split nor partial), when `rule` is a per-device map (``register_rule(...,
    per_device=True)``) and this process holds every device; () otherwise."""
    if not getattr(rule, "per_device", False) or plan.post or len(dm) < 2:
        return ()
    common = None
    for lay in plan.inputs + plan.outputs:
        if lay is None:
            continue
        if lay.device_matrix != dm:
            return ()
        axes = set(lay.replicated_axes)
        common = axes if common is None else common & axes
        if not common:
            return ()
    if not common or len(common) == len(dm) or not holds_all_devices(math.prod(dm)):
        return ()
    return tuple(sorted(common))


def _compact(grid, dm_c, local):
    """A grid broadcastable to ``dm_c + local`` as a stack ``(prod(dm_c), *local)``."""
    shape = dm_c + tuple(local)
    if grid.shape != shape:
        grid = broadcast_view(grid, shape)
    return grid.reshape((math.prod(dm_c),) + tuple(local))


@functools.lru_cache(maxsize=1024)
def _replica_set(dm, reps):
    """``(dm_c, first)``: the device matrix `dm` with the axes `reps` reduced to 1, and
    the index of the first replica along them."""
    return (tuple(1 if a in reps else s for a, s in enumerate(dm)),
            tuple(slice(0, 1) if a in reps else slice(None) for a in range(len(dm))))


def _apply_once_per_replica_set(op, attrs, inputs, lays, plan, dtypes, dm, reps,
                                validate=True):
    """Run `plan.local` on one replica of the blocks along the device axes `reps` (every
    input and output is replicated along them), then give every replica the results.
    Inputs are moved as device grids (redistribute_grid), so their replicas are never
    written either."""
    dm_c, first = _replica_set(dm, reps)
    stacks = []
    for x, have, need in zip(inputs, lays, plan.inputs):
        if need is None:
            stacks.append(x._value() if isinstance(x, TensorBase) else x)
            continue
        if have == need and isinstance(x, TensorBase) and x._layout is not None:
            stacks.append(replica_grid(stored(x), need, dm, reps))
            continue
        grid = redistribute_grid(x, need, op.name)
        if grid is None:                            # cannot happen with every device local
            grid = to_layout(x, need, op.name).reshape(dm + need.local_shape)[first]
        stacks.append(_compact(grid, dm_c, need.local_shape))
    if validate:
        _validate(op, attrs, stacks, dtypes, plan)
    with DEFERRING:                       # the outputs become Tensors: may stay unwritten
        return once_per_replica_set(op, attrs, plan, stacks, dm, reps)


def replica_grid(stack, need, dm, reps):
    """The stack of an input in layout `need` (or a deferred stack) reduced to one
    replica along the device axes `reps`, as :func:`once_per_replica_set` takes it: a
    view of the stack, or of the whole value when it is known."""
    dm_c, first = _replica_set(dm, reps)
    if type(stack) is ReplicaBlocks:                # a Parameter's replicas stored once
        grid = stack.current_grid(need)
        if grid is not None:
            return _compact(grid, dm_c, need.local_shape)
    if not need.partial:
        known = known_totals(stack, dm, ())
        if known is not None:
            return _compact(known, dm_c, need.local_shape)
    return _compact(as_stack(stack).reshape(dm + need.local_shape)[first], dm_c,
                    need.local_shape)


def once_per_replica_set(op, attrs, plan, stacks, dm, reps):
    """`plan.local` on one replica along `reps` (inputs given so, see
    :func:`replica_grid`), every replica then given the results (a list of stacks;
    while :data:`~dualmode.communication.totals.DEFERRING` is on, a result without
    pending sums is a deferred stack: its replicas are written only if read)."""
    dm_c = _replica_set(dm, reps)[0]
    out = plan.local(attrs, stacks)
    outs = list(out) if op.multi_output else [out]
    n = math.prod(dm)
    defer = deferral_on()
    for i, lay in enumerate(plan.outputs):
        o = np.asarray(outs[i])
        if not lay.partial and not any(lay.tensor_map):
            continue                                # a replicated result: kept as one value
        if defer and not lay.partial and not _aliases(o, stacks):
            # a fresh result (a view of an input could change before it is read)
            outs[i] = DeferredShares(o.reshape(dm_c + lay.local_shape), dm, (), 1)
            continue
        full = np.empty((n,) + lay.local_shape, dtype=o.dtype)
        full.reshape(dm + lay.local_shape)[...] = o.reshape(dm_c + lay.local_shape)
        outs[i] = full
    return outs


def _aliases(out, arrays) -> bool:
    """Whether `out` may share memory with one of `arrays`."""
    return any(isinstance(a, np.ndarray) and np.may_share_memory(out, a) for a in arrays)


def accepts_grids(local, prefer: bool = False):
    """Mark a rule's `local` as also accepting device grids: inputs shaped
    ``device_matrix + local_shape`` with size 1 along device axes where the input is
    replicated (broadcast, never written per replica); it still returns stacks. With
    `prefer`, grids are given whenever this process holds every device."""
    local.accepts_grids = True
    local.prefers_grids = prefer
    return local


def wants_grids(plan, lays, dm) -> bool:
    """Does `plan` (for inputs in `lays`, over `dm`) run on device grids, in eager and
    graph mode alike? Grids pay off when an input must be moved into a layout that
    repeats its blocks over some (not all) device axes, or when the local prefers them,
    and this process holds every device."""
    if not getattr(plan.local, "accepts_grids", False) or plan.post or len(dm) < 2:
        return False
    if getattr(plan.local, "prefers_grids", False):
        # the local computation reads blocks as views of whole values (e.g. one GEMM per
        # group of devices): every input as a grid, however it is laid out
        return holds_all_devices(math.prod(dm))
    found = False
    for have, need in zip(lays, plan.inputs):
        if need is None:
            return False
        if have != need and 0 < len(need.replicated_axes) < len(dm) and not need.partial:
            found = True
    return found and holds_all_devices(math.prod(dm))


def _blocks_stored_once(inputs, needs) -> bool:
    """Is some input, in the layout the plan needs, still stored once per distinct block:
    a Parameter whose replicas are stored once (:mod:`.replicas`), or an unwritten
    result that is the blocks of a known whole value (a :class:`DeferredShares` over no
    device axes, e.g. a replicated result computed once per replica set)? A local that
    accepts grids then reads that grid, instead of having the stack written."""
    for x, need in zip(inputs, needs):
        if not isinstance(x, TensorBase):
            continue
        lazy = x._lazy
        if type(lazy) is ReplicaBlocks and lazy.current_grid(need) is not None:
            return True
        if type(lazy) is DeferredShares and not lazy.axes and x._layout == need:
            return True
    return False


def _apply_on_grids(op, attrs, inputs, plan, dtypes, dm, ready, validate=True):
    """Run a grid-accepting `plan.local` with every input as a device grid (`ready`: per
    input, whether it is in the layout the plan needs; the shapes are checked first
    unless the same call signature passed before)."""
    grids = []
    for x, same, need in zip(inputs, ready, plan.inputs):
        if same and isinstance(x, TensorBase) and x._layout is not None:
            grids.append(stack_grid(stored(x), need))
            continue
        grid = redistribute_grid(x, need, op.name)
        if grid is None:                            # cannot happen with every device local
            grid = to_layout(x, need, op.name).reshape(dm + need.local_shape)
        grids.append(grid)
    if validate:
        _validate(op, attrs, grids, dtypes, plan)
    with DEFERRING:                       # the outputs become Tensors: may stay unwritten
        out = plan.local(attrs, grids)
    return list(out) if op.multi_output else [out]


def stack_grid(stack, lay):
    """`stack` (every device's blocks in `lay`, or a deferred stack of them) as a device
    grid for a local that accepts grids: views of the whole value when it is known
    (:mod:`dualmode.communication.totals`), else the stack with the first replica along
    each axis where `lay` repeats standing for all (size 1 there: replicas hold equal
    blocks)."""
    dm = lay.device_matrix
    if lay.partial:
        return as_stack(stack).reshape(dm + lay.local_shape)
    if type(stack) is ReplicaBlocks:                # a Parameter's replicas stored once
        grid = stack.current_grid(lay)
        if grid is not None:
            return grid
    known = known_totals(stack, dm, ())
    if known is not None:
        return known
    return as_stack(stack).reshape(dm + lay.local_shape)[
        _replica_set(dm, lay.replicated_axes)[1]]


def grid_to_stack(out, dm):
    """A result over the device grid (size 1 where it repeats) as a stack (n, *local)."""
    k = len(dm)
    full = broadcast_view(out, tuple(dm) + out.shape[k:])
    return full.reshape((math.prod(dm),) + out.shape[k:])


# ---------------------------------------------------------------------------
# helpers for rules
# ---------------------------------------------------------------------------
def expand_stack(stack, rank):
    """A stack (n, *local) viewed with leading unit dims so its local part has `rank` dims
    (numpy broadcasting then aligns with higher-rank stacks)."""
    extra = rank - (stack.ndim - 1)
    if extra <= 0:
        return stack
    return stack.reshape((stack.shape[0],) + (1,) * extra + stack.shape[1:])


def layout(dm, tmap, shape, partial=()):
    return _make_layout(dm, tuple(tuple(a) for a in tmap), tuple(shape), tuple(sorted(partial)))


@functools.lru_cache(maxsize=8192)
def _make_layout(dm, tmap, shape, partial):
    return TensorLayout(dm, tmap, shape, partial)


def run_kernel(op, attrs, stacks):
    if op.kind == KIND_GENERIC:
        return op.kernel(attrs, *stacks)
    return op.kernel(*stacks)
