"""The executor of a lowered graph (lower.py): it runs the IR, nothing else.

Every value lives in an environment as this process's stack of shards (or, for a
value whose layout is None, the one whole value) — plain numpy arrays, no Tensor
objects, no tape, no layout decided at run time. A stack whose whole value is known
may stay unwritten (a deferred stack, :mod:`dualmode.communication.totals`) while only
moves read it; every other step gets it written. Each node is one step:

* MOVE: the redistribution plan made at compile time, run through the backend
  (collectives recorded for CommReport; the AllReduce / ReduceScatter resolving a
  pending sum under the op that made it, the source layout's ``partial_op``), or a
  local slice / view;
* REDUCE: one AllReduce through the backend;
* FUSED, FUSED_RS, FUSED_AG: one AllReduce / ReduceScatter for a bucket of gradients,
  one AllGather for a bucket of parameters (fuse.py);
* an op: its kernel on the global values ("global", "plain") or its sharding rule's
  local computation on the stacks ("rule", "once");
* CALL: the opaque call (an optimizer update), given Tensors and the Parameters.

:meth:`Program.run` can stop after a node and resume from a saved environment: a
compiled block differentiated by its caller runs the forward nodes, keeps the
environment, and runs the backward nodes (derived once at compile time) when the
caller's tape asks for the gradients.

Binding and running take every array's data from graph mode's buffer pool
(buffers.py), so a step's large buffers are the blocks the step before freed.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..._core import _tensor as _core
from ..._core._tensor import Deferred, TensorBase, written
from ...communication.totals import DEFERRING, as_stack, stored
from ...communication.trace import pending_sum
from ..buffers import pooled
from ..devices import backend as _backend
from ..devices import op_cause, op_reason
from ..dtensor import batch_global_outputs
from ..moves import gather_stack
from ..redistribution.executor import execute, run_plan_grid
from ..redistribution.planner import plan_redistribution
from ..moves import local_stack, move_stack, redistribute_tensor
from ..sharding import (RULES, linear_on_totals, once_per_replica_set, replica_grid,
                        run_kernel, run_local, stack_grid, zero_output_pads)
from ..strategy import _to
from .ir import (CALL, FUSED, FUSED_AG, FUSED_RS, MOVE, REDUCE, Ref, flatten_refs,
                 map_leaves)

__all__ = ["Program"]

#: the steps that are one collective through the backend (their inputs are written)
_COLLECTIVES = frozenset((REDUCE, FUSED, FUSED_RS, FUSED_AG))


def _const(x):
    """The value a Const input contributes: an array, a stack, or a Python number."""
    v = x.value
    if isinstance(v, TensorBase):
        return v._data if v._layout is not None else v._value()
    return v


class Program:
    """A lowered graph, ready to run."""

    def __init__(self, graph):
        self.graph = graph
        self.layouts = graph.meta["layouts"]
        self.param_plans = graph.meta["params"]
        self.name = graph.meta.get("name", "graph")
        self.params = {v.id: p for p, v in graph.params}   # what Call nodes are given
        self.steps = tuple(step + (done,) for step, done in
                           zip(self._prepare(graph), _releases(graph)))

    def _prepare(self, graph):
        for node in graph.nodes:
            ins = tuple((True, x.id) if isinstance(x, Ref) else (False, _const(x))
                        for x in node.inputs)
            outs = tuple(v.id for v in node.outputs)
            gradient = node.op == MOVE and node.attrs["reason"] == "gradient"
            reason = "gradient" if gradient else "backward" if node.backward else None
            if node.op in (MOVE, REDUCE):
                yield (node.op, node.attrs, ins, outs, reason)
            elif node.op == FUSED:
                yield (FUSED, node.attrs, ins, outs, "gradient")
            elif node.op in (FUSED_RS, FUSED_AG):
                yield (node.op, node.attrs, ins, outs, node.attrs["reason"])
            elif node.op == CALL:
                yield (CALL, node.attrs, ins, outs,
                       tuple(self.layouts.get(x.id) if isinstance(x, Ref) else None
                             for x in node.inputs))
            else:
                yield (node.run.mode, node, ins, outs, reason)

    # ---- binding -----------------------------------------------------------------------
    def bind(self, args, params_by_id=None):
        """The environment holding the arguments and parameters (a parameter moved to
        its planned layout takes its buffers from the buffer pool, as :meth:`run`)."""
        with pooled():
            return self._bind(args)

    def _bind(self, args):
        g = self.graph
        env = {}
        for v, x in zip(g.args, args):
            env[v.id] = x._data if self.layouts[v.id] is not None else x._value()
        for p, v in g.params:
            plan = self.param_plans[v.id]
            lay = plan.layout
            if p._layout == lay:
                val = p
            elif plan.store:
                val = _to(p, lay, plan.owner)          # its first sharded use
            elif lay is None:
                val = _core.wrap_dist(gather_stack(p._data, p._layout, self.name), None)
            else:
                val = _core.wrap_dist(redistribute_tensor(p, lay, self.name), lay)
            # as stored: a Parameter's replicas stored once stay so (parallel/replicas.py)
            env[v.id] = stored(val) if lay is not None else val._value()
        return env

    # ---- running -----------------------------------------------------------------------
    def run(self, env, start=0, stop=None, keep=False):
        """Run the steps ``start:stop`` on `env` (value id -> stack or whole value) and
        return it. A value is dropped from `env` after its last reader (its memory goes
        back to the allocator for the next values of the step) unless it is an output
        of the graph, or `keep` (every value kept, for inspection).

        Every array the steps allocate takes its data from the buffer pool
        (:func:`~dualmode.parallel.buffers.pooled`): the next run's large buffers are
        the blocks this one freed."""
        with pooled():
            return self._run(env, start, stop, keep)

    def _run(self, env, start, stop, keep):
        steps = self.steps if stop is None and start == 0 else self.steps[start:stop]
        for kind, what, ins, outs, extra, done in steps:
            xs = [env[x] if is_ref else x for is_ref, x in ins]
            if kind == MOVE:
                with DEFERRING:           # blocks of a known value: written if read
                    env[outs[0]] = _move(what, xs[0], extra)
            elif kind == CALL:              # Tensors: a deferred stack is written if read
                what["fn"](*self._tensors(ins, xs, extra))
            elif kind not in _COLLECTIVES:
                with DEFERRING:             # "once" reads a known value's replica itself
                    res = _on_totals(what, xs) if kind == "rule" else None
                    if res is None:
                        res = _run_op(kind, what, xs if kind == "once" else written(xs),
                                      extra)
                for vid, o in zip(outs, res):
                    env[vid] = o
            else:
                self._collective(kind, what, written(xs), outs, extra, env)
            if done and not keep:
                for vid in done:
                    del env[vid]
        return env

    @staticmethod
    def _collective(kind, what, xs, outs, extra, env):
        """REDUCE, FUSED, FUSED_RS, FUSED_AG: one collective through the backend."""
        if kind == REDUCE:
            lay = what["layout"]
            with op_cause(what["cause"], extra):
                out = np.asarray(_backend().all_reduce(
                    xs[0], members=lay.group_members(what["axes"]), op=what["op"]))
            env[outs[0]] = out if what["dst"] is not None else np.asarray(out[0])
        elif kind == FUSED:
            src = what["src"]
            with op_cause(what["cause"], extra):
                res = _backend().all_reduce_fused(
                    xs, members=src.group_members(src.partial), op="sum")
            for vid, out, dst, scale in zip(outs, res, what["dsts"], what["scales"]):
                env[vid] = _scaled(out if dst is not None else np.asarray(out[0]), scale)
        elif kind == FUSED_RS:
            with op_cause(what["cause"], extra):
                res = _backend().reduce_scatter_fused(xs, what["members"], what["axes"])
            for vid, out in zip(outs, res):
                env[vid] = out
        elif kind == FUSED_AG:
            with op_cause(what["cause"], extra):
                res = _backend().all_gather_fused(xs, what["members"], what["axes"])
            for vid, out in zip(outs, res):
                env[vid] = out

    def _tensors(self, ins, xs, lays):
        out = []
        for (is_ref, x), val, lay in zip(ins, xs, lays):
            if is_ref and x in self.params:
                out.append(self.params[x])        # the optimizer updates the Parameter
            elif is_ref:
                out.append(_core.wrap_dist(val, lay))
            else:
                out.append(val)
        return out

    def outputs(self, env, tree=None):
        """The graph's output structure with Tensors for its values."""
        lays = self.layouts
        return map_leaves(self.graph.outputs if tree is None else tree,
                          lambda x: _core.wrap_dist(env[x.id], lays[x.id])
                          if isinstance(x, Ref) else x.value)


