"""Compiling a traced graph, and running it.

Passes (each returns a new, verified Graph):

1. :func:`apply_strategies` — ``in_strategy`` / ``out_strategy`` / ``parameter_plan``
   of ``ops.shard`` and the strategies of Primitives become layouts: ``Graph.arg_layouts``,
   ``Graph.param_layouts``, ``Graph.out_layouts`` and ``Node.in_layouts/out_layouts``.
2. :func:`propagate_strategies` — (``sharding_propagation``) every forward op without a
   strategy gets one: candidates from the op's sharding rule (candidates.py), costs from
   the alpha-beta model over the rules' collectives and the redistribution planner's
   byte counts (cost.py), choices by the context's ``search_mode`` (search.py: the
   propagation kernel, exact dynamic programming, or recursive programming).
   Configured strategies are fixed points. In ``semi_auto`` mode this pass is skipped:
   an op without a strategy runs data parallel on whatever layout reaches it, exactly as
   in PyNative mode.
3. :func:`~.lower.insert_communication` — every value's layout is now known, so each
   redistribution, pending-sum AllReduce and rule collective becomes an IR node (MOVE,
   REDUCE) and each op node records how it runs on the stacks (lower.py).
4. :func:`~.fuse.fuse_communication` — the gradient AllReduces lowering put before an
   optimizer update are packed into buckets per the ``comm_fusion`` /
   ``all_reduce_fusion_config`` settings: one FUSED node (one collective) per bucket,
   the buckets the eager optimizer would make; likewise the gradient ReduceScatters
   (``comm_fusion["reducescatter"]``, FUSED_RS) and the AllGathers of sharded
   parameters (``comm_fusion["allgather"]``, FUSED_AG, hoisted to the first member).
5. :func:`derive_backward` — for a graph without its own backward nodes, the
   vector-Jacobian product of the graph, traced once and lowered like the forward (its
   parameter AllGathers fused as in 4.): what runs when a caller differentiates through
   the block.

The executor (executor.py) runs the lowered IR on this process's stacks. A graph that is
not sharded runs its nodes through the dispatcher on whole values.
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from ..._core import _tensor as _core
from ..._core._tensor import KIND_GENERIC, OpDef, TensorBase
from ...autograd import vjp
from ...tensor import Tensor
from ..moves import gather_stack
from ..tensor_layout import TensorLayout
from ..moves import redistribute_tensor
from ..report import compiled_comm_times
from ..sharding import RULES, common_device_matrix, reexpress
from .candidates import op_candidates
from .cost import CostModel, allreduce_cost, redistribution_cost
from ..devices import some_devices
from .executor import Program
from .ir import (CALL, FUSED, FUSED_AG, FUSED_RS, MOVE, REDUCE, Const, Graph, Ref,
                 flatten_refs, map_leaves, verify)
from .fuse import fuse_communication, fuse_parameter_gathers
from .lower import insert_communication
from .search import PlanTable, search
from .trace import trace

__all__ = ["apply_strategies", "propagate_strategies",
           "CompiledGraph", "compile_graph"]


# ---------------------------------------------------------------------------
# pass 1: configured strategies -> layouts
# ---------------------------------------------------------------------------
def _layout_of(strategy, shape, n, owner, index, param):
    if strategy is None:
        return None
    return TensorLayout.from_strategy(strategy, tuple(shape), n, owner, index, param=param)


def _tensor_inputs(node, values):
    """Indices of a node's inputs that are tensors of rank >= 0 taken by its strategy."""
    out = []
    for i, x in enumerate(node.inputs):
        if isinstance(x, Ref):
            out.append(i)
        elif isinstance(x.value, (TensorBase, np.ndarray)):
            out.append(i)
    return out


def _dtypes(node, values):
    """The dtype of each input of `node` (graph values and constants alike)."""
    return [values[x.id].dtype if isinstance(x, Ref) else
            np.asarray(x.value._value() if isinstance(x.value, TensorBase)
                       else x.value).dtype for x in node.inputs]


def _shape_of(x, values):
    if isinstance(x, Ref):
        return values[x.id].shape
    return tuple(np.shape(x.value._value() if isinstance(x.value, TensorBase) else x.value))


