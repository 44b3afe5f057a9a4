"""Lowering: the pass that inserts communication into a planned graph.

After strategies and propagation have placed the ops, every value's layout is known
before anything runs. :func:`insert_communication` walks the graph once, in order,
taking for each op the decisions the eager dispatcher (parallel/dtensor.py) would take
at run time — from the same sharding rule — and writes them down:

* a :data:`~.ir.MOVE` node wherever a value must change layout: into a configured or
  propagated strategy, into the layout the op's rule asks for, a pending sum resolved
  (AllReduce) before an op that is not linear in it, a value gathered whole for an op
  with no rule for its layouts, the outputs into ``out_strategy``; a pending sum's
  layout names the op that made it (``partial_op``, kept through the ops linear in it),
  under which the executor reports its resolution;
* a :data:`~.ir.REDUCE` node for a collective that finishes an op's output
  (AllReduce(max) after a max over a split dim);
* before an optimizer update (a CALL recorded with its parameters), a MOVE per gradient
  into the layout the update reads it in (reason "gradient"): the gradient
  communication, which the fusion pass (fuse.py) then buckets;
* on every op node, ``Node.run``: how it computes on this process's stacks — the op's
  kernel once on the global values (data parallel), its rule's local computation over
  the stacks (once per replica set where the rule is a per-device map), or its kernel
  on whole values.

The result is what :mod:`.executor` runs, and what ``dump()`` and ``strategies()``
describe: communication is in the IR, not discovered while executing.

Parameters: each gets one storage layout for the graph (:class:`ParamPlan`), the
layout its first configured consumer (or ``parameter_plan``, or else its first
propagated consumer) gives it, as in PyNative mode where a parameter lives where its
first sharded op puts it; other consumers get a moved copy (a MOVE).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..._core._tensor import TensorBase
from ..grad_reduce import is_dp_partial, replica_gradient_scale, resolves_pending
from ..optimizer_shard import shard_layout
from ..stacks import is_batch_layout
from ..tensor_layout import TensorLayout
from ..redistribution.planner import plan_redistribution
from ..rules.base import pending_sums
from ..sharding import (RULES, check_even, made_by, plan_for, same_placement,
                        shared_replicas, wants_grids)
from ..strategy import is_sharded_layout, placement_conflict, stored_from_file
from .ir import CALL, MOVE, REDUCE, Graph, Node, Ref, Value, flatten_refs, map_leaves, verify

__all__ = ["insert_communication", "ParamPlan", "OpRun", "LoweringError"]


class LoweringError(ValueError):
    """A graph the static executor cannot place (named op and reason)."""


@dataclass(frozen=True)
class ParamPlan:
    """How a parameter enters the graph: ``layout`` (None: a whole value) and ``store``
    — on the first call a parameter not yet in that layout is stored there (its first
    sharded use); otherwise it lends a moved copy."""
    layout: Optional[TensorLayout]
    store: bool
    owner: str = ""


@dataclass(frozen=True)
class OpRun:
    """How an op node runs.

    mode     "global" (the op's kernel once on the global values of batch-split inputs),
             "rule" (the rule's local computation over the stacks), "once" (the same on
             one replica per replica set), "grids" (the same on device grids),
             "plain" (the kernel on whole values)
    plan     the rule's ShardPlan (global / rule / once)
    outputs  the layout of each output (None: a whole value)
    dm, reps the device matrix and the replicated axes ("once")
    stacked  per input, is it a stack of batch rows ("global": merged into the global value)
    """
    mode: str
    plan: Any = None
    outputs: tuple = ()
    dm: tuple = ()
    reps: tuple = ()
    stacked: tuple = ()


def _const_layout(c):
    v = c.value
    if isinstance(v, TensorBase) and isinstance(v._layout, TensorLayout):
        return v._layout
    return None


class _Lowering:
    def __init__(self, graph: Graph, n: int, arg_sources, some_devices: bool, name: str):
        self.g = graph
        self.n = n
        self.name = name
        self.some = some_devices
        self.values = graph.values()
        self.next_id = max(self.values, default=-1) + 1
        self.lay = {}                 # value id -> layout (None: a whole value)
        self.nodes = []
        self.moves = 0
        self.arg_sources = arg_sources or {}
        self.aliases = {}             # value id -> the id that replaced it (moved, reduced)
        self.current = None           # the node being lowered (what its moves are for)
        self.done = {}                # (value id, dst, ...) -> the Ref a MOVE made

    # ---- helpers -------------------------------------------------------------------
    def fresh(self, like: Value) -> Value:
        v = Value(self.next_id, like.shape, like.dtype)
        self.next_id += 1
        self.values[v.id] = v
        return v

    def move(self, ref, dst, cause, reason="redistribution", backward=False, grid=False,
             scale=None):
        """A MOVE node taking value `ref` into `dst`; returns the new Ref. `grid`: the
        result is the device grid ``dst.device_matrix + dst.local_shape`` (size 1 along
        the axes that split nothing), for a rule whose `local` accepts grids. `scale`:
        a factor applied after pending sums are resolved (a data-parallel gradient's,
        grad_reduce.replica_gradient_scale)."""
        src = self.input_layout(ref)
        if src == dst and not grid:
            return ref
        # a pending sum moved the same way for a second consumer (read by two ops that
        # are not linear in it, e.g. a gradient by both products of a MatMul's backward)
        # reuses the first move: resolved once, as the sum is one value
        key = (ref.id, dst, grid, scale, reason, backward) if isinstance(ref, Ref) and \
            src is not None and src.partial and reason != "gradient" else None
        done = self.done.get(key) if key is not None else None
        if done is not None:
            return done
        v = self.values[ref.id] if isinstance(ref, Ref) else _const_value(ref)
        kind, plan = "move", None
        if src is None:
            kind = "slice"                              # a whole value: local blocks only
        elif resolves_pending(src, dst):
            kind = "resolve"                            # an AllReduce of the pending sums
        elif dst is None:
            kind = "gather"
        elif src.device_num == dst.device_num:
            plan = plan_redistribution(src, dst, v.dtype.itemsize)
        if grid:
            kind = "grid"
        out = self.fresh(v)
        self.moves += 1
        attrs = {"src": src, "dst": dst, "kind": kind, "plan": plan, "cause": cause,
                 "reason": reason, "for": self.current}
        if scale is not None:
            attrs["scale"] = scale
        self.nodes.append(Node(MOVE, attrs, (ref,), (out,), f"Move-{self.moves}",
                               backward=backward))
        self.lay[out.id] = dst
        if key is not None:
            self.done[key] = Ref(out.id)
        return Ref(out.id)

    def resolve(self, ref, cause, backward):
        """`ref` with its pending sums AllReduced (a whole value when nothing else is
        split), as the eager dispatcher resolves them before a non-linear op."""
        src = self.lay[ref.id]
        rest = src.without_partial()
        return self.move(ref, None if not any(rest.tensor_map) else rest, cause,
                         reason=None, backward=backward)

    # ---- entry: arguments and parameters -------------------------------------------------
    def bind(self):
        g = self.g
        for k, v in enumerate(g.args):
            src = self.arg_sources.get(v.id)
            self.lay[v.id] = src if isinstance(src, TensorLayout) else None
            if src is not None and not isinstance(src, TensorLayout):
                raise LoweringError(
                    f"{self.name}: argument {k} holds per-device values "
                    f"({type(src).__name__}); a compiled graph places global tensors only, "
                    f"so call the function in PyNative mode")
        self.param_plans = {}
        # each parameter's consumers with layouts, in program order (one pass over the
        # nodes, not one per parameter: a 96-layer step has ~1,500 parameters)
        pids = {v.id for _, v in g.params}
        self.uses = {}
        for node in g.nodes:
            if node.in_layouts is None:
                continue
            for i, x in enumerate(node.inputs):
                if isinstance(x, Ref) and x.id in pids:
                    self.uses.setdefault(x.id, []).append((node, i))
        for k, (p, v) in enumerate(g.params):
            self.param_plans[v.id] = plan = self._param_plan(k, p, v)
            self.lay[v.id] = plan.layout

    def _param_plan(self, k, p, v) -> ParamPlan:
        g = self.g
        stored = p._layout
        if stored is not None and not isinstance(stored, TensorLayout):
            raise LoweringError(
                f"{self.name}: parameter {p.name} holds per-device values "
                f"({type(stored).__name__}, layerwise_parallel); a compiled graph places "
                f"global tensors only, so call the function in PyNative mode")
        if stored_from_file(p):     # strategy_ckpt_load_file wins; consumers get copies
            return ParamPlan(stored, False)
        storable = not p.layerwise_parallel
        configured = []
        if g.param_layouts and g.param_layouts[k] is not None:
            configured.append((g.param_layouts[k], f"parameter_plan[{p.name!r}]"))
        propagated = []
        for node, i in self.uses.get(v.id, ()):
            need = node.in_layouts[i]
            if need is None:
                continue
            if node.op_name == "Redistribute":
                configured.append((need, node.attrs.get("owner", node.name)))
            elif node.op != CALL:
                propagated.append(need)
        target, target_owner = None, None
        for lay, owner in configured:
            if is_sharded_layout(lay):
                target, target_owner = lay, owner
                break
        if target is None and not configured and stored is None:
            target = next((lay for lay in propagated if is_sharded_layout(lay)), None)
        if target is None or not storable:
            return ParamPlan(stored, False)
        if stored is not None and stored != target:
            if not same_placement(stored, target):
                if configured:
                    raise placement_conflict(p, target, target_owner)
                return ParamPlan(stored, False)
        # every configured consumer must agree with the storage (as in PyNative mode)
        for lay, owner in configured:
            if is_sharded_layout(lay) and lay != target and not same_placement(lay, target):
                raise placement_conflict(p, lay, owner, stored_as=target, owner=target_owner)
        return ParamPlan(target, True, target_owner)

    # ---- ops ---------------------------------------------------------------------------
    def lower(self) -> Graph:
        self.bind()
        g = self.g
        self.current = "input"
        for k, v in enumerate(g.args):
            need = g.arg_layouts[k] if g.arg_layouts else None
            if need is not None:
                ref = self.move(Ref(v.id), need, self.name)
                if ref.id != v.id:
                    self.alias(v.id, ref.id)
        for node in g.nodes:
            self.lower_node(node)
        self.current = "output"
        outputs = self.rename(g.outputs)
        leaves = flatten_refs(outputs)
        if g.out_layouts:
            moved = {}
            for leaf, need in zip(leaves, g.out_layouts):
                if need is not None and isinstance(leaf, Ref):
                    moved[id(leaf)] = self.move(leaf, need, self.name)
            outputs = map_leaves(outputs, lambda r: moved.get(id(r), r))
        meta = dict(g.meta)
        meta["layouts"] = dict(self.lay)
        meta["params"] = self.param_plans
        return verify(g.replace(nodes=tuple(self.nodes), outputs=outputs, meta=meta))

    def alias(self, old, new):
        self.aliases[old] = new

    def ref(self, x):
        if isinstance(x, Ref) and x.id in self.aliases:
            return Ref(self.aliases[x.id])
        return x

    def rename(self, tree):
        return map_leaves(tree, self.ref)

    def input_layout(self, x):
        if isinstance(x, Ref):
            return self.lay[x.id]
        return _const_layout(x)

    def lower_node(self, node: Node):
        self.current = node.name
        ins = [self.ref(x) for x in node.inputs]
        bw = node.backward
        if node.op == CALL:
            self.done.clear()                 # nothing moved before an update is reused
            self.nodes.append(node.replace(inputs=tuple(self.gradient_moves(node, ins))))
            return
        if node.op_name == "Redistribute":           # a strategy's move
            need = node.in_layouts[0] if node.in_layouts is not None else None
            x = ins[0]
            if not isinstance(x, Ref) and need is None:
                need = self.input_layout(x)
            ref = self.move(x, need, node.attrs.get("owner", node.name), backward=bw) \
                if need is not None or not isinstance(x, Ref) else x
            if not isinstance(ref, Ref):                # a constant, moved nowhere
                ref = self.relabel(ref, need)
            self.alias(node.outputs[0].id, ref.id)
            return
        cause = node.op_name
        if node.in_layouts is not None:                # configured or propagated layouts
            for i, need in enumerate(node.in_layouts):
                if need is not None and isinstance(ins[i], Ref):
                    ins[i] = self.move(ins[i], need, cause, backward=bw)
        if node.op_name not in RULES:
            raise LoweringError(f"{self.name}: op {node.op_name} ({node.name}) has no "
                                f"sharding rule, so a sharded graph cannot place it; call "
                                f"it outside the compiled function (in PyNative mode)")
        op = node.op
        lays = [self.input_layout(x) for x in ins]
        if any(lay is not None and lay.partial for lay in lays):
            if pending_sums(op, node.attrs, lays) is not None:
                run = self.rule_run(node, ins, lays)
                if run is not None:             # still the sums of the op that made them
                    return self.emit(node, ins, run, made_by(lays))
            for i, lay in enumerate(lays):
                if lay is not None and lay.partial:
                    if not isinstance(ins[i], Ref):
                        raise LoweringError(f"{self.name}: {node.name} reads a constant "
                                            f"holding pending sums; compute it inside the "
                                            f"function")
                    ins[i] = self.resolve(ins[i], cause, bw)
            lays = [self.input_layout(x) for x in ins]
        if all(lay is None for lay in lays):
            return self.emit(node, ins, OpRun("plain", outputs=(None,) * len(node.outputs)))
        dist = [lay for lay in lays if lay is not None]
        if all(is_batch_layout(lay) for lay in dist) and not self.some:
            run = self.global_run(node, ins, lays)
            if run is not None:
                return self.emit(node, ins, run)
        run = self.rule_run(node, ins, lays)
        if run is not None:
            return self.emit(node, ins, run)
        # no rule for these layouts: every distributed input gathered whole
        for i, lay in enumerate(lays):
            if lay is not None:
                ins[i] = self.move(ins[i], None, cause, backward=bw)
        return self.emit(node, ins, OpRun("plain", outputs=(None,) * len(node.outputs)))

    def gradient_moves(self, node, ins):
        """An optimizer update's gradients moved where the update reads them, as the
        optimizer would move them eagerly: a sharded weight's gradient into the weight's
        layout; a data-parallel gradient resolved (its AllReduce, scaled as the eager
        optimizer scales it: grad_reduce.replica_gradient_scale); another distributed
        gradient of a weight kept whole gathered whole. The update then communicates
        nothing, and the fusion pass can bucket the AllReduces."""
        params = node.attrs.get("params")
        if not params:
            return ins
        plans = {id(p): self.param_plans[v.id] for p, v in self.g.params}
        for i, (x, p) in enumerate(zip(ins, params)):
            plan = plans.get(id(p))
            lay = self.lay[x.id] if isinstance(x, Ref) else None
            if lay is None or plan is None or p.layerwise_parallel or not p.requires_grad:
                continue
            target = plan.layout
            sliced = shard_layout(p, target)
            if sliced is not None:
                # the parallel optimizer: into the weight's optimizer slices (its
                # ReduceScatter), where the update reads it. (Graphs are compiled in
                # semi_auto/auto parallel, where replica_gradient_scale is None.)
                if lay != sliced:
                    ins[i] = self.move(x, sliced, p.name, reason="gradient", backward=True)
            elif target is not None and is_sharded_layout(target):
                if lay != target:
                    ins[i] = self.move(x, target, p.name, reason="gradient", backward=True)
            elif target is None and is_dp_partial(lay):
                ins[i] = self.move(x, None, p.name, reason="gradient", backward=True,
                                   scale=replica_gradient_scale(self.n))
            else:
                ins[i] = self.move(x, None, p.name, reason="gradient", backward=True)
        return ins

    def _specs(self, node, ins, lays):
        specs, dtypes = [], []
        for x, lay in zip(ins, lays):
            if isinstance(x, Ref):
                v = self.values[x.id]
                specs.append(lay if lay is not None else v.shape)
                dtypes.append(v.dtype)
            elif isinstance(x.value, TensorBase):
                specs.append(lay if lay is not None else tuple(x.value.shape))
                dtypes.append(x.value.dtype)
            else:
                arr = np.asarray(x.value)
                specs.append(arr.shape if arr.ndim > 0 else None)
                dtypes.append(arr.dtype)
        return specs, dtypes

    def found_plan(self, node, ins, lays):
        specs, dtypes = self._specs(node, ins, lays)
        # a rule that does not handle pieces of unequal size refuses them by name, as in
        # PyNative mode (a rule declining these layouts gathers them, which is not that)
        check_even(RULES[node.op_name], node.op_name,
                   [s if isinstance(s, TensorLayout) else None for s in specs])
        try:
            return plan_for(node.op, node.attrs, specs, dtypes)
        except (ValueError, TypeError):
            return None

    def global_run(self, node, ins, lays):
        found = self.found_plan(node, ins, lays)
        if found is None:
            return None
        plan, rlays, dm, _ = found
        if plan.post:
            return None
        for x, have, need, orig in zip(ins, rlays, plan.inputs, lays):
            if need is not None and (need.partial or (orig is not None and need != have)):
                return None
        return OpRun("global", plan, _stored(plan),
                     stacked=tuple(lay is not None for lay in lays))

    def rule_run(self, node, ins, lays):
        found = self.found_plan(node, ins, lays)
        if found is None:
            return None
        plan, rlays, dm, _ = found
        if self.wants_grids(plan, rlays, dm):
            # inputs moved into layouts that repeat over some axes arrive as device grids
            # (size 1 where they repeat): the replicas are neither written nor computed
            for i, (have, need) in enumerate(zip(rlays, plan.inputs)):
                if lays[i] is not None and have == need:
                    ins[i] = self.relabel(ins[i], need, kind="gridview", backward=node.backward)
                else:
                    ins[i] = self.move(ins[i], need, node.op_name, backward=node.backward,
                                       grid=True)
            return OpRun("grids", plan, _stored(plan), dm)
        for i, (have, need) in enumerate(zip(rlays, plan.inputs)):
            if need is None:
                continue
            if lays[i] is None or have != need:
                ins[i] = self.move(ins[i], need, node.op_name, backward=node.backward)
            elif lays[i] != need:
                # the same placement over the op's device matrix: relabel, no data
                ins[i] = self.relabel(ins[i], need, backward=node.backward)
        reps = shared_replicas(RULES[node.op_name], plan, dm)
        return OpRun("once" if reps else "rule", plan, _stored(plan), dm, reps)

    def wants_grids(self, plan, rlays, dm) -> bool:
        """As in PyNative mode (:func:`~dualmode.parallel.sharding.wants_grids`), when
        this process holds every device."""
        return not self.some and wants_grids(plan, rlays, dm)

    def relabel(self, ref, lay, kind="view", backward=False):
        """`ref` viewed in `lay` (the same blocks over a refined device matrix): a MOVE
        of kind "view" that copies nothing ("gridview": reshaped to the device grid)."""
        v = self.values[ref.id] if isinstance(ref, Ref) else _const_value(ref)
        out = self.fresh(v)
        self.moves += 1
        self.nodes.append(Node(MOVE, {"src": self.input_layout(ref), "dst": lay, "kind": kind,
                                      "plan": None, "cause": None, "reason": None,
                                      "for": self.current},
                               (ref,), (out,), f"Move-{self.moves}", backward=backward))
        self.lay[out.id] = lay
        return Ref(out.id)

    def emit(self, node, ins, run: OpRun, maker=None):
        """`node` with its inputs `ins` and `run`; `maker`: the op that made the pending
        sums an op linear in them keeps (its outputs' layouts name it)."""
        self.nodes.append(node.replace(inputs=tuple(ins), run=run, in_layouts=node.in_layouts))
        for v, lay in zip(node.outputs, run.outputs):
            self.lay[v.id] = lay if maker is None or lay is None or not lay.partial \
                else lay.with_partial_op(maker)
        plan = run.plan
        if plan is not None and any(p is not None for p in plan.post):
            for j, post in enumerate(plan.post):
                if post is None:
                    continue
                v = node.outputs[j]
                out = self.fresh(v)
                red_op, axes = post
                lay = plan.outputs[j]
                dst = None if not lay.partial and not any(lay.tensor_map) else lay
                self.nodes.append(Node(REDUCE, {"op": red_op, "axes": tuple(axes),
                                                "layout": lay, "dst": dst,
                                                "cause": node.op_name},
                                       (Ref(v.id),), (out,), f"{node.name}/AllReduce-{j}",
                                       backward=node.backward))
                self.lay[out.id] = dst
                self.alias(v.id, out.id)
        if node.out_layouts is not None:
            for j, need in enumerate(node.out_layouts):
                if need is not None:
                    ref = self.move(self.ref(Ref(node.outputs[j].id)), need, node.op_name,
                                    backward=node.backward)
                    self.alias(node.outputs[j].id, ref.id)


def _stored(plan) -> tuple:
    """The layout each output of `plan` is kept in: None for a replicated result (one
    whole value), unless a collective still has to finish it."""
    posts = plan.post or (None,) * len(plan.outputs)
    return tuple(None if post is None and not lay.partial and not any(lay.tensor_map)
                 else lay for lay, post in zip(plan.outputs, posts))


def _const_value(c) -> Value:
    v = c.value
    if isinstance(v, TensorBase):
        return Value(-1, tuple(v.shape), v.dtype)
    return Value(-1, tuple(np.shape(v)), np.asarray(v).dtype)


def insert_communication(graph: Graph, n: int, *, arg_sources=None, some_devices=False,
                         name="graph") -> Graph:
    """The graph with every communication an IR node and every op node's ``run`` set
    (see the module docstring)."""
    return _Lowering(graph, n, arg_sources, some_devices, name).lower()