def _releases(graph):
    """Per node, the ids of the values no later node reads (its inputs read for the
    last time, its outputs nobody reads), outputs of the graph excepted: what the
    executor drops after running it."""
    kept = {x.id for x in flatten_refs(graph.outputs) if isinstance(x, Ref)}
    last = {}
    for k, node in enumerate(graph.nodes):
        for v in node.outputs:
            last[v.id] = k
        for x in node.inputs:
            if isinstance(x, Ref):
                last[x.id] = k
    out = [[] for _ in graph.nodes]
    for vid, k in last.items():
        if vid not in kept:
            out[k].append(vid)
    return [tuple(ids) for ids in out]


def _move(attrs, x, reason):
    src = attrs["src"]
    if src is not None and src.partial:     # reported under the op that made the sums
        with pending_sum(src.partial_op):
            return _move_value(attrs, x, reason)
    return _move_value(attrs, x, reason)


def _move_value(attrs, x, reason):
    kind = attrs["kind"]
    if kind == "view":
        return x
    dst = attrs["dst"]
    if kind == "gridview":
        return stack_grid(x, dst)
    if kind == "grid":
        if attrs["src"] is None:
            return dst.local_blocks_grid(np.asarray(x))
        plan = attrs["plan"]
        grid = None if plan is None else run_plan_grid(plan, x, op_name=attrs["cause"],
                                                       reason=attrs["reason"])
        if grid is None:            # pending sums or another device count: whole stacks
            grid = (execute(plan, x, op_name=attrs["cause"], reason=attrs["reason"])
                    if plan is not None else move_stack(x, attrs["src"], dst, attrs["cause"],
                                                        attrs["reason"]))
            grid = as_stack(grid).reshape(dst.device_matrix + dst.local_shape)
        return grid
    if kind == "slice":
        return local_stack(np.asarray(x), attrs["dst"])
    cause = attrs["cause"]
    if kind == "resolve":
        src, dst = attrs["src"], attrs["dst"]
        if isinstance(x, Deferred) and attrs.get("scale") is None and dst is not None \
                and dst == src.without_partial():
            # pending sums whose totals are known: the same AllReduce recorded, the
            # result's blocks read from the totals (written only if read)
            return execute(plan_redistribution(src, dst, x.itemsize), x, op_name=cause,
                           reason=op_reason(reason))
        with op_cause(cause, reason):
            out = np.asarray(_backend().all_reduce(as_stack(x),
                                                   members=src.group_members(src.partial),
                                                   op="sum"))
        return _scaled(out if attrs["dst"] is not None else np.asarray(out[0]),
                       attrs.get("scale"))
    if kind == "gather":
        with op_cause(cause, reason):
            # a gradient gathered whole for the update: all its collectives are the
            # gradient's; otherwise the resolve is the pass's, the gathers redistribution
            return gather_stack(as_stack(x), attrs["src"], cause,
                                "gradient" if reason == "gradient" else None)
    plan = attrs["plan"]
    if plan is not None:
        return execute(plan, x, op_name=cause, reason=attrs["reason"])
    return move_stack(x, attrs["src"], attrs["dst"], cause, attrs["reason"])