def apply_strategies(graph: Graph, n: int, *, name="ops.shard", in_strategy=None,
                     out_strategy=None, parameter_plan=None) -> Graph:
    values = graph.values()
    arg_layouts = tuple(_layout_of(s, v.shape, n, name, k, "in_strategy")
                        for k, (s, v) in enumerate(zip(in_strategy or (None,) * len(graph.args),
                                                       graph.args)))
    plan = dict(parameter_plan or {})
    param_layouts = []
    for p, v in graph.params:
        s = plan.pop(p.name, None)
        if isinstance(s, tuple):
            if len(s) != len(v.shape):
                raise ValueError(f"{name}: parameter_plan[{p.name!r}]={s} has {len(s)} "
                                 f"entries but parameter {p.name} has rank {len(v.shape)} "
                                 f"(shape {v.shape})")
            for d, (k, size) in enumerate(zip(s, v.shape)):
                if 0 < size < k:
                    raise ValueError(f"{name}: parameter_plan[{p.name!r}][{d}]={k} exceeds "
                                     f"dim {d} (size {size}) of parameter {p.name}: some "
                                     f"devices would hold an empty piece")
        param_layouts.append(_layout_of(s, v.shape, n, f"{name}: parameter_plan[{p.name!r}]",
                                        0, "parameter_plan") if s is not None else None)
    for unknown in plan:
        warnings.warn(f"{name}: parameter_plan names {unknown!r}, which the function does "
                      f"not use; known parameters: {[p.name for p, _ in graph.params]}",
                      stacklevel=4)
    leaves = flatten_refs(graph.outputs)
    out_layouts = ()
    if out_strategy is not None:
        if len(out_strategy) != len(leaves):
            raise ValueError(f"{name}: out_strategy has {len(out_strategy)} entries but the "
                             f"function returns {len(leaves)} tensor(s); give one strategy "
                             f"(or None) per output")
        out_layouts = tuple(_layout_of(s, _shape_of(x, values), n, name, k, "out_strategy")
                            for k, (s, x) in enumerate(zip(out_strategy, leaves)))
    nodes = []
    moved_to = {}               # value id -> the layout a strategy's move gave it
    for node in graph.nodes:
        if node.op_name == "Redistribute":          # a strategy's move
            a = node.attrs
            lay = a.get("layout") or _layout_of(a["strategy"], node.outputs[0].shape, n,
                                                a["owner"], a["index"], a["param"])
            nodes.append(node.replace(in_layouts=(lay,)))
            if a.get("param") == "in_strategy":
                moved_to[node.outputs[0].id] = lay
            continue
        if node.op != CALL and node.op_name not in RULES:
            raise ValueError(f"{name}: op {node.op_name} ({node.name}) has no sharding rule, "
                             f"so a sharded graph cannot place it; call it outside the "
                             f"compiled function (in PyNative mode)")
        if node.strategy is not None:
            ins, outs = node.strategy
            in_lays = None
            if ins is not None:
                idx = _tensor_inputs(node, values)
                if len(idx) != len(ins):
                    # Python numbers the op made 0-d constants (OneHot's on/off values)
                    # have no entry, as at the call
                    shaped = [i for i in idx if isinstance(node.inputs[i], Ref)
                              or np.ndim(node.inputs[i].value) > 0]
                    idx = shaped if len(shaped) == len(ins) else idx
                if len(idx) != len(ins):
                    raise ValueError(f"{node.op_name}: in_strategy has {len(ins)} entries but "
                                     f"the op got {len(idx)} tensor inputs")
                lays = [None] * len(node.inputs)
                for k, i in enumerate(idx):
                    x = node.inputs[i]
                    # the op's layouts over ONE device matrix, as its strategy's moves
                    # (recorded at trace time) placed them; else the entry's own layout
                    moved = moved_to.get(x.id) if isinstance(x, Ref) else None
                    lays[i] = moved if moved is not None else _layout_of(
                        ins[k], _shape_of(x, values), n, node.op_name, k, "in_strategy")
                in_lays = tuple(lays)
            out_lays = None
            if outs is not None:
                if len(outs) != len(node.outputs):
                    raise ValueError(f"{node.op_name}: out_strategy has {len(outs)} entries but "
                                     f"the op has {len(node.outputs)} output(s)")
                out_lays = tuple(_layout_of(s, v.shape, n, node.op_name, k, "out_strategy")
                                 for k, (s, v) in enumerate(zip(outs, node.outputs)))
            node = node.replace(in_layouts=in_lays, out_layouts=out_lays)
        nodes.append(node)
    return verify(graph.replace(nodes=tuple(nodes), arg_layouts=arg_layouts,
                                param_layouts=tuple(param_layouts), out_layouts=out_layouts))


# ---------------------------------------------------------------------------
# static layouts: what each value's layout is, where the rules tell
# ---------------------------------------------------------------------------
def _replicated(shape, n):
    return TensorLayout.replicated(tuple(shape), (n,))


def _rule_outputs(node, in_lays, dtypes):
    """The output layouts the op's sharding rule gives for `in_lays`, or None."""
    rule = RULES.get(node.op_name)
    if rule is None or any(lay is None for lay, x in zip(in_lays, node.inputs)
                           if isinstance(x, Ref)):
        return None
    dm = common_device_matrix([lay for lay in in_lays if lay is not None])
    lays = []
    for lay, x in zip(in_lays, node.inputs):
        if lay is not None:
            lays.append(reexpress(lay, dm))
        elif isinstance(x, Const) and np.ndim(x.value) > 0:
            # a constant array (e.g. the ones a backward pass starts from) is whole on
            # every device, as eager sharded calls take it; its shape counts
            lays.append(TensorLayout.replicated(np.shape(x.value), dm))
        else:
            lays.append(None)
    try:
        plan = rule(node.attrs, lays, dtypes)
    except (ValueError, TypeError):
        return None
    return plan


def _input_layouts(graph, n, arg_sources):
    """value id -> its layout on entry (arguments and parameters)."""
    known = {}
    for k, v in enumerate(graph.args):
        lay = graph.arg_layouts[k] if graph.arg_layouts else None
        if lay is None:
            lay = arg_sources.get(v.id)
        known[v.id] = lay if isinstance(lay, TensorLayout) else _replicated(v.shape, n)
    for k, (p, v) in enumerate(graph.params):
        lay = graph.param_layouts[k] if graph.param_layouts else None
        if lay is None:
            lay = p._layout if isinstance(p._layout, TensorLayout) else None
        known[v.id] = lay if lay is not None else _replicated(v.shape, n)
    return known