def _scaled(x, scale):
    """A resolved data-parallel gradient times its factor (None: 1; the rule is
    grad_reduce.replica_gradient_scale)."""
    return x if scale is None else np.multiply(x, scale, dtype=x.dtype)


_NO_CONTEXT = contextlib.nullcontext()


def _on_totals(node, xs):
    """An op linear in pending sums whose totals its inputs know, run once per group of
    devices on the totals (:func:`~dualmode.parallel.sharding.linear_on_totals`, as in
    PyNative mode), or None."""
    run = node.run
    if run.plan.post:
        return None
    with op_cause(node.op.name, None):
        return linear_on_totals(node.op, node.attrs, run.plan, run.dm, xs)


def _run_op(mode, node, xs, reason):
    op, attrs, run = node.op, node.attrs, node.run
    if mode == "plain":
        out = run_kernel(op, attrs, [np.asarray(x) if isinstance(x, np.generic) else x
                                     for x in xs])
        return out if op.multi_output else (out,)
    plan = run.plan
    if mode == "global":
        merged = [x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
                  if stacked else x for x, stacked in zip(xs, run.stacked)]
        with op_cause(op.name, reason):
            arrays, _ = batch_global_outputs(run_kernel(op, attrs, merged), op, plan, merged)
        return arrays
    quiet = np.errstate(all="ignore") if not plan.even_inputs else _NO_CONTEXT
    with op_cause(op.name, reason), quiet:       # the pads (zeros) may meet log, 1/x, ...
        if mode == "grids":
            out = plan.local(attrs, xs)
            outs = list(out) if op.multi_output else [out]
        elif mode == "once":
            stacks = [replica_grid(x, need, run.dm, run.reps) if need is not None else x
                      for x, need in zip(xs, plan.inputs)]
            outs = once_per_replica_set(op, attrs, plan, stacks, run.dm, run.reps)
        else:
            outs = run_local(RULES[op.name], op, attrs, plan, xs)
        if not plan.even_outputs:
            zero_output_pads(plan, outs)
    return [o if lay is not None else np.asarray(o[0])
            for o, lay in zip(outs, run.outputs)]