# ---------------------------------------------------------------------------
# pass 2: sharding propagation
# ---------------------------------------------------------------------------
def propagate_strategies(graph: Graph, n: int, *, arg_sources=None, impl="cython",
                         fully_use_devices=False) -> Graph:
    model = CostModel()
    values = graph.values()
    known = _input_layouts(graph, n, arg_sources or {})
    trained = {v.id for p, v in graph.params if p.requires_grad}
    # pseudo-nodes: one per argument / parameter (a single fixed candidate)
    cand_in, cand_out, node_costs, fixed, labels = [], [], [], [], []
    producer = {}                         # value id -> (problem node, output index)
    for v in list(graph.args) + [v for _, v in graph.params]:
        producer[v.id] = (len(cand_out), 0)
        cand_in.append([()])
        cand_out.append([(known[v.id],)])
        node_costs.append(np.zeros(1))
        fixed.append(0)
        labels.append(None)
    index_of = {}
    free = {}                             # problem node -> its candidates (free nodes)
    for k, node in enumerate(graph.nodes):
        if node.op == CALL or node.backward:
            continue
        dtypes = _dtypes(node, values)
        if node.op_name == "Redistribute":
            if node.in_layouts is None:
                continue
            cands_in, cands_out, costs, fix = [node.in_layouts], [node.in_layouts], \
                np.zeros(1), 0
        elif node.in_layouts is not None:          # configured: one fixed candidate
            plan = _rule_outputs(node, node.in_layouts, dtypes)
            outs = node.out_layouts or (plan.outputs if plan is not None else None)
            if outs is None:
                continue
            cands_in, cands_out, costs = [node.in_layouts], [tuple(outs)], np.zeros(1)
            fix = 0
        else:
            shapes = [_shape_of(x, values) for x in node.inputs]
            cands = op_candidates(node.op, node.attrs, shapes, dtypes, n,
                                  fully_use_devices=fully_use_devices)
            if not cands:
                continue
            free[len(cand_out)] = cands
            cands_in = [c.in_layouts for c in cands]
            cands_out = [c.out_layouts for c in cands]
            costs = np.array([c.cost + _gradient_cost(node, c, trained, values, model)
                              for c in cands], dtype=np.float64)
            fix = -1
        index_of[k] = len(cand_out)
        for j, v in enumerate(node.outputs):
            producer[v.id] = (len(cand_out), j)
        cand_in.append(cands_in)
        cand_out.append(cands_out)
        node_costs.append(costs)
        fixed.append(fix)
        labels.append(k)
    edges, edge_costs = [], []
    for k, node in enumerate(graph.nodes):
        if k not in index_of:
            continue
        dst = index_of[k]
        for i, x in enumerate(node.inputs):
            if not isinstance(x, Ref) or x.id not in producer:
                continue
            src, j = producer[x.id]
            itemsize = values[x.id].dtype.itemsize
            m = np.empty((len(cand_out[src]), len(cand_in[dst])))
            for a, outs in enumerate(cand_out[src]):
                for b, ins in enumerate(cand_in[dst]):
                    have, need = outs[j], ins[i] if ins else None
                    m[a, b] = 0.0 if need is None or have is None else \
                        redistribution_cost(have, need, itemsize, model)
            edges.append((src, dst))
            edge_costs.append(m)
    plan = search(node_costs, np.array(edges, dtype=np.int64).reshape(-1, 2), edge_costs,
                  np.array(fixed, dtype=np.int64), impl=impl)  # the context's search_mode
    choice = plan.choice
    nodes = list(graph.nodes)
    for p, cands in free.items():
        k = labels[p]
        cand = cands[int(choice[p])]
        nodes[k] = nodes[k].replace(in_layouts=tuple(cand.in_layouts), cost=float(cand.cost),
                                    chosen=cand.strategy)
    return verify(graph.replace(nodes=tuple(nodes), meta={
        **graph.meta, "search_mode": plan.search_mode, "plan_cost": plan.cost}))


def _gradient_cost(node, cand, trained, values, model) -> float:
    """The backward communication a candidate implies for the trained parameters it
    reads: their gradients are summed (AllReduce) over the devices that replicate them."""
    total = 0.0
    for x, lay in zip(node.inputs, cand.in_layouts):
        if isinstance(x, Ref) and x.id in trained and lay is not None:
            total += allreduce_cost(lay, lay.replicated_axes, values[x.id].dtype.itemsize,
                                    model)
    return total


# ---------------------------------------------------------------------------
# the compiled graph: executor and introspection
# ---------------------------------------------------------------------------
class CompiledGraph:
    """A graph ready to run; ``strategies()`` and ``dump()`` show what was planned.

    A sharded graph runs its lowered program (lower.py, executor.py). Called while the
    caller's tape records (the caller differentiates through it), it runs as one op on
    that tape: the forward nodes of its derived forward+backward program now, the
    backward nodes when the tape reaches it (:class:`Block`). A graph that is not
    sharded runs its nodes through the dispatcher on whole values (recorded by a tape
    like any eager op)."""

    def __init__(self, graph: Graph, sharded: bool, program: Optional[Program] = None):
        self.graph = graph
        self.sharded = sharded
        self.program = program          # the lowered graph the executor runs (sharded)
        self.backward_graph = None      # forward + backward, when derived at compile time
        self.block = None               # its program, for callers that differentiate
        self._plan = tuple((node.op, node.attrs,
                            tuple((True, x.id) if isinstance(x, Ref) else (False, x.value)
                                  for x in node.inputs),
                            tuple(v.id for v in node.outputs), node.op_name)
                           for node in graph.nodes)

    def __call__(self, args):
        prog = self.program
        if prog is None:
            return self._run_plain(args)
        if self.block is not None and _core.recording() and self.block.taped(args):
            return self.block(args)
        return prog.outputs(prog.run(prog.bind(args)))

    def _run_plain(self, args):
        """Not sharded: the nodes through the dispatcher, on whole values."""
        g = self.graph
        env = {v.id: x for v, x in zip(g.args, args)}
        env.update({v.id: p for p, v in g.params})
        apply = _core.apply
        for op, attrs, ins, outs, name in self._plan:
            xs = tuple(env[x] if is_ref else x for is_ref, x in ins)
            if op == CALL:
                attrs["fn"](*xs)
            elif name == "Redistribute":
                env[outs[0]] = xs[0]
            else:
                out = apply(op, attrs, xs)
                for vid, o in zip(outs, out if op.multi_output else (out,)):
                    env[vid] = o
        return map_leaves(g.outputs, lambda x: env[x.id] if isinstance(x, Ref) else x.value)

    # ---- introspection ------------------------------------------------------------
    def parameter_layouts(self) -> list:
        """``[(Parameter, layout), ...]``: where each parameter the graph reads lives while
        it runs (its first sharded consumer's layout, as in PyNative mode; None: a
        whole value). Empty for a graph that is not sharded."""
        if self.program is None:
            return []
        plans = self.program.param_plans
        return [(p, plans[v.id].layout) for p, v in self.program.graph.params]

    def strategies(self, *, alpha_s=None, beta_s_per_byte=None, link=None) -> dict:
        """node name -> {"strategy": strategy tuples per input (None: as it comes),
        "configured": bool, "cost": alpha-beta cost of its communication (s),
        "backward": bool}. The cost of a propagated op is the one propagation weighed;
        of any other, that of the moves the lowered graph makes for it. Given a network
        model (as for CommReport: ``link="10GbE"`` or ``alpha_s``/``beta_s_per_byte``),
        each entry also has "time": the predicted time of the collectives made for it
        (:func:`~dualmode.parallel.report.compiled_comm_times`). The result is a
        :class:`~.search.PlanTable` (a dict): ``total_cost`` sums the entries' costs,
        ``plan_cost`` is the total the search minimised, ``search_mode`` the search."""
        moved = _move_costs(self.program.graph) if self.program is not None else {}
        times = None
        if (alpha_s, beta_s_per_byte, link) != (None, None, None) and self.program is not None:
            times = compiled_comm_times(self, alpha_s, beta_s_per_byte, link)
        out = {}
        for node in self.graph.nodes:
            if node.op == CALL:
                continue
            if node.strategy is not None and node.strategy[0] is not None:
                st, conf = node.strategy[0], True
            elif node.chosen is not None:
                st, conf = node.chosen, False
            else:
                st, conf = None, False
            cost = node.cost if node.chosen is not None else node.cost + moved.get(node.name, 0.0)
            out[node.name] = {"strategy": st, "configured": conf, "cost": cost,
                              "backward": node.backward}
            if times is not None:
                out[node.name]["time"] = times.get(node.name, {}).get("time", 0.0)
        return PlanTable(out, self.graph.meta.get("plan_cost"), self.graph.meta.get("search_mode"))

    def dump(self, path=None, backward=False) -> str:
        """The graph as graphviz dot text, written to `path` when given (no graphviz
        binary needed). A sharded graph is shown as it runs: the lowered graph, its
        communication nodes in red, pending sums noted. ``backward=True``: the forward
        and backward program derived at compile time (backward nodes dashed)."""
        if backward:
            if self.block is None:
                raise ValueError("dump: backward=True but this graph has no derived backward "
                                 "pass (it is not sharded, holds its own backward already, or "
                                 "nothing in it is differentiable)")
            g = self.block.program.graph
        else:
            g = self.program.graph if self.program is not None else self.graph
        text = _dot(g, self.strategies())
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def __repr__(self):
        return f"CompiledGraph({len(self.graph.nodes)} nodes)\n{self.graph!r}"


def compile_graph(graph: Graph, n: int, *, sharded: bool, propagate: bool, name="ops.shard",
                  in_strategy=None, out_strategy=None, parameter_plan=None,
                  arg_sources=None, fully_use_devices=False) -> CompiledGraph:
    """Run the passes on a traced graph; the result runs on every call."""
    if sharded:
        graph = apply_strategies(graph, n, name=name, in_strategy=in_strategy,
                                 out_strategy=out_strategy, parameter_plan=parameter_plan)
        if propagate:
            graph = propagate_strategies(graph, n, arg_sources=arg_sources,
                                         fully_use_devices=fully_use_devices)
        lowered = insert_communication(graph, n, arg_sources=arg_sources,
                                       some_devices=some_devices(), name=name)
        compiled = CompiledGraph(graph, sharded, Program(fuse_communication(lowered)))
    else:
        compiled = CompiledGraph(graph, sharded)
    if sharded and not any(node.backward for node in graph.nodes):
        with _core.paused_recording():      # compiling may happen inside a caller's grad
            found = derive_backward(compiled, n, arg_sources=arg_sources, name=name)
        if found is not None:
            compiled.backward_graph, compiled.block = found
    return compiled


def derive_backward(compiled: CompiledGraph, n: int, *, arg_sources=None, name="graph"):
    """The forward graph and its backward pass, derived once at compile time:
    ``(planned graph, Block)``, or None when nothing is differentiable.

    It is the trace of a vector-Jacobian product (:func:`~dualmode.autograd.vjp`) over a
    replay of the graph, with respect to its floating arguments and trained parameters,
    taking one cotangent argument per floating output. Forward nodes keep their
    compiled layouts; every node, backward ones included, is then planned and lowered
    like the forward (what ``dump(backward=True)`` shows and what a differentiating
    caller runs)."""
    g = compiled.graph
    positions = tuple(k for k, v in enumerate(g.args) if v.dtype.kind == "f")
    weights = [p for p, v in g.params if p.requires_grad and v.dtype.kind == "f"]
    values = g.values()
    leaves = flatten_refs(g.outputs)
    diff = tuple(isinstance(x, Ref) and values[x.id].dtype.kind == "f" for x in leaves)
    if not any(diff) or not (positions or weights):
        return None
    replay = CompiledGraph(g, sharded=False)
    nargs = len(g.args)
    fn = vjp(lambda *xs: tuple(_flat_outputs(g.outputs, replay(list(xs)))),
             positions or None, weights or None)

    def forward_backward(*xs):
        cots = iter(xs[nargs:])
        out, grads = fn(xs[:nargs], [next(cots) if d else None for d in diff])
        if positions and weights:
            grads = tuple(grads[0]) + tuple(grads[1])
        return out, tuple(grads)

    shapes = [v.shape for v in g.args] + [values[x.id].shape for x, d in zip(leaves, diff) if d]
    dtypes = [v.dtype for v in g.args] + [values[x.id].dtype for x, d in zip(leaves, diff) if d]
    stand_ins = [Tensor(np.broadcast_to(np.zeros((), d), s)) for s, d in zip(shapes, dtypes)]
    both = trace(forward_backward, stand_ins, name=f"{g.meta.get('name', 'graph')} backward",
                 params=[p for p, _ in g.params])
    by_name = {node.name: node for node in g.nodes}
    nodes = tuple(node.replace(in_layouts=by_name[node.name].in_layouts,
                               out_layouts=by_name[node.name].out_layouts,
                               chosen=by_name[node.name].chosen, cost=by_name[node.name].cost)
                  if not node.backward and node.name in by_name else node
                  for node in both.nodes)
    ncots = len(both.args) - nargs
    both = verify(both.replace(nodes=nodes, arg_layouts=tuple(g.arg_layouts or
                                                              (None,) * nargs)
                               + (None,) * ncots,
                               param_layouts=_param_layouts_for(both, g)))
    # a cotangent arrives in its output's layout (pending sums resolved)
    lowered_out = flatten_refs(compiled.program.graph.outputs)
    cot_lays = [_cotangent_layout(compiled.program.layouts[x.id])
                for x, d in zip(lowered_out, diff) if d]
    sources = {v.id: (arg_sources or {}).get(old.id) for v, old in zip(both.args, g.args)}
    sources.update({v.id: lay for v, lay in zip(both.args[nargs:], cot_lays)})
    lowered = insert_communication(both, n, arg_sources=sources,
                                   some_devices=some_devices(), name=name)
    # the parameter AllGathers fuse as in the forward program (comm_fusion["allgather"])
    block = Block(Program(fuse_parameter_gathers(lowered)), nargs, positions, weights, diff,
                  cot_lays, g.outputs)
    return lowered, block


def _cotangent_layout(lay):
    if lay is None:
        return None
    if lay.partial:
        lay = lay.without_partial()
    return lay if any(lay.tensor_map) else None


class Block:
    """A compiled block run as one op on the caller's tape: its forward nodes now, its
    backward nodes (derived once at compile time) when the tape asks for gradients."""

    def __init__(self, program, nargs, positions, weights, diff, cot_layouts, template):
        self.program = program
        self.nargs = nargs
        self.positions = positions
        self.weights = tuple(weights)
        self.diff = diff
        self.cot_layouts = tuple(cot_layouts)
        self.template = template
        g = program.graph
        self.split = next((k for k, node in enumerate(g.nodes) if node.backward),
                          len(g.nodes))
        fwd, grads = g.outputs
        self.fwd = flatten_refs(fwd)
        self.grads = tuple(grads)
        self.cots = g.args[nargs:]
        self.op = OpDef(f"{g.meta.get('name', 'graph')}", kind=KIND_GENERIC,
                        infer=_no_infer, kernel=_no_kernel, backward=self._backward,
                        multi_output=True)

    def taped(self, args) -> bool:
        return any(args[k]._node is not None for k in self.positions) or any(
            p._node is not None for p in self.weights)

    def __call__(self, args):
        prog = self.program
        env = prog.run(prog.bind(args), 0, self.split)
        lays = prog.layouts
        arrays = tuple(env[x.id] for x, d in zip(self.fwd, self.diff) if d)
        outs = iter(_core.finish(self.op, {"env": env}, tuple(args[k] for k in self.positions)
                                 + self.weights, arrays, True,
                                 tuple(lays[x.id] for x, d in zip(self.fwd, self.diff) if d)))
        flat = [next(outs) if d else prog.outputs(env, x) for x, d in zip(self.fwd, self.diff)]
        flat = iter(flat)
        return map_leaves(self.template, lambda x: next(flat))

    def _backward(self, node, *douts):
        prog = self.program
        env = node.attrs["env"]
        for v, g, lay in zip(self.cots, douts, self.cot_layouts):
            env[v.id] = _cotangent(g, lay, prog.name)
        prog.run(env, self.split, keep=True)     # the tape may ask again: keep the env
        return tuple(prog.outputs(env, x) for x in self.grads)


def _no_infer(attrs, *inputs):
    raise TypeError("a compiled block is run by its CompiledGraph, not dispatched")


_no_kernel = _no_infer


def _cotangent(g, lay, name):
    """The incoming gradient `g` (a Tensor) as the stack (or whole value) in `lay`."""
    if g._layout == lay:
        return g._data if lay is not None else g._value()
    if lay is None:
        return gather_stack(g._data, g._layout, name)
    return redistribute_tensor(g, lay, name)


def _flat_outputs(template, out):
    """The leaves of `out` where `template` (an output structure) has Ref/Const."""
    if isinstance(template, (Ref, Const)):
        yield out
    elif isinstance(template, (tuple, list)):
        for t, o in zip(template, out):
            yield from _flat_outputs(t, o)
    elif isinstance(template, dict):
        for k in template:
            yield from _flat_outputs(template[k], out[k])


def _move_costs(lowered: Graph) -> dict:
    """Consumer node name -> alpha-beta cost of the redistributions made for it."""
    model = CostModel()
    out = {}
    for node in lowered.nodes:
        if node.op == MOVE and node.attrs["plan"] is not None:
            moves = ((node.attrs["plan"], node.attrs.get("for")),)
        elif node.op in (FUSED_RS, FUSED_AG):      # a fused bucket: each member's share
            moves = zip(node.attrs["plans"], node.attrs["fors"])
        else:
            continue
        for plan, key in moves:
            out[key] = out.get(key, 0.0) + redistribution_cost(plan.src, plan.dst,
                                                               plan.itemsize, model)
    return out


def _dot(g: Graph, chosen: dict) -> str:
    """Graphviz dot text of `g`: arguments and parameters as ellipses, ops as boxes
    (backward ones dashed), communication (MOVE nodes that communicate, AllReduce) in
    red, outputs holding pending sums with a note."""
    lays = g.meta.get("layouts", {})
    lines = [f'digraph "{g.meta.get("name", "graph")}" {{', "  rankdir=TB;",
             '  node [shape=box, fontname="monospace"];']
    producer = {}
    for k, v in enumerate(g.args):
        lines.append(f'  v{v.id} [label="arg {k}\\n{list(v.shape)} {v.dtype}", shape=ellipse];')
        producer[v.id] = f"v{v.id}"
    for p, v in g.params:
        lines.append(f'  v{v.id} [label="{p.name}\\n{list(v.shape)} {v.dtype}", '
                     f'shape=ellipse, style=filled, fillcolor=lightyellow];')
        producer[v.id] = f"v{v.id}"
    for k, node in enumerate(g.nodes):
        nid = f"n{k}"
        style = ", style=dashed" if node.backward else ""
        if node.op == MOVE:
            a = node.attrs
            if a["kind"] in ("view", "gridview", "slice"):       # no data moves
                for x in node.inputs:
                    if isinstance(x, Ref) and x.id in producer:
                        producer[node.outputs[0].id] = producer[x.id]
                continue
            desc = "\\n".join(str(s) for s in a["plan"]) if a["plan"] is not None else \
                {"resolve": "AllReduce (pending sums)", "gather": "AllGather (whole value)"
                 }.get(a["kind"], a["kind"])
            lines.append(f'  {nid} [label="redistribute for {a.get("for")}\\n{desc}", '
                         f'color=red, fontcolor=red{style}];')
        elif node.op == REDUCE:
            lines.append(f'  {nid} [label="AllReduce({node.attrs["op"]}) over axes '
                         f'{node.attrs["axes"]}", color=red, fontcolor=red{style}];')
        elif node.op in (FUSED, FUSED_RS, FUSED_AG):
            kind = {FUSED: "AllReduce of", FUSED_RS: "ReduceScatter of",
                    FUSED_AG: "AllGather of"}[node.op]
            what = "parameters" if node.op == FUSED_AG else "gradients"
            lines.append(f'  {nid} [label="fused {kind} {len(node.inputs)} {what}\\n'
                         f'{node.attrs["cause"]}", color=red, fontcolor=red{style}];')
        else:
            st = chosen.get(node.name, {}).get("strategy") if node.op != CALL else None
            label = node.name + (f"\\nstrategy={st}" if st is not None else "")
            lines.append(f'  {nid} [label="{label}"{style}];')
            for j, v in enumerate(node.outputs):
                lay = lays.get(v.id)
                if lay is not None and lay.partial:
                    lines.append(f'  {nid}_s{j} [label="pending sum over axes '
                                 f'{tuple(lay.partial)}\\n(AllReduce / ReduceScatter at its '
                                 f'consumer)", color=red, fontcolor=red, shape=note];')
                    lines.append(f"  {nid} -> {nid}_s{j} [style=dotted];")
        for x in node.inputs:
            if isinstance(x, Ref) and x.id in producer:
                lines.append(f"  {producer[x.id]} -> {nid};")
        for v in node.outputs:
            producer[v.id] = nid
    for j, leaf in enumerate(flatten_refs(g.outputs)):
        if isinstance(leaf, Ref) and leaf.id in producer:
            lines.append(f'  out{j} [label="output {j}", shape=ellipse];')
            lines.append(f"  {producer[leaf.id]} -> out{j};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _param_layouts_for(new, old):
    by_param = {id(p): lay for (p, _), lay in zip(old.params, old.param_layouts or
                                                 (None,) * len(old.params))}
    return tuple(by_param.get(id(p)) for p, _ in new.params)
